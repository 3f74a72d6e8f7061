"""The two metrics that group a whole ledger (compute and link) run in parts on a big job, to bound
the store's memory (issue 18): in parts they give exactly the rows, in the order, of one query.
Checked on both backends by making the part size tiny on a small simulated job."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ranklens.analyzers import compute, links
from ranklens.analyzers.compute import _step_parts, compute_matrix
from ranklens.analyzers.links import compute_link_metrics, find_slow_links
from tests.links_helpers import SimSpec, simulate


def _same(a: object, b: object) -> None:
    for f in dataclasses.fields(a):  # type: ignore[arg-type]
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape, f.name
            if x.dtype.kind == "f":
                np.testing.assert_array_equal(x, y, err_msg=f.name)  # NaN where NaN
            else:
                assert (x == y).all(), f.name
        elif f.name != "sql":
            assert x == y, f.name


@pytest.mark.parametrize("store", ["embedded", "server"], indirect=True)
def test_link_metric_in_parts_is_the_one_query(store, monkeypatch):
    store.write_many(simulate(SimSpec(job_id="parts", slow_nodes={5: 2.0}, slow_from=3, steps=12)))
    whole = compute_link_metrics(store, "parts")
    found = [f.evidence["link"] for f in find_slow_links(store, "parts")]
    assert len(whole) > 100 and found == ["node5<->network"]
    queries: list[str] = []
    real = store.query

    def counting(sql: str):
        queries.append(sql)
        return real(sql)

    monkeypatch.setattr(links, "PART_ROWS", 200)
    monkeypatch.setattr(store, "query", counting)
    parts = compute_link_metrics(store, "parts")
    assert sum("cityHash64(pg) %" in q for q in queries) > 3  # it did run in parts
    _same(whole, parts)
    assert [f.evidence["link"] for f in find_slow_links(store, "parts")] == found


@pytest.mark.parametrize("store", ["embedded", "server"], indirect=True)
def test_compute_matrix_in_parts_is_the_one_query(store, monkeypatch):
    store.write_many(simulate(SimSpec(job_id="parts", steps=12, seed=3)))
    whole = compute_matrix(store, "parts")
    assert whole.compute_s.shape[1] == 12 and np.isfinite(whole.compute_s).all()
    monkeypatch.setattr(compute, "PART_ROWS", 40)  # 32 ranks: one step a part
    _same(whole, compute_matrix(store, "parts"))
    tail = compute_matrix(store, "parts", window_steps=5)
    monkeypatch.setattr(compute, "PART_ROWS", 10**9)
    _same(compute_matrix(store, "parts", window_steps=5), tail)
    assert list(tail.steps) == list(range(7, 12))


def test_step_parts_cover_the_steps_once():
    assert _step_parts(0, 99, 1_024_000, 0) == [(0, 24), (25, 49), (50, 74), (75, None)]
    assert _step_parts(0, 99, 6_400, 0) == [(0, None)]  # a small job: one query, as before
    assert _step_parts(0, 99, 1_024_000, 90) == [(90, None)]  # a live window
    assert _step_parts(0, 0, 0, 0) == [(0, None)]  # no steps yet
    for lo, hi, rows, since in [(3, 50, 480_000, 0), (0, 7, 10**7, 2), (5, 5, 10**6, 0)]:
        parts = _step_parts(lo, hi, rows, since)
        covered = [s for a, b in parts for s in range(a, (hi if b is None else b) + 1)]
        assert covered == list(range(max(lo, since), hi + 1)) and parts[-1][1] is None


@pytest.mark.parametrize("store", ["embedded", "server"], indirect=True)
def test_the_compute_metric_looks_up_last_arrivals_only_where_a_collective_is_unfinished(store):
    import pyarrow as pa
    import pyarrow.compute as pc

    from ranklens.analyzers.compute import compute_sql

    tables = simulate(SimSpec(job_id="done", steps=6, seed=5))
    store.write_many(tables)
    rows = store.query(compute_sql("done", 0)).rows()
    assert rows == store.query(compute_sql("done", 0, unfinished=False)).rows()  # nothing to look up: the same
    assert not compute_matrix(store, "done").unfinished
    # the collectives of steps 3.. seen by torch's ring only (no completion time): the last arrival stands in
    c = tables["collectives"]
    zero = pc.greater_equal(c.column("step"), 3)
    c = c.set_column(
        c.schema.get_field_index("end_ns"), "end_ns", pc.if_else(zero, pa.scalar(0, pa.int64()), c.column("end_ns"))
    )
    c = c.set_column(c.schema.get_field_index("job_id"), "job_id", pa.array(["open"] * c.num_rows))
    store.write_many(
        {
            **{
                k: t.set_column(t.schema.get_field_index("job_id"), "job_id", pa.array(["open"] * t.num_rows))
                for k, t in tables.items()
                if "job_id" in t.column_names
            },
            "collectives": c,
        }
    )
    looked_up = store.query(compute_sql("open", 0)).rows()
    assert looked_up != store.query(compute_sql("open", 0, unfinished=False)).rows()
    m = compute_matrix(store, "open")
    assert m.unfinished
    for rank, step, dur, wait, _ in looked_up:
        i, j = int(np.searchsorted(m.ranks, rank)), int(np.searchsorted(m.steps, step))
        assert m.compute_s[i, j] == pytest.approx((dur - min(wait, dur)) / 1e9, rel=1e-12, abs=1e-12)
