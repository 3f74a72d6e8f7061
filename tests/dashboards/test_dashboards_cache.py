"""The per-data-version cache of the dashboards' queries (issue 18): the clock offsets behind every
blame, wait and culprit query are computed once per version of the job's rows, give the analyzer's
own blame cells, and are recomputed when rows arrive."""

from __future__ import annotations

import numpy as np
import pytest

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
    assert len(calls) == 1  # the version is read again only once it is TTL_S old
    later = _cache._clock() + _cache.TTL_S + 1
    monkeypatch.setattr(_cache, "_clock", lambda: later)
    _cache.job_offsets(store, job.job_id, 0)
    assert len(calls) == 2  # a new version: computed again


def test_link_bandwidth_in_one_pass_is_the_per_collective_sums(store):
    """The links page's rollup (one scan of the transfers) gives what summing the analyzer's
    transfer rows per pair, group and member rank gives, straight from SQL."""
    from ranklens.analyzers.links import transfer_sql
    from ranklens.dashboards import queries as q
    from ranklens.dashboards.queries.links import LINK_MIN_BYTES

    job = simulate(store, ranks=16, steps=8, pp=2, tp=4, ranks_per_node=4, faults=["slow_link:1:3@2"], job_id="l1")
    lo, hi = 1, 7
    bw = q.link_bandwidth(store, job.job_id, 0, lo, hi)
    xfer = transfer_sql(job.job_id, 0, min_bytes=LINK_MIN_BYTES, step_from=lo, step_to=hi)
    w = f"job_id = '{job.job_id}' AND attempt = 0 AND step >= {lo} AND step <= {hi}"
    want_rank = store.query(
        f"SELECT rank, sum(bus_bytes), sum(xfer_ns), count() "
        f"FROM (SELECT rank, pg, seq FROM collectives WHERE {w}) AS l "
        f"ALL INNER JOIN (SELECT pg, seq, bus_bytes, xfer_ns FROM ({xfer})) AS r USING (pg, seq) "
        "GROUP BY rank ORDER BY rank"
    ).rows()
    got_rank = list(bw.per_rank.itertuples(index=False, name=None))
    assert [r[0] for r in got_rank] == [r[0] for r in want_rank] == list(range(16))
    for got, want in zip(got_rank, want_rank):
        assert got[1] == pytest.approx(want[1]) and got[2:] == tuple(want[2:])
    want_groups = dict(
        (pg, (calls, bps, med))
        for pg, calls, bps, med in store.query(
            f"SELECT pg, count(), sum(bus_bytes) / (sum(xfer_ns) / 1e9), quantileExact(0.5)(bw_Bps) "
            f"FROM ({xfer}) GROUP BY pg"
        ).rows()
    )
    assert set(bw.groups["pg"]) == set(want_groups)
    for pg, calls, bps, med in zip(
        bw.groups["pg"], bw.groups["calls"], bw.groups["bytes_per_s"], bw.groups["median_bps"]
    ):
        assert (calls, bps, med) == (
            want_groups[pg][0],
            pytest.approx(want_groups[pg][1]),
            pytest.approx(want_groups[pg][2]),
        )
    assert list(bw.groups["bytes_per_s"]) == sorted(bw.groups["bytes_per_s"])  # slowest first
    want_pairs = store.query(
        f"SELECT a_rank, b_rank, count() FROM ({xfer}) WHERE members = 2 GROUP BY a_rank, b_rank"
    ).rows()
    assert sorted(zip(bw.pairs["a_rank"], bw.pairs["b_rank"], bw.pairs["calls"])) == sorted(want_pairs)
    assert len(want_pairs) == 16  # the 8 pipeline stage pairs and the 8 two-member data-parallel groups


def test_versioned_queries_are_computed_once_per_data_version(tmp_path, monkeypatch):
    """``cached`` keeps a heat map past the short TTL while the job's rows are unchanged and
    recomputes it once rows arrive (the data version is itself under the short TTL)."""
    pytest.importorskip("streamlit")
    from ranklens.dashboards import queries as q
    from ranklens.store import open_store

    store = open_store(f"embedded://{tmp_path / 'store'}")
    job = simulate(store, ranks=8, steps=4, tp=4, ranks_per_node=4, job_id="v1")
    calls = []
    real = q.QUERIES["heatmap"]
    monkeypatch.setitem(q.QUERIES, "heatmap", lambda *a, **k: calls.append(a) or real(*a, **k))
    q._cached_versioned.clear()

    def heat():
        return q.cached("heatmap", store.url, job.job_id, 0, "step_time", 0, 3, axis="rank")

    first = heat()
    q._cached.clear()  # the short TTL ran out: the version is read again, the same
    assert heat().equals(first) and len(calls) == 1
    store.write("steps", [{"job_id": job.job_id, "rank": 0, "step": 3, "start_ns": 1, "end_ns": 10**12}])
    assert heat().equals(first) and len(calls) == 1  # within the TTL the old version still holds
    q._cached.clear()
    assert heat()["value"].max() > first["value"].max() and len(calls) == 2  # new rows, recomputed
