"""Links: effective bandwidth per pair, per process group and per rank in a step window.

Every number is the links analyzer's transfer metric (:func:`ranklens.analyzers.links.transfer_sql`):
bus bytes (:data:`~ranklens.analyzers.links.BUS_FACTORS`) over the transfer time after the group's
last arrival, per completed ``(pg, seq)``; the pages only sum it per pair, group or rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from ranklens.analyzers.links import transfer_sql
from ranklens.dashboards.queries._sql import ROW_LIMIT, frame, steps_where
from ranklens.store.api import Store, sql_string

__all__ = ["LINK_MIN_BYTES", "LinkBandwidth", "group_bandwidth", "link_bandwidth", "pair_bandwidth", "rank_bandwidth"]

# The pages show every collective that moved data (a small job's 4-byte all-reduces included);
# the analyzer's findings leave out those under links.DEFAULT_MIN_BYTES (latency bound).
LINK_MIN_BYTES = 1


def _transfers(job_id: str, attempt: int, step_from: int, step_to: int) -> str:
    return transfer_sql(job_id, attempt, min_bytes=LINK_MIN_BYTES, step_from=step_from, step_to=step_to)


@dataclass(frozen=True)
class LinkBandwidth:
    """The links page's three tables, from one pass over the transfers (:func:`link_bandwidth`)."""

    pairs: pd.DataFrame
    groups: pd.DataFrame
    per_rank: pd.DataFrame


def link_bandwidth(
    store: Store, job_id: str, attempt: int, step_from: int, step_to: int, group_limit: int = 200
) -> LinkBandwidth:
    """Effective bandwidth per pair, per process group and per rank in a step window, from ONE scan
    of the transfers (rolled up per group and member set in the store, ~one row per group) and one
    of the groups' members in the window; the three tables are sums of that rollup.

    ``pairs``: two-member collectives and p2p pairs (both directions together) per (lower rank,
    higher rank): bytes, transfer time after the last arrival, calls. ``groups``: per process group
    (a p2p pair per direction), slowest first: bus bytes over transfer time, and the median of its
    collectives (``median_bps``). ``per_rank``: the bus bytes and transfer time of the collectives
    of the groups the rank was a member of in the window.
    """
    transfers = _transfers(job_id, attempt, step_from, step_to)
    roll = frame(
        store,
        f"""
SELECT pg, members, a_rank, b_rank, any(fam) AS op_kind, count() AS calls, sum(bus_bytes) AS total_bytes,
       sum(xfer_ns) AS total_xfer_ns, quantileExact(0.5)(bw_Bps) AS median_bps
FROM ({transfers})
GROUP BY pg, members, a_rank, b_rank
ORDER BY pg, members, a_rank, b_rank
LIMIT {ROW_LIMIT}
""",
    )
    sums = ["total_bytes", "total_xfer_ns", "calls"]
    two = roll[roll["members"] == 2]
    pairs = two.groupby(["a_rank", "b_rank"], as_index=False)[sums].sum()[["a_rank", "b_rank", *sums]]
    pairs = pairs.sort_values(["calls", "a_rank", "b_rank"], ascending=[False, True, True], kind="stable")
    groups = roll.groupby("pg", as_index=False, sort=True).agg(
        op_kind=("op_kind", "first"),
        size=("members", "max"),
        calls=("calls", "sum"),
        total_bytes=("total_bytes", "sum"),
        total_xfer_ns=("total_xfer_ns", "sum"),
        median_bps=("median_bps", "first"),
        parts=("calls", "size"),
    )
    split = groups.loc[groups["parts"] > 1, "pg"].tolist()
    if split:  # a group whose member set changed: its median over all its collectives (rare)
        exact = frame(
            store,
            f"SELECT pg, quantileExact(0.5)(bw_Bps) AS m FROM ({transfers}) "
            f"WHERE pg IN ({', '.join(sql_string(str(p)) for p in split)}) GROUP BY pg",
        )
        groups["median_bps"] = groups["pg"].map(dict(zip(exact["pg"], exact["m"]))).fillna(groups["median_bps"])
    groups["bytes_per_s"] = groups["total_bytes"] / (groups["total_xfer_ns"] / 1e9)
    groups = groups.sort_values(["bytes_per_s", "pg"], kind="stable").head(int(group_limit))
    groups = groups[["pg", "op_kind", "size", "calls", "total_bytes", "total_xfer_ns", "bytes_per_s", "median_bps"]]
    members = frame(
        store,
        f"SELECT pg, groupUniqArray(rank) AS ranks FROM collectives "
        f"WHERE {steps_where(job_id, attempt, step_from, step_to)} GROUP BY pg LIMIT {ROW_LIMIT}",
    ).explode("ranks")
    per_pg = roll.groupby("pg", as_index=False)[sums].sum()
    per_rank = (
        members.rename(columns={"ranks": "rank"})
        .merge(per_pg, on="pg", how="inner")
        .astype({"rank": "int64"})
        .groupby("rank", as_index=False, sort=True)[sums]
        .sum()
        .head(ROW_LIMIT)
    )
    return LinkBandwidth(pairs.reset_index(drop=True), groups.reset_index(drop=True), per_rank)


def pair_bandwidth(store: Store, job_id: str, attempt: int, step_from: int, step_to: int) -> pd.DataFrame:
    """:attr:`LinkBandwidth.pairs` (:func:`link_bandwidth`)."""
    return link_bandwidth(store, job_id, attempt, step_from, step_to).pairs


def group_bandwidth(
    store: Store, job_id: str, attempt: int, step_from: int, step_to: int, limit: int = 200
) -> pd.DataFrame:
    """:attr:`LinkBandwidth.groups` (:func:`link_bandwidth`), the ``limit`` slowest."""
    return link_bandwidth(store, job_id, attempt, step_from, step_to, limit).groups


def rank_bandwidth(store: Store, job_id: str, attempt: int, step_from: int, step_to: int) -> pd.DataFrame:
    """:attr:`LinkBandwidth.per_rank` (:func:`link_bandwidth`)."""
    return link_bandwidth(store, job_id, attempt, step_from, step_to).per_rank
