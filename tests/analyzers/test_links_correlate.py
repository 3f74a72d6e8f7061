"""Root-cause correlation: GPU events and classified log errors tied to findings by node and time."""

from __future__ import annotations

import pytest

from ranklens.analyzers.correlate import correlate_findings, gpu_event_severity, related_events
from ranklens.analyzers.findings import Finding, Severity, Suspect, finding_id
from ranklens.analyzers.links import find_slow_links
from tests.links_helpers import SimSpec, simulate

S = 1_000_000_000


def _gpu(host: str, ts: int, kind: str = "xid", code: int = 79, rank: int = -1, job: str = "job-links") -> dict:
    return {
        "host": host,
        "gpu_index": 0,
        "ts_ns": ts,
        "job_id": job,
        "rank": rank,
        "kind": kind,
        "code": code,
        "message": f"{kind} {code}",
    }


def _log(host: str, ts: int, klass: str = "nccl_error", severity: str = "error", rank: int = -1, job="job-links"):
    return {
        "job_id": job,
        "host": host,
        "rank": rank,
        "ts_ns": ts,
        "stream": "stderr",
        "klass": klass,
        "severity": severity,
        "message": f"{klass} on {host}",
    }


@pytest.fixture
def link_finding(store):
    store.write_many(simulate(SimSpec(slow_nodes={5: 4.0}, slow_from=3)))
    (f,) = find_slow_links(store, "job-links")
    return store, f


def test_xid_on_the_suspect_node_is_cited_as_origin_later_errors_are_collateral(link_finding):
    store, f = link_finding
    onset = f.first_seen_ns
    store.write(
        "gpu_events",
        [
            _gpu("node5", onset - 2 * S, code=79),  # the origin, on the suspect node
            _gpu("node5", onset - 3 * S, kind="ecc_sbe", code=1),  # a warning: below min_severity
            _gpu("node7", onset - 900 * S, code=79),  # long before the window
        ],
    )
    store.write(
        "log_events",
        [
            _log("node2", onset + 1 * S, rank=4),  # a peer's NCCL error: collateral
            _log("node5", onset + 2 * S, klass="gpu_xid", severity="critical", rank=10),
            _log("node3", onset + 1 * S, klass="nccl_warn", severity="warning"),  # not an error
            _log("node9", onset, job="other-job"),  # another job, node not in this job
        ],
    )
    (g,) = correlate_findings(store, [f])
    events = g.evidence["related_events"]
    assert [(e["source"], e["host"], e["kind"], e["role"]) for e in events] == [
        ("gpu", "node5", "xid", "origin"),
        ("log", "node2", "nccl_error", "collateral"),
        ("log", "node5", "gpu_xid", "collateral"),
    ]
    assert [e["on_suspect"] for e in events] == [True, False, True]
    assert events[0]["offset_s"] == pytest.approx(-2.0) and events[0]["severity"] == "critical"
    rc = g.evidence["root_cause"]
    assert rc["origin_on_suspect"] and rc["collateral"] == 2 and rc["events_on_suspects"] == 2
    assert "likely origin: XID 79 on node5" in g.title and "2.0 s before onset" in g.title
    assert g.title.startswith(f.title) and g.id == f.id and g.evidence["link"] == "node5<->network"


def test_origin_elsewhere_makes_the_suspects_errors_collateral(embedded_store):
    embedded_store.write_many(simulate(SimSpec(slow_nodes={5: 4.0})))
    (f,) = find_slow_links(embedded_store, "job-links")
    t = f.first_seen_ns
    embedded_store.write("gpu_events", [_gpu("node7", t - 5 * S, code=74, job="")])  # NVLink XID, node-level
    embedded_store.write("log_events", [_log("node5", t + S, rank=11)])
    (g,) = correlate_findings(embedded_store, [f])
    assert [e["host"] for e in g.evidence["related_events"]] == ["node7", "node5"]
    assert not g.evidence["root_cause"]["origin_on_suspect"]
    assert (
        "likely origin elsewhere: XID 74 on node7" in g.title and "1 error(s) on the suspects are collateral" in g.title
    )


def test_findings_without_events_are_unchanged_and_kernel_lines_of_job_nodes_count(embedded_store):
    embedded_store.write_many(simulate(SimSpec(job_id="j2", dp=2, pp=2)))
    f = Finding(
        id=finding_id("j2", 0, "straggler", "rank:3"),
        job_id="j2",
        attempt=0,
        kind="straggler",
        severity=Severity.WARNING,
        confidence=0.9,
        title="rank 3 is a straggler",
        suspects=(Suspect(rank=3, node="node1"),),
        first_seen_step=2,
        last_seen_step=5,
        first_seen_ns=1_790_000_000_000_000_000 + 100 * S,
        last_seen_ns=1_790_000_000_000_000_000 + 200 * S,
    )
    assert correlate_findings(embedded_store, [f]) == [f]
    # a kernel line of the node (no job id: the node collector's dmesg tail) is tied to the job
    embedded_store.write("log_events", [_log("node1", f.first_seen_ns + 5 * S, klass="gpu_xid", job="")])
    (g,) = correlate_findings(embedded_store, [f])
    assert g.evidence["related_events"][0]["kind"] == "gpu_xid" and g.evidence["related_events"][0]["on_suspect"]
    rows = related_events(embedded_store, "j2", f.first_seen_ns, f.last_seen_ns, hosts=["node1"], min_severity="info")
    assert len(rows) == 1
    with pytest.raises(ValueError, match="min_severity"):
        related_events(embedded_store, "j2", 0, 1, min_severity="loud")


def test_gpu_event_severity():
    assert gpu_event_severity("xid", 79) == "critical"
    assert gpu_event_severity("xid", 13) == "error"
    assert gpu_event_severity("ecc_dbe", 1) == "critical"
    assert gpu_event_severity("ecc_sbe", 1) == "warning"


def test_another_jobs_xid_before_this_job_started_is_not_its_origin(embedded_store):
    embedded_store.write_many(simulate(SimSpec(slow_nodes={5: 4.0})))
    (f,) = find_slow_links(embedded_store, "job-links")
    began = f.first_seen_ns - 60 * S  # the job's first heartbeat
    embedded_store.write(
        "heartbeats", [{"job_id": "job-links", "attempt": 0, "rank": 0, "ts_ns": began, "host": "node0"}]
    )
    # an earlier job's XID on the suspect node (its GPU since reset), then one during this job
    embedded_store.write("gpu_events", [_gpu("node5", began - 2 * S, job="earlier-job")])
    assert correlate_findings(embedded_store, [f]) == [f]
    embedded_store.write("gpu_events", [_gpu("node5", f.first_seen_ns - 2 * S, code=48, job="other")])
    (g,) = correlate_findings(embedded_store, [f])
    assert [e["code"] for e in g.evidence["related_events"]] == [48]
