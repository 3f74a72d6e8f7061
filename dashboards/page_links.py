"""Links: effective bandwidth between ranks or nodes, per rank/node and per process group.

Effective bandwidth of a collective = bus bytes / (completion - the group's last arrival), the links
analyzer's metric (:func:`ranklens.analyzers.links.transfer_sql`, bus bytes per nccl-tests): the time
spent moving data once everybody was there, so a straggler's compute does not count as a slow link.
The pair matrix comes from two-member collectives and p2p transfers; larger groups show per group
and per node.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
import streamlit as st

from ranklens.dashboards import charts, ui

RANK_MATRIX_MAX = 64  # jobs up to this many ranks get a rank x rank matrix; larger ones node x node
MATRIX_MAX = 64  # at most this many rows/columns in the matrix (the slowest ones)

st.title("Links")
ctx = ui.context()
b = ctx.bounds
lo, hi = ui.step_window(ctx, 20, 2000, "links")
info = ctx.query("rank_info")
nodes_of = dict(zip(info["rank"].astype(int), info["node"])) if not info.empty else {}
by_rank = b.ranks <= RANK_MATRIX_MAX and st.radio("granularity", ["ranks", "nodes"], horizontal=True) == "ranks"

bw = ctx.query("link_bandwidth", lo, hi)  # pairs, groups and ranks from one pass over the transfers
per_rank = bw.per_rank
key_of: Callable[[int], Any]
label: Callable[[Any], str]
if by_rank:
    key_of, label = int, ui.rank_labeler(info)
else:
    key_of, label = (lambda r: str(nodes_of.get(int(r), "?"))), str
per_key = per_rank.assign(key=[key_of(int(r)) for r in per_rank["rank"]])
agg = per_key.groupby("key", sort=True)[["total_bytes", "total_xfer_ns"]].sum()
agg = agg[agg["total_xfer_ns"] > 0]
bps = (agg["total_bytes"] / (agg["total_xfer_ns"] / 1e9)).sort_values()
unit = "rank" if by_rank else "node"
shown = list(bps.index[:MATRIX_MAX])
if len(bps) > MATRIX_MAX:
    st.caption(f"{len(bps):,} {unit}s: showing the {MATRIX_MAX} with the lowest effective bandwidth")

pairs = bw.pairs
keys = sorted(shown) if shown else None
m, keys_out = charts.bandwidth_matrix(pairs, key_of, keys)
st.plotly_chart(
    charts.bandwidth_matrix_chart(m, [label(k) for k in keys_out], f"{unit} x {unit} effective bandwidth (MB/s)"),
    key="matrix",
)
order = sorted(shown)
st.plotly_chart(
    charts.rank_bandwidth_chart(
        [label(k) for k in order],
        [float(bps[k]) for k in order],
        f"Effective bandwidth per {unit} (bus bytes / transfer time after the last arrival, MB/s)",
    ),
    key="per_key",
)
groups = bw.groups
gn = ctx.query("group_names")
names = dict(zip(gn["pg"], gn["pg_desc"]))
st.plotly_chart(charts.group_bandwidth_chart(groups.head(30), names), key="groups")
if not groups.empty:
    st.dataframe(
        pd.DataFrame(
            {
                "pg": groups["pg"],
                "name": [names.get(pg, "") for pg in groups["pg"]],
                "members": groups["size"],
                "calls": groups["calls"],
                "MB/s": np.round(groups["bytes_per_s"] / 1e6, 3),
            }
        ),
        hide_index=True,
    )
