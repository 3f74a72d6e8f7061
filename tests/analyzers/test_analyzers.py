"""Blame analysis: ground truth on synthetic ledgers, the same answer on chDB and on the server."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ranklens.analyzers import (
    PersistentBlameDetector,
    compute_blame,
    find_stragglers,
    latest_findings,
    save_findings,
)
from ranklens.analyzers.blame import union_length
from ranklens.analyzers.findings import finding_id
from ranklens.store import open_store
from tests.helpers import synthetic_job


def _load(store, rows):
    store.write_many({k: v for k, v in rows.items()})


def test_union_length():
    assert union_length(np.array([]), np.array([])) == 0
    assert union_length(np.array([10.0, 11.0]), np.array([5.0, 5.0])) == 6.0  # overlapping waits
    assert union_length(np.array([10.0, 30.0]), np.array([5.0, 5.0])) == 10.0  # disjoint waits


def test_names_the_slow_rank_with_onset_and_impact(store):
    _load(store, synthetic_job(slow_rank=2, slow_from=5, extra_s=0.05, steps=20))
    (f,) = find_stragglers(store, "job-synth")
    assert [s.rank for s in f.suspects] == [2]
    assert f.suspects[0].node == "node1"
    assert f.first_seen_step == 5 and f.last_seen_step == 19
    # extra 50 ms of compute per step for 15 steps; the others waited about that much each step
    assert f.evidence["excess_per_step_s"] == pytest.approx(0.05, abs=0.006)
    assert f.evidence["others_waited_per_step_s"] == pytest.approx(0.05, abs=0.006)
    assert f.detector == "peer_compute"
    assert f.impact_s == pytest.approx(15 * 0.05, rel=0.15)
    assert f.impact_gpu_s == pytest.approx(3 * f.impact_s, rel=0.01)  # three ranks waited
    assert f.kind == "straggler" and f.state == "open" and f.confidence > 0.9
    assert "rank 2" in f.title and "since step 5" in f.title
    assert "FROM collectives" in f.evidence["sql"]


def test_healthy_job_has_no_findings(store):
    _load(store, synthetic_job(slow_rank=None, noise_s=0.01, steps=30))
    assert find_stragglers(store, "job-synth") == []


def test_small_slowdown_below_threshold_is_not_reported(store):
    _load(store, synthetic_job(slow_rank=1, extra_s=0.004, step_s=0.2, noise_s=0.0005))
    assert find_stragglers(store, "job-synth") == []  # 2% of the step: below min_share 5%
    (f,) = find_stragglers(store, "job-synth", detector=PersistentBlameDetector(min_share=0.01))
    assert f.suspects[0].rank == 1


def test_resolved_when_the_behaviour_stopped(store):
    rows = synthetic_job(slow_rank=3, slow_from=2, steps=30)
    # make rank 3 healthy again after step 12 by rebuilding the later steps without the slowdown
    late = synthetic_job(slow_rank=None, steps=30, seed=1)
    rows["collectives"] = [r for r in rows["collectives"] if r["step"] <= 12] + [
        r for r in late["collectives"] if r["step"] > 12
    ]
    _load(store, rows)
    (f,) = find_stragglers(store, "job-synth")
    assert f.state == "resolved" and f.last_seen_step == 12


def test_same_answer_on_chdb_and_server(tmp_path, server_db_url):
    rows = synthetic_job(ranks=8, steps=25, slow_rank=5, slow_from=7, seed=3)
    emb = open_store(f"embedded://{tmp_path}/s")
    srv = open_store(server_db_url)
    _load(emb, rows)
    _load(srv, rows)
    a, b = compute_blame(emb, "job-synth"), compute_blame(srv, "job-synth")
    assert a.sql == b.sql  # the raw ledger on both (the server's rollup: tests/analyzers/test_rollups.py)
    np.testing.assert_array_equal(a.ranks, b.ranks)
    np.testing.assert_array_equal(a.steps, b.steps)
    np.testing.assert_allclose(a.delay_s, b.delay_s, rtol=1e-9, atol=1e-12)
    np.testing.assert_array_equal(a.last_count, b.last_count)
    np.testing.assert_allclose(a.step_time_s, b.step_time_s)
    fa, fb = find_stragglers(emb, "job-synth"), find_stragglers(srv, "job-synth")
    assert [f.to_row() | {"updated_ns": 0} for f in fa] == [f.to_row() | {"updated_ns": 0} for f in fb]
    assert [f.suspects[0].rank for f in fa] == [5]
    srv.close()


def test_findings_keep_a_stable_identity(store):
    _load(store, synthetic_job())
    first = find_stragglers(store, "job-synth")
    save_findings(store, first)
    again = find_stragglers(store, "job-synth")
    save_findings(store, again)
    assert [f.id for f in first] == [f.id for f in again] == [finding_id("job-synth", 0, "straggler", "rank:2")]
    latest = latest_findings(store, "job-synth")
    assert len(latest) == 1 and latest[0]["suspect_ranks"] == [2]


def test_detector_validates_its_thresholds():
    with pytest.raises(ValueError, match="persistence"):
        PersistentBlameDetector(persistence=0)


def test_collectives_without_completion_times_still_name_the_slow_rank(store):
    # Collectives only torch's flight-recorder ring saw (DTensor / functional collectives on gloo)
    # carry end_ns = 0: the group's last arrival stands for their completion, so the ranks that
    # waited for a late peer are seen blocked and the late one computing (it named nobody before).
    rows = synthetic_job(slow_rank=2, slow_from=5, extra_s=0.05, steps=20)
    for c in rows["collectives"]:
        c["end_ns"] = 0
    _load(store, rows)
    (f,) = find_stragglers(store, "job-synth")
    assert [s.rank for s in f.suspects] == [2]
    assert f.first_seen_step == 5
    assert f.evidence["excess_per_step_s"] == pytest.approx(0.05, abs=0.006)


def _round_trip_findings():
    from ranklens.analyzers.findings import Finding, Severity, Suspect

    common = dict(
        job_id="job-rt", attempt=1, first_seen_ns=1_700_000_000_000_000_000, last_seen_ns=1_700_000_060_000_000_000
    )
    return [
        # ranks on different nodes, one with a GPU: a set of hosts cannot say which was whose
        Finding(
            finding_id("job-rt", 1, "straggler", "rank:3"), kind="straggler", severity=Severity.WARNING,
            confidence=0.9, title="ranks 3, 5 slow", suspects=(Suspect(3, "node1", "node1:3"), Suspect(5, "node0")),
            first_seen_step=4, last_seen_step=40, impact_s=1.5, impact_gpu_s=12.0, step_time_pct=3.25,
            evidence={"per_step": [0.1, 0.2], "sql": "SELECT 1"}, detector="robust_z", updated_ns=17, **common,
        ),
        # a node, no rank
        Finding(
            finding_id("job-rt", 1, "straggler", "node:node0003"), kind="straggler", severity=Severity.CRITICAL,
            confidence=0.7, title="node0003 slow", suspects=(Suspect(-1, "node0003"),), first_seen_step=0,
            last_seen_step=9, evidence={"ranks": [4, 5]}, state="resolved", updated_ns=18, **common,
        ),
        # two links: each rank keeps its own link and node
        Finding(
            finding_id("job-rt", 1, "slow_link", "node3"), kind="slow_link", severity=Severity.INFO, confidence=0.5,
            title="links slow",
            suspects=(Suspect(6, "node3", "", ("node3", "network")), Suspect(1, "node1", "", ("node1", "node3"))),
            first_seen_step=-1, last_seen_step=-1, evidence={}, updated_ns=19, **common,
        ),
    ]  # fmt: skip


def test_finding_row_finding_is_identity_for_rank_node_and_link_findings():
    from ranklens.analyzers.findings import finding_from_row
    from ranklens.schema import TABLES

    for f in _round_trip_findings():
        row = f.to_row()
        # one row shape: every column of the table but the store's ingest_id, nothing else
        assert set(row) == set(TABLES["findings"].column_names) - {"ingest_id"}
        assert finding_from_row(row) == f
        assert finding_from_row(json.loads(json.dumps(row))) == f  # as a JSON-Lines ingest would give it


def test_finding_round_trips_through_the_store(store):
    from ranklens.analyzers.findings import load_finding

    fs = _round_trip_findings()
    save_findings(store, fs)
    assert [load_finding(store, f.id) for f in fs] == fs


def test_finding_rows_written_before_the_stored_suspects_still_read():
    from ranklens.analyzers.findings import Suspect, finding_from_row

    old = {"id": "x", "job_id": "j", "kind": "slow_link", "suspect_ranks": [6, 7], "suspect_hosts": ["node3"]}
    old |= {"suspect_links": ["node3<->network"], "evidence": '{"sql": "S"}'}
    f = finding_from_row(old)
    assert f.suspects == (Suspect(6, "node3", "", ("node3", "network")), Suspect(7, "node3", "", ("node3", "network")))
    assert f.evidence == {"sql": "S"}


def test_evidence_may_not_use_the_stored_suspects_key():
    import dataclasses

    f = dataclasses.replace(_round_trip_findings()[0], evidence={"suspects": [1]})
    with pytest.raises(ValueError, match="reserved"):
        f.to_row()


def test_find_stragglers_reads_the_matrix_the_detector_names(embedded_store):
    """A detector says which matrix it decides over (``metric``), not which attributes it happens to
    have: a peer detector without a ``z`` threshold still gets the compute matrix."""
    from ranklens.analyzers.blame import BlameMatrix
    from ranklens.analyzers.compute import ComputeMatrix

    _load(embedded_store, synthetic_job(slow_rank=2, slow_from=5, extra_s=0.05, steps=20))
    seen: list[object] = []

    class MyPeerDetector:
        name = "mine"
        metric = "compute"

        def detect(self, cm):
            seen.append(cm)
            return []

    class MyBlameDetector(MyPeerDetector):
        metric = "blame"

    assert find_stragglers(embedded_store, "job-synth", detector=MyPeerDetector()) == []
    assert find_stragglers(embedded_store, "job-synth", detector=MyBlameDetector()) == []
    assert [type(m) for m in seen] == [ComputeMatrix, BlameMatrix]
    (f,) = find_stragglers(embedded_store, "job-synth", detector=PersistentBlameDetector())
    assert f.detector == "persistent_blame" and [s.rank for s in f.suspects] == [2]

    class NoMetric:
        name = "x"

        def detect(self, m):
            return []

    with pytest.raises(ValueError, match="metric=None; allowed: 'blame'"):
        find_stragglers(embedded_store, "job-synth", detector=NoMetric())


def _blip_matrix(step_s: float, n: int = 17, hot: range = range(8, 13), delay_s: float = 0.013):
    """Blame of a 4-rank job: rank 3 kept the others waiting ``delay_s`` in the steps of ``hot``
    (alone, every one of them), nobody in the others; every step lasts ``step_s``."""
    from ranklens.analyzers.blame import BlameMatrix

    delay = np.zeros((4, n))
    delay[3, list(hot)] = delay_s
    return BlameMatrix(
        job_id="j", attempt=0, ranks=np.arange(4), steps=np.arange(n), delay_s=delay, wait_s=3 * delay,
        last_count=np.zeros((4, n)), step_time_s=np.full(n, step_s), step_start_ns=np.zeros(n, dtype=np.int64),
        hosts={r: "vm" for r in range(4)}, sql="", step_basis="iterations",
    )  # fmt: skip


def test_a_sub_second_blip_over_short_iterations_is_not_a_straggler():
    """Seen in a loaded suite run: a healthy step-free job (iterations of 33 ms) whose rank 3 was
    last for 5 iterations (0.17 s: the host's scheduler), then never again, was named a critical
    straggler. Five hot steps of 33 ms are a blip; five of 0.2 s (1 s), or eight short ones, persist."""
    det = PersistentBlameDetector()
    assert det.detect(_blip_matrix(0.033)) == []
    (d,) = det.detect(_blip_matrix(0.2))
    assert (d.rank, d.onset_index, d.hot_steps) == (3, 8, 5)
    # eight hot steps or more: persistent, short iterations or not (and, going on to the end, open)
    (d,) = det.detect(_blip_matrix(0.033, hot=range(8, 17)))
    assert (d.rank, d.onset_index, d.last_index, d.hot_steps) == (3, 8, 16, 9)
    # a short run that is still going on waits until it has lasted half a second
    assert det.detect(_blip_matrix(0.033, hot=range(12, 17))) == []
    assert [d.rank for d in det.detect(_blip_matrix(0.11, hot=range(12, 17)))] == [3]
