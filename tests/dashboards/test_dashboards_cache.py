"""The per-data-version cache of the dashboards' queries (issue 18): the clock offsets behind every
blame, wait and culprit query are computed once per version of the job's rows, give the analyzer's
own blame cells, and are recomputed when rows arrive."""

from __future__ import annotations

import numpy as np

from ranklens.analyzers.blame import blame_cells
from ranklens.dashboards.queries import _cache
from ranklens.simulate import simulate


def test_cached_offsets_give_the_analyzers_blame_cells_and_follow_new_rows(store, monkeypatch):
    # node 0's clock runs 200 ms ahead: the offsets matter (raw clocks would blame ranks 0..3)
    job = simulate(
        store, ranks=16, steps=8, tp=4, ranks_per_node=4, faults=["slow_gpu:6:1.4@2", "clock_skew:0:200"], job_id="c1"
    )
    calls = []
    real = _cache.blame_offsets
    monkeypatch.setattr(_cache, "blame_offsets", lambda *a: calls.append(a) or real(*a))

    want = blame_cells(store, job.job_id, 0, step_from=2, step_to=7)
    got = _cache.job_blame_cells(store, job.job_id, 0, 2, 7, None)
    again = _cache.job_blame_cells(store, job.job_id, 0, 0, 7, None)
    assert len(calls) == 1  # one offsets scan for both windows
    assert _cache.job_offsets(store, job.job_id, 0)  # the skewed node has an offset
    assert len(calls) == 1
    order = np.lexsort((want.ranks, want.steps))
    order_got = np.lexsort((got.ranks, got.steps))
    np.testing.assert_array_equal(got.ranks[order_got], want.ranks[order])
    np.testing.assert_array_equal(got.steps[order_got], want.steps[order])
    np.testing.assert_allclose(got.delay_s[order_got], want.delay_s[order])
    assert len(again.ranks) >= len(got.ranks)

    before = _cache.data_version(store, job.job_id, 0)
    store.write(
        "steps", [{"job_id": job.job_id, "rank": 0, "step": 99, "start_ns": job.last_ns, "end_ns": job.last_ns + 1}]
    )
    assert _cache.data_version(store, job.job_id, 0) != before
    _cache.job_offsets(store, job.job_id, 0)
    assert len(calls) == 2  # a new version: computed again
