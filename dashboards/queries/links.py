"""Links: effective bandwidth per pair, per process group and per rank in a step window.

Every number is the links analyzer's transfer metric (:func:`ranklens.analyzers.links.transfer_sql`):
bus bytes (:data:`~ranklens.analyzers.links.BUS_FACTORS`) over the transfer time after the group's
last arrival, per completed ``(pg, seq)``; the pages only sum it per pair, group or rank.
"""

from __future__ import annotations

import pandas as pd

from ranklens.analyzers.links import transfer_sql
from ranklens.dashboards.queries._sql import ROW_LIMIT, frame, steps_where
from ranklens.store.api import Store

__all__ = ["LINK_MIN_BYTES", "group_bandwidth", "pair_bandwidth", "rank_bandwidth"]

# The pages show every collective that moved data (a small job's 4-byte all-reduces included);
# the analyzer's findings leave out those under links.DEFAULT_MIN_BYTES (latency bound).
LINK_MIN_BYTES = 1


def _transfers(job_id: str, attempt: int, step_from: int, step_to: int) -> str:
    return transfer_sql(job_id, attempt, min_bytes=LINK_MIN_BYTES, step_from=step_from, step_to=step_to)


def pair_bandwidth(store: Store, job_id: str, attempt: int, step_from: int, step_to: int) -> pd.DataFrame:
    """Effective bandwidth of two-member collectives and p2p pairs (both directions together), per
    (lower rank, higher rank): bytes, transfer time after the last arrival, calls."""
    return frame(
        store,
        f"""
SELECT a_rank, b_rank, sum(bus_bytes) AS total_bytes, sum(xfer_ns) AS total_xfer_ns, count() AS calls
FROM ({_transfers(job_id, attempt, step_from, step_to)})
WHERE members = 2
GROUP BY a_rank, b_rank
ORDER BY calls DESC, a_rank, b_rank
LIMIT {ROW_LIMIT}
""",
    )


def group_bandwidth(
    store: Store, job_id: str, attempt: int, step_from: int, step_to: int, limit: int = 200
) -> pd.DataFrame:
    """Effective bandwidth per process group (a p2p pair per direction), slowest first: bus bytes over
    transfer time after the last arrival, and the median of its collectives (``median_bps``)."""
    return frame(
        store,
        f"""
SELECT pg, any(fam) AS op_kind, max(members) AS size, count() AS calls, sum(bus_bytes) AS total_bytes,
       sum(xfer_ns) AS total_xfer_ns, total_bytes / (total_xfer_ns / 1e9) AS bytes_per_s,
       quantileExact(0.5)(bw_Bps) AS median_bps
FROM ({_transfers(job_id, attempt, step_from, step_to)})
GROUP BY pg
ORDER BY bytes_per_s ASC, pg
LIMIT {int(limit)}
""",
    )


def rank_bandwidth(store: Store, job_id: str, attempt: int, step_from: int, step_to: int) -> pd.DataFrame:
    """Per rank: the bus bytes and transfer time (after the last arrival) of the collectives it was in."""
    return frame(
        store,
        f"""
SELECT rank, sum(bus_bytes) AS total_bytes, sum(xfer_ns) AS total_xfer_ns, count() AS calls
FROM (SELECT rank, pg, seq FROM collectives WHERE {steps_where(job_id, attempt, step_from, step_to)}) AS lhs
ALL INNER JOIN
(
    SELECT pg, seq, bus_bytes, xfer_ns FROM ({_transfers(job_id, attempt, step_from, step_to)})
) AS rhs
USING (pg, seq)
GROUP BY rank
ORDER BY rank
LIMIT {ROW_LIMIT}
""",
    )
