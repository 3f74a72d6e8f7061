"""Peer-aware straggler metric: how long each rank *computes* per step, compared with its peers.

A rank that waits for a slow peer has a long step but a short compute time; the slow rank itself
has the long compute time. So the metric is, per (rank, step), the step's duration minus the time
the rank was blocked in collectives (from each of its entries to the last completion before its
next entry: a sync call's ``end - enter``, an async batch's last issue to its last completion;
clipped to the step), and the same per phase. It is measured on each rank's own clock, so clock skew between hosts does
not touch it. Peers are ranks doing the same work: the same pipeline stage when the ``ranks`` table
knows the coordinate, else every rank of the job.

Everything heavy is SQL in the store (chDB or ClickHouse >= 18.16); Python shapes matrices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ranklens.records import numpy_array
from ranklens.store.api import QueryResult, Store
from ranklens.store.api import sql_escape as _esc

__all__ = ["ComputeMatrix", "compute_matrix", "compute_sql", "phase_compute_sql"]


def _waits_subquery(
    job_id: str, attempt: int, min_step: int = 0, max_step: int | None = None, only: str = "", unfinished: bool = True
) -> str:
    # A collective with no completion time (end_ns = 0: one only torch's flight-recorder ring saw,
    # e.g. a DTensor/functional collective on gloo) cannot have completed before its group's last
    # member arrived: that arrival stands for its completion, so a rank waiting for a late peer is
    # still seen blocked (taking its own arrival instead made the wait vanish, and the straggler with it).
    where = f"job_id = '{_esc(job_id)}' AND attempt = {int(attempt)}"
    upto = f" AND step <= {int(max_step)}" if max_step is not None else ""
    # `only` (" AND rank IN (...)") limits whose waits are summed; a collective's last arrival is every member's
    if not unfinished:  # the caller knows the ledger has no such collective: no join, no second scan
        return (
            "SELECT rank, step, groupArray(enter_ns) AS enters, groupArray(end_ns) AS ends FROM collectives "
            f"WHERE {where} AND step >= {int(min_step)}{upto}{only} GROUP BY rank, step"
        )
    return (
        "SELECT rank, step, groupArray(enter_ns) AS enters, "
        "groupArray(if(end_ns > 0, end_ns, greatest(last_enter_ns, enter_ns))) AS ends "
        f"FROM (SELECT rank, step, pg, seq, enter_ns, end_ns FROM collectives "
        f"WHERE {where} AND step >= {int(min_step)}{upto}{only}) AS cc "
        "ALL LEFT JOIN (SELECT pg, seq, max(enter_ns) AS last_enter_ns FROM collectives "
        f"WHERE {where} AND end_ns = 0 GROUP BY pg, seq) AS lg USING (pg, seq) "
        "GROUP BY rank, step"
    )


# Time a rank was blocked in collectives issued within [start_ns, end_ns), clipped to it. A rank
# acts when it enters a collective; between two of its entries it either computes or waits. It is
# taken as blocked from an entry until the last completion that came before its next entry (or the
# window's end): it had issued all it could and waited for that work to finish. For a sync call
# that is its arrival to its completion; for a batch of async calls (DDP's gradient buckets, or the
# cross-node exchanges a forward issues and then waits for) the batch's last issue to its last
# completion, whatever else the step issues later. (Taking one async batch per step, the last
# issue to the last completion of *all* the step's async calls, counted an exchange the forward
# waited on as compute whenever backward issued DDP buckets after it: behind a throttled link every
# rank then "computed" the link's time, and its noise named healthy ranks stragglers.)
# The ledger cannot tell waiting from overlapped compute between an entry and a completion (an early
# DDP bucket that completes before the next is issued counts as wait). That errs one way only: the
# rank that everybody waits for arrives last, so its calls complete right after its entries and its
# compute stands; the ranks that wait for it are the ones whose wait grows. On the simulated
# 64/1,024-rank jobs (sync calls only) and the tests' zero-code DDP jobs the metric is as before
# (one of 128 DDP steps differs).
# How, in arrays (no window functions on 18.16, and no lambda captures an array: ClickHouse
# replicates a captured column per element): completions and entries sorted together, one Int64
# key an event, time * 2 for a completion and time * 2 + 1 for an entry, so a completion sorts
# before an entry at a tie (a call that returns as the next one is entered ends its gap there).
# An entry's rise (its time over the previous entry's) is sorted by the same keys, so the running
# sum at a completion is the rank's latest entry before it (the anchor). A completion followed by
# an entry (or the window's end) is the last of its gap. The intervals of different gaps are
# disjoint, so their lengths add up. A call with no duration blocks nothing and is left out.
# (Integer keys, not (time, kind, rise) tuples: the same waits, ~15 % less time on chDB.)
_IN = "(e >= start_ns AND e < end_ns)"
# the window's columns (start_ns, end_ns, enters, ends) -> wait_ns, the rank's time blocked in it
_WAIT_COLUMNS = (
    f"arrayFilter(e -> {_IN}, enters) AS w_enters_, "
    f"arrayMap((x, e) -> least(greatest(x, e), end_ns), arrayFilter((x, e) -> {_IN}, ends, enters), w_enters_)"
    " AS w_ends_, "
    "arraySort(w_enters_) AS w_sorted_, "
    "arrayFilter((x, e) -> x > e, w_ends_, w_enters_) AS w_done_, "
    "arrayConcat(arrayMap(x -> x * 2, w_done_), arrayMap(e -> e * 2 + 1, w_sorted_)) AS w_keys_, "
    "arraySort(w_keys_) AS w_events_, "
    "arrayCumSum(arraySort((r, k) -> k, arrayConcat(arrayMap(x -> toInt64(0), w_done_), "
    "arrayMap((e, prev) -> e - prev, w_sorted_, arraySlice(arrayPushFront(w_sorted_, 0), 1, length(w_sorted_)))), "
    "w_keys_)) AS w_anchor_, "
    "arraySlice(arrayPushBack(arrayPopFront(arrayMap(k -> k % 2, w_events_)), 1), 1, length(w_events_)) AS w_next_, "
    "arraySum(arrayMap((k, a, nx) -> if(k % 2 = 0 AND nx = 1, intDiv(k, 2) - a, 0), w_events_, w_anchor_, w_next_))"
    " AS wait_ns"
)


def compute_sql(
    job_id: str, attempt: int, min_step: int = 0, max_step: int | None = None, *, unfinished: bool = True
) -> str:
    """THE compute metric, per (rank, step) from ``min_step`` (to ``max_step``): ``dur_ns`` (the
    step's duration) and ``wait_ns`` (time inside collectives); compute = dur - min(wait, dur). The
    straggler analyzer and the dashboards' compute heat map read these rows. ``unfinished=False``
    when the ledger is known to hold no collective without a completion time (the same rows, ~20 %
    less time: the last arrivals that would stand in for their completions are not looked up)."""
    upto = f" AND step <= {int(max_step)}" if max_step is not None else ""
    return f"""
SELECT rank, step, dur_ns, wait_ns, start_ns FROM (
SELECT rank, step, end_ns - start_ns AS dur_ns, start_ns, {_WAIT_COLUMNS}
FROM (SELECT rank, step, start_ns, end_ns FROM steps
      WHERE job_id = '{_esc(job_id)}' AND attempt = {int(attempt)} AND step >= {int(min_step)}{upto}) AS s
ALL LEFT JOIN ({_waits_subquery(job_id, attempt, min_step, max_step, unfinished=unfinished)}) AS c USING (rank, step))
ORDER BY step, rank
""".strip()


def phase_compute_sql(
    job_id: str,
    attempt: int,
    ranks: list[int] | None = None,
    *,
    min_step: int | None = None,
    max_step: int | None = None,
    unfinished: bool = True,
) -> str:
    """Per (rank, step, phase): phase duration and time inside collectives (optionally for some
    ranks, and steps ``min_step..max_step``). The collectives are read for those ranks and steps
    only (at 10,240 ranks, reading every rank's for one peer group's phases was most of the query)."""
    only = f" AND rank IN ({', '.join(str(int(r)) for r in ranks)})" if ranks else ""
    if min_step is not None:
        only += f" AND step >= {int(min_step)}"
    if max_step is not None:
        only += f" AND step <= {int(max_step)}"
    waits = _waits_subquery(job_id, attempt, max(0, int(min_step or 0)), max_step, only, unfinished)
    return f"""
SELECT rank, step, phase, dur_ns, wait_ns FROM (
SELECT rank, step, phase, end_ns - start_ns AS dur_ns, {_WAIT_COLUMNS}
FROM (SELECT rank, step, phase, start_ns, end_ns FROM phases
      WHERE job_id = '{_esc(job_id)}' AND attempt = {int(attempt)}{only}) AS p
ALL LEFT JOIN ({waits}) AS c USING (rank, step))
""".strip()


@dataclass(frozen=True)
class ComputeMatrix:
    """Per rank x step (seconds): ``compute_s`` = step minus collective time, ``step_s`` the step."""

    job_id: str
    attempt: int
    ranks: np.ndarray
    steps: np.ndarray
    compute_s: np.ndarray  # nan where the rank has no record of the step
    step_s: np.ndarray
    step_start_ns: np.ndarray  # per step: earliest start
    peer_group: np.ndarray  # per rank: a peer-group label (same label, same work)
    hosts: dict[int, str]
    sql: str
    unsettled: int = 0  # (rank, step) rows a settled matrix left out: their ledger is not in yet
    unfinished: bool = True  # the ledger may hold collectives without a completion time (see compute_sql)
    settled_on: str = ""  # a settled matrix: "own ledger" or "every ledger" (see compute_matrix); "" not settled

    @property
    def empty(self) -> bool:
        return self.compute_s.size == 0


def _peer_groups(store: Store, job_id: str, attempt: int, ranks: np.ndarray) -> tuple[np.ndarray, dict[int, str]]:
    r = store.query(
        f"SELECT rank, any(host) AS h, max(pp) AS stage FROM ranks WHERE job_id = '{_esc(job_id)}' "
        f"AND attempt = {int(attempt)} GROUP BY rank"
    )
    hosts: dict[int, str] = {}
    stage: dict[int, int] = {}
    for rank, host, pp in r.rows():
        hosts[int(rank)] = str(host)
        stage[int(rank)] = int(pp)
    labels = np.array([stage.get(int(x), -1) for x in ranks], dtype=np.int64)
    return labels, hosts


def compute_matrix(
    store: Store, job_id: str, attempt: int = 0, *, window_steps: int | None = None, settled: bool = False
) -> ComputeMatrix:
    """Run the compute metric in the store and shape it as rank x step matrices (only the last
    ``window_steps`` steps when given: a live loop does not rescan the whole history).

    ``settled`` (a live pass): a rank's step counts only once the store holds the rank's ledger past
    the step's end (a collective it entered after the step ended). A rank's collectives reach the
    store later than its steps (its tracer reads torch's ring every few seconds, and each table is
    a segment of its own): a step whose waits are not in yet looks like compute, and a rank whose
    ring was read last looked like a straggler for a few steps (a fresh-clone CI run named healthy
    rank 0 of the throttled-link drill, +240 ms/step for three steps, while its stored compute was
    flat). A rank with no collective in the window is kept as it is when no rank has one (a job
    with no collectives), and left out otherwise (its ledger has not arrived).

    Where the ledger holds collectives without a completion time (DDP's gradient buckets on gloo,
    seen by torch's ring alone), a rank's wait in one ends at the group's last stored arrival: a
    step is settled only once *every* rank's ledger has passed it (a peer's missing arrival made the
    wait short; a CI run of the network drill named healthy rank 0 a straggler in backward, +300 ms
    for three steps, while its peers' bucket rows were still on their way).

    The ledgers' marks are read *before* the metric: the store gives no snapshot across queries, so
    marks read after it could pass rows that arrived between the two reads (the drill named healthy
    rank 1, +233 ms/step for three steps, with every step settled and every row in the store a
    moment later). Rows are only added, so what the marks passed, the metric's read holds."""
    where = f"job_id = '{_esc(job_id)}' AND attempt = {int(attempt)}"
    # a live pass counts the collectives without a completion time with its marks, read later
    unfinished_sql = "0" if settled else f"(SELECT count() FROM collectives WHERE {where} AND end_ns = 0)"
    lo, hi, n, n_unfinished = (
        int(x or 0)
        for x in store.query(
            f"SELECT min(step), max(step), count(), {unfinished_sql} FROM steps WHERE {where} AND step >= 0"
        ).rows()[0]
    )
    min_step = max(0, hi - int(window_steps) + 1) if window_steps else 0
    marks = _ledger_marks(store, job_id, attempt, min_step) if settled else None
    if marks is not None:
        n_unfinished = marks[1]
    sql = compute_sql(job_id, attempt, min_step)
    look_up = n_unfinished > 0 or settled
    r = QueryResult.concat(
        # a live pass looks up last arrivals whatever the check said: a collective may arrive unfinished meanwhile
        store.query(compute_sql(job_id, attempt, a, b, unfinished=look_up))
        for a, b in _step_parts(lo, hi, n, min_step)
    )
    if r.num_rows == 0:
        return _empty_matrix(job_id, attempt, sql)
    rank = r.column("rank").astype(np.int64)
    step = r.column("step").astype(np.int64)
    dur = r.column("dur_ns").astype(np.float64) / 1e9
    wait = np.minimum(r.column("wait_ns").astype(np.float64) / 1e9, dur)
    start = r.column("start_ns").astype(np.int64)
    unsettled = 0
    settled_on = ""
    if settled:
        settled_on = "every ledger" if n_unfinished > 0 else "own ledger"
        ends = start + r.column("dur_ns").astype(np.int64)
        keep = _settled(marks[0] if marks else {}, rank, ends, everyone=n_unfinished > 0)
        if keep is not None:
            unsettled = int(len(keep) - keep.sum())
            rank, step, dur, wait, start = rank[keep], step[keep], dur[keep], wait[keep], start[keep]
            if len(rank) == 0:
                return _empty_matrix(job_id, attempt, sql, unsettled)
    ranks, ri = np.unique(rank, return_inverse=True)
    steps, si = np.unique(step, return_inverse=True)
    compute = np.full((len(ranks), len(steps)), np.nan)
    step_s = np.full((len(ranks), len(steps)), np.nan)
    compute[ri, si] = dur - wait
    step_s[ri, si] = dur
    step_start = np.full(len(steps), np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(step_start, si, start)
    labels, hosts = _peer_groups(store, job_id, attempt, ranks)
    return ComputeMatrix(
        job_id, attempt, ranks, steps, compute, step_s, step_start, labels, hosts, sql, unsettled, look_up, settled_on
    )


# The metric holds each (rank, step)'s collectives as arrays and works through them with a dozen
# array functions: one query over a 10,240-rank x 100-step job peaked at 1.4 GB in chDB (issue 18).
# It runs over step ranges of about this many (rank, step) rows each: the same rows in the same
# order (a row depends on its own rank and step only), each query holding its part (at 10,240 ranks
# four queries of 25 steps, peak 0.77 GB, the same time).
PART_ROWS = 256_000


def _step_parts(lo: int, hi: int, rows: int, min_step: int) -> list[tuple[int, int | None]]:
    """Step ranges ``(first, last)`` for the metric from ``min_step`` on, when the job's steps run
    ``lo..hi`` in ``rows`` (rank, step) rows; the last range is open (None: steps written since)."""
    first = max(lo, min_step)
    if rows <= 0 or hi < first:
        return [(min_step, None)]
    per_step = rows / max(1, hi - lo + 1)
    span = max(1, int(PART_ROWS // max(per_step, 1.0)))
    starts = list(range(first, hi + 1, span))
    return [(a, starts[k + 1] - 1) for k, a in enumerate(starts[:-1])] + [(starts[-1], None)]


def _empty_matrix(job_id: str, attempt: int, sql: str, unsettled: int = 0) -> ComputeMatrix:
    z = np.zeros((0, 0))
    e = np.array([], np.int64)
    return ComputeMatrix(job_id, attempt, e, e, z, z, e, e, {}, sql, unsettled)


def _ledger_marks(store: Store, job_id: str, attempt: int, min_step: int) -> tuple[dict[int, int], int]:
    """Per rank, the latest arrival its stored ledger holds from ``min_step`` on, and how many of
    the job's collectives have no completion time (both read in one query, before the metric)."""
    where = f"job_id = '{_esc(job_id)}' AND attempt = {int(attempt)}"
    r = store.query(
        f"SELECT rank, max(enter_ns) AS mark, (SELECT count() FROM collectives WHERE {where} AND end_ns = 0) AS unf "
        f"FROM collectives WHERE {where} AND step >= {int(min_step)} GROUP BY rank"
    )
    if r.num_rows == 0:
        return {}, 0
    marks = dict(zip(r.column("rank").astype(np.int64).tolist(), r.column("mark").astype(np.int64).tolist()))
    return marks, int(r.column("unf").astype(np.int64)[0])


def _settled(marks: dict[int, int], rank: np.ndarray, end_ns: np.ndarray, *, everyone: bool) -> np.ndarray | None:
    """Which (rank, step) rows have the rank's ledger past their end (``everyone``: every rank's
    ledger, the earliest of the window's ranks; see :func:`compute_matrix`); None: the window has
    no collective at all (nothing to wait for)."""
    if not marks:
        return None
    mark = np.array([marks.get(int(x), np.iinfo(np.int64).min) for x in rank], dtype=np.int64)
    if everyone:
        return end_ns <= mark.min()
    return end_ns <= mark


def phase_excess(store: Store, cm: ComputeMatrix, rank: int, steps: np.ndarray) -> dict[str, float]:
    """For one rank over some steps: median excess compute (s) per phase over its peers' median."""
    group = cm.peer_group[int(np.searchsorted(cm.ranks, rank))]
    peers = [int(r) for r, g in zip(cm.ranks, cm.peer_group) if g == group]
    lo, hi = (int(np.min(steps)), int(np.max(steps))) if len(steps) else (None, None)
    r = store.query(phase_compute_sql(cm.job_id, cm.attempt, peers, min_step=lo, max_step=hi, unfinished=cm.unfinished))
    if r.num_rows == 0:
        return {}
    import pyarrow.compute as pc

    codes = pc.dictionary_encode(r.arrow.column("phase")).combine_chunks()
    names = [str(x) for x in codes.dictionary.to_pylist()]
    dur = r.column("dur_ns").astype(np.float64)
    compute = (dur - np.minimum(r.column("wait_ns").astype(np.float64), dur)) / 1e9
    return excess_by_phase(
        r.column("rank").astype(np.int64),
        r.column("step").astype(np.int64),
        numpy_array(codes.indices).astype(np.int64),
        names,
        compute,
        rank,
        np.asarray(steps, dtype=np.int64),
    )


def excess_by_phase(
    rank: np.ndarray,
    step: np.ndarray,
    phase: np.ndarray,
    names: list[str],
    compute: np.ndarray,
    who: int,
    steps: np.ndarray,
) -> dict[str, float]:
    """:func:`phase_excess` on arrays, one entry a (rank, step, phase) row (``phase``: an index into
    ``names``; a row given twice: the later counts): per phase, the median over ``steps`` of ``who``'s
    compute minus the median of its peers' in the same step and phase, for the steps where ``who``
    and at least one peer have the phase. Vectorised: at 10,240 ranks a stage's 1,280 peers over 60
    steps are ~460k rows, which a loop over Python tuples took ~0.5 s to go through (issue 18)."""
    keep = np.isin(step, steps)
    rank, step, phase, compute = rank[keep], step[keep], phase[keep], compute[keep]
    if len(rank) == 0:
        return {}
    _, si = np.unique(step, return_inverse=True)
    ranks, ri = np.unique(rank, return_inverse=True)
    n_s, n_r = int(si.max()) + 1, len(ranks)
    cell = phase * n_s + si  # (phase, step)
    key = cell * n_r + ri
    # a (rank, step, phase) given twice: the later row counts
    _, first_rev = np.unique(key[::-1], return_index=True)
    last = len(key) - 1 - first_rev
    cell, ri, compute = cell[last], ri[last], compute[last]
    mine_rank = int(np.searchsorted(ranks, who))
    if mine_rank >= n_r or ranks[mine_rank] != who:
        return {}
    order = np.lexsort((compute, cell))
    cell, ri, compute = cell[order], ri[order], compute[order]
    cells, start, size = np.unique(cell, return_index=True, return_counts=True)
    is_mine = ri == mine_rank
    has_mine = np.zeros(len(cells), dtype=bool)
    at = np.zeros(len(cells), dtype=np.int64)  # where the rank's value sits in its cell's sorted values
    ci = np.searchsorted(cells, cell[is_mine])
    has_mine[ci] = True
    at[ci] = np.flatnonzero(is_mine) - start[ci]
    ok = has_mine & (size > 1)
    cells, start, size, at = cells[ok], start[ok], size[ok], at[ok]
    m = size - 1  # the peers' values: the cell's without the rank's

    def other(j: np.ndarray) -> np.ndarray:  # the j-th smallest peer value of each cell
        return compute[start + j + (j >= at)]

    med = (other((m - 1) // 2) + other(m // 2)) / 2.0
    excess = compute[start + at] - med
    out: dict[str, float] = {}
    cell_phase = cells // n_s
    for p in np.unique(cell_phase):
        out[names[int(p)]] = float(np.median(excess[cell_phase == p]))
    return out
