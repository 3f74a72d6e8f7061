"""The ``collective_arrivals`` rollup (issue 19): a materialised view on a real ClickHouse server
fills it as collectives are inserted. Blame reads it once the job's raw rows are gone (expired), and
wherever it serves with RANKLENS_ROLLUPS=1, with the raw ledger's results: the same last arrivers,
waits and findings, the clocks aligned by host. Where it cannot serve (rows it saw twice after a
batch was resent, rows that name no host while clocks need aligning, a store without it) the raw
ledger answers."""

from __future__ import annotations

import numpy as np
import pytest

from ranklens.analyzers.blame import blame_offsets, blame_source, compute_blame, run_blame
from ranklens.analyzers.job import analyze_job
from ranklens.simulate import simulate
from tests._sync import wait_until

JOB = "roll-1"
# 64 ranks on 8 hosts; rank 17 slow from step 10; two hosts' clocks off by +40 ms and -25 ms
FAULTS = ["slow_gpu:17:1.3@10", "clock_skew:node0003:40", "clock_skew:node0001:-25"]


def _both(monkeypatch, fn):
    """``fn()`` with the rollup (RANKLENS_ROLLUPS=1), then as by default (the raw ledger holds the job)."""
    monkeypatch.setenv("RANKLENS_ROLLUPS", "1")
    with_rollup = fn()
    monkeypatch.delenv("RANKLENS_ROLLUPS")
    raw = fn()
    return with_rollup, raw


def _same_blame(a, b) -> None:
    assert "collective_arrivals" in a.sql and "collective_arrivals" not in b.sql
    assert np.array_equal(a.ranks, b.ranks) and np.array_equal(a.steps, b.steps)
    assert np.array_equal(a.last_count, b.last_count)
    assert np.allclose(a.delay_s, b.delay_s, rtol=1e-9, atol=1e-9)
    assert np.allclose(a.wait_s, b.wait_s, rtol=1e-9, atol=1e-9)


@pytest.mark.server
def test_the_rollup_is_filled_on_insert_and_blame_from_it_is_the_raw_ledgers(server_store, monkeypatch):
    simulate(server_store, ranks=64, steps=30, faults=FAULTS, job_id=JOB, seed=3)
    raw_rows = server_store.query(f"SELECT count() FROM collectives WHERE job_id = '{JOB}'").scalar()
    rolled = server_store.query(
        f"SELECT count(), sum(n) FROM (SELECT countMerge(rows) AS n FROM collective_arrivals "
        f"WHERE job_id = '{JOB}' GROUP BY pg, seq, step, host)"
    ).rows()[0]
    assert rolled[1] == raw_rows and rolled[0] < raw_rows  # every row once, fewer rows (one per host)
    offsets = blame_offsets(server_store, JOB, 0)
    assert blame_source(server_store, JOB, 0, offsets) is None  # by default: the raw ledger holds it all
    monkeypatch.setenv("RANKLENS_ROLLUPS", "1")
    source = blame_source(server_store, JOB, 0, offsets)
    monkeypatch.delenv("RANKLENS_ROLLUPS")
    assert offsets and source is not None
    assert abs(source["node0003"] - source["node0000"] - 40_000_000) < 1_000_000, source  # by host
    a, b = _both(monkeypatch, lambda: compute_blame(server_store, JOB))
    _same_blame(a, b)
    fa, fb = _both(monkeypatch, lambda: analyze_job(server_store, JOB))
    assert [(f.kind, f.title) for f in fa] == [(f.kind, f.title) for f in fb]
    assert any(f.kind == "straggler" and [s.rank for s in f.suspects] == [17] for f in fa), [f.title for f in fa]


@pytest.mark.server
def test_the_dashboards_wait_heat_map_reads_the_rollup_with_the_same_values(server_store, monkeypatch):
    from ranklens.dashboards.queries import heatmaps

    simulate(server_store, ranks=32, steps=12, faults=FAULTS[:2], job_id=JOB, seed=1)

    def source() -> str:
        return heatmaps._metric_source(server_store, "wait", JOB, 0, 0, 11, "", 0)

    rolled, raw = _both(monkeypatch, source)
    assert "collective_arrivals" in rolled and "collective_arrivals" not in raw
    a, b = _both(monkeypatch, lambda: server_store.query(source()).rows())
    assert len(a) == 32 * 12
    a, b = sorted(a), sorted(b)
    assert [x[:2] for x in a] == [x[:2] for x in b]
    assert np.allclose([x[2] for x in a], [x[2] for x in b], rtol=1e-9, atol=1e-9)


@pytest.mark.server
def test_rows_the_rollup_saw_twice_send_blame_to_the_raw_ledger(server_store, monkeypatch):
    """A batch stored in part, discarded and sent again (the collector's exactly-once path): the raw
    table holds every row once, the view saw the first part twice. Blame must not sum it twice."""
    monkeypatch.setenv("RANKLENS_ROLLUPS", "1")
    simulate(server_store, ranks=16, steps=8, faults=["slow_gpu:5:1.5@2"], job_id=JOB, seed=2)
    good = compute_blame(server_store, JOB)
    assert "collective_arrivals" in good.sql
    part = server_store.query(f"SELECT * FROM collectives WHERE job_id = '{JOB}' AND step = 3 AND rank < 8").to_pylist()
    server_store.write("collectives", [dict(r, ingest_id=99) for r in part])  # the part stored ...
    assert server_store.discard_ingest("collectives", [99]) == len(part)  # ... and discarded
    dup = server_store.query(
        f"SELECT sum(n - u) FROM (SELECT countMerge(rows) AS n, uniqExactMerge(ranks) AS u "
        f"FROM collective_arrivals WHERE job_id = '{JOB}' GROUP BY pg, seq, step, host)"
    ).scalar()
    assert dup == len(part)  # the view cannot forget them
    again = compute_blame(server_store, JOB)
    assert "collective_arrivals" not in again.sql  # the raw ledger answered
    monkeypatch.setenv("RANKLENS_ROLLUPS", "0")
    _same = compute_blame(server_store, JOB)
    assert np.array_equal(again.delay_s, _same.delay_s) and np.array_equal(good.last_count, again.last_count)
    assert np.allclose(good.delay_s, again.delay_s, rtol=1e-9, atol=1e-9)


@pytest.mark.server
def test_rows_without_a_host_are_not_aligned_by_the_rollup(server_store, monkeypatch):
    """Rows written before schema 11 name no host: with clocks to align, blame reads the raw ledger
    (which aligns each rank by the ranks table); without, the rollup still serves."""
    monkeypatch.setenv("RANKLENS_ROLLUPS", "1")
    simulate(server_store, ranks=16, steps=6, faults=["clock_skew:node0001:30"], job_id=JOB, seed=4)
    rows = server_store.query(f"SELECT * FROM collectives WHERE job_id = '{JOB}' AND rank = 0").to_pylist()
    server_store.write("collectives", [dict(r, job_id="roll-nohost", host="") for r in rows[:4]])
    offsets = blame_offsets(server_store, JOB, 0)
    assert offsets and blame_source(server_store, JOB, 0, offsets)
    assert blame_source(server_store, "roll-nohost", 0, {0: 5}) is None
    assert blame_source(server_store, "roll-nohost", 0, None) == {}
    assert blame_source(server_store, "no-such-job", 0, None) is None  # nothing of it in the rollup


@pytest.mark.server
def test_blame_outlives_the_raw_ledger(server_store):
    """The raw ledger expires first (14 days against the rollup's 180 on a current server; here its
    rows are deleted, as a TTL drops them): blame of the job then comes from the rollup, by default,
    and still names the slowed rank with the waits it caused."""
    simulate(server_store, ranks=32, steps=12, faults=["slow_gpu:9:1.5@3"], job_id=JOB, seed=6)
    before = compute_blame(server_store, JOB, align=False)
    assert "collective_arrivals" not in before.sql
    server_store._execute(f"ALTER TABLE {server_store.config.database}.collectives DELETE WHERE job_id = '{JOB}'")
    wait_until(lambda: not server_store.query("SELECT count() FROM collectives").scalar(), 30, "the rows deleted")
    after = compute_blame(server_store, JOB, align=False)
    assert "collective_arrivals" in after.sql
    assert np.array_equal(after.last_count, before.last_count)
    assert np.allclose(after.delay_s, before.delay_s, rtol=1e-6, atol=1e-9)
    worst = int(after.ranks[np.argmax(after.delay_s.sum(axis=1))])
    assert worst == 9, after.delay_s.sum(axis=1)


def test_the_embedded_store_has_no_rollup_and_blame_reads_the_raw_ledger(embedded_store):
    simulate(embedded_store, ranks=8, steps=4, job_id=JOB, seed=0)
    assert blame_source(embedded_store, JOB, 0, None) is None
    result, sql = run_blame(embedded_store, JOB, 0, 0)
    assert result.num_rows and "collective_arrivals" not in sql


@pytest.mark.server
def test_the_jobs_list_reads_the_rank_steps_rollup_with_the_raw_ledgers_answer(server_store, monkeypatch):
    """A job traced without step markers is listed from its collectives: from the rank_steps rollup
    (one row per rank and step) where the server has it, with the raw ledger's ranks and times."""
    from ranklens.dashboards.queries import jobs

    rows = [
        {"job_id": "ledger-only", "rank": r, "pg": "0", "seq": q, "op": "all_reduce", "step": q // 4,
         "enter_ns": 1_000 + 10 * q + r, "end_ns": 2_000 + 10 * q if q < 15 else 0, "host": f"h{r // 2}"}
        for r in range(4) for q in range(16)
    ]  # fmt: skip
    server_store.write("collectives", rows)
    assert "rank_steps" in jobs._ledger_jobs_sql(server_store, 10)
    rolled = jobs.list_jobs(server_store)
    monkeypatch.setenv("RANKLENS_ROLLUPS", "0")
    assert "rank_steps" not in jobs._ledger_jobs_sql(server_store, 10)
    raw = jobs.list_jobs(server_store)
    cols = ["job_id", "attempt", "ranks", "first_ns", "last_ns"]
    assert rolled[cols].to_dict("records") == raw[cols].to_dict("records")
    assert rolled[cols].to_dict("records") == [
        {"job_id": "ledger-only", "attempt": 0, "ranks": 4, "first_ns": 1_000, "last_ns": 2_140}
    ]
