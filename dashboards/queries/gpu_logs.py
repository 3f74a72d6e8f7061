"""GPU series and events on a job's nodes, and its classified log lines."""

from __future__ import annotations

import pandas as pd

from ranklens.dashboards.queries._sql import MAX_SERIES, ROW_LIMIT, esc, frame, ints, job_where
from ranklens.store.api import Store

__all__ = ["GPU_METRICS", "gpu_events", "gpu_series", "log_classes", "log_events"]

GPU_METRICS = {
    # column: (label, worst is high?)
    "util_pct": ("GPU utilization %", False),
    "sm_clock_mhz": ("SM clock MHz", False),
    "temp_c": ("temperature °C", True),
    "power_w": ("power W", False),
    "mem_used_bytes": ("memory used bytes", True),
    "ecc_corrected": ("corrected ECC errors", True),
    "nvlink_errors": ("NVLink errors", True),
}


def _gpu_where(job_id: str, attempt: int, t_from: int, t_to: int) -> str:
    hosts = f"SELECT host FROM ranks WHERE {job_where(job_id, attempt)}"
    return f"(job_id = '{esc(job_id)}' OR host IN ({hosts})) AND ts_ns >= {int(t_from)} AND ts_ns <= {int(t_to)}"


def gpu_series(
    store: Store,
    job_id: str,
    attempt: int,
    t_from: int,
    t_to: int,
    metric: str = "util_pct",
    *,
    buckets: int = 300,
    max_series: int = MAX_SERIES,
) -> pd.DataFrame:
    """GPU metric over time, bucketed: one series per GPU while they are few; past ``max_series``
    GPUs, the fleet's 10th/50th/90th percentiles plus the ``max_series`` worst GPUs.

    Returns:
        Columns ``series`` (``host:gpu`` or ``fleet p50`` ...), ``t_ns``, ``value``.
    """
    if metric not in GPU_METRICS:
        raise ValueError(f"unknown GPU metric {metric!r}; one of {', '.join(GPU_METRICS)}")
    w = _gpu_where(job_id, attempt, t_from, t_to)
    b = max(1, (int(t_to) - int(t_from)) // max(1, buckets))
    n = int(store.query(f"SELECT uniqExact(host, gpu_index) AS n FROM gpu_samples WHERE {w}").scalar() or 0)
    if n == 0:
        return pd.DataFrame({"series": [], "t_ns": [], "value": []})
    worst_high = GPU_METRICS[metric][1]
    per_gpu = f"""
SELECT concat(host, ':', toString(gpu_index)) AS series, intDiv(ts_ns, {b}) * {b} AS t_ns,
       avg(toFloat64({metric})) AS value
FROM gpu_samples WHERE {w} {{extra}}
GROUP BY series, t_ns
"""
    if n <= max_series:
        return frame(store, per_gpu.format(extra="") + f" ORDER BY series, t_ns LIMIT {ROW_LIMIT}")
    worst = (
        f"SELECT concat(host, ':', toString(gpu_index)) AS gpu_key FROM gpu_samples WHERE {w} GROUP BY gpu_key "
        f"ORDER BY {'max' if worst_high else 'min'}(toFloat64({metric})) {'DESC' if worst_high else 'ASC'} "
        f"LIMIT {int(max_series)}"
    )
    top = frame(
        store,
        per_gpu.format(extra=f"AND concat(host, ':', toString(gpu_index)) IN ({worst})")
        + f" ORDER BY series, t_ns LIMIT {ROW_LIMIT}",
    )
    fleet = frame(
        store,
        f"""
SELECT intDiv(ts_ns, {b}) * {b} AS t_ns, quantiles(0.1, 0.5, 0.9)(toFloat64({metric})) AS qs
FROM gpu_samples WHERE {w}
GROUP BY t_ns ORDER BY t_ns
LIMIT {ROW_LIMIT}
""",
    )
    parts = [top]
    for i, name in enumerate(("fleet p10", "fleet p50", "fleet p90")):
        parts.append(pd.DataFrame({"series": name, "t_ns": fleet["t_ns"], "value": [q[i] for q in fleet["qs"]]}))
    return pd.concat(parts, ignore_index=True)


def gpu_events(store: Store, job_id: str, attempt: int, t_from: int, t_to: int, limit: int = 500) -> pd.DataFrame:
    """Discrete GPU events (XID, ECC, row remap, ...) on the job's nodes in a time window."""
    return frame(
        store,
        f"SELECT ts_ns, host, gpu_index, rank, kind, code, message FROM gpu_events "
        f"WHERE {_gpu_where(job_id, attempt, t_from, t_to)} ORDER BY ts_ns LIMIT {int(limit)}",
    )


def log_classes(store: Store, job_id: str, attempt: int) -> pd.DataFrame:
    """Log classes and severities of a job with their counts (the filter choices)."""
    return frame(
        store,
        f"SELECT klass, severity, count() AS lines, sum(repeat_count) AS repeats FROM log_events "
        f"WHERE {job_where(job_id, attempt)} GROUP BY klass, severity ORDER BY lines DESC LIMIT 1000",
    )


def log_events(
    store: Store,
    job_id: str,
    attempt: int,
    t_from: int,
    t_to: int,
    *,
    klasses: tuple[str, ...] = (),
    severities: tuple[str, ...] = (),
    ranks: tuple[int, ...] = (),
    text: str = "",
    limit: int = 500,
) -> pd.DataFrame:
    """Classified log lines of a job in a time window, filtered, earliest first."""
    w = f"{job_where(job_id, attempt)} AND ts_ns >= {int(t_from)} AND ts_ns <= {int(t_to)}"
    if klasses:
        w += " AND klass IN (" + ", ".join(f"'{esc(k)}'" for k in klasses) + ")"
    if severities:
        w += " AND severity IN (" + ", ".join(f"'{esc(s)}'" for s in severities) + ")"
    if ranks:
        w += f" AND rank IN ({ints(ranks)})"
    if text:
        w += f" AND positionCaseInsensitive(message, '{esc(text)}') > 0"
    return frame(
        store,
        f"SELECT ts_ns, host, rank, stream, klass, severity, message, repeat_count, context, rule, source "
        f"FROM log_events WHERE {w} ORDER BY ts_ns LIMIT {int(limit)}",
    )
