"""Blame: per ``(pg, seq)`` who arrived last and how long everybody else waited for it.

Metric (SQL, runs inside the store on chDB and on a ClickHouse server >= 18.16):
for every collective with at least two members, the last arriver, the wait of every other member
(last arrival minus its own arrival) and the mean wait of the others; summed per
(last arriver, step). The decision is a detector passed in (:mod:`ranklens.analyzers.detectors`);
presentation lives elsewhere.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from ranklens.analyzers.ranks import rank_hosts
from ranklens.analyzers.windows import Windows, collective_windows
from ranklens.store.api import Store, sql_string
from ranklens.store.api import sql_escape as _esc

__all__ = [
    "P2P_MARK",
    "BlameCells",
    "BlameMatrix",
    "blame_cells",
    "blame_offsets",
    "blame_source",
    "blame_sql",
    "collective_blame_sql",
    "compute_blame",
    "latest_job",
    "member_wait_sql",
    "rollup_collective_blame_sql",
    "rollup_present",
    "run_blame",
    "step_times_sql",
    "union_length",
    "union_lengths",
]

log = logging.getLogger("ranklens.analyzers")

P2P_MARK = "/p2p:"  # the tracer's point-to-point "pg": "<group>/p2p:<src>-><dst>"


def _aligned(offsets: dict[int, int] | None) -> str:
    """``enter_ns`` on the reference clock: minus the rank's host clock offset."""
    if not offsets:
        return "enter_ns"
    ks = ", ".join(str(int(k)) for k in offsets)
    vs = ", ".join(f"toInt64({int(v)})" for v in offsets.values())
    return f"(enter_ns - transform(rank, [{ks}], [{vs}], toInt64(0)))"


def _blame_where(job_id: str, attempt: int, step_from: int | None, step_to: int | None, stepless: bool) -> str:
    w = f"job_id = '{_esc(job_id)}' AND attempt = {int(attempt)}"
    if stepless:
        w += " AND step < 0"
    else:
        w += f" AND step >= {max(0, int(step_from or 0))}"
        if step_to is not None:
            w += f" AND step <= {int(step_to)}"
    # point-to-point transfers are left out: a pipeline's receiver waits for its sender by design
    return w + f" AND position(pg, '{P2P_MARK}') = 0"


def collective_blame_sql(
    job_id: str,
    attempt: int,
    t0_ns: int,
    offsets: dict[int, int] | None = None,
    *,
    step_from: int | None = None,
    step_to: int | None = None,
    stepless: bool = False,
    of_ranks: list[int] | None = None,
) -> str:
    """THE blame of one collective, one row per ``(pg, seq)`` with at least two members:
    ``last_rank`` (the last arriver on the aligned clock), ``c_step`` (its step), ``members``,
    ``first_enter_ns``, ``last_enter`` (ns after ``t0_ns``, Float64) and ``delay_ns`` (the mean wait
    of the other members for it).

    Point-to-point transfers are left out: in a pipeline the receiver of activations waits for the
    sender by design (the pipeline bubble), which is not the sender's fault. Only collectives of
    steps ``step_from..step_to`` (never a negative step), or with ``stepless`` only those without a
    step. Arrivals are taken relative to ``t0_ns`` in Float64 so sums cannot overflow Int64 at
    10,000 ranks; ``offsets`` (rank -> host clock offset, :func:`blame_offsets`) align the clocks.
    The analyzer (:func:`blame_sql`) and the dashboards aggregate these rows.

    ``of_ranks``: only the collectives those ranks were members of (whole: every member's row),
    the only ones whose last arriver can be one of them (a suspect's blame reads ~850 of a
    10,240-rank job's million collectives instead of grouping all of them, issue 18)."""
    enter = _aligned(offsets)
    where = _blame_where(job_id, attempt, step_from, step_to, stepless)
    if of_ranks:
        ranks = ", ".join(str(int(r)) for r in of_ranks)
        # GLOBAL: on a cluster's Distributed table the set is built once, from every shard, and
        # sent to the shards (a plain IN over a Distributed table is refused there); elsewhere it
        # is a plain IN
        where += f" AND (pg, seq) GLOBAL IN (SELECT pg, seq FROM collectives WHERE {where} AND rank IN ({ranks}))"
    # at equal arrivals the lowest rank is the last arriver (as the rollup decides: the same answer
    # however the rows are read; argMax alone kept whichever row came first)
    last = f"({enter}, toInt64(-rank))"
    return f"""
SELECT pg, seq,
       argMax(rank, {last}) AS last_rank,
       argMax(step, {last}) AS c_step,
       min(enter_ns) AS first_enter_ns,
       count() AS members,
       toFloat64(max({enter}) - {int(t0_ns)}) AS last_enter,
       (last_enter * count() - sum(toFloat64({enter} - {int(t0_ns)}))) / (members - 1) AS delay_ns
FROM collectives
WHERE {where}
GROUP BY pg, seq
HAVING members >= 2
""".strip()


def _host_aligned(host_offsets: dict[str, int] | None) -> str:
    """The rollup rows' host clock offset (see :func:`_aligned`)."""
    if not host_offsets:
        return "toInt64(0)"
    ks = ", ".join(sql_string(h) for h in host_offsets)
    vs = ", ".join(f"toInt64({int(v)})" for v in host_offsets.values())
    return f"transform(host, [{ks}], [{vs}], toInt64(0))"


def _rollup_per_host(where: str, host_offsets: dict[str, int] | None) -> str:
    """The rollup merged per ``(pg, seq, step, host)`` (over its insert blocks and days)."""
    return f"""SELECT pg, seq, step, host, {_host_aligned(host_offsets)} AS h_off,
           toInt64(countMerge(rows)) AS h_rows, toInt64(uniqExactMerge(ranks)) AS h_ranks,
           minMerge(first_enter_ns) AS h_first, maxMerge(last_enter_ns) AS h_last,
           argMaxMerge(last_rank) AS h_last_rank,
           sumMerge(enter_s_sum) AS h_s, sumMerge(enter_rest_ns_sum) AS h_rest
    FROM {ARRIVALS}
    WHERE {where}
    GROUP BY pg, seq, step, host"""


def rollup_collective_blame_sql(
    job_id: str,
    attempt: int,
    t0_ns: int,
    host_offsets: dict[str, int] | None = None,
    *,
    step_from: int | None = None,
    step_to: int | None = None,
    stepless: bool = False,
) -> str:
    """:func:`collective_blame_sql` from the ``collective_arrivals`` rollup (one row per collective,
    step and host instead of one per rank; ``host_offsets``: host -> clock offset), plus
    ``duplicates``: rows the rollup saw more than once (a batch the collector discarded in part and
    sent again): where it is not 0 the sums are off and the raw ledger must answer instead.

    Per host the last arrival, its rank, the count and the sum of arrivals; the host's offset
    shifts its last arrival and its sum alike, so the collective's last arriver and the mean wait
    of the others are the raw query's."""
    t0 = int(t0_ns)
    t0_s, t0_rest = divmod(t0, 1_000_000_000)
    where = _blame_where(job_id, attempt, step_from, step_to, stepless)
    per_host = "\n".join("    " + line for line in _rollup_per_host(where, host_offsets).splitlines())
    return f"""
SELECT pg, seq,
       argMax(h_last_rank, (h_last - h_off, toInt64(-h_last_rank))) AS last_rank,
       argMax(step, (h_last - h_off, toInt64(-h_last_rank))) AS c_step,
       min(h_first) AS first_enter_ns,
       sum(h_rows) AS members,
       toFloat64(max(h_last - h_off) - {t0}) AS last_enter,
       (last_enter * members - sum(toFloat64(h_s - h_rows * {t0_s}) * 1e9
            + toFloat64(h_rest - h_rows * {t0_rest}) - toFloat64(h_rows * h_off))) / (members - 1) AS delay_ns,
       sum(h_rows) - sum(h_ranks) AS duplicates
FROM (
{per_host}
)
GROUP BY pg, seq
HAVING members >= 2
""".strip()


def member_wait_sql(
    job_id: str,
    attempt: int,
    offsets: dict[int, int] | None = None,
    *,
    step_from: int | None = None,
    step_to: int | None = None,
    rollup_host_offsets: dict[str, int] | None = None,
) -> str:
    """The other side of blame, one row per ``(rank, step)``: ``wait_ns``, how long the rank waited
    in the collectives of :func:`collective_blame_sql` for their last arriver (aligned clocks, p2p
    left out), and ``collectives``, how many. With ``rollup_host_offsets`` (host -> clock offset,
    maybe empty; :func:`blame_source` says when) each collective's last arrival comes from the
    ``collective_arrivals`` rollup: one scan of the raw ledger instead of two. A maximum and a
    count of distinct ranks are the same however often the rollup saw a row, so no duplicates
    check is needed here."""
    enter = _aligned(offsets)
    w = _blame_where(job_id, attempt, step_from, step_to, False)
    if rollup_host_offsets is None:
        last = f"""    SELECT pg, seq, max({enter}) AS last_enter, count() AS members
    FROM collectives WHERE {w}
    GROUP BY pg, seq
    HAVING members >= 2"""
    else:
        per_host = "\n".join("    " + line for line in _rollup_per_host(w, rollup_host_offsets).splitlines())
        last = f"""    SELECT pg, seq, max(h_last - h_off) AS last_enter, sum(h_ranks) AS members
    FROM (
{per_host}
    )
    GROUP BY pg, seq
    HAVING members >= 2"""
    return f"""
SELECT rank, step, sum(toFloat64(last_enter - own_enter)) AS wait_ns, count() AS collectives
FROM (SELECT rank, step, pg, seq, {enter} AS own_enter FROM collectives WHERE {w}) AS lhs
ALL INNER JOIN
(
{last}
) AS rhs
USING (pg, seq)
GROUP BY rank, step
""".strip()


def blame_offsets(store: Store, job_id: str, attempt: int) -> dict[int, int] | None:
    """Per rank, its host's clock offset from the collectives' completions (ranks with a zero
    offset left out); None when no clock needs aligning."""
    from ranklens.analyzers.clocks import clock_offsets, rank_offsets

    host_offsets = clock_offsets(store, job_id, attempt)
    return {r: o for r, o in rank_offsets(store, job_id, attempt, host_offsets).items() if o} or None


def blame_sql(
    job_id: str,
    attempt: int,
    t0_ns: int,
    only_ranks: list[int] | None = None,
    offsets: dict[int, int] | None = None,
    windows: Windows | None = None,
    *,
    step_from: int | None = None,
    step_to: int | None = None,
    rollup_host_offsets: dict[str, int] | None = None,
) -> str:
    """Per (last arriver, step): the collectives it was last at (:func:`collective_blame_sql`), each
    with its last arrival and the mean wait of the other members (only steps ``step_from..step_to``
    when given). With ``windows`` (a job whose collectives carry no step) the collectives without a
    step are taken and "step" is the window (iteration) of the collective's first arrival.
    With ``rollup_host_offsets`` (host -> clock offset, maybe empty): from the rollup
    (:func:`rollup_collective_blame_sql`), with a ``duplicates`` column (see :func:`run_blame`)."""
    at_step = "c_step" if windows is None else windows.window_of_sql("first_enter_ns")
    stepless = windows is not None
    if rollup_host_offsets is None:
        per_collective = collective_blame_sql(
            job_id,
            attempt,
            t0_ns,
            offsets,
            step_from=step_from,
            step_to=step_to,
            stepless=stepless,
            of_ranks=only_ranks,
        )
        dups, dup_col = "", ""
    else:
        per_collective = rollup_collective_blame_sql(
            job_id, attempt, t0_ns, rollup_host_offsets, step_from=step_from, step_to=step_to, stepless=stepless
        )
        dups, dup_col = ",\n       sum(duplicates) AS duplicates", ", duplicates"
    inner = "\n".join("        " + line for line in per_collective.splitlines())
    return f"""
SELECT last_rank, at_step, count() AS collectives,
       groupArray(last_enter) AS last_enters, groupArray(delay_ns) AS delays, avg(members) AS avg_members,
       max(first_enter_ns) AS newest_first_ns{dups}
FROM
(
    SELECT last_rank, {at_step} AS at_step, members, last_enter, delay_ns, first_enter_ns{dup_col}
    FROM
    (
{inner}
    )
){_only(only_ranks)}
GROUP BY last_rank, at_step
ORDER BY at_step, last_rank
""".strip()


ARRIVALS = "collective_arrivals"  # the rollup (ranklens.schema.ROLLUPS) blame reads when a store has it


def rollup_present(store: Store, name: str) -> bool:
    """Whether the store has the rollup ``name`` (:data:`ranklens.schema.ROLLUPS`: servers of
    schema 11 on; never the embedded store) and may read it (not ``RANKLENS_ROLLUPS=0``)."""
    import os

    from ranklens.config import ENV_ROLLUPS

    if os.environ.get(ENV_ROLLUPS, "").strip() == "0":
        return False
    present = store.query(
        f"SELECT count() FROM system.tables WHERE database = currentDatabase() AND name = {sql_string(name)}"
    ).scalar()
    return bool(int(present or 0))


def blame_source(store: Store, job_id: str, attempt: int, offsets: dict[int, int] | None) -> dict[str, int] | None:
    """Where blame reads a job's arrivals: None for the raw ledger; the rollup otherwise, with the
    host clock offsets that ``offsets`` (rank -> offset) come from (empty: none needed).

    By default the rollup serves a job whose raw rows are (partly) gone, expired by the ledger's
    shorter retention (14 days against the rollup's 180 on a current server): it holds more of the
    job's arrivals than the raw ledger does. While the raw ledger holds the job it answers: on
    18.16 merging the rollup's states cost as much as grouping the raw rows they stand for
    (bench/rollup_bench.py, docs/cluster.md). ``RANKLENS_ROLLUPS=1`` reads the rollup wherever it
    serves, ``0`` never. It serves when the store has it (servers; the embedded store keeps none),
    it holds the job, and, where clocks need aligning, every row of it names its host (rows
    written before schema 11 do not: their host's offset is unknown there)."""
    import os

    from ranklens.config import ENV_ROLLUPS

    mode = os.environ.get(ENV_ROLLUPS, "").strip()
    if not rollup_present(store, ARRIVALS):
        return None
    where = f"job_id = '{_esc(job_id)}' AND attempt = {int(attempt)}"
    rows, hostless, arrivals = store.query(
        f"SELECT count(), countIf(host = ''), countMerge(rows) FROM {ARRIVALS} WHERE {where}"
    ).rows()[0]
    if not int(rows or 0) or (offsets and int(hostless or 0)):
        return None
    if mode != "1":
        raw = int(store.query(f"SELECT count() FROM collectives WHERE {where}").scalar() or 0)
        if raw >= int(arrivals or 0):
            return None  # the raw ledger holds every arrival the rollup has
    if not offsets:
        return {}
    hosts = rank_hosts(store, job_id, attempt)
    return {h: int(offsets[r]) for r, h in hosts.items() if r in offsets}


def run_blame(
    store: Store,
    job_id: str,
    attempt: int,
    t0_ns: int,
    only_ranks: list[int] | None = None,
    offsets: dict[int, int] | None = None,
    windows: Windows | None = None,
    *,
    step_from: int | None = None,
    step_to: int | None = None,
) -> tuple[Any, str]:
    """Run :func:`blame_sql` where :func:`blame_source` says: ``(result, sql)``. A rollup that saw
    some rows twice (``duplicates``: a batch sent again after a partial store) cannot sum them:
    the raw ledger answers instead, with the same columns."""
    source = blame_source(store, job_id, attempt, offsets)
    kw: dict[str, Any] = {"step_from": step_from, "step_to": step_to}
    if source is not None and not t0_ns:  # the raw ledger is gone: the job's first arrival from the rollup
        t0_ns = int(
            store.query(
                f"SELECT minMerge(first_enter_ns) FROM {ARRIVALS} "
                f"WHERE job_id = '{_esc(job_id)}' AND attempt = {int(attempt)}"
            ).scalar()
            or 0
        )
    if source is not None:
        sql = blame_sql(job_id, attempt, t0_ns, only_ranks, offsets, windows, rollup_host_offsets=source, **kw)
        result = store.query(sql)
        if result.num_rows == 0 or not int(np.sum(result.column("duplicates"))):
            return result, sql
        log.info(
            "ranklens: the %s rollup of job %s saw rows twice (a batch resent after a partial store): "
            "blame reads the raw ledger",
            ARRIVALS,
            job_id,
        )
    sql = blame_sql(job_id, attempt, t0_ns, only_ranks, offsets, windows, **kw)
    return store.query(sql), sql


def _only(ranks: list[int] | None) -> str:
    return f"\nWHERE last_rank IN ({', '.join(str(int(r)) for r in ranks)})" if ranks else ""


def union_length(ends: np.ndarray, lengths: np.ndarray) -> float:
    """Total length of the union of intervals ``[end - length, end]``.

    Waits for one culprit overlap when collectives are asynchronous (DDP launches several bucket
    all-reduces before anyone waits): the job lost the union of those waits, not their sum."""
    if len(ends) == 0:
        return 0.0
    starts = ends - np.maximum(lengths, 0.0)
    order = np.argsort(starts)
    total, cur_s, cur_e = 0.0, float(starts[order[0]]), float(ends[order[0]])
    for k in order[1:]:
        s, e = float(starts[k]), float(ends[k])
        if s > cur_e:
            total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + cur_e - cur_s


def step_times_sql(job_id: str, attempt: int) -> str:
    """Per step: the median step duration over ranks, and the step's first start."""
    return f"""
SELECT step, quantileExact(0.5)(end_ns - start_ns) AS step_ns,
       min(start_ns) AS first_start_ns, count() AS ranks
FROM steps
WHERE job_id = '{_esc(job_id)}' AND attempt = {int(attempt)}
GROUP BY step
ORDER BY step
""".strip()


def latest_job(store: Store) -> tuple[str, int] | None:
    """The job and attempt with the most recent activity (a step or a collective), or None for an
    empty store. A job traced without step markers has collectives only: it is a job too."""
    candidates = []
    for sql in (
        "SELECT job_id, attempt, end_ns FROM steps ORDER BY end_ns DESC LIMIT 1",
        "SELECT job_id, attempt, enter_ns FROM collectives ORDER BY enter_ns DESC LIMIT 1",
    ):
        r = store.query(sql)
        if r.num_rows:
            job, attempt, t = r.rows()[0]
            candidates.append((int(t), str(job), int(attempt)))
    if not candidates:
        return None
    _t, job, attempt = max(candidates)
    return job, attempt


@dataclass(frozen=True)
class BlameMatrix:
    """Blame per rank x step (seconds). ``delay_s[i, j]``: how long the others waited for rank
    ``ranks[i]`` in step ``steps[j]`` (mean over the others, summed over collectives);
    ``wait_s``: that delay times the number of others (rank-seconds, i.e. GPU-seconds)."""

    job_id: str
    attempt: int
    ranks: np.ndarray
    steps: np.ndarray
    delay_s: np.ndarray
    wait_s: np.ndarray
    last_count: np.ndarray
    step_time_s: np.ndarray
    step_start_ns: np.ndarray
    hosts: dict[int, str]
    sql: str
    step_basis: str = "steps"  # "steps"; or, without step markers, "iterations" / "windows" (analyzers.windows)

    @property
    def by_step(self) -> bool:
        """True when the columns are steps of the job (or iterations counted from its collectives)."""
        return self.step_basis in ("steps", "iterations")


def compute_blame(
    store: Store, job_id: str, attempt: int = 0, *, only_ranks: list[int] | None = None, align: bool = True
) -> BlameMatrix:
    """Run the blame metric in the store and shape it as a rank x step matrix (only the blame of
    ``only_ranks`` when given: evidence for suspects found by another detector)."""
    t0, with_step = store.query(  # one scan for both
        f"SELECT min(enter_ns), countIf(step >= 0) FROM collectives "
        f"WHERE job_id = '{_esc(job_id)}' AND attempt = {int(attempt)}"
    ).rows()[0]
    offsets = blame_offsets(store, job_id, attempt) if align else None
    windows = None if int(with_step or 0) > 0 else collective_windows(store, job_id, attempt)
    if windows is not None and windows.empty:
        windows = None
    b, sql = run_blame(store, job_id, attempt, int(t0 or 0), only_ranks, offsets, windows)
    hosts = rank_hosts(store, job_id, attempt)
    if windows is not None:
        steps = np.arange(len(windows.starts_ns), dtype=np.int64)
        step_time = windows.durations_s
        step_start = windows.starts_ns.astype(np.int64)
        basis = windows.basis
    else:
        st = store.query(step_times_sql(job_id, attempt))
        steps = (
            st.column("step").astype(np.int64)
            if st.num_rows
            else np.array(sorted(set(b.column("at_step").tolist())), dtype=np.int64)
        )
        if st.num_rows:
            step_time = st.column("step_ns").astype(np.float64) / 1e9
            step_start = st.column("first_start_ns").astype(np.int64)
        else:
            step_time = np.full(len(steps), np.nan)
            step_start = np.zeros(len(steps), dtype=np.int64)
        basis = "steps"
    ranks_seen = set(hosts) | {int(x) for x in b.column("last_rank")} if b.num_rows else set(hosts)
    ranks = np.array(sorted(ranks_seen), dtype=np.int64)
    ri = {int(r): i for i, r in enumerate(ranks)}
    si = {int(s): j for j, s in enumerate(steps)}
    shape = (len(ranks), len(steps))
    delay = np.zeros(shape)
    wait = np.zeros(shape)
    count = np.zeros(shape, dtype=np.int64)
    last, step, n, d, w = _cell_values(b)
    j = np.array([si.get(int(x), -1) for x in step], dtype=np.int64)
    keep = j >= 0
    i = np.array([ri[int(x)] for x in last[keep]], dtype=np.int64)
    np.add.at(delay, (i, j[keep]), d[keep])
    np.add.at(wait, (i, j[keep]), w[keep])
    np.add.at(count, (i, j[keep]), n[keep])
    return BlameMatrix(job_id, attempt, ranks, steps, delay, wait, count, step_time, step_start, hosts, sql, basis)


def union_lengths(cell: np.ndarray, ends: np.ndarray, lengths: np.ndarray, n_cells: int) -> np.ndarray:
    """:func:`union_length` of many cells at once: ``out[c]`` is the length of the union of the
    intervals ``[ends[k] - lengths[k], ends[k]]`` with ``cell[k] == c``.

    Each cell's intervals are shifted onto a stretch of the line of their own (cell ``c`` starts
    after cell ``c - 1`` ends), so one sort and one running maximum serve every cell."""
    out = np.zeros(int(n_cells))
    if len(ends) == 0:
        return out
    cell = np.asarray(cell, dtype=np.int64)
    ends = np.asarray(ends, dtype=np.float64)
    starts = ends - np.maximum(np.asarray(lengths, dtype=np.float64), 0.0)
    lo = np.full(int(n_cells), np.inf)
    np.minimum.at(lo, cell, starts)
    rel_s, rel_e = starts - lo[cell], ends - lo[cell]  # each cell from 0 (keeps Float64 exact)
    shift = (float(rel_e.max()) + 1.0) * cell
    s_, e_ = rel_s + shift, rel_e + shift
    order = np.argsort(s_, kind="stable")
    s_, e_, c_ = s_[order], e_[order], cell[order]
    covered = np.maximum.accumulate(e_)  # the furthest end so far (earlier cells end before this one starts)
    before = np.concatenate([[-np.inf], covered[:-1]])
    np.add.at(out, c_, np.maximum(e_ - np.maximum(s_, before), 0.0))
    return out


def _cell_values(result: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(last rank, step, collectives, delay s, wait s)`` arrays of the rows of :func:`blame_sql`:
    per row the union of the waits for the culprit (not their sum: they overlap), and that times
    the others' count."""
    import pyarrow.compute as pc

    from ranklens.records import numpy_array

    if result.num_rows == 0:
        z = np.zeros(0)
        return z.astype(np.int64), z.astype(np.int64), z.astype(np.int64), z, z
    table = result.arrow
    ends = table.column("last_enters").combine_chunks()
    delays = table.column("delays").combine_chunks()
    # (newest_first_ns keeps the column a lambda reads from being pruned on ClickHouse 18.16)
    cell = numpy_array(pc.list_parent_indices(ends))
    d = (
        union_lengths(
            cell,
            numpy_array(pc.list_flatten(ends)),
            numpy_array(pc.list_flatten(delays)),
            table.num_rows,
        )
        / 1e9
    )
    members = result.column("avg_members").astype(np.float64)
    return (
        result.column("last_rank").astype(np.int64),
        result.column("at_step").astype(np.int64),
        result.column("collectives").astype(np.int64),
        d,
        d * (members - 1.0),
    )


@dataclass(frozen=True)
class BlameCells:
    """The blame of every (last arriver, step) with any, as parallel arrays (seconds): what
    :class:`BlameMatrix` holds without the zeros, for one step window."""

    ranks: np.ndarray
    steps: np.ndarray
    collectives: np.ndarray
    delay_s: np.ndarray
    wait_s: np.ndarray
    sql: str


def blame_cells(
    store: Store,
    job_id: str,
    attempt: int = 0,
    *,
    step_from: int | None = None,
    step_to: int | None = None,
    t0_ns: int | None = None,
    align: bool = True,
) -> BlameCells:
    """The blame per (last arriver, step) of steps ``step_from..step_to``, aligned and aggregated as
    :func:`compute_blame` does (the dashboards' culprit tables and heat maps read it).

    Args:
        t0_ns: a time near the job's start (default: its first arrival) that keeps Float64 exact.
        align: align host clocks (:func:`blame_offsets`).
    """
    if t0_ns is None:
        t0_ns = int(
            store.query(
                f"SELECT min(enter_ns) FROM collectives WHERE job_id = '{_esc(job_id)}' AND attempt = {int(attempt)}"
            ).scalar()
            or 0
        )
    offsets = blame_offsets(store, job_id, attempt) if align else None
    result, sql = run_blame(store, job_id, attempt, int(t0_ns), offsets=offsets, step_from=step_from, step_to=step_to)
    last, step, n, d, w = _cell_values(result)
    return BlameCells(ranks=last, steps=step, collectives=n, delay_s=d, wait_s=w, sql=sql)
