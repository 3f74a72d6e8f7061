"""Heat maps: rank (or node, or rank bucket) x step of step time, per-phase time, compute, blame and wait.

MegaScale's straggler view: one hot row is a straggler, one hot column a slow step. Large jobs are
aggregated in the store (``max`` by default, so a straggler stays visible in its node's row).
"""

from __future__ import annotations

import numpy as np
import streamlit as st

from ranklens.dashboards import charts, ui
from ranklens.dashboards import queries as q

MAX_STEPS = 400

METRIC_LABELS = {
    "step_time": "step time",
    "phase_time": "time in one phase",
    "compute": "compute: step time minus time in collectives (the straggler metric)",
    "blame": "blame: time the others waited for this rank",
    "wait": "wait: time this rank waited for others",
}

st.title("Heat maps")
ctx = ui.context()
b = ctx.bounds
metric_qp = ui.qp_str("metric", "step_time")
metrics = list(q.HEAT_METRICS)
c1, c2, c3, c4 = st.columns(4)
metric = c1.selectbox(
    "metric",
    metrics,
    index=metrics.index(metric_qp) if metric_qp in metrics else 0,
    format_func=lambda m: METRIC_LABELS[m],
    key=f"heat_metric_{metric_qp}",
)
phase = ""
if metric == "phase_time":
    names = [str(x) for x in ctx.query("phase_names")["phase"]] or ["forward"]
    phase = c1.selectbox("phase", names, index=names.index("backward") if "backward" in names else 0)
lo, hi = ui.step_window(ctx, 200, MAX_STEPS, "heat")
n_steps = hi - lo + 1
auto_axis, auto_bucket = q.choose_heat_axis(b.ranks, b.hosts, n_steps)
axes = list(q.HEAT_AXES)
axis = c2.selectbox(
    "rows",
    axes,
    index=axes.index(ui.qp_str("axis", auto_axis)) if ui.qp_str("axis", auto_axis) in axes else 0,
    format_func=lambda a: {"rank": "ranks", "node": "nodes", "bucket": "rank buckets"}[a],
)
if axis == "rank" and b.ranks * n_steps > q.MAX_CELLS:
    st.warning(f"{b.ranks:,} ranks x {n_steps} steps is too many cells for a browser: showing {auto_axis}s instead")
    axis = auto_axis if auto_axis != "rank" else "bucket"
bucket = auto_bucket if axis == "bucket" else 1
if axis == "bucket":
    bucket = int(c2.number_input("ranks per bucket", min_value=1, value=max(auto_bucket, 2 if b.ranks > 1 else 1)))
agg = c3.selectbox("aggregate rows by", ["max", "avg"], disabled=axis == "rank")
sort_by = c4.selectbox("sort rows by", ["rank / name", "topology (node, local rank)", "pp, tp, dp", "hottest first"])

df = ctx.query("heatmap", metric, lo, hi, axis=axis, rank_bucket=bucket, phase=phase, agg=agg, t0_ns=b.first_ns)
if len(df) > q.MAX_CELLS:
    st.warning("too many cells: narrow the step window or use larger buckets (showing the first part)")
    df = df.head(q.MAX_CELLS)

info = ctx.query("rank_info")
highlight = set(ui.qp_ints("highlight"))
if axis == "rank":
    rows = sorted(set(int(r) for r in df["row_key"]))
    if sort_by.startswith("topology") and not info.empty:
        order = info.sort_values(["node", "node_rank", "rank"])["rank"].astype(int).tolist()
        rows = [r for r in order if r in set(rows)] + [r for r in rows if r not in set(order)]
    elif sort_by.startswith("pp") and not info.empty:
        order = info.sort_values(["pp_coord", "tp_coord", "dp_coord", "rank"])["rank"].astype(int).tolist()
        rows = [r for r in order if r in set(rows)] + [r for r in rows if r not in set(order)]
    label = ui.rank_labeler(info)
    labels_of = {r: label(r) for r in rows}
    hl_keys = highlight
elif axis == "node":
    rows = sorted(set(df["row_key"]), key=str)
    nodes_of = dict(zip(info["rank"].astype(int), info["node"])) if not info.empty else {}
    hl_keys = {nodes_of[r] for r in highlight if r in nodes_of}
    labels_of = {r: str(r) for r in rows}
else:
    rows = sorted(set(int(r) for r in df["row_key"]))
    hl_keys = {(r // bucket) * bucket for r in highlight}
    labels_of = {r: f"ranks {r}-{r + bucket - 1}" for r in rows}
z, rows, steps = charts.pivot_heat(df, rows)
if sort_by == "hottest first" and z.size:
    seen = (~np.isnan(z)).sum(axis=1)
    order = np.argsort(-(np.nan_to_num(z).sum(axis=1) / np.maximum(seen, 1)), kind="stable")
    z, rows = z[order], [rows[i] for i in order]
hl_rows = [i for i, r in enumerate(rows) if r in hl_keys]
what = METRIC_LABELS[str(metric)] + (f" ({phase})" if phase else "")
agg_note = "" if axis == "rank" else f", {agg} over the ranks of each row"
st.plotly_chart(
    charts.heatmap_chart(
        z,
        [labels_of[r] for r in rows],
        steps,
        title=f"{what}, ms per step{agg_note}",
        highlight_rows=hl_rows,
    ),
    key="heat",
)
st.caption(f"{len(rows):,} rows x {len(steps):,} steps = {z.size:,} cells (limit {q.MAX_CELLS:,}).")
