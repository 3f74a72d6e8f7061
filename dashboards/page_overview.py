"""Jobs overview: jobs and attempts, their health, the step-time trend and open findings by impact."""

from __future__ import annotations

import streamlit as st

from ranklens.dashboards import charts, ui
from ranklens.dashboards import queries as q

st.title("Jobs overview")
jobs = q.cached("list_jobs", ui.store_url())
if jobs.empty:
    st.info("No jobs in this store yet. Run `ranklens demo`, or trace a job and run `ranklens collect`.")
    st.stop()

table = jobs.assign(
    started=[ui.fmt_ns(x) for x in jobs["first_ns"]],
    last_activity=[ui.fmt_ns(x) for x in jobs["last_ns"]],
    median_step_ms=(jobs["median_step_s"] * 1e3).round(1),
    open_impact_s=jobs["open_impact_s"].round(2),
)
st.dataframe(
    table[
        [
            "job_id",
            "attempt",
            "health",
            "ranks",
            "last_step",
            "median_step_ms",
            "open_findings",
            "open_critical",
            "open_impact_s",
            "started",
            "last_activity",
        ]
    ],
    hide_index=True,
)

ctx = ui.context()
b = ctx.bounds
st.subheader(f"{ctx.job_id} · attempt {ctx.attempt}")
row = jobs[(jobs["job_id"] == ctx.job_id) & (jobs["attempt"] == ctx.attempt)]
found = ctx.query("findings")
open_f = found[found["state"] == "open"] if not found.empty else found
c = st.columns(5)
c[0].metric("ranks", f"{b.ranks:,}")
c[1].metric("nodes", f"{b.hosts:,}")
c[2].metric("steps", f"{b.first_step}-{b.last_step}" if b.steps else "none marked")
median = float(row["median_step_s"].iloc[0]) if not row.empty else float("nan")
c[3].metric("median step", f"{median * 1e3:.1f} ms" if median == median else "—")
c[4].metric("open findings", f"{len(open_f)}", help="health: " + (str(row["health"].iloc[0]) if not row.empty else ""))

if not b.steps:
    # no step markers (an unmodified script): draw what the arrival ledger alone says
    blame = ctx.query("ledger_blame")
    basis = str(blame["basis"].iloc[0]) if not blame.empty else "windows"
    st.info(
        "This job has no step markers: its iterations are counted from the collectives' repeating pattern "
        f"({basis}), and the analysis works from the arrival ledger alone (who arrived last, how long the others "
        "waited). Phases are unknown; mark steps with `rlt.step` for step times and phases."
    )
    if not blame.empty:
        wide = blame.pivot_table(index="window", columns="rank", values="delay_s", aggfunc="sum").fillna(0.0)
        wide.columns = [f"rank {c}" for c in wide.columns]
        st.caption(f"Seconds the other ranks waited for each rank, per {basis[:-1] if basis.endswith('s') else basis}")
        st.line_chart(wide)
trend = ctx.query("step_trend")
onsets = {int(s): f"{k} onset" for s, k in zip(found["first_seen_step"], found["kind"]) if int(s) >= 0}
st.plotly_chart(charts.step_trend_chart(trend, onsets), key="trend")
st.plotly_chart(charts.findings_impact_chart(open_f), key="impact")
for fid, title, sev in list(zip(open_f["id"], open_f["title"], open_f["severity"]))[:10]:
    ui.link("findings", f"[{str(sev).upper()}] {title}", ctx, finding=fid)
