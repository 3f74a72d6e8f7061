"""Issue 21's done-when for sharded jobs: an unmodified FSDP2 job and a DTensor tensor-parallel job
under ``ranklens run``, rank 1 slowed 100 ms in forward from step 8 -> rank 1 named, in forward,
onset within one step, nobody else. FSDP2's collectives come through the wrappers and torch's
flight-recorder ring; DTensor's functional all-reduces only through the ring (no completion times
on gloo), which the compute metric must still read right."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests._jobs import TORCHRUN, analyze_report, ranklens_run

pytestmark = pytest.mark.e2e
JOB = Path(__file__).parent.parent.joinpath("jobs_sharded_slow.py")


@pytest.mark.parametrize("mode", ["fsdp2", "tp"])
def test_sharded_job_names_the_rank_slowed_in_forward(tmp_path, mode):
    store = f"embedded://{tmp_path}/store"
    env = {k: v for k, v in os.environ.items() if k not in ("RANKLENS_JOB_ID", "RANKLENS_STORE")}
    env["OMP_NUM_THREADS"] = "1"
    job = f"sharded-{mode}"
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "4", str(JOB), mode]
    run = ranklens_run(store, tmp_path / "spool", cmd, job_id=job, timeout=600, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    report = analyze_report(store, job, timeout=300, env=env, cwd=tmp_path)
    assert report["step_source"] == "inferred"
    stragglers = [f for f in report["findings"] if f["kind"] == "straggler"]
    titles = [f["title"] for f in stragglers]
    assert len(stragglers) == 1, titles
    (f,) = stragglers
    assert [s["rank"] for s in f["suspects"]] == [1], titles
    assert f["evidence"].get("phase") == "forward", titles
    assert abs(f["first_seen_step"] - 8) <= 1, titles
