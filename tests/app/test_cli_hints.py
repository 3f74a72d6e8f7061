"""Every hint the CLI prints is runnable as printed: it carries the ``--store`` the command ran with."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys

import pytest

from ranklens._cli_common import password_note, store_flag

_JOB = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(4)
for _ in range(3):
    dist.all_reduce(t)
dist.destroy_process_group()
"""


def test_store_flag_drops_the_password_and_says_where_it_comes_from():
    assert store_flag("clickhouse://u:***@h:9000/db") == " --store clickhouse://u@h:9000/db"
    assert "RANKLENS_STORE_PASSWORD" in (password_note("clickhouse://u:***@h:9000/db") or "")
    assert store_flag("embedded:///tmp/a b") == " --store 'embedded:///tmp/a b'"
    assert password_note("embedded:///tmp/x") is None


@pytest.mark.e2e
def test_run_prints_a_next_hint_with_its_store_that_runs_as_printed(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(_JOB)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKLENS_")}
    env.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    store = f"embedded://{tmp_path}/store"
    run = [sys.executable, "-m", "ranklens.cli", "run", "--store", store, "--spool", str(tmp_path / "spool")]
    proc = subprocess.run(
        [*run, "--", sys.executable, str(script)], capture_output=True, text=True, timeout=180, env=env
    )
    assert proc.returncode == 0, proc.stderr
    [hint] = [ln for ln in proc.stderr.splitlines() if "next:" in ln]
    command = shlex.split(hint.split("next:", 1)[1])
    assert command[command.index("--store") + 1] == store
    # run the hint as printed (from another directory: the default store would be elsewhere)
    other = tmp_path / "elsewhere"
    other.mkdir()
    argv = [sys.executable, "-m", "ranklens.cli", *command[1:]]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180, env=env, cwd=other)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not (other / "ranklens-store").exists()
