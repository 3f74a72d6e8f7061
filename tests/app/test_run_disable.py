"""``RANKLENS_DISABLE=1`` under ``ranklens run``: the command runs untraced, its exit code passes through."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

_SCRIPT = """
import os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(4)
for _ in range(3):
    dist.all_reduce(t)
dist.destroy_process_group()
sys.exit(3)
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spooled(spool) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, f), spool)
        for d, _, files in os.walk(spool)
        for f in files
        if not f.startswith(".") and "_collector" not in d
    )


@pytest.mark.parametrize("disabled", [False, True])
def test_disable_turns_tracing_off_and_the_exit_code_passes_through(tmp_path, disabled):
    script = tmp_path / "job.py"
    script.write_text(_SCRIPT)
    spool = tmp_path / "spool"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKLENS_")}
    # as torchrun would set them for a rank
    env.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if disabled:
        env["RANKLENS_DISABLE"] = "1"
    cmd = [sys.executable, "-m", "ranklens.cli", "run", "--no-collect", "--spool", str(spool), "--job-id", "dis-job"]
    proc = subprocess.run(
        [*cmd, "--", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert proc.returncode == 3, proc.stderr
    files = _spooled(spool)
    if disabled:
        assert files == [], f"RANKLENS_DISABLE=1 still traced: {files}"
    else:
        assert any("collectives" in f for f in files), f"the traced run spooled no collectives: {files}"
