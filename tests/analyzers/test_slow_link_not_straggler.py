"""A throttled link makes no healthy rank a straggler: time blocked in a slow collective is not compute.

Real data (tests/data/slow_link_exchange/, see its PROVENANCE.md): the network drill's 3-node job,
one rank per node, whose forward issues async all-reduces in its cross-node pair groups and waits
for them, and whose backward then issues DDP's async gradient bucket. Node 2's link was throttled
to 40 Mbit/s at step 8. Every rank's forward then waits 300-450 ms for the pair groups through
node 2. The compute metric used to take one async batch per step (the last issue to the last
completion of all the step's async calls: the DDP bucket), so that wait counted as compute on
every rank (~70 ms -> ~500 ms) and its rank-to-rank noise named healthy ranks 0 and 1 stragglers.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ranklens.analyzers import find_stragglers
from ranklens.analyzers.compute import compute_matrix, phase_compute_sql
from ranklens.analyzers.job import analyze_job

DATA = Path(__file__).parent.parent / "data" / "slow_link_exchange"
JOB = "drill-20261205-072325-f60544"
ONSET_STEP = 8  # tc applied when the ranks reported step 8 (the drill's ground truth)
TABLES = ("ranks", "process_groups", "steps", "phases", "collectives", "cpu")


def _load(store, upto_step: int | None = None) -> None:
    for table in TABLES:
        rows = [json.loads(line) for line in (DATA / f"{table}.jsonl").read_text().splitlines()]
        if upto_step is not None and table in ("steps", "phases", "collectives"):
            rows = [r for r in rows if r["step"] <= upto_step]
        store.write(table, rows)


def test_the_link_time_is_no_ranks_compute(store):
    _load(store)
    cm = compute_matrix(store, JOB)
    before = np.nanmedian(cm.compute_s[:, 1:ONSET_STEP], axis=1)
    after = np.nanmedian(cm.compute_s[:, ONSET_STEP + 4 :], axis=1)
    step_after = np.nanmedian(cm.step_s[:, ONSET_STEP + 4 :], axis=1)
    # the steps got ~7x longer; what every rank computes did not change (same model, same data)
    assert np.all(step_after > 4 * before), (step_after, before)
    assert np.all(np.abs(after - before) < 0.2 * before), (before, after)
    # and ranks 0 and 1 compute no more than rank 2 (the one behind the slow link)
    assert np.all(np.abs(after - np.median(after)) < 0.05 * np.median(after)), after


def test_an_async_exchange_waited_on_in_forward_is_wait_not_compute(store):
    _load(store)
    rows = store.query(phase_compute_sql(JOB, 0, min_step=20, max_step=20)).rows()
    by = {(int(r), str(p)): (int(d), int(w)) for r, _s, p, d, w in rows}
    for rank in (0, 1, 2):
        dur, wait = by[(rank, "forward")]
        assert dur > 300e6 and dur - wait < 40e6, (rank, dur, wait)  # ~30 ms of layer time, the rest waiting


def test_no_straggler_behind_a_throttled_link(embedded_store):
    _load(embedded_store)
    stragglers = find_stragglers(embedded_store, JOB)
    assert stragglers == [], [f.title for f in stragglers]
    # the link is what analyze names (the first of the two bugs the drill found)
    findings = analyze_job(embedded_store, JOB)
    kinds = [(f.kind, f.title) for f in findings]
    assert [k for k, _ in kinds] == ["slow_link"], kinds
    assert "node2" in findings[0].title


@pytest.mark.parametrize("upto_step", [14, 17, 21, 25])
def test_no_straggler_in_live_passes(embedded_store, upto_step):
    """As the drill's live loop saw the job: only the steps reported so far."""
    _load(embedded_store, upto_step)
    stragglers = find_stragglers(embedded_store, JOB, window_steps=500)
    assert stragglers == [], [f.title for f in stragglers]


def _load_lagging(store, upto_step: int, rank: int, lag_steps: int) -> None:
    """What a live pass saw in a fresh-clone CI run: every rank's steps through ``upto_step``, but
    ``rank``'s ledger only through ``upto_step - lag_steps`` (its tracer reads torch's ring every
    few seconds, so its collectives reach the store after its steps)."""
    for table in TABLES:
        rows = [json.loads(line) for line in (DATA / f"{table}.jsonl").read_text().splitlines()]
        if table in ("steps", "phases", "collectives"):
            rows = [r for r in rows if r["step"] <= upto_step]
        if table == "collectives":
            rows = [r for r in rows if r["rank"] != rank or r["step"] <= upto_step - lag_steps]
        store.write(table, rows)


@pytest.mark.parametrize("upto_step", [13, 20, 25])
def test_a_rank_whose_ledger_lags_its_steps_is_no_straggler_live(embedded_store, upto_step):
    """Its last steps' waits are not in the store yet: a live pass leaves those steps out rather
    than take the waits for compute (the run named rank 0, +240 ms/step at steps 11-13)."""
    _load_lagging(embedded_store, upto_step, rank=0, lag_steps=4)
    stragglers = find_stragglers(embedded_store, JOB, window_steps=500)
    assert stragglers == [], [f.title for f in stragglers]
    cm = compute_matrix(embedded_store, JOB, window_steps=500, settled=True)
    # steps count up to the last one rank 0's ledger has passed (each step's loss all-reduce comes
    # after the step's end): this ledger has collectives without a completion time, whose waits end
    # at the group's last stored arrival, so every rank's steps wait for the slowest ledger
    for k in range(len(cm.ranks)):
        done = cm.steps[np.isfinite(cm.compute_s[k])]
        assert upto_step - 6 <= done.max() <= upto_step - 4, (int(cm.ranks[k]), done.max())
        if cm.ranks[k] == 0:
            assert done.max() == upto_step - 4
    assert cm.unsettled >= 4 * len(cm.ranks), cm.unsettled


@pytest.mark.parametrize("upto_step", [13, 20, 25])
def test_peers_whose_ledgers_lag_make_no_straggler_of_the_rank_whose_ledger_is_in(tmp_path, upto_step):
    """Ranks 1 and 2's ledgers lag: rank 0's waits in collectives without a completion time (here
    the world group's, as DDP's buckets seen by torch's ring alone on gloo) end at the group's last
    *stored* arrival, too early while its peers' arrivals are missing, so its waits looked like
    compute (a CI run named healthy rank 0 a straggler in backward, +300 ms/step for three steps). A
    live pass leaves those steps out for every rank."""
    from ranklens.store import open_store

    rows = {t: [json.loads(x) for x in (DATA / f"{t}.jsonl").read_text().splitlines()] for t in TABLES}
    rows["collectives"] = [{**r, "end_ns": 0} if r["pg"] == "0" else r for r in rows["collectives"]]

    def load(store, lag: int) -> None:
        for table in TABLES:
            got = rows[table]
            if table in ("steps", "phases", "collectives"):
                got = [r for r in got if r["step"] <= upto_step]
            if table == "collectives":  # rank 0's ledger in, its peers' through upto_step - lag
                got = [r for r in got if r["rank"] == 0 or r["step"] <= upto_step - lag]
            store.write(table, got)

    whole = open_store(f"embedded://{tmp_path / 'whole'}")
    load(whole, 0)
    assert find_stragglers(whole, JOB, window_steps=500) == []  # every ledger in: nobody
    whole.close()
    lagging = open_store(f"embedded://{tmp_path / 'lagging'}")
    load(lagging, 3)
    stragglers = find_stragglers(lagging, JOB, window_steps=500)
    assert stragglers == [], [f.title for f in stragglers]
    cm = compute_matrix(lagging, JOB, window_steps=500, settled=True)
    assert cm.steps[np.isfinite(cm.compute_s).any(axis=0)].max() <= upto_step - 3
    lagging.close()


def test_rows_arriving_during_a_live_pass_are_not_taken_for_compute(embedded_store):
    """The store has no snapshot across a pass's queries: rows that arrive between the metric's
    read and the ledgers' marks made steps look settled whose waits the metric had not seen (the
    drill named healthy rank 1, +233 ms/step for three steps, with nothing left unsettled). Here
    rank 0's last four steps of collectives arrive just before the marks are read."""
    upto = 20
    late = []
    for table in TABLES:
        rows = [json.loads(line) for line in (DATA / f"{table}.jsonl").read_text().splitlines()]
        if table in ("steps", "phases", "collectives"):
            rows = [r for r in rows if r["step"] <= upto]
        if table == "collectives":
            late = [r for r in rows if r["rank"] == 0 and r["step"] > upto - 4]
            rows = [r for r in rows if not (r["rank"] == 0 and r["step"] > upto - 4)]
        embedded_store.write(table, rows)

    class Arriving:
        """The store, with the late rows written just before the marks are read."""

        def __getattr__(self, name):
            return getattr(embedded_store, name)

        def query(self, sql):
            if late and "AS mark" in sql:
                embedded_store.write("collectives", late[:])
                late.clear()
            return embedded_store.query(sql)

    cm = compute_matrix(Arriving(), JOB, window_steps=500, settled=True)
    whole = compute_matrix(embedded_store, JOB)
    for k, r in enumerate(cm.ranks):
        w = int(np.searchsorted(whole.ranks, r))
        got = {int(s): c for s, c in zip(cm.steps, cm.compute_s[k]) if np.isfinite(c)}
        want = {int(s): c for s, c in zip(whole.steps, whole.compute_s[w]) if np.isfinite(c)}
        assert all(abs(got[s] - want[s]) < 1e-6 for s in got), (int(r), got, want)
