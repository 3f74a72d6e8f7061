"""Heat maps: rank (node, rank bucket) x step of a metric, aggregated in the store.

The blame, wait and compute metrics are the analyzers' own (:mod:`ranklens.analyzers.blame`,
:mod:`ranklens.analyzers.compute`): a hot row here is the rank the finding beside it names.
"""

from __future__ import annotations

import math

import pandas as pd

from ranklens.analyzers.blame import blame_source, member_wait_sql
from ranklens.analyzers.compute import compute_sql
from ranklens.dashboards.queries._cache import job_blame_cells, job_offsets
from ranklens.dashboards.queries._sql import MAX_CELLS, RANK_DETAIL_MAX, esc, frame, job_where, steps_where
from ranklens.store.api import Store

__all__ = ["HEAT_AXES", "HEAT_METRICS", "choose_heat_axis", "heatmap"]

HEAT_METRICS = ("step_time", "phase_time", "compute", "blame", "wait")
HEAT_AXES = ("rank", "node", "bucket")


def choose_heat_axis(ranks: int, hosts: int, steps: int) -> tuple[str, int]:
    """The default row axis of a heat map and the rank bucket size: ranks while they fit, then
    nodes, then buckets of consecutive ranks sized so that rows x steps stays under MAX_CELLS."""
    steps = max(steps, 1)
    if ranks <= RANK_DETAIL_MAX and ranks * steps <= MAX_CELLS:
        return "rank", 1
    if hosts > 1 and hosts * steps <= MAX_CELLS:
        return "node", 1
    rows = max(1, MAX_CELLS // steps)
    return "bucket", max(1, math.ceil(ranks / rows))


def _metric_source(
    store: Store, metric: str, job_id: str, attempt: int, step_from: int, step_to: int, phase: str, t0: int
) -> str:
    """Rows (r = rank, s = step, v = seconds) of one heat-map metric."""
    w = steps_where(job_id, attempt, step_from, step_to)
    if metric == "step_time":
        return f"SELECT rank AS r, step AS s, toFloat64(end_ns - start_ns) / 1e9 AS v FROM steps WHERE {w}"
    if metric == "phase_time":
        return (
            f"SELECT rank AS r, step AS s, toFloat64(sum(end_ns - start_ns)) / 1e9 AS v FROM phases "
            f"WHERE {w} AND phase = '{esc(phase)}' GROUP BY r, s"
        )
    if metric == "compute":
        src = compute_sql(job_id, attempt, max(0, int(step_from)), int(step_to))
        return f"SELECT rank AS r, step AS s, toFloat64(dur_ns - least(wait_ns, dur_ns)) / 1e9 AS v FROM ({src})"
    if metric != "wait":  # blame is aggregated in Python: _blame_heatmap
        raise ValueError(f"unknown heat-map metric {metric!r}; one of {', '.join(HEAT_METRICS)}")
    offsets = job_offsets(store, job_id, attempt)
    src = member_wait_sql(
        job_id,
        attempt,
        offsets,
        step_from=step_from,
        step_to=step_to,
        rollup_host_offsets=blame_source(store, job_id, attempt, offsets),
    )
    return f"SELECT rank AS r, step AS s, wait_ns / 1e9 AS v FROM ({src})"


def heatmap(
    store: Store,
    job_id: str,
    attempt: int,
    metric: str,
    step_from: int,
    step_to: int,
    *,
    axis: str = "rank",
    rank_bucket: int = 1,
    step_bucket: int = 1,
    phase: str = "",
    agg: str = "max",
    t0_ns: int = 0,
) -> pd.DataFrame:
    """Long-form heat map ``(row_key, step_key, value)`` of a metric, aggregated in the store.

    Args:
        metric: ``step_time``, ``phase_time`` (of ``phase``), ``compute`` (step time minus time
            inside collectives: the straggler analyzer's metric), ``blame`` (seconds the others
            waited for this rank, summed over the collectives it arrived last at) or ``wait``
            (seconds this rank waited in collectives for the last arriver); blame and wait on
            aligned clocks, point-to-point transfers left out, as the blame analyzer counts them.
        axis: rows are ranks (``rank``), nodes (``node``) or buckets of ``rank_bucket``
            consecutive ranks (``bucket``, keyed by the first rank).
        step_bucket: steps per column.
        agg: ``max`` (a straggler stays visible in an aggregate) or ``avg``.
        t0_ns: a time near the job start (keeps Float64 sums exact).

    Returns:
        At most MAX_CELLS + 1 rows (one more than allowed means the caller should aggregate more).
    """
    if agg not in ("max", "avg"):
        raise ValueError(f"agg {agg!r}: use max or avg")
    if axis not in HEAT_AXES:
        raise ValueError(f"unknown heat-map axis {axis!r}; one of {', '.join(HEAT_AXES)}")
    if metric == "blame":
        return _blame_heatmap(store, job_id, attempt, step_from, step_to, axis, rank_bucket, step_bucket, agg, t0_ns)
    src = _metric_source(store, metric, job_id, attempt, step_from, step_to, phase, t0_ns)
    sb = max(1, int(step_bucket))
    step_key = f"intDiv(s, {sb}) * {sb}"
    if axis == "node":
        return frame(
            store,
            f"""
SELECT node AS row_key, {step_key} AS step_key, {agg}(v) AS value
FROM ({src}) AS lhs
ALL INNER JOIN (SELECT rank AS r, any(host) AS node FROM ranks WHERE {job_where(job_id, attempt)} GROUP BY r) AS rhs
USING r
GROUP BY row_key, step_key
ORDER BY row_key, step_key
LIMIT {MAX_CELLS + 1}
""",
        )
    if axis == "rank":
        row_key = "r"
    elif axis == "bucket":
        rb = max(1, int(rank_bucket))
        row_key = f"intDiv(r, {rb}) * {rb}"
    else:
        raise ValueError(f"unknown heat-map axis {axis!r}; one of {', '.join(HEAT_AXES)}")
    return frame(
        store,
        f"""
SELECT {row_key} AS row_key, {step_key} AS step_key, {agg}(v) AS value
FROM ({src})
GROUP BY row_key, step_key
ORDER BY row_key, step_key
LIMIT {MAX_CELLS + 1}
""",
    )


def _blame_heatmap(
    store: Store,
    job_id: str,
    attempt: int,
    step_from: int,
    step_to: int,
    axis: str,
    rank_bucket: int,
    step_bucket: int,
    agg: str,
    t0_ns: int,
) -> pd.DataFrame:
    """The blame heat map: the analyzer's cells (:func:`~ranklens.analyzers.blame.blame_cells`, through
    :func:`~ranklens.dashboards.queries._cache.job_blame_cells`; the
    union of overlapping waits is computed per cell, which SQL on 18.16 cannot), then bucketed like
    the other metrics. A cell exists only where a rank arrived last: at most ranks x steps rows."""
    cells = job_blame_cells(store, job_id, attempt, step_from, step_to, t0_ns or None)
    sb = max(1, int(step_bucket))
    cols = pd.DataFrame({"r": cells.ranks, "step_key": cells.steps // sb * sb, "value": cells.delay_s})
    if axis == "node":
        nodes = frame(
            store, f"SELECT rank AS r, any(host) AS node FROM ranks WHERE {job_where(job_id, attempt)} GROUP BY r"
        )
        cols = cols.merge(nodes, on="r", how="inner").assign(row_key=lambda d: d["node"])
    elif axis == "bucket":
        rb = max(1, int(rank_bucket))
        cols["row_key"] = cols["r"] // rb * rb
    else:
        cols["row_key"] = cols["r"]
    grouped = cols.groupby(["row_key", "step_key"], as_index=False)["value"]
    out = grouped.max() if agg == "max" else grouped.mean()
    return out.sort_values(["row_key", "step_key"]).head(MAX_CELLS + 1).reset_index(drop=True)
