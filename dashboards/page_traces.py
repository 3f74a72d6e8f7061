"""GPU traces: the CUDA timing view of the job's profiler windows (Kineto traces): HTA's breakdowns
for every traced rank side by side, and one rank's GPU timeline (streams, kernels, communication)
of one profiler step. The same numbers as ``ranklens analyze --traces``."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from ranklens.dashboards import charts, ui

st.title("GPU traces")
ctx = ui.context()
breakdown = ctx.query("trace_breakdown")
if breakdown.empty:
    st.info(
        "No profiler traces for this job. Profile a window with `rlt.init(profile_every=500)` or "
        "`touch <spool>/<job>/<attempt>/profile-now`, or load traces with `ranklens ingest TRACE_DIR --format kineto`."
    )
    st.stop()

c = st.columns(4)
c[0].metric("traced ranks", f"{len(breakdown):,}")
c[1].metric("GPU idle (median rank)", f"{breakdown['idle_time_pctg'].median():.1f} %")
c[2].metric("compute (median rank)", f"{breakdown['compute_time_pctg'].median():.1f} %")
c[3].metric("comm/comp overlap (median rank)", f"{breakdown['comp_comm_overlap_pctg'].median():.1f} %")
st.caption(
    "Holistic Trace Analysis' definitions: % of each rank's window from its first kernel to its last, "
    "every profiler step but the last (docs/traces.md)."
)
st.dataframe(
    pd.DataFrame(
        {
            "rank": breakdown["rank"],
            "window ms": breakdown["kernel_time_us"] / 1000,
            "idle %": breakdown["idle_time_pctg"],
            "compute %": breakdown["compute_time_pctg"],
            "non-compute %": breakdown["non_compute_time_pctg"],
            "comm/comp overlap %": breakdown["comp_comm_overlap_pctg"],
        }
    ),
    hide_index=True,
)

steps = ctx.query("trace_steps")
ranks = [int(r) for r in breakdown["rank"]]
left, right = st.columns(2)
wanted = ui.qp_int("rank", ranks[0])  # ?rank=R preselects a rank
rank = left.selectbox("rank", ranks, index=ranks.index(wanted) if wanted in ranks else 0)
mine = steps[steps["rank"] == rank] if not steps.empty else steps
if mine.empty:  # no ProfilerStep markers: the whole window
    start_ns, end_ns, label = int(ctx.bounds.first_ns), int(ctx.bounds.last_ns) + 1, "the whole trace"
else:
    numbers = [int(s) for s in mine["step"]]
    step = right.selectbox("profiler step", numbers, index=0)
    row = mine[mine["step"] == step].iloc[0]
    start_ns, end_ns, label = int(row["start_ns"]), int(row["end_ns"]), f"profiler step {step}"
kernels = ctx.query("trace_timeline", rank, start_ns, end_ns)
st.plotly_chart(charts.trace_timeline_chart(kernels, f"rank {rank}, {label}: GPU events by stream"), key="timeline")

types = ctx.query("trace_kernel_types")
if not types.empty:
    st.subheader("Kernel types (all ranks, time while exactly these run)")
    st.dataframe(types.rename(columns={"sum_us": "µs", "percentage": "%"}), hide_index=True)
top = ctx.query("trace_top_kernels")
if not top.empty:
    st.subheader(f"Top kernels of rank {rank}")
    t = top[top["rank"] == rank]
    st.dataframe(
        t[["kernel_type", "name", "count", "sum_us", "mean_us", "max_us"]].sort_values("sum_us", ascending=False),
        hide_index=True,
    )
found = ctx.query("findings")
if not found.empty:
    for fid, title, sev, kind in zip(found["id"], found["title"], found["severity"], found["kind"]):
        if kind in ("trace_idle", "kernel_straggler", "exposed_communication"):
            ui.link("findings", f"[{str(sev).upper()}] {title}", ctx, finding=fid)
