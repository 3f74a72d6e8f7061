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
