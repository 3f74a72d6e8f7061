"""Findings over time: stable identity, new / changed / resolved events, `analyze --follow`."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time

from ranklens.analyzers.findings import Finding, Severity, Suspect
from ranklens.analyzers.job import FindingTracker
from tests.helpers import synthetic_job


def _f(fid: str, title: str = "t", state: str = "open") -> Finding:
    return Finding(fid, "j", 0, "straggler", Severity.WARNING, 0.9, title, (Suspect(1),), 1, 2, state=state)


def test_tracker_events():
    t = FindingTracker()
    u = t.update([_f("a"), _f("b")])
    assert [f.id for f in u.new] == ["a", "b"] and not u.changed and not u.resolved
    u = t.update([_f("a"), _f("b")])
    assert not u.all()  # the same ongoing problems: nothing to say
    u = t.update([_f("a", title="worse")])
    assert [f.id for f in u.changed] == ["a"]
    assert [(f.id, f.state) for f in u.resolved] == [("b", "resolved")]
    u = t.update([dataclasses.replace(_f("a"), state="resolved")])
    assert [f.id for f in u.changed] == ["a"] and t.open == {}


def test_analyze_follow_prints_json_events(tmp_path):
    from ranklens.store import open_store

    store = open_store(f"embedded://{tmp_path}/s")
    store.write_many(synthetic_job(slow_rank=3))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ranklens.cli",
            "analyze",
            "--store",
            store.url,
            "--follow",
            "--json",
            "--interval",
            "0.2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
    finally:
        time.sleep(0.5)
        proc.terminate()
        proc.communicate(timeout=30)
    event = json.loads(line)
    assert event["event"] == "new" and [s["rank"] for s in event["finding"]["suspects"]] == [3]
    # the finding was saved once, not once per pass
    assert store.query("SELECT count() FROM findings").scalar() == 1
