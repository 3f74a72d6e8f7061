"""`ranklens drill` as a user runs it: real 4-rank gloo jobs of an unmodified script, faults injected
through the bootstrap, findings watched live, scorecards stored in `drills`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ranklens.drill.suites import quick_command
from ranklens.store import open_store
from tests._jobs import ranklens

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]


def test_quick_suite_catches_every_fault_with_no_false_alarm(tmp_path):
    url = f"embedded://{tmp_path / 'store'}"
    r = ranklens("drill", "--store", url, "--suite", "quick", "--json", timeout=1400)
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    drills, summary = lines[:-1], lines[-1]
    assert len(drills) == 7, r.stdout + r.stderr
    for d in drills:
        assert d["passed"], json.dumps(d, indent=1)
    assert r.returncode == 0, r.stderr
    assert summary["recall"] == 1.0 and summary["precision"] == 1.0
    assert len(summary["kinds"]) == 9 and summary["ttd_p90_s"] is not None
    print("quick suite:", json.dumps(summary), file=sys.stderr)  # the scorecard, in the CI log
    rows = (
        open_store(url, create=False)
        .query("SELECT suite, kind, detected, culprit_ok, passed FROM drills ORDER BY kind")
        .to_pylist()
    )
    assert len(rows) == sum(len(d["faults"]) for d in drills) == 11
    assert all(x["suite"] == "quick" and x["detected"] == 1 and x["passed"] == 1 for x in rows)


def test_a_job_that_fails_by_itself_is_not_a_detection(tmp_path):
    url = f"embedded://{tmp_path / 'store'}"
    cmd = [sys.executable, "-c", "import sys; print('RuntimeError: boom', file=sys.stderr); sys.exit(4)"]
    r = ranklens("drill", "--store", url, "--world", "4", "--fault", "hang:1@5", "--json", "--", *cmd, timeout=300)
    assert r.returncode == 9, r.stdout + r.stderr
    d = json.loads(r.stdout.splitlines()[0])
    assert not d["passed"] and d["exit_code"] == 4
    assert "exited with code 4 before any fault took effect" in d["job_failed"]
    assert d["faults"][0]["applied"] is False and d["faults"][0]["detected"] is False


def test_a_missed_fault_fails_the_drill(tmp_path):
    """A fault whose onset the job never reaches: reported as never applied, exit 9."""
    url = f"embedded://{tmp_path / 'store'}"
    r = ranklens("drill", "--store", url, "--fault", "slow_gpu:1:1.5@500", timeout=600)
    assert r.returncode == 9, r.stdout + r.stderr
    assert "FAIL" in r.stdout and "never took effect" in r.stdout
    assert f"next: ranklens analyze --store {url} --job drill-" in r.stdout


def test_with_recovery_a_crash_ends_in_training_resumed(tmp_path):
    """`--recover` with the shipped torchrun policy: the crash is found, torch elastic restarts the
    group (the executor has nothing left to end), the job resumes from its checkpoint, exit 0."""
    url = f"embedded://{tmp_path / 'store'}"
    policy = str(Path(__file__).resolve().parents[2] / "deploy" / "policies" / "torchrun-restart.toml")
    cmd = quick_command(30, restarts=2)
    r = ranklens(
        "drill", "--store", url, "--recover", policy, "--outbox", str(tmp_path / "outbox"),
        "--fault", "crash:1:3@10", "--json", "--", *cmd, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    d = json.loads(r.stdout.splitlines()[0])
    (f,) = d["faults"]
    assert d["passed"] and d["recovering"] and d["exit_code"] == 0
    assert f["ok"] and f["resumed_s"] is not None and f["resumed_s"] > f["time_to_detect_s"]
    print("drill --recover:", json.dumps(f), file=sys.stderr)
