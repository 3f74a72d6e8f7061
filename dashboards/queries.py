"""Every query behind the dashboards: aggregating SQL with limits, run in the store, cached.

Each ``fetch`` function takes a :class:`~ranklens.store.api.Store` and returns a small pandas
DataFrame (or a frozen record): the aggregation happens in the store (chDB or a ClickHouse server,
the same SQL on both, 18.16 included: no window functions, no ``WITH`` subqueries, aliases never
shadow a column used inside an aggregate), and every result has a ``LIMIT``. When a job has more
ranks than a chart can show, the query aggregates (by node, by rank bucket, top-k worst) instead of
sending every rank to the browser.

The pages call :func:`cached`, which runs a fetch function through ``st.cache_data`` with a short
TTL (the job may be running) keyed by the store URL and the arguments. The fetch functions are
plain functions, so tests and the benchmark call them without Streamlit.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from ranklens.store.api import Store
from ranklens.store.api import sql_escape as _esc

__all__ = [
    "HEAT_AXES",
    "HEAT_METRICS",
    "MAX_CELLS",
    "MAX_SERIES",
    "RANK_DETAIL_MAX",
    "ROW_LIMIT",
    "TTL_S",
    "JobBounds",
    "cached",
    "choose_heat_axis",
    "finding_actions",
    "finding_history",
    "findings",
    "get_store",
    "gpu_events",
    "gpu_series",
    "group_bandwidth",
    "group_names",
    "hang_groups",
    "heartbeat_ages",
    "heatmap",
    "job_bounds",
    "ledger_blame",
    "list_jobs",
    "log_classes",
    "log_events",
    "pair_bandwidth",
    "phase_names",
    "rank_bandwidth",
    "rank_info",
    "rank_last_activity",
    "step_trend",
    "timeline_collectives",
    "timeline_phases",
    "worst_ranks",
]

TTL_S = 10.0  # the job may be running: results older than this are recomputed
ROW_LIMIT = 50_000  # no query feeding a chart or a table returns more rows than this
MAX_CELLS = 80_000  # heat-map cells sent to the browser
RANK_DETAIL_MAX = 512  # above this many ranks, heat maps aggregate rows (node or rank bucket)
MAX_SERIES = 16  # GPU series drawn one by one; more are summarised (fleet quantiles + worst k)
HEAT_METRICS = ("step_time", "phase_time", "blame", "wait")
HEAT_AXES = ("rank", "node", "bucket")
LIVE_S = 120.0  # a job whose newest step is older than this is no longer running


def _job_where(job_id: str, attempt: int) -> str:
    return f"job_id = '{_esc(job_id)}' AND attempt = {int(attempt)}"


def _steps_where(job_id: str, attempt: int, step_from: int, step_to: int) -> str:
    return f"{_job_where(job_id, attempt)} AND step >= {int(step_from)} AND step <= {int(step_to)}"


def _ints(values: Sequence[int]) -> str:
    return ", ".join(str(int(v)) for v in values) or "-1"


def _df(store: Store, sql: str) -> pd.DataFrame:
    return store.query(sql).arrow.to_pandas()


# -- store and cache ------------------------------------------------------------------------------


def get_store(store_url: str) -> Store:
    """The store at ``store_url``, opened once per dashboard process (``st.cache_resource``)."""
    return _get_store_cached(store_url)


def _open(store_url: str) -> Store:
    from ranklens.store import open_store

    return open_store(store_url, create=False)


def _run(name: str, store_url: str, args: tuple[Any, ...], kwargs: tuple[tuple[str, Any], ...]) -> Any:
    return globals()[name](get_store(store_url), *args, **dict(kwargs))


_get_store_cached: Callable[[str], Store] = _open
_cached: Callable[[str, str, tuple[Any, ...], tuple[tuple[str, Any], ...]], Any] = _run
try:  # the dashboards run under Streamlit; the fetch functions below do not need it
    import streamlit as st

    _get_store_cached = st.cache_resource(show_spinner=False)(_open)
    _cached = st.cache_data(ttl=TTL_S, max_entries=512, show_spinner=False)(_run)
except ImportError:  # pragma: no cover - depends on the install
    pass


def cached(name: str, store_url: str, *args: Any, **kwargs: Any) -> Any:
    """Run the fetch function ``name`` of this module on the store, through the TTL cache.

    Args:
        name: a fetch function of this module (e.g. ``"heatmap"``).
        store_url: the store; opened once per process.
        args, kwargs: the function's arguments after the store (hashable values).
    """
    if name not in __all__ or name in {"cached", "get_store", "choose_heat_axis"} or not name.islower():
        raise ValueError(f"{name!r} is not a dashboard query")
    return _cached(name, store_url, tuple(args), tuple(sorted(kwargs.items())))


# -- jobs -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobBounds:
    """Extent of one job attempt: ranks, nodes, steps and time."""

    job_id: str
    attempt: int
    ranks: int
    hosts: int
    first_step: int
    last_step: int
    first_ns: int
    last_ns: int

    @property
    def steps(self) -> int:
        return self.last_step - self.first_step + 1 if self.last_step >= self.first_step else 0


def list_jobs(store: Store, limit: int = 200, now_ns: int | None = None) -> pd.DataFrame:
    """Jobs and attempts, newest first, with their size, pace, open findings and health.

    Health: ``critical`` (an open critical finding), ``degraded`` (an open finding), ``healthy``
    (running, nothing open) or ``finished`` (no step for a while, nothing open).
    """
    import time

    jobs = _df(
        store,
        f"""
SELECT job_id, attempt, uniqExact(rank) AS ranks, min(step) AS first_step, max(step) AS last_step,
       min(start_ns) AS first_ns, max(end_ns) AS last_ns, quantileExact(0.5)(end_ns - start_ns) AS median_step_ns
FROM steps
GROUP BY job_id, attempt
ORDER BY last_ns DESC
LIMIT {int(limit)}
""",
    )
    # a job traced without step markers has collectives only: it is a job too (no steps, no step time)
    ledger = _df(
        store,
        f"""
SELECT job_id, attempt, uniqExact(rank) AS ranks, toInt64(0) AS first_step, toInt64(-1) AS last_step,
       min(enter_ns) AS first_ns, max(greatest(end_ns, enter_ns)) AS last_ns, toInt64(0) AS median_step_ns
FROM collectives
GROUP BY job_id, attempt
ORDER BY last_ns DESC
LIMIT {int(limit)}
""",
    )
    if not ledger.empty:
        known = set(zip(jobs["job_id"], jobs["attempt"]))
        extra = ledger[[(j, a) not in known for j, a in zip(ledger["job_id"], ledger["attempt"])]]
        if not extra.empty:
            extra = extra.assign(median_step_ns=np.nan)
            jobs = pd.concat([jobs, extra], ignore_index=True) if not jobs.empty else extra.reset_index(drop=True)
            jobs = jobs.sort_values("last_ns", ascending=False).head(int(limit)).reset_index(drop=True)
    fnd = _df(
        store,
        """
SELECT job_id, attempt, countIf(latest_state = 'open') AS open_findings,
       countIf(latest_state = 'open' AND latest_severity = 'critical') AS open_critical,
       sumIf(latest_impact_s, latest_state = 'open') AS open_impact_s
FROM
(
    SELECT id, job_id, attempt, argMax(state, updated_ns) AS latest_state,
           argMax(severity, updated_ns) AS latest_severity, argMax(impact_s, updated_ns) AS latest_impact_s
    FROM findings
    GROUP BY id, job_id, attempt
)
GROUP BY job_id, attempt
LIMIT 100000
""",
    )
    out = jobs.merge(fnd, on=["job_id", "attempt"], how="left")
    for c in ("open_findings", "open_critical"):
        out[c] = out[c].fillna(0).astype("int64")
    out["open_impact_s"] = out["open_impact_s"].fillna(0.0).astype("float64")
    out["median_step_s"] = out.pop("median_step_ns").astype("float64") / 1e9
    now = now_ns if now_ns is not None else time.time_ns()
    running = (now - out["last_ns"].astype("int64")) < LIVE_S * 1e9
    out["health"] = np.where(
        out["open_critical"] > 0,
        "critical",
        np.where(out["open_findings"] > 0, "degraded", np.where(running, "healthy", "finished")),
    )
    out["running"] = running
    return out


def job_bounds(store: Store, job_id: str, attempt: int) -> JobBounds:
    """Ranks, nodes, step range and time range of a job attempt."""
    w = _job_where(job_id, attempt)
    s = store.query(
        f"SELECT uniqExact(rank) AS n_ranks, min(step) AS first_step, max(step) AS last_step, "
        f"min(start_ns) AS first_start, max(end_ns) AS last_end, count() AS n FROM steps WHERE {w}"
    ).rows()[0]
    h = store.query(f"SELECT uniqExact(host) AS n_hosts, uniqExact(rank) AS n_ranks FROM ranks WHERE {w}").rows()[0]
    n = int(s[5])
    if not n:  # no step markers: the job's extent comes from its collectives
        c = store.query(
            "SELECT uniqExact(rank), min(enter_ns), max(greatest(end_ns, enter_ns)), count() "
            f"FROM collectives WHERE {w}"
        ).rows()[0]
        if int(c[3]):
            return JobBounds(job_id, int(attempt), max(int(c[0]), int(h[1])), int(h[0]), 0, -1, int(c[1]), int(c[2]))
    return JobBounds(
        job_id=job_id,
        attempt=int(attempt),
        ranks=max(int(s[0]), int(h[1])),
        hosts=int(h[0]),
        first_step=int(s[1]) if n else 0,
        last_step=int(s[2]) if n else -1,
        first_ns=int(s[3]) if n else 0,
        last_ns=int(s[4]) if n else 0,
    )


def ledger_blame(store: Store, job_id: str, attempt: int) -> pd.DataFrame:
    """For a job without step markers: per iteration (counted from the collectives' repeating
    pattern, :mod:`ranklens.analyzers.windows`) and rank, the seconds the others waited for it.
    Long form ``(window, rank, delay_s, basis)``; empty when the job has steps."""
    from ranklens.analyzers.blame import compute_blame

    b = compute_blame(store, job_id, attempt)
    if b.step_basis == "steps" or b.delay_s.size == 0:
        return pd.DataFrame({"window": [], "rank": [], "delay_s": [], "basis": []})
    rows = [
        (int(w), int(r), float(b.delay_s[i, j]), b.step_basis)
        for i, r in enumerate(b.ranks[:MAX_SERIES])
        for j, w in enumerate(b.steps[-ROW_LIMIT // max(1, min(len(b.ranks), MAX_SERIES)) :])
    ]
    return pd.DataFrame(rows, columns=["window", "rank", "delay_s", "basis"])


def rank_info(store: Store, job_id: str, attempt: int) -> pd.DataFrame:
    """Per rank: node, local rank, GPU and parallelism coordinates (for labels and sorting)."""
    return _df(
        store,
        f"""
SELECT rank, any(host) AS node, any(local_rank) AS node_rank, any(gpu_index) AS gpu, any(pp) AS pp_coord,
       any(tp) AS tp_coord, any(dp) AS dp_coord
FROM ranks WHERE {_job_where(job_id, attempt)}
GROUP BY rank ORDER BY rank
LIMIT {ROW_LIMIT}
""",
    )


def phase_names(store: Store, job_id: str, attempt: int) -> pd.DataFrame:
    """The phases a job records, most frequent first."""
    return _df(
        store,
        f"SELECT phase, count() AS n FROM phases WHERE {_job_where(job_id, attempt)} "
        "GROUP BY phase ORDER BY n DESC, phase LIMIT 100",
    )


def step_trend(store: Store, job_id: str, attempt: int, max_points: int = 400) -> pd.DataFrame:
    """Step time over the job (median, p90 and max over ranks); steps bucketed past ``max_points``."""
    b = job_bounds(store, job_id, attempt)
    bucket = max(1, math.ceil(b.steps / max(1, max_points)))
    return _df(
        store,
        f"""
SELECT intDiv(step, {bucket}) * {bucket} AS step_key,
       quantilesExact(0.5, 0.9)(end_ns - start_ns) AS qs, max(end_ns - start_ns) AS max_ns,
       min(start_ns) AS first_start_ns, uniqExact(rank) AS n_ranks
FROM steps WHERE {_job_where(job_id, attempt)}
GROUP BY step_key ORDER BY step_key
LIMIT {ROW_LIMIT}
""",
    ).pipe(_trend_columns)


def _trend_columns(df: pd.DataFrame) -> pd.DataFrame:
    qs = np.array([list(q) for q in df["qs"]], dtype=np.float64).reshape(len(df), 2) / 1e9
    return pd.DataFrame(
        {
            "step": df["step_key"].astype("int64"),
            "p50_s": qs[:, 0],
            "p90_s": qs[:, 1],
            "max_s": df["max_ns"].astype("float64") / 1e9,
            "start_ns": df["first_start_ns"].astype("int64"),
            "ranks": df["n_ranks"].astype("int64"),
        }
    )


# -- findings -------------------------------------------------------------------------------------

_FINDING_COLS = (
    "attempt",
    "kind",
    "severity",
    "confidence",
    "title",
    "state",
    "impact_s",
    "impact_gpu_s",
    "step_time_pct",
    "suspect_ranks",
    "suspect_hosts",
    "suspect_gpus",
    "suspect_links",
    "first_seen_step",
    "last_seen_step",
    "first_seen_ns",
    "last_seen_ns",
    "evidence",
    "detector",
)


def findings(store: Store, job_id: str, attempt: int | None = None, limit: int = 500) -> pd.DataFrame:
    """The newest version of every finding of a job, most costly first (``evidence`` parsed)."""
    where = f"job_id = '{_esc(job_id)}'" + (f" AND attempt = {int(attempt)}" if attempt is not None else "")
    from ranklens.analyzers.findings import latest_columns

    df = _df(
        store,
        f"SELECT id, {latest_columns(_FINDING_COLS)}, max(updated_ns) AS latest_updated_ns, "
        f"min(updated_ns) AS first_reported_ns, count() AS versions FROM findings WHERE {where} GROUP BY id "
        f"ORDER BY latest_impact_s DESC, id LIMIT {int(limit)}",
    )
    df.columns = [c.removeprefix("latest_") for c in df.columns]
    df["evidence"] = [_parse_json(e) for e in df["evidence"]]
    return df


def _parse_json(text: Any) -> dict[str, Any]:
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {"raw": str(text)}
    return value if isinstance(value, dict) else {"value": value}


def finding_history(store: Store, finding_id: str, limit: int = 1000) -> pd.DataFrame:
    """Every stored version of one finding, oldest first: how it opened, grew and resolved."""
    return _df(
        store,
        f"SELECT updated_ns, state, severity, confidence, impact_s, last_seen_step FROM findings "
        f"WHERE id = '{_esc(finding_id)}' ORDER BY updated_ns LIMIT {int(limit)}",
    )


def finding_actions(store: Store, finding_id: str, limit: int = 500) -> pd.DataFrame:
    """Recovery actions delivered for a finding (the ``actions`` table), oldest first."""
    return _df(
        store,
        f"SELECT ts_ns, action, target, attempt_no, outcome, detail, idempotency_key FROM actions "
        f"WHERE finding_id = '{_esc(finding_id)}' ORDER BY ts_ns LIMIT {int(limit)}",
    )


# -- timeline -------------------------------------------------------------------------------------


def _blame_sql(job_id: str, attempt: int, step_from: int, step_to: int, t0_ns: int) -> str:
    """Per (pg, seq) with at least two members: last arriver, its step, the mean wait of the others.

    Arrivals relative to ``t0_ns`` in Float64, so sums over 10,000 members cannot overflow."""
    return f"""
SELECT pg, seq, argMax(rank, enter_ns) AS last_rank, argMax(step, enter_ns) AS at_step, count() AS members,
       (toFloat64(max(enter_ns) - {int(t0_ns)}) * count() - sum(toFloat64(enter_ns - {int(t0_ns)})))
           / (members - 1) AS delay_ns
FROM collectives
WHERE {_steps_where(job_id, attempt, step_from, step_to)}
GROUP BY pg, seq
HAVING members >= 2
"""


def worst_ranks(
    store: Store, job_id: str, attempt: int, step_from: int, step_to: int, k: int = 16, t0_ns: int = 0
) -> pd.DataFrame:
    """The ``k`` ranks that made the others wait longest in a step window (culprits, not victims)."""
    return _df(
        store,
        f"""
SELECT last_rank AS culprit, sum(delay_ns) / 1e9 AS caused_s, count() AS times_last
FROM ({_blame_sql(job_id, attempt, step_from, step_to, t0_ns)})
GROUP BY culprit
ORDER BY caused_s DESC, culprit
LIMIT {int(k)}
""",
    )


def timeline_phases(
    store: Store, job_id: str, attempt: int, step_from: int, step_to: int, ranks: tuple[int, ...]
) -> pd.DataFrame:
    """Phases of the given ranks in a step window (one row per rank x step x phase)."""
    return _df(
        store,
        f"""
SELECT rank, step, phase, start_ns, end_ns
FROM phases
WHERE {_steps_where(job_id, attempt, step_from, step_to)} AND rank IN ({_ints(ranks)})
ORDER BY rank, start_ns
LIMIT {ROW_LIMIT}
""",
    )


def timeline_collectives(
    store: Store, job_id: str, attempt: int, step_from: int, step_to: int, ranks: tuple[int, ...]
) -> pd.DataFrame:
    """Collectives of the given ranks in a step window, each with its group's last arrival.

    ``last_enter_ns`` and ``last_rank`` are over *all* members of the ``(pg, seq)``, so the wait
    of a shown rank (its arrival up to the last arrival) is right even when the culprit is not shown.
    """
    w = _steps_where(job_id, attempt, step_from, step_to)
    return _df(
        store,
        f"""
SELECT rank, pg, seq, op, nbytes, step, enter_ns, end_ns, last_enter_ns, last_rank, members
FROM
(
    SELECT rank, pg, seq, op, nbytes, step, enter_ns, end_ns
    FROM collectives WHERE {w} AND rank IN ({_ints(ranks)})
) AS lhs
ALL INNER JOIN
(
    SELECT pg, seq, max(enter_ns) AS last_enter_ns, argMax(rank, enter_ns) AS last_rank, count() AS members
    FROM collectives WHERE {w}
    GROUP BY pg, seq
) AS rhs
USING (pg, seq)
ORDER BY rank, enter_ns
LIMIT {ROW_LIMIT}
""",
    )


# -- heat maps ------------------------------------------------------------------------------------


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


def _metric_source(metric: str, job_id: str, attempt: int, step_from: int, step_to: int, phase: str, t0: int) -> str:
    """Rows (r = rank, s = step, v = seconds) of one heat-map metric."""
    w = _steps_where(job_id, attempt, step_from, step_to)
    if metric == "step_time":
        return f"SELECT rank AS r, step AS s, toFloat64(end_ns - start_ns) / 1e9 AS v FROM steps WHERE {w}"
    if metric == "phase_time":
        return (
            f"SELECT rank AS r, step AS s, toFloat64(sum(end_ns - start_ns)) / 1e9 AS v FROM phases "
            f"WHERE {w} AND phase = '{_esc(phase)}' GROUP BY r, s"
        )
    if metric == "blame":
        return (
            f"SELECT last_rank AS r, at_step AS s, sum(delay_ns) / 1e9 AS v "
            f"FROM ({_blame_sql(job_id, attempt, step_from, step_to, t0)}) GROUP BY r, s"
        )
    if metric == "wait":
        return f"""
SELECT rank AS r, step AS s, sum(toFloat64(last_enter_ns - enter_ns)) / 1e9 AS v
FROM (SELECT rank, step, pg, seq, enter_ns FROM collectives WHERE {w}) AS lhs
ALL INNER JOIN (SELECT pg, seq, max(enter_ns) AS last_enter_ns FROM collectives WHERE {w} GROUP BY pg, seq) AS rhs
USING (pg, seq)
GROUP BY r, s"""
    raise ValueError(f"unknown heat-map metric {metric!r}; one of {', '.join(HEAT_METRICS)}")


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
        metric: ``step_time``, ``phase_time`` (of ``phase``), ``blame`` (seconds the others waited
            for this rank, summed over the collectives it arrived last at) or ``wait`` (seconds
            this rank waited in collectives for the last arriver).
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
    src = _metric_source(metric, job_id, attempt, step_from, step_to, phase, t0_ns)
    sb = max(1, int(step_bucket))
    step_key = f"intDiv(s, {sb}) * {sb}"
    if axis == "node":
        return _df(
            store,
            f"""
SELECT node AS row_key, {step_key} AS step_key, {agg}(v) AS value
FROM ({src}) AS lhs
ALL INNER JOIN (SELECT rank AS r, any(host) AS node FROM ranks WHERE {_job_where(job_id, attempt)} GROUP BY r) AS rhs
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
    return _df(
        store,
        f"""
SELECT {row_key} AS row_key, {step_key} AS step_key, {agg}(v) AS value
FROM ({src})
GROUP BY row_key, step_key
ORDER BY row_key, step_key
LIMIT {MAX_CELLS + 1}
""",
    )


# -- links ----------------------------------------------------------------------------------------


def _per_collective_sql(job_id: str, attempt: int, step_from: int, step_to: int) -> str:
    """Per completed (pg, seq): members, bytes and the transfer time after the last arrival."""
    return f"""
SELECT pg, seq, count() AS members, min(rank) AS a_rank, max(rank) AS b_rank, max(nbytes) AS nb, any(op) AS kind,
       toFloat64(max(end_ns) - max(enter_ns)) AS xfer_ns, min(end_ns) AS first_end_ns
FROM collectives
WHERE {_steps_where(job_id, attempt, step_from, step_to)}
GROUP BY pg, seq
HAVING members >= 2 AND first_end_ns > 0 AND xfer_ns > 0 AND nb > 0
"""


def pair_bandwidth(store: Store, job_id: str, attempt: int, step_from: int, step_to: int) -> pd.DataFrame:
    """Effective bandwidth of two-member collectives and p2p pairs: bytes over transfer time after
    the last arrival, per (lower rank, higher rank)."""
    return _df(
        store,
        f"""
SELECT a_rank, b_rank, sum(nb) AS total_bytes, sum(xfer_ns) AS total_xfer_ns, count() AS calls
FROM ({_per_collective_sql(job_id, attempt, step_from, step_to)})
WHERE members = 2
GROUP BY a_rank, b_rank
ORDER BY calls DESC
LIMIT {ROW_LIMIT}
""",
    )


def group_bandwidth(
    store: Store, job_id: str, attempt: int, step_from: int, step_to: int, limit: int = 200
) -> pd.DataFrame:
    """Effective bandwidth per process group, slowest first (bytes / time after the last arrival)."""
    return _df(
        store,
        f"""
SELECT pg, any(kind) AS op_kind, max(members) AS size, count() AS calls, sum(nb) AS total_bytes,
       sum(xfer_ns) AS total_xfer_ns, total_bytes / (total_xfer_ns / 1e9) AS bytes_per_s
FROM ({_per_collective_sql(job_id, attempt, step_from, step_to)})
GROUP BY pg
ORDER BY bytes_per_s ASC
LIMIT {int(limit)}
""",
    )


def rank_bandwidth(store: Store, job_id: str, attempt: int, step_from: int, step_to: int) -> pd.DataFrame:
    """Per rank: bytes it moved and the time its collectives took after the group's last arrival."""
    w = _steps_where(job_id, attempt, step_from, step_to)
    return _df(
        store,
        f"""
SELECT rank, sum(nbytes) AS total_bytes, sum(toFloat64(end_ns - last_enter_ns)) AS total_xfer_ns, count() AS calls
FROM (SELECT rank, pg, seq, nbytes, end_ns FROM collectives WHERE {w} AND end_ns > 0 AND nbytes > 0) AS lhs
ALL INNER JOIN (SELECT pg, seq, max(enter_ns) AS last_enter_ns FROM collectives WHERE {w} GROUP BY pg, seq) AS rhs
USING (pg, seq)
WHERE end_ns > last_enter_ns
GROUP BY rank
ORDER BY rank
LIMIT {ROW_LIMIT}
""",
    )


# -- hangs ----------------------------------------------------------------------------------------


def _latest_pg_rows(job_id: str, attempt: int) -> str:
    """(rank, pg, entered, completed) from every rank's newest heartbeat."""
    return f"""
SELECT rank, pg_name, e, c, hb_ts
FROM
(
    SELECT rank, argMax(pgs, ts_ns) AS hb_pgs, argMax(pg_entered, ts_ns) AS hb_entered,
           argMax(pg_completed, ts_ns) AS hb_completed, max(ts_ns) AS hb_ts
    FROM heartbeats WHERE {_job_where(job_id, attempt)}
    GROUP BY rank
)
ARRAY JOIN hb_pgs AS pg_name, hb_entered AS e, hb_completed AS c
"""


def hang_groups(store: Store, job_id: str, attempt: int, list_max: int = 64) -> pd.DataFrame:
    """Per process group, from the newest heartbeats: the furthest seq any member entered (the
    frontier), who entered it, who completed it, who did not enter (first ``list_max`` ranks of
    each list), and the group's members (from ``process_groups``; ranks that never sent a heartbeat
    count as not entered)."""
    rows = _latest_pg_rows(job_id, attempt)
    df = _df(
        store,
        f"""
SELECT pg_name, frontier, count() AS reporting, countIf(e >= frontier) AS entered_n,
       countIf(c >= frontier) AS completed_n,
       arraySlice(groupArrayIf(rank, e < frontier), 1, {int(list_max)}) AS not_entered,
       arraySlice(groupArrayIf(rank, e >= frontier AND c < frontier), 1, {int(list_max)}) AS in_flight,
       min(hb_ts) AS oldest_hb_ns, max(hb_ts) AS newest_hb_ns
FROM ({rows}) AS lhs
ALL INNER JOIN (SELECT pg_name, max(e) AS frontier FROM ({rows}) GROUP BY pg_name) AS rhs USING pg_name
GROUP BY pg_name, frontier
ORDER BY (reporting - completed_n) DESC, pg_name
LIMIT 1000
""",
    )
    groups = group_names(store, job_id, attempt)
    world = int(job_bounds(store, job_id, attempt).ranks)
    desc = dict(zip(groups["pg"], groups["pg_desc"]))
    sizes = dict(zip(groups["pg"], groups["size"]))
    out_members, silent = [], []
    for pg, reporting in zip(df["pg_name"], df["reporting"]):
        m = sizes.get(pg)
        n = int(m) if m is not None else (world if pg == "0" else int(reporting))
        out_members.append(n)
        silent.append(max(0, n - int(reporting)))
    df.insert(1, "pg_desc", [desc.get(pg, "") for pg in df["pg_name"]])
    df["members_n"] = out_members
    df["silent_n"] = silent  # members with no heartbeat at all
    df["not_entered_n"] = (df["reporting"] - df["entered_n"] + df["silent_n"]).astype("int64")
    df["in_flight_n"] = df["entered_n"] - df["completed_n"]
    df["not_entered"] = [list(x) for x in df["not_entered"]]
    df["in_flight"] = [list(x) for x in df["in_flight"]]
    return df


def group_names(store: Store, job_id: str, attempt: int) -> pd.DataFrame:
    """Process groups of a job: name (description) and size."""
    return _df(
        store,
        f"SELECT pg, any(name) AS pg_desc, length(any(ranks)) AS size FROM process_groups "
        f"WHERE {_job_where(job_id, attempt)} GROUP BY pg ORDER BY pg LIMIT {ROW_LIMIT}",
    )


def rank_last_activity(store: Store, job_id: str, attempt: int, ranks: tuple[int, ...]) -> pd.DataFrame:
    """The newest heartbeat of each given rank: what it was last doing."""
    return _df(
        store,
        f"""
SELECT rank, max(ts_ns) AS hb_ns, argMax(host, ts_ns) AS node, argMax(pid, ts_ns) AS last_pid,
       argMax(step, ts_ns) AS last_step, argMax(phase, ts_ns) AS last_phase,
       argMax(phase_start_ns, ts_ns) AS last_phase_start_ns, argMax(last_progress_ns, ts_ns) AS progress_ns,
       argMax(pending_pgs, ts_ns) AS in_flight_pgs, argMax(pending_seqs, ts_ns) AS in_flight_seqs,
       argMax(pending_ops, ts_ns) AS in_flight_ops
FROM heartbeats WHERE {_job_where(job_id, attempt)} AND rank IN ({_ints(ranks)})
GROUP BY rank ORDER BY rank
LIMIT 1000
""",
    )


def heartbeat_ages(store: Store, job_id: str, attempt: int) -> pd.DataFrame:
    """Per rank: its newest heartbeat time and step (one row per rank, at most ROW_LIMIT)."""
    return _df(
        store,
        f"SELECT rank, max(ts_ns) AS hb_ns, argMax(step, ts_ns) AS hb_step FROM heartbeats "
        f"WHERE {_job_where(job_id, attempt)} GROUP BY rank ORDER BY rank LIMIT {ROW_LIMIT}",
    )


# -- GPU and logs ---------------------------------------------------------------------------------

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
    hosts = f"SELECT host FROM ranks WHERE {_job_where(job_id, attempt)}"
    return f"(job_id = '{_esc(job_id)}' OR host IN ({hosts})) AND ts_ns >= {int(t_from)} AND ts_ns <= {int(t_to)}"


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
        return _df(store, per_gpu.format(extra="") + f" ORDER BY series, t_ns LIMIT {ROW_LIMIT}")
    worst = (
        f"SELECT concat(host, ':', toString(gpu_index)) AS gpu_key FROM gpu_samples WHERE {w} GROUP BY gpu_key "
        f"ORDER BY {'max' if worst_high else 'min'}(toFloat64({metric})) {'DESC' if worst_high else 'ASC'} "
        f"LIMIT {int(max_series)}"
    )
    top = _df(
        store,
        per_gpu.format(extra=f"AND concat(host, ':', toString(gpu_index)) IN ({worst})")
        + f" ORDER BY series, t_ns LIMIT {ROW_LIMIT}",
    )
    fleet = _df(
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
    return _df(
        store,
        f"SELECT ts_ns, host, gpu_index, rank, kind, code, message FROM gpu_events "
        f"WHERE {_gpu_where(job_id, attempt, t_from, t_to)} ORDER BY ts_ns LIMIT {int(limit)}",
    )


def log_classes(store: Store, job_id: str, attempt: int) -> pd.DataFrame:
    """Log classes and severities of a job with their counts (the filter choices)."""
    return _df(
        store,
        f"SELECT klass, severity, count() AS lines, sum(repeat_count) AS repeats FROM log_events "
        f"WHERE {_job_where(job_id, attempt)} GROUP BY klass, severity ORDER BY lines DESC LIMIT 1000",
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
    w = f"{_job_where(job_id, attempt)} AND ts_ns >= {int(t_from)} AND ts_ns <= {int(t_to)}"
    if klasses:
        w += " AND klass IN (" + ", ".join(f"'{_esc(k)}'" for k in klasses) + ")"
    if severities:
        w += " AND severity IN (" + ", ".join(f"'{_esc(s)}'" for s in severities) + ")"
    if ranks:
        w += f" AND rank IN ({_ints(ranks)})"
    if text:
        w += f" AND positionCaseInsensitive(message, '{_esc(text)}') > 0"
    return _df(
        store,
        f"SELECT ts_ns, host, rank, stream, klass, severity, message, repeat_count, context, rule, source "
        f"FROM log_events WHERE {w} ORDER BY ts_ns LIMIT {int(limit)}",
    )


def env_store_url() -> str:
    """The store the dashboard shows: ``$RANKLENS_STORE`` (set by ``ranklens dashboard``) or the default."""
    from ranklens.store import default_store_url

    return os.environ.get("RANKLENS_STORE") or default_store_url()
