"""Profiler traces (the CUDA timing view): HTA's per-rank breakdowns and one rank's GPU timeline
of one profiler step, from ``trace_events`` (:mod:`ranklens.analyzers.traces` computes the numbers
the page shows, so they are the numbers ``ranklens analyze --traces`` prints)."""

from __future__ import annotations

import pandas as pd

from ranklens.dashboards.queries._sql import ROW_LIMIT, frame, job_where
from ranklens.store.api import Store

__all__ = ["trace_breakdown", "trace_kernel_types", "trace_steps", "trace_timeline", "trace_top_kernels"]


def _has_traces(store: Store, job_id: str, attempt: int) -> bool:
    return bool(store.query(f"SELECT count() FROM trace_events WHERE {job_where(job_id, attempt)}").scalar())


def trace_breakdown(store: Store, job_id: str, attempt: int) -> pd.DataFrame:
    """Per traced rank: idle / compute / non-compute % and comm/comp overlap % (empty: no traces)."""
    from ranklens.analyzers.traces import temporal_breakdown

    if not _has_traces(store, job_id, attempt):
        return pd.DataFrame()
    return pd.DataFrame([b.to_json() for b in temporal_breakdown(store, job_id, attempt)])


def trace_kernel_types(store: Store, job_id: str, attempt: int) -> pd.DataFrame:
    from ranklens.analyzers.traces import kernel_type_breakdown

    if not _has_traces(store, job_id, attempt):
        return pd.DataFrame()
    return pd.DataFrame([k.to_json() for k in kernel_type_breakdown(store, job_id, attempt)])


def trace_top_kernels(store: Store, job_id: str, attempt: int) -> pd.DataFrame:
    from ranklens.analyzers.traces import kernel_breakdown

    if not _has_traces(store, job_id, attempt):
        return pd.DataFrame()
    return pd.DataFrame([k.to_json() for k in kernel_breakdown(store, job_id, attempt)])


def trace_steps(store: Store, job_id: str, attempt: int) -> pd.DataFrame:
    """The profiler steps of each traced rank: ``rank, step, start_ns, end_ns`` (CPU side)."""
    return frame(
        store,
        f"""
SELECT rank, toInt64OrZero(extract(name, '#[ ]*([0-9]+)')) AS step,
       min(ts_ns) AS start_ns, max(ts_ns + dur_ns) AS end_ns
FROM trace_events
WHERE {job_where(job_id, attempt)} AND position(name, 'ProfilerStep') > 0 AND stream = -1
GROUP BY rank, step ORDER BY rank, step LIMIT {ROW_LIMIT}
""",
    )


def trace_timeline(store: Store, job_id: str, attempt: int, rank: int, start_ns: int, end_ns: int) -> pd.DataFrame:
    """One rank's GPU events (kernels, memcpy, memset, syncs) that start in ``[start_ns, end_ns)``:
    ``stream, ts_ns, dur_ns, kernel_type, name``, at most ROW_LIMIT of them (the first ones)."""
    from ranklens.analyzers.traces import KERNEL_TYPE_BITS, KERNEL_TYPE_SQL

    return frame(
        store,
        f"""
SELECT stream, ts_ns, dur_ns, {KERNEL_TYPE_SQL} AS kt, name
FROM trace_events
WHERE {job_where(job_id, attempt)} AND rank = {int(rank)} AND stream >= 0
  AND ts_ns >= {int(start_ns)} AND ts_ns < {int(end_ns)}
  AND cat NOT IN ('python_function', 'Trace')
ORDER BY ts_ns LIMIT {ROW_LIMIT}
""",
    ).assign(kernel_type=lambda d: d["kt"].map({bit: name for name, bit in KERNEL_TYPE_BITS.items()}))
