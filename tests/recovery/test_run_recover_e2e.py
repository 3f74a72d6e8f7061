"""`ranklens run --recover` closes the loop on a real 4-rank gloo job under torchrun: one rank hangs
in attempt 0, the hang is detected live, its stacks are taken, the torchrun executor ends it, torch
elastic restarts the worker group in place, the job resumes from its checkpoint and exits 0; the
actions rows and MTTD/MTTR are printed and stored."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ranklens.store import open_store
from tests._jobs import ranklens

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]
POLICY = ROOT / "deploy" / "policies" / "torchrun-restart.toml"


def test_a_hung_rank_is_restarted_in_place_and_training_resumes(tmp_path):
    url = f"embedded://{tmp_path / 'store'}"
    env = {
        **{k: v for k, v in __import__("os").environ.items() if not k.startswith("RANKLENS_")},
        "HANG_RANK": "2",
        "HANG_STEP": "8",
        "CKPT": str(tmp_path / "ckpt.pt"),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    cmd += ["--max-restarts", "2", str(ROOT / "tests" / "recover_hang_job.py")]
    r = ranklens(
        "run", "--store", url, "--spool", str(tmp_path / "spool"), "--outbox", str(tmp_path / "outbox"),
        "--recover", str(POLICY), "--", *cmd, timeout=800, env=env,
    )  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert "trained" in out and "in attempt 1" in out  # the restarted group finished the job
    assert "executor elastic: acknowledged: SIGKILL to rank 2" in out
    line = next(x for x in out.splitlines() if "recovery: hang" in x and "MTTR" in x)
    assert "training resumed (attempt 1's first step done)" in line
    summary = next(x for x in out.splitlines() if "recovery: job " in x and "remediation(s)" in x)
    assert "1 remediation(s), 1 resumed training; mean MTTD" in summary and "GPU-s lost to recovery" in summary

    store = open_store(url, create=False)
    job = store.query("SELECT DISTINCT job_id FROM heartbeats").scalar()
    rows = store.query(
        f"SELECT action, target, outcome, detail FROM actions WHERE job_id = '{job}' ORDER BY ts_ns"
    ).to_pylist()
    outcomes = [(x["target"], x["outcome"]) for x in rows]
    assert ("rank:2", "decided") in outcomes and ("executor:elastic", "acknowledged") in outcomes
    resumed = [json.loads(x["detail"]) for x in rows if x["outcome"] == "resumed"]
    assert len(resumed) == 1 and resumed[0]["kind"] == "hang" and resumed[0]["resumed_attempt"] == 1
    assert 0 < resumed[0]["mttd_s"] < resumed[0]["mttr_s"] < 300
    print("run --recover:", json.dumps(resumed[0]), file=sys.stderr)  # the figures, in the CI log
    # the stuck rank's stack, taken before the restart, is on the hang finding
    ev = json.loads(
        store.query(
            f"SELECT argMax(evidence, updated_ns) AS e FROM findings WHERE job_id = '{job}' AND kind = 'hang'"
        ).scalar()
    )
    frames = ev["stacks"]["2"]["innermost"]
    assert "recover_hang_job.py" in frames[0] and "time.sleep(3600)" in frames[0]
