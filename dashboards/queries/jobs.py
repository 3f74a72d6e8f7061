"""Jobs: the job list with health, a job's bounds, ranks, phases and step-time trend."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ranklens.dashboards.queries._sql import LIVE_S, MAX_SERIES, ROW_LIMIT, frame, job_where
from ranklens.store.api import Store

__all__ = ["JobBounds", "job_bounds", "ledger_blame", "list_jobs", "phase_names", "rank_info", "step_trend"]


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

    jobs = frame(
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
    # a job traced without step markers has collectives only: it is a job too (no steps, no step time);
    # from the rank_steps rollup where the server has it (one row per rank and step, not per collective)
    ledger = frame(store, _ledger_jobs_sql(store, limit))
    # a job known only by its profiler traces (ingested Kineto traces) is a job too
    traced = frame(
        store,
        f"""
SELECT job_id, attempt, uniqExact(rank) AS ranks, toInt64(0) AS first_step, toInt64(-1) AS last_step,
       min(ts_ns) AS first_ns, max(ts_ns + dur_ns) AS last_ns, toInt64(0) AS median_step_ns
FROM trace_events
GROUP BY job_id, attempt
ORDER BY last_ns DESC
LIMIT {int(limit)}
""",
    )
    if not traced.empty:
        ledger = pd.concat([ledger, traced], ignore_index=True) if not ledger.empty else traced
        ledger = ledger.drop_duplicates(["job_id", "attempt"]).reset_index(drop=True)
    if not ledger.empty:
        known = set(zip(jobs["job_id"], jobs["attempt"]))
        extra = ledger[[(j, a) not in known for j, a in zip(ledger["job_id"], ledger["attempt"])]]
        if not extra.empty:
            extra = extra.assign(median_step_ns=np.nan)
            jobs = pd.concat([jobs, extra], ignore_index=True) if not jobs.empty else extra.reset_index(drop=True)
            jobs = jobs.sort_values("last_ns", ascending=False).head(int(limit)).reset_index(drop=True)
    fnd = frame(
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


def _ledger_jobs_sql(store: Store, limit: int) -> str:
    """Jobs as their collectives know them: ranks and time range per job and attempt."""
    from ranklens.analyzers.blame import rollup_present

    if rollup_present(store, "rank_steps"):
        inner = (
            "SELECT job_id, attempt, rank, minMerge(first_enter_ns) AS f, maxMerge(last_ns) AS l "
            "FROM rank_steps GROUP BY job_id, attempt, rank"
        )
        first, last = "min(f)", "max(l)"
    else:
        inner = "SELECT job_id, attempt, rank, enter_ns, end_ns FROM collectives"
        first, last = "min(enter_ns)", "max(greatest(end_ns, enter_ns))"
    return f"""
SELECT job_id, attempt, uniqExact(rank) AS ranks, toInt64(0) AS first_step, toInt64(-1) AS last_step,
       {first} AS first_ns, {last} AS last_ns, toInt64(0) AS median_step_ns
FROM ({inner})
GROUP BY job_id, attempt
ORDER BY last_ns DESC
LIMIT {int(limit)}
"""


def job_bounds(store: Store, job_id: str, attempt: int) -> JobBounds:
    """Ranks, nodes, step range and time range of a job attempt."""
    w = job_where(job_id, attempt)
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
        t = store.query(
            f"SELECT uniqExact(rank), min(ts_ns), max(ts_ns + dur_ns), count() FROM trace_events WHERE {w}"
        ).rows()[0]
        if int(t[3]):  # only profiler traces
            return JobBounds(job_id, int(attempt), int(t[0]), int(h[0]), 0, -1, int(t[1]), int(t[2]))
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
    return frame(
        store,
        f"""
SELECT rank, any(host) AS node, any(local_rank) AS node_rank, any(gpu_index) AS gpu, any(pp) AS pp_coord,
       any(tp) AS tp_coord, any(dp) AS dp_coord
FROM ranks WHERE {job_where(job_id, attempt)}
GROUP BY rank ORDER BY rank
LIMIT {ROW_LIMIT}
""",
    )


def phase_names(store: Store, job_id: str, attempt: int) -> pd.DataFrame:
    """The phases a job records, most frequent first."""
    return frame(
        store,
        f"SELECT phase, count() AS n FROM phases WHERE {job_where(job_id, attempt)} "
        "GROUP BY phase ORDER BY n DESC, phase LIMIT 100",
    )


def step_trend(store: Store, job_id: str, attempt: int, max_points: int = 400) -> pd.DataFrame:
    """Step time over the job (median, p90 and max over ranks); steps bucketed past ``max_points``."""
    b = job_bounds(store, job_id, attempt)
    bucket = max(1, math.ceil(b.steps / max(1, max_points)))
    return frame(
        store,
        f"""
SELECT intDiv(step, {bucket}) * {bucket} AS step_key,
       quantilesExact(0.5, 0.9)(end_ns - start_ns) AS qs, max(end_ns - start_ns) AS max_ns,
       min(start_ns) AS first_start_ns, uniqExact(rank) AS n_ranks
FROM steps WHERE {job_where(job_id, attempt)}
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
