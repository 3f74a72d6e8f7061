"""Issue 21's done-when for sharded jobs: an unmodified FSDP2 job and a DTensor tensor-parallel job
under ``ranklens run``, rank 1 slowed 100 ms in forward from step 8 -> rank 1 named, in forward,
onset within one step, nobody else. FSDP2's collectives come through the wrappers and torch's
flight-recorder ring; DTensor's functional all-reduces only through the ring (no completion times
on gloo), which the compute metric must still read right."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
JOB = Path(__file__).parent.parent.joinpath("jobs_sharded_slow.py")
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


@pytest.mark.parametrize("mode", ["fsdp2", "tp"])
def test_sharded_job_names_the_rank_slowed_in_forward(tmp_path, mode):
    store = f"embedded://{tmp_path}/store"
    env = {k: v for k, v in os.environ.items() if k not in ("RANKLENS_JOB_ID", "RANKLENS_STORE")}
    env["OMP_NUM_THREADS"] = "1"
    job = f"sharded-{mode}"
    run = subprocess.run(
        [sys.executable, "-m", "ranklens.cli", "run", "--store", store, "--spool", str(tmp_path / "spool"),
         "--job-id", job, "--", TORCHRUN, "--standalone", "--nproc-per-node", "4", str(JOB), mode],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    out = subprocess.run(
        [sys.executable, "-m", "ranklens.cli", "analyze", "--store", store, "--job", job, "--json", "--no-save"],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["step_source"] == "inferred"
    stragglers = [f for f in report["findings"] if f["kind"] == "straggler"]
    titles = [f["title"] for f in stragglers]
    assert len(stragglers) == 1, titles
    (f,) = stragglers
    assert [s["rank"] for s in f["suspects"]] == [1], titles
    assert f["evidence"].get("phase") == "forward", titles
    assert abs(f["first_seen_step"] - 8) <= 1, titles
