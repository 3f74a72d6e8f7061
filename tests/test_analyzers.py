"""Blame analysis: ground truth on synthetic ledgers, the same answer on chDB and on the server."""

from __future__ import annotations

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
    assert a.sql == b.sql
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
