"""Findings over time: stable identity, new / changed / resolved events, `analyze --follow`."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

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


def _last_run_s(metrics_url: str) -> float:
    """The follow loop's ``ranklens_analyzer_last_run_timestamp_seconds`` (set by every pass)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    body = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    for fam in text_string_to_metric_families(body):
        for sample in fam.samples:
            if sample.name == "ranklens_analyzer_last_run_timestamp_seconds":
                return sample.value
    return 0.0


def test_analyze_follow_prints_json_events(tmp_path):
    import re

    from ranklens.store import open_store
    from tests._sync import wait_until

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
            "--metrics-port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    passes: set[float] = set()
    try:
        said = [proc.stderr.readline()]  # the endpoint's address comes first, before any pass
        while not (m := re.search(r"metrics on (http://\S+/metrics)", said[-1])) and said[-1]:
            said.append(proc.stderr.readline())
        assert m, "".join(said)
        line = proc.stdout.readline()
        # "saved once, not once per pass" needs passes after the one that found it: count them by the
        # exporter's last-run stamp (a fixed sleep gives none on a loaded machine and proves nothing)
        first = _last_run_s(m.group(1))

        def two_more_passes() -> bool:
            passes.add(_last_run_s(m.group(1)))
            return len({t for t in passes if t > first}) >= 2

        wait_until(two_more_passes, 120, "two more passes of analyze --follow", procs=[proc], interval_s=0.05)
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    event = json.loads(line)
    assert event["event"] == "new" and [s["rank"] for s in event["finding"]["suspects"]] == [3]
    # the finding was saved once, not once per pass
    assert store.query("SELECT count() FROM findings").scalar() == 1
