"""Hangs: per process group, from the newest heartbeats, who did not enter or complete the frontier."""

from __future__ import annotations

import pandas as pd

from ranklens.dashboards.queries._sql import ROW_LIMIT, frame, ints, job_where
from ranklens.dashboards.queries.jobs import job_bounds
from ranklens.store.api import Store

__all__ = ["group_names", "hang_groups", "heartbeat_ages", "rank_last_activity"]


def _latest_pg_rows(job_id: str, attempt: int) -> str:
    """(rank, pg, entered, completed) from every rank's newest heartbeat."""
    return f"""
SELECT rank, pg_name, e, c, hb_ts
FROM
(
    SELECT rank, argMax(pgs, ts_ns) AS hb_pgs, argMax(pg_entered, ts_ns) AS hb_entered,
           argMax(pg_completed, ts_ns) AS hb_completed, max(ts_ns) AS hb_ts
    FROM heartbeats WHERE {job_where(job_id, attempt)}
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
    df = frame(
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
    return frame(
        store,
        f"SELECT pg, any(name) AS pg_desc, length(any(ranks)) AS size FROM process_groups "
        f"WHERE {job_where(job_id, attempt)} GROUP BY pg ORDER BY pg LIMIT {ROW_LIMIT}",
    )


def rank_last_activity(store: Store, job_id: str, attempt: int, ranks: tuple[int, ...]) -> pd.DataFrame:
    """The newest heartbeat of each given rank: what it was last doing."""
    return frame(
        store,
        f"""
SELECT rank, max(ts_ns) AS hb_ns, argMax(host, ts_ns) AS node, argMax(pid, ts_ns) AS last_pid,
       argMax(step, ts_ns) AS last_step, argMax(phase, ts_ns) AS last_phase,
       argMax(phase_start_ns, ts_ns) AS last_phase_start_ns, argMax(last_progress_ns, ts_ns) AS progress_ns,
       argMax(pending_pgs, ts_ns) AS in_flight_pgs, argMax(pending_seqs, ts_ns) AS in_flight_seqs,
       argMax(pending_ops, ts_ns) AS in_flight_ops
FROM heartbeats WHERE {job_where(job_id, attempt)} AND rank IN ({ints(ranks)})
GROUP BY rank ORDER BY rank
LIMIT 1000
""",
    )


def heartbeat_ages(store: Store, job_id: str, attempt: int) -> pd.DataFrame:
    """Per rank: its newest heartbeat time and step (one row per rank, at most ROW_LIMIT)."""
    return frame(
        store,
        f"SELECT rank, max(ts_ns) AS hb_ns, argMax(step, ts_ns) AS hb_step FROM heartbeats "
        f"WHERE {job_where(job_id, attempt)} GROUP BY rank ORDER BY rank LIMIT {ROW_LIMIT}",
    )
