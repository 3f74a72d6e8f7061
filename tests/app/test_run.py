"""The zero-code path: `ranklens run -- torchrun ... examples/train.py` on an unmodified script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ranklens.collector import Shipper
from ranklens.store import open_store
from tests._jobs import TORCHRUN, ranklens, ranklens_run

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]  # a hang guard: 4-rank jobs on a loaded machine
ROOT = Path(__file__).resolve().parents[2]


def _ledger(store, job):
    return sorted(
        store.query(
            f"SELECT rank, pg, seq, op, nbytes FROM collectives WHERE job_id = '{job}' ORDER BY rank, pg, seq"
        ).rows()
    )


def test_unmodified_script_gives_the_same_records_as_the_explicit_api(tmp_path):
    store_url = f"embedded://{tmp_path}/store"
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "4", str(ROOT / "examples/train.py")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANKLENS_JOB_ID", None)
    proc = ranklens_run(store_url, tmp_path / "spool", cmd, job_id="zero-code", timeout=400, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "job zero-code exited 0" in proc.stderr

    # the same script with the explicit API, spooled and shipped by hand
    explicit_env = {
        **env,
        "EXAMPLE_EXPLICIT": "1",
        "RANKLENS_JOB_ID": "explicit",
        "RANKLENS_SPOOL": str(tmp_path / "sp2"),
    }
    proc2 = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=explicit_env)
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    store = open_store(store_url)
    Shipper(tmp_path / "sp2", store).ship_once()

    zero, explicit = _ledger(store, "zero-code"), _ledger(store, "explicit")
    assert zero == explicit
    ops = {r[3] for r in zero}
    assert {"all_reduce", "broadcast", "barrier"} <= ops
    # DDP gradient buckets (at least one per step) were traced without any hook code
    per_rank = store.query(
        "SELECT rank, count() FROM collectives WHERE job_id = 'zero-code' AND op = 'all_reduce' AND async_op = 1 "
        "GROUP BY rank"
    ).rows()
    assert len(per_rank) == 4 and all(n >= 5 for _, n in per_rank)
    groups = store.query("SELECT pg, any(ranks) FROM process_groups WHERE job_id = 'zero-code' GROUP BY pg").rows()
    assert sorted(sorted(r) for _, r in groups) == [[0, 1, 2, 3], [0, 2]]


def test_disable_and_exit_code_pass_through(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import sys; sys.exit(3)\n")
    proc = ranklens_run(f"embedded://{tmp_path}/s", tmp_path / "spool", [sys.executable, str(script)], timeout=120)
    assert proc.returncode == 3
    proc = ranklens("run", "--no-collect", "--", "no-such-binary-xyz", timeout=60)
    assert proc.returncode == 2 and "cannot start 'no-such-binary-xyz'" in proc.stderr


def test_bootstrap_chains_a_shadowed_sitecustomize(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os; os.environ['SHADOWED_RAN'] = '1'\n")
    from ranklens.launch import BOOTSTRAP_DIR

    env = {**os.environ, "RANK": "0", "PYTHONPATH": os.pathsep.join([BOOTSTRAP_DIR, str(other)])}  # a training rank
    code = (
        "import os, sys; "
        "print(os.environ.get('SHADOWED_RAN'), any(type(f).__name__ == '_Finder' for f in sys.meta_path))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    out = out.stdout.split()
    assert out == ["1", "True"]


def test_a_sigterm_before_the_command_has_started_still_reaches_it(tmp_path):
    """The race a CI run hung on: SIGTERM came after the command started but before `ranklens run`
    had put its handler in (its thread was waiting for the GIL), so ranklens died at once and the
    command ran on, never told. Here the signal comes just before the command is started, every time;
    it must be passed on to the command once it exists, and ranklens must live to report its code."""
    script = tmp_path / "early.py"
    script.write_text(
        "import os, signal, subprocess, sys, time\n"
        "import ranklens.launch as L\n"
        "real = subprocess.Popen\n"
        "def popen(*a, **k):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return real(*a, **k)\n"
        "subprocess.Popen = popen\n"
        "t = time.monotonic()\n"
        "rc = L._run_child([sys.executable, '-c', 'import time; time.sleep(60)'], dict(os.environ))\n"
        "print('rc', rc, round(time.monotonic() - t, 1), flush=True)\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (out.returncode, out.stderr)  # ranklens was not killed by the signal
    rc, took = out.stdout.split()[1:]
    assert int(rc) == -15, out.stdout  # the command got the SIGTERM
    assert float(took) < 30, out.stdout  # at once, not at the end of its 60 s


def test_a_sigterm_to_ranklens_run_reaches_the_command_and_the_last_pass_still_runs(tmp_path):
    """Slurm's scancel / requeue / time limit and a deleted pod send SIGTERM: `ranklens run` passes it
    on to its command and ends only after its last shipping pass (before, it died at once)."""
    import signal

    child = tmp_path / "child.py"
    got = tmp_path / "got-sigterm"
    child.write_text(
        "import signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda *a: (open({str(got)!r}, 'w').close(), sys.exit(7)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKLENS_")}
    cmd = [sys.executable, "-m", "ranklens.cli", "run", "--store", f"embedded://{tmp_path}/store"]
    cmd += ["--spool", str(tmp_path / "spool"), "--job-id", "term-job", "--", sys.executable, "-u", str(child)]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"  # the command runs
        p.send_signal(signal.SIGTERM)
        _out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert got.exists(), err  # the command got the SIGTERM
    assert p.returncode == 7, err  # ranklens run exits with the command's code
    assert "ranklens run: job term-job exited 7" in err  # after its last pass, not killed midway
