"""The CUDA timing view of profiler traces: Holistic Trace Analysis' (HTA) breakdowns as SQL over
``trace_events``, computed in the store for every rank of a job at once.

The definitions are HTA's (``holistictraceanalysis`` 0.5), so the numbers match it:

- **Times** are whole microseconds as HTA reads them: a start rounded up, an end rounded down.
- **Kernels** are the events on a CUDA stream (``args.stream``): kernels, memcpy, memset and
  stream syncs. ``Event Sync`` / ``Context Sync`` count as GPU events without a stream.
- **Analysed window**: when the job's traces name at least two ``ProfilerStep#N`` steps, a rank's
  GPU events are those launched (by correlation id) from a CPU event that started before the
  rank's last profiler step, i.e. every profiler step but the last (which Kineto often cuts
  short); CPU-side events with a stream count when they start before it too.
- **Kernel type** by name: ``^nccl.*Kernel`` communication; ``^(Memcpy|Memset|dma)`` memory;
  else, unless the name matches ``^nccl.*Kernel|.*Memcpy|Memset|.*Sync`` (other: syncs), computation.
- **Temporal breakdown** per rank: ``kernel_time`` = last kernel end - first kernel start; idle =
  the part of it no kernel covers; compute = the part computation kernels cover; non-compute =
  the rest (communication, memory, syncs not under a computation kernel).
- **Communication/computation overlap**: the time both kinds run at once over the time
  communication runs.
- **Kernel-type breakdown**: each instant covered by kernels is labelled with the types running
  then (``COMPUTATION overlapping COMMUNICATION`` ...), summed over the job's ranks.
- **Kernel breakdown** (per rank and type): kernels by total time; with more than
  ``num_kernels`` names, those past the first ``num_kernels`` or whose running total is above
  the ``duration_ratio`` quantile of the running totals become ``others``.
- **Idle-time breakdown** per stream: the gap before each kernel (to the previous kernel's end on
  that stream) is a *host wait* when the kernel's launch started after that end, a *kernel wait*
  when it is shorter than ``consecutive_kernel_delay_us`` (30), else *other*.

All of it is one or two SQL statements per analysis: the store sweeps each rank's kernel
intervals (sorted start/end events and running counts per kernel type, in arrays); nothing
loads a trace into Python. Works on chDB and ClickHouse >= 18.16.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ranklens.errors import NotFound
from ranklens.store.api import Store, sql_string

__all__ = [
    "KERNEL_TYPE_BITS",
    "KERNEL_TYPE_SQL",
    "IdleTime",
    "KernelStats",
    "KernelTypeTime",
    "LaunchStats",
    "LedgerWindow",
    "QueueLength",
    "RankBreakdown",
    "TraceWindow",
    "breakdowns",
    "idle_time_breakdown",
    "kernel_breakdown",
    "kernel_launches",
    "kernel_type_breakdown",
    "latest_trace_job",
    "launch_stats",
    "ledger_window",
    "queue_length_summary",
    "temporal_breakdown",
    "trace_span",
    "trace_window",
]

COMPUTATION, COMMUNICATION, MEMORY, OTHER = "COMPUTATION", "COMMUNICATION", "MEMORY", "OTHER"
# bits of a kernel's type in the sweep's state; the breakdown's labels list them in this order.
# KERNEL_TYPE_SQL: a kernel's type bit (KERNEL_TYPE_BITS) from its name
KERNEL_TYPE_BITS = {COMPUTATION: 1, COMMUNICATION: 2, MEMORY: 4, OTHER: 8}
KERNEL_TYPE_SQL = (
    "multiIf(match(name, '^nccl.*Kernel'), 2, match(name, '^(Memcpy|Memset|dma)'), 4, "
    "match(name, '^(nccl.*Kernel|.*Memcpy|Memset|.*Sync)'), 8, 1)"
)
_IS_GPU = "((stream >= 0 AND correlation >= 0) OR name IN ('Event Sync', 'Context Sync'))"
_TS_US = "intDiv(ts_ns + 999, 1000)"  # HTA: ceil(ts), floor(ts + dur), in microseconds
_END_US = "intDiv(ts_ns + dur_ns, 1000)"
# HTA's idle-time breakdown reads these categories only (not syncs)
IDLE_CATEGORIES = ("host_wait", "kernel_wait", "other")
_KERNEL_CATS = "('kernel', 'Kernel', 'gpu_memset', 'Memset', 'gpu_memcpy', 'Memcpy', 'mtia_ccp_events')"


@dataclass(frozen=True)
class TraceWindow:
    """Which part of a job's traces the analyses read."""

    job_id: str
    attempt: int
    ranks: tuple[int, ...]
    profiler_steps: int  # distinct ProfilerStep#N names in the job's traces
    windowed: bool  # True: the last profiler step of each rank is left out (HTA's default)


@dataclass(frozen=True)
class RankBreakdown:
    """HTA's temporal breakdown and communication/computation overlap of one rank (microseconds)."""

    rank: int
    kernel_time_us: int
    idle_time_us: int
    compute_time_us: int
    non_compute_time_us: int
    comm_time_us: int  # time communication kernels run (merged)
    comp_comm_overlap_us: int

    @property
    def idle_time_pctg(self) -> float:
        return _pct(self.idle_time_us, self.kernel_time_us)

    @property
    def compute_time_pctg(self) -> float:
        return _pct(self.compute_time_us, self.kernel_time_us)

    @property
    def non_compute_time_pctg(self) -> float:
        return _pct(self.non_compute_time_us, self.kernel_time_us)

    @property
    def comp_comm_overlap_pctg(self) -> float:
        return _pct(self.comp_comm_overlap_us, self.comm_time_us)

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "idle_time_us": self.idle_time_us,
            "compute_time_us": self.compute_time_us,
            "non_compute_time_us": self.non_compute_time_us,
            "kernel_time_us": self.kernel_time_us,
            "idle_time_pctg": self.idle_time_pctg,
            "compute_time_pctg": self.compute_time_pctg,
            "non_compute_time_pctg": self.non_compute_time_pctg,
            "comm_time_us": self.comm_time_us,
            "comp_comm_overlap_pctg": self.comp_comm_overlap_pctg,
        }


@dataclass(frozen=True)
class KernelTypeTime:
    """Time (summed over ranks) during which exactly this combination of kernel types runs."""

    kernel_type: str  # e.g. "COMPUTATION overlapping COMMUNICATION"
    sum_us: int
    percentage: float

    def to_json(self) -> dict[str, Any]:
        return {"kernel_type": self.kernel_type, "sum_us": self.sum_us, "percentage": self.percentage}


@dataclass(frozen=True)
class KernelStats:
    """One row of the kernel breakdown: a kernel name (or ``others``) of one type on one rank."""

    rank: int
    kernel_type: str
    name: str
    count: int
    sum_us: int
    max_us: int
    min_us: int
    mean_us: float
    stddev_us: float

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "kernel_type": self.kernel_type,
            "name": self.name,
            "count": self.count,
            "sum_us": self.sum_us,
            "max_us": self.max_us,
            "min_us": self.min_us,
            "mean_us": round(self.mean_us, 3),
            "stddev_us": round(self.stddev_us, 3),
        }


@dataclass(frozen=True)
class IdleTime:
    """Idle time of one stream of one rank in one category (host_wait, kernel_wait, other)."""

    rank: int
    stream: int
    idle_category: str
    idle_time_us: int
    idle_time_ratio: float  # of the stream's idle time

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "stream": self.stream,
            "idle_category": self.idle_category,
            "idle_time_us": self.idle_time_us,
            "idle_time_ratio": round(self.idle_time_ratio, 4),
        }


def _pct(part: int, whole: int) -> float:
    return round(100.0 * part / whole, 2) if whole > 0 else 0.0


def latest_trace_job(store: Store) -> tuple[str, int] | None:
    """The job and attempt whose profiler traces were recorded last, or None (no traces)."""
    r = store.query("SELECT job_id, attempt FROM trace_events ORDER BY ts_ns DESC LIMIT 1")
    if not r.num_rows:
        return None
    job, attempt = r.rows()[0]
    return str(job), int(attempt)


def _where(job_id: str, attempt: int, ranks: Sequence[int] | None) -> str:
    w = f"job_id = {sql_string(job_id)} AND attempt = {int(attempt)} AND cat NOT IN ('python_function', 'Trace')"
    if ranks:
        w += f" AND rank IN ({', '.join(str(int(r)) for r in ranks)})"
    return w


def trace_window(store: Store, job_id: str, attempt: int = 0, ranks: Sequence[int] | None = None) -> TraceWindow:
    """The job's traced ranks and whether the analysed window leaves out the last profiler step.

    Raises:
        NotFound: the store holds no trace events of this job (and ranks).
    """
    where = _where(job_id, attempt, ranks)
    n, steps, got = store.query(
        "SELECT count(), uniqExactIf(name, position(name, 'ProfilerStep') > 0), groupUniqArray(rank) "
        f"FROM trace_events WHERE {where}"
    ).rows()[0]
    if not n:
        which = f" rank(s) {', '.join(map(str, ranks))} of" if ranks else ""
        raise NotFound(
            f"no profiler trace events of{which} job {job_id!r} attempt {attempt}; "
            "`ranklens ingest TRACE_DIR --format kineto` loads torch.profiler traces"
        )
    return TraceWindow(job_id, attempt, tuple(sorted(int(r) for r in got)), int(steps), int(steps) >= 2)


# ranks analysed per statement: each rank's kernels become arrays in the store, so a 10,000-rank
# job is swept a slice of ranks at a time, in bounded memory
RANKS_PER_QUERY = 64


def _rows(
    store: Store, w: TraceWindow, ranks: Sequence[int] | None, sql_for: Callable[[Sequence[int] | None], str]
) -> Iterator[tuple[Any, ...]]:
    """The rows of ``sql_for(slice)`` over slices of the analysed ranks (one statement for a job
    of up to RANKS_PER_QUERY ranks)."""
    sel = list(ranks) if ranks else list(w.ranks)
    if len(sel) <= RANKS_PER_QUERY:
        yield from store.query(sql_for(ranks or None)).rows()
        return
    for i in range(0, len(sel), RANKS_PER_QUERY):
        yield from store.query(sql_for(sel[i : i + RANKS_PER_QUERY])).rows()


def _last_step_sql(where: str) -> str:
    """The start of each rank's last profiler step (CPU side): the analysed window ends there."""
    return (
        f"SELECT rank, max({_TS_US}) AS win_end_us FROM trace_events WHERE {where} "
        f"AND position(name, 'ProfilerStep') > 0 AND NOT {_IS_GPU} GROUP BY rank"
    )


def _events_sql(w: TraceWindow, ranks: Sequence[int] | None) -> str:
    """The rows of the analysed window that are on a CUDA stream: rank, ts_us, end_us, kt (type
    bit), name, stream, cat, correlation."""
    where = _where(w.job_id, w.attempt, ranks)
    base = (
        f"SELECT rank, {_TS_US} AS ts_us, {_END_US} AS end_us, {KERNEL_TYPE_SQL} AS kt, name, stream, cat, "
        f"correlation, {_IS_GPU} AS is_gpu FROM trace_events WHERE {where} AND stream != -1"
    )
    if not w.windowed:
        return f"SELECT rank, ts_us, end_us, kt, name, stream, cat, correlation FROM ({base}) AS ev"
    last_step = _last_step_sql(where)  # events launched before each rank's last step are analysed
    launched = (
        f"SELECT rank, correlation FROM (SELECT rank, {_TS_US} AS ts_us, correlation FROM trace_events "
        f"WHERE {where} AND NOT {_IS_GPU} AND correlation >= 0) AS c "
        f"ALL INNER JOIN ({last_step}) AS l USING (rank) WHERE ts_us < win_end_us"
    )
    return (
        "SELECT rank, ts_us, end_us, kt, name, stream, cat, correlation "
        f"FROM ({base}) AS ev ALL INNER JOIN ({last_step}) AS lw USING (rank) "
        f"WHERE (is_gpu AND (rank, correlation) IN ({launched})) OR (NOT is_gpu AND ts_us < win_end_us)"
    )


def _sweep_sql(w: TraceWindow, ranks: Sequence[int] | None) -> str:
    """Per (rank, state): microseconds during which exactly the kernel types of ``state`` (a bit
    set of KERNEL_TYPE_BITS) run, and the rank's first start and last end. Each rank's start (+1) and end (-1)
    events are sorted, counted per type (running sums), and the gaps between consecutive events
    summed by state: the measure of the union of intervals, without a merge pass."""
    ev = _events_sql(w, ranks)
    per_rank = f"""
SELECT rank, min(ts_us) AS first_us, max(end_us) AS last_us,
  arraySort(arrayConcat(arrayMap((t, k) -> (t, 1, k), groupArray(ts_us), groupArray(kt)),
                        arrayMap((t, k) -> (t, -1, k), groupArray(end_us), groupArray(kt)))) AS evs
FROM ({ev}) AS k GROUP BY rank"""
    runs = ", ".join(
        f"arrayCumSum(arrayMap(e -> if(tupleElement(e, 3) = {b}, tupleElement(e, 2), 0), evs)) AS c{b}"
        for b in KERNEL_TYPE_BITS.values()
    )
    state = " + ".join(f"{b} * (x{b} > 0)" for b in KERNEL_TYPE_BITS.values())
    lambda_args = ", ".join(f"x{b}" for b in KERNEL_TYPE_BITS.values())
    arrays = ", ".join(f"arrayPopBack(c{b})" for b in KERNEL_TYPE_BITS.values())
    return f"""
SELECT rank, st AS state, sum(seg) AS dur_us, any(first_us) AS first_us, any(last_us) AS last_us
FROM (
  SELECT rank, first_us, last_us,
    arrayMap((a, b) -> b - a, arrayPopBack(ts), arrayPopFront(ts)) AS segs,
    arrayMap(({lambda_args}) -> {state}, {arrays}) AS states
  FROM (SELECT rank, first_us, last_us, arrayMap(e -> tupleElement(e, 1), evs) AS ts, {runs}
        FROM ({per_rank}) AS p) AS q
) AS s
ARRAY JOIN segs AS seg, states AS st
GROUP BY rank, st
ORDER BY rank, st"""


def _states(store: Store, w: TraceWindow, ranks: Sequence[int] | None) -> dict[int, tuple[int, dict[int, int]]]:
    """rank -> (kernel_time_us, {state: us})."""
    out: dict[int, tuple[int, dict[int, int]]] = {}
    for rank, state, dur, first, last in _rows(store, w, ranks, lambda rs: _sweep_sql(w, rs)):
        _kernel_time, states = out.setdefault(int(rank), (int(last) - int(first), {}))
        states[int(state)] = states.get(int(state), 0) + int(dur)
    return out


def temporal_breakdown(
    store: Store, job_id: str, attempt: int = 0, ranks: Sequence[int] | None = None
) -> list[RankBreakdown]:
    """HTA's temporal breakdown and communication/computation overlap, per rank (sorted).

    Raises:
        NotFound: no trace events of this job.
    """
    return breakdowns(store, job_id, attempt, ranks)[0]


def breakdowns(
    store: Store,
    job_id: str,
    attempt: int = 0,
    ranks: Sequence[int] | None = None,
    *,
    include_memory: bool = True,
) -> tuple[list[RankBreakdown], list[KernelTypeTime]]:
    """:func:`temporal_breakdown` and :func:`kernel_type_breakdown` from one sweep of the kernels
    (the heaviest statement of the analyses: callers that want both run it once)."""
    states = _states(store, trace_window(store, job_id, attempt, ranks), ranks)
    return _temporal(states), _kernel_types(states, include_memory)


def _temporal(by_rank: dict[int, tuple[int, dict[int, int]]]) -> list[RankBreakdown]:
    out = []
    for rank, (kernel_time, states) in sorted(by_rank.items()):
        busy = sum(d for s, d in states.items() if s)
        compute = sum(d for s, d in states.items() if s & KERNEL_TYPE_BITS[COMPUTATION])
        comm = sum(d for s, d in states.items() if s & KERNEL_TYPE_BITS[COMMUNICATION])
        both = KERNEL_TYPE_BITS[COMPUTATION] | KERNEL_TYPE_BITS[COMMUNICATION]
        overlap = sum(d for s, d in states.items() if s & both == both)
        idle = kernel_time - busy
        out.append(
            RankBreakdown(
                rank=rank,
                kernel_time_us=kernel_time,
                idle_time_us=idle,
                compute_time_us=compute,
                non_compute_time_us=kernel_time - compute - idle,
                comm_time_us=comm,
                comp_comm_overlap_us=overlap,
            )
        )
    return out


def _label(state: int, include_memory: bool) -> str:
    names = [COMPUTATION, COMMUNICATION] + ([MEMORY] if include_memory else [])
    return " overlapping ".join(n for n in names if state & KERNEL_TYPE_BITS[n])


def kernel_type_breakdown(
    store: Store,
    job_id: str,
    attempt: int = 0,
    ranks: Sequence[int] | None = None,
    *,
    include_memory: bool = True,
) -> list[KernelTypeTime]:
    """Time per combination of running kernel types, summed over ranks, largest first; the
    percentage is of all labelled time (HTA's kernel-type pie)."""
    return breakdowns(store, job_id, attempt, ranks, include_memory=include_memory)[1]


def _kernel_types(by_rank: dict[int, tuple[int, dict[int, int]]], include_memory: bool) -> list[KernelTypeTime]:
    sums: dict[str, int] = {}
    for _kt, states in by_rank.values():
        for s, d in states.items():
            label = _label(s, include_memory)
            if label:
                sums[label] = sums.get(label, 0) + d
    total = sum(sums.values())
    rows = sorted(sums.items(), key=lambda kv: (-kv[1], kv[0]))
    return [KernelTypeTime(k, v, round(100.0 * v / total, 1) if total else 0.0) for k, v in rows]


def kernel_breakdown(
    store: Store,
    job_id: str,
    attempt: int = 0,
    ranks: Sequence[int] | None = None,
    *,
    num_kernels: int = 10,
    duration_ratio: float = 0.8,
    include_memory: bool = True,
) -> list[KernelStats]:
    """The top kernels per rank and kernel type by total time, the rest as ``others`` (HTA's rule:
    with more than ``num_kernels`` names, a name past the first ``num_kernels``, or whose running
    total exceeds the ``duration_ratio`` quantile of the running totals, is grouped). Statistics
    of a named kernel are over its launches; of ``others``, over all its kernels' launches."""
    if num_kernels < 1:
        raise ValueError(f"num_kernels {num_kernels}: must be >= 1")
    if not 0.0 < duration_ratio <= 1.0:
        raise ValueError(f"duration_ratio {duration_ratio}: must be in (0, 1]")
    w = trace_window(store, job_id, attempt, ranks)
    types = {k: KERNEL_TYPE_BITS[k] for k in (COMPUTATION, COMMUNICATION, *([MEMORY] if include_memory else []))}
    kts = ", ".join(str(v) for v in types.values())

    def sql(rs: Sequence[int] | None) -> str:
        return (
            "SELECT rank, kt, name, count() AS n, sum(d) AS s, max(d) AS mx, min(d) AS mn, sum(d * d) AS s2 "
            f"FROM (SELECT rank, kt, name, end_us - ts_us AS d FROM ({_events_sql(w, rs)}) AS e "
            f"WHERE kt IN ({kts})) AS k "
            "GROUP BY rank, kt, name"
        )

    by: dict[tuple[int, int], list[tuple[str, int, int, int, int, int]]] = {}
    for rank, kt, name, n, s, mx, mn, s2 in _rows(store, w, ranks, sql):
        by.setdefault((int(rank), int(kt)), []).append((str(name), int(n), int(s), int(mx), int(mn), int(s2)))
    type_name = {v: k for k, v in types.items()}
    out: list[KernelStats] = []
    for (rank, kt), rows in sorted(by.items()):
        rows.sort(key=lambda r: (-r[2], r[0]))
        keep = len(rows)
        if len(rows) > num_kernels:
            cum = np.cumsum([r[2] for r in rows])
            cutoff = float(np.quantile(cum, duration_ratio))  # linear interpolation, as pandas
            keep = min(num_kernels, int(np.searchsorted(cum, cutoff, side="right")))
        for r in rows[:keep]:
            out.append(_stats(rank, type_name[kt], r[0], [r]))
        if keep < len(rows):
            out.append(_stats(rank, type_name[kt], "others", rows[keep:]))
    return out


def _stats(rank: int, kernel_type: str, name: str, rows: list[tuple[str, int, int, int, int, int]]) -> KernelStats:
    n = sum(r[1] for r in rows)
    s = sum(r[2] for r in rows)
    s2 = sum(r[5] for r in rows)
    mean = s / n
    var = (s2 - n * mean * mean) / (n - 1) if n > 1 else 0.0
    return KernelStats(
        rank=rank,
        kernel_type=kernel_type,
        name=name,
        count=n,
        sum_us=s,
        max_us=max(r[3] for r in rows),
        min_us=min(r[4] for r in rows),
        mean_us=mean,
        stddev_us=float(np.sqrt(max(var, 0.0))),
    )


def idle_time_breakdown(
    store: Store,
    job_id: str,
    attempt: int = 0,
    ranks: Sequence[int] | None = None,
    *,
    consecutive_kernel_delay_us: int = 30,
) -> list[IdleTime]:
    """Idle time per rank, stream and category: ``host_wait`` (the kernel was launched after the
    stream's previous kernel ended: the CPU was late), ``kernel_wait`` (a gap shorter than
    ``consecutive_kernel_delay_us``: launch overhead), ``other``."""
    w = trace_window(store, job_id, attempt, ranks)
    delay = int(consecutive_kernel_delay_us)

    def sql(rs: Sequence[int] | None) -> str:
        kernels = (
            f"SELECT rank, stream, ts_us, end_us, correlation FROM ({_events_sql(w, rs)}) AS e "
            f"WHERE cat IN {_KERNEL_CATS}"
        )
        launches = (
            f"SELECT rank, correlation, any({_TS_US}) AS launch_us FROM trace_events "
            f"WHERE {_where(job_id, attempt, rs)} AND NOT {_IS_GPU} AND correlation >= 0 GROUP BY rank, correlation"
        )
        # per stream, kernels by start: the gap before each to the previous one's end, and its cause
        return f"""
SELECT rank, stream, cat_, sum(gap) AS idle_us FROM (
  SELECT rank, stream, arraySort(groupArray((ts_us, end_us, launch_us, has_launch))) AS ks,
    arrayMap((p, k) -> tupleElement(k, 1) - tupleElement(p, 2), arrayPopBack(ks), arrayPopFront(ks)) AS gaps,
    arrayMap((p, k) -> multiIf(tupleElement(k, 4) AND tupleElement(k, 3) > tupleElement(p, 2), 'host_wait',
                               tupleElement(k, 1) - tupleElement(p, 2) < {delay}, 'kernel_wait', 'other'),
             arrayPopBack(ks), arrayPopFront(ks)) AS cats
  FROM (SELECT rank, stream, ts_us, end_us, launch_us, launch_us > 0 AS has_launch
        FROM ({kernels}) AS k ALL LEFT JOIN ({launches}) AS l USING (rank, correlation)) AS j
  GROUP BY rank, stream
) AS s LEFT ARRAY JOIN gaps AS gap, cats AS cat_
GROUP BY rank, stream, cat_
ORDER BY rank, stream, cat_"""

    idle: dict[tuple[int, int], dict[str, int]] = {}
    for r, s, c, d in _rows(store, w, ranks, sql):
        # as HTA: a stream lists the categories of its gaps, and `other` always (its first kernel's)
        by_cat = idle.setdefault((int(r), int(s)), {"other": 0})
        if c:  # '' is a stream with a single kernel: no gap
            by_cat[str(c)] = int(d)
    out: list[IdleTime] = []
    for (r, s), by_cat in sorted(idle.items()):
        total = sum(by_cat.values())
        out.extend(
            IdleTime(r, s, c, by_cat[c], by_cat[c] / total if total else 0.0) for c in IDLE_CATEGORIES if c in by_cat
        )
    return out


def kernel_launches(
    store: Store, job_id: str, attempt: int = 0, ranks: Sequence[int] | None = None, *, kernel_type: str = COMPUTATION
) -> dict[str, dict[int, tuple[int, float]]]:
    """Per kernel name of one type: rank -> (launches, mean duration in us), over the analysed
    window; what kernel-level stragglers are found from (the same kernel, slower on one rank)."""
    w = trace_window(store, job_id, attempt, ranks)
    bit = KERNEL_TYPE_BITS[kernel_type]

    def sql(rs: Sequence[int] | None) -> str:
        return (
            "SELECT name, rank, count() AS n, avg(end_us - ts_us) AS mean_us "
            f"FROM ({_events_sql(w, rs)}) AS e WHERE kt = {bit} GROUP BY name, rank"
        )

    out: dict[str, dict[int, tuple[int, float]]] = {}
    for name, rank, n, mean in _rows(store, w, ranks, sql):
        out.setdefault(str(name), {})[int(rank)] = (int(n), float(mean))
    return out


@dataclass(frozen=True)
class TraceSpan:
    """When a job's profiler window ran: its first and last event, and the ProfilerStep numbers."""

    start_ns: int
    end_ns: int
    first_step: int  # -1: no ProfilerStep#N in the traces
    last_step: int


def trace_span(store: Store, job_id: str, attempt: int = 0, ranks: Sequence[int] | None = None) -> TraceSpan:
    """The job's profiler window: first and last event, and the ProfilerStep numbers analysed
    (the last step left out, as the analyses do, when there are two or more)."""
    where = _where(job_id, attempt, ranks)
    lo, hi, steps = store.query(
        "SELECT min(ts_ns), max(ts_ns + dur_ns), "
        "groupUniqArrayIf(toInt64OrZero(extract(name, '#[ ]*([0-9]+)')), position(name, 'ProfilerStep') > 0) "
        f"FROM trace_events WHERE {where}"
    ).rows()[0]
    numbers = sorted(int(x) for x in steps)
    if len(numbers) >= 2:
        numbers = numbers[:-1]
    if not numbers:
        return TraceSpan(int(lo), int(hi), -1, -1)
    return TraceSpan(int(lo), int(hi), numbers[0], numbers[-1])


# CUDA runtime calls that launch work on a stream (HTA's list, CUDA and ROCm)
_KERNEL_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "runFunction - job_prep_and_submit_for_execution")
_MEMORY_LAUNCHES = ("cudaMemsetAsync", "cudaMemcpyAsync")
_QUEUE_LAUNCHES = (
    *_KERNEL_LAUNCHES,
    *_MEMORY_LAUNCHES,
    "cuLaunchKernel",
    "hipLaunchKernel",
    "hipExtModuleLaunchKernel",
    "hipMemsetAsync",
    "hipMemcpyAsync",
    "hipMemcpyWithStream",
)


def _names(names: Sequence[str]) -> str:
    return "(" + ", ".join(sql_string(n) for n in names) + ")"


def _cpu_sql(w: TraceWindow, ranks: Sequence[int] | None, names: Sequence[str]) -> str:
    """CPU-side runtime calls of the analysed window with these names: rank, correlation, ts_us, dur_us."""
    where = _where(w.job_id, w.attempt, ranks)
    base = (
        f"SELECT rank, correlation, {_TS_US} AS ts_us, {_END_US} - {_TS_US} AS dur_us FROM trace_events "
        f"WHERE {where} AND stream = -1 AND correlation >= 0 AND name IN {_names(names)}"
    )
    if not w.windowed:
        return base
    last_step = _last_step_sql(where)
    return (
        f"SELECT rank, correlation, ts_us, dur_us FROM ({base}) AS c ALL INNER JOIN ({last_step}) AS l "
        "USING (rank) WHERE ts_us < win_end_us"
    )


@dataclass(frozen=True)
class LaunchStats:
    """HTA's CUDA kernel launch statistics of one rank, summarised: per launch, the CPU runtime
    call's duration, the GPU event's, and the launch delay (GPU start - CPU call end, >= 0)."""

    rank: int
    launches: int
    cpu_duration_us: int  # summed
    gpu_duration_us: int
    launch_delay_us: int
    short_gpu_kernels: int  # GPU event shorter than its CPU launch call (launch-bound)
    long_runtime_calls: int  # CPU launch call longer than runtime_cutoff_us
    long_launch_delays: int  # launch delay longer than launch_delay_cutoff_us
    launch_delay_p50_us: float
    launch_delay_p99_us: float

    def to_json(self) -> dict[str, Any]:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def launch_stats(
    store: Store,
    job_id: str,
    attempt: int = 0,
    ranks: Sequence[int] | None = None,
    *,
    runtime_cutoff_us: int = 50,
    launch_delay_cutoff_us: int = 100,
    include_memory_events: bool = True,
) -> list[LaunchStats]:
    """Per rank: every GPU event joined to the CPU runtime call that launched it (by correlation
    id), summarised with HTA's cutoffs (a runtime call over 50 us, a launch delay over 100 us)."""
    w = trace_window(store, job_id, attempt, ranks)
    names = (*_KERNEL_LAUNCHES, *(_MEMORY_LAUNCHES if include_memory_events else ()))

    def sql(rs: Sequence[int] | None) -> str:
        gpu = f"SELECT rank, correlation, ts_us AS g_ts, end_us - ts_us AS g_dur FROM ({_events_sql(w, rs)}) AS e"
        return f"""
SELECT rank, count(), sum(dur_us), sum(g_dur), sum(delay), countIf(g_dur < dur_us),
  countIf(dur_us > {int(runtime_cutoff_us)}), countIf(delay > {int(launch_delay_cutoff_us)}),
  quantileExact(0.5)(delay), quantileExact(0.99)(delay)
FROM (SELECT rank, dur_us, g_dur, greatest(g_ts - ts_us - dur_us, 0) AS delay
      FROM ({_cpu_sql(w, rs, names)}) AS c ALL INNER JOIN ({gpu}) AS g USING (rank, correlation)) AS j
GROUP BY rank ORDER BY rank"""

    return [
        LaunchStats(int(r), int(n), int(c), int(g), int(d), int(a), int(b), int(e), float(p50), float(p99))
        for r, n, c, g, d, a, b, e, p50, p99 in _rows(store, w, ranks, sql)
    ]


@dataclass(frozen=True)
class QueueLength:
    """HTA's queue-length summary of one stream: the outstanding operations on it (launched, not
    yet started), sampled at every change, described as pandas' ``describe()`` does."""

    rank: int
    stream: int
    count: int
    mean: float
    std: float
    min: int
    p25: float
    p50: float
    p75: float
    max: int

    def to_json(self) -> dict[str, Any]:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def _hist_quantile(values: list[int], counts: list[int], q: float) -> float:
    """numpy's linear-interpolation quantile of the samples a histogram describes."""
    n = sum(counts)
    pos = q * (n - 1)
    lo, frac = int(pos), pos - int(pos)

    def at(i: int) -> int:
        acc = 0
        for v, c in zip(values, counts):
            acc += c
            if i < acc:
                return v
        return values[-1]

    a = at(lo)
    return float(a) if frac == 0 else a + frac * (at(lo + 1) - a)


def queue_length_summary(
    store: Store, job_id: str, attempt: int = 0, ranks: Sequence[int] | None = None
) -> list[QueueLength]:
    """Per rank and stream: +1 when a runtime call launches work on the stream, -1 when that work
    starts on the GPU; the running count at each change, summarised (count, mean, std, quartiles).
    The store returns a histogram of the queue lengths, so the quartiles are exact."""
    w = trace_window(store, job_id, attempt, ranks)

    def sql(rs: Sequence[int] | None) -> str:
        gpu = f"SELECT rank, correlation, stream, ts_us AS g_ts FROM ({_events_sql(w, rs)}) AS e"
        return f"""
SELECT rank, stream, q, count() AS n FROM (
  SELECT rank, stream,
    arrayCumSum(arrayMap(e -> tupleElement(e, 3),
      arraySort(arrayConcat(arrayMap(t -> (t, 0, 1), groupArray(ts_us)),
                            arrayMap(t -> (t, 1, -1), groupArray(g_ts)))))) AS qs
  FROM (SELECT rank, stream, ts_us, g_ts FROM ({_cpu_sql(w, rs, _QUEUE_LAUNCHES)}) AS c
        ALL INNER JOIN ({gpu}) AS g USING (rank, correlation)) AS j
  GROUP BY rank, stream
) AS s ARRAY JOIN qs AS q
GROUP BY rank, stream, q ORDER BY rank, stream, q"""

    hist: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
    for r, s, v, n in _rows(store, w, ranks, sql):
        vs, cs = hist.setdefault((int(r), int(s)), ([], []))
        vs.append(int(v))
        cs.append(int(n))
    out = []
    for (r, s), (vs, cs) in sorted(hist.items()):
        n = sum(cs)
        mean = sum(v * c for v, c in zip(vs, cs)) / n
        var = sum(c * (v - mean) ** 2 for v, c in zip(vs, cs)) / (n - 1) if n > 1 else 0.0
        qs = [_hist_quantile(vs, cs, q) for q in (0.25, 0.5, 0.75)]
        out.append(QueueLength(r, s, n, mean, var**0.5, vs[0], qs[0], qs[1], qs[2], vs[-1]))
    return out


@dataclass(frozen=True)
class LedgerWindow:
    """What the job's own ledger says about the steps a profiler window covers (a window inside a
    job traced by ranklens): per rank, the steps' mean duration and time inside collectives."""

    first_step: int
    last_step: int
    per_rank: dict[int, tuple[int, float, float]]  # rank -> (steps, mean step ms, mean ms in collectives)

    def to_json(self) -> dict[str, Any]:
        return {
            "first_step": self.first_step,
            "last_step": self.last_step,
            "ranks": [
                {"rank": r, "steps": n, "step_ms": round(d, 3), "in_collectives_ms": round(c, 3)}
                for r, (n, d, c) in sorted(self.per_rank.items())
            ],
        }


def ledger_window(
    store: Store, job_id: str, attempt: int = 0, ranks: Sequence[int] | None = None
) -> LedgerWindow | None:
    """The ledger's steps that overlap the job's profiler window (per rank, on the same wall
    clock), with the compute metric's numbers for them; None when the job has no ledger there."""
    from ranklens.analyzers.compute import compute_sql

    span = trace_span(store, job_id, attempt, ranks)
    sel = f" AND rank IN ({', '.join(str(int(r)) for r in ranks)})" if ranks else ""
    n, lo, hi = store.query(
        f"SELECT count(), min(step), max(step) FROM steps WHERE job_id = {sql_string(job_id)} "
        f"AND attempt = {int(attempt)}{sel} AND end_ns > {span.start_ns} AND start_ns < {span.end_ns}"
    ).rows()[0]
    if not n:
        return None
    keep = set(int(r) for r in ranks) if ranks else None
    acc: dict[int, list[float]] = {}
    for rank, _step, dur, wait, _start in store.query(compute_sql(job_id, attempt, int(lo), int(hi))).rows():
        if keep is not None and int(rank) not in keep:
            continue
        a = acc.setdefault(int(rank), [0, 0.0, 0.0])
        a[0] += 1
        a[1] += float(dur) / 1e6
        a[2] += min(float(wait or 0), float(dur)) / 1e6
    per_rank = {r: (int(a[0]), a[1] / a[0], a[2] / a[0]) for r, a in acc.items() if a[0]}
    return LedgerWindow(int(lo), int(hi), per_rank)
