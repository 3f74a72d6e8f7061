"""Findings: evidence, impact, onset and resolution, recovery actions, links into the other views."""

from __future__ import annotations

import streamlit as st

from ranklens.dashboards import charts, ui
from ranklens.dashboards import queries as q

st.title("Findings")
ctx = ui.context()
found = ctx.query("findings")
if found.empty:
    st.success(f"No findings for {ctx.job_id} attempt {ctx.attempt}: nothing is slowing or hanging it.")
    st.stop()

states = st.multiselect("state", ["open", "resolved"], default=["open", "resolved"])
shown = found[found["state"].isin(states)] if states else found
st.dataframe(
    shown.assign(
        suspects=[
            ", ".join(str(x) for x in r if int(x) >= 0) or ", ".join(h)
            for r, h in zip(shown["suspect_ranks"], shown["suspect_hosts"])
        ],
        impact_s=shown["impact_s"].round(3),
        impact_gpu_s=shown["impact_gpu_s"].round(3),
        step_time_pct=shown["step_time_pct"].round(1),
    )[
        [
            "severity",
            "kind",
            "title",
            "state",
            "impact_s",
            "impact_gpu_s",
            "step_time_pct",
            "confidence",
            "suspects",
            "id",
        ]
    ],
    hide_index=True,
)
ids = list(shown["id"]) or list(found["id"])
wanted = ui.qp_str("finding")
titles = dict(zip(found["id"], found["title"]))
fid = st.selectbox(
    "finding",
    ids,
    index=ids.index(wanted) if wanted in ids else 0,
    format_func=lambda i: f"{titles.get(i, '')} [{i}]",
    key=f"finding_{wanted}",
)
f = found[found["id"] == fid].iloc[0]
ev = f["evidence"] if isinstance(f["evidence"], dict) else {}

st.subheader(f"[{str(f['severity']).upper()}] {f['title']}")
c = st.columns(5)
c[0].metric("job time lost", f"{float(f['impact_s']):.2f} s")
c[1].metric("GPU time lost", f"{float(f['impact_gpu_s']):.2f} GPU-s")
c[2].metric("share of step time", f"{float(f['step_time_pct']):.1f} %")
c[3].metric("confidence", f"{float(f['confidence']):.2f}")
c[4].metric("state", str(f["state"]))
suspects = [int(r) for r in f["suspect_ranks"] if int(r) >= 0]
hosts = list(f["suspect_hosts"])
if not suspects and ev.get("ranks"):  # a finding about a node: its ranks are the evidence
    suspects = [int(r) for r in ev["ranks"]]
    who = f"node {', '.join(hosts)} (ranks {', '.join(map(str, suspects))})"
else:
    who = f"ranks {', '.join(map(str, suspects)) or '—'}" + (f" on {', '.join(hosts)}" if hosts else "")
st.markdown(
    f"**Suspects:** {who}"
    + (f" · GPUs {', '.join(f['suspect_gpus'])}" if len(f["suspect_gpus"]) else "")
    + (f" · links {', '.join(f['suspect_links'])}" if len(f["suspect_links"]) else "")
    + f"  \n**Seen:** steps {int(f['first_seen_step'])}-{int(f['last_seen_step'])}"
    + f" ({ui.fmt_ns(int(f['first_seen_ns']))} - {ui.fmt_ns(int(f['last_seen_ns']))}) · detector `{f['detector']}`"
)

st.markdown("**Look closer**")
onset = max(int(f["first_seen_step"]), ctx.bounds.first_step)
lc = st.columns(5)
with lc[0]:
    ui.link(
        "timeline",
        "Timeline at the onset",
        ctx,
        ranks=suspects,
        step_from=max(ctx.bounds.first_step, onset - 1),
        step_to=onset + 1,
    )
with lc[1]:
    ui.link("heatmaps", "Blame heat map", ctx, metric="blame", highlight=suspects)
with lc[2]:
    ui.link("links", "Links", ctx)
with lc[3]:
    ui.link("hangs", "Hang view", ctx, pg=ev.get("pg", ""))
with lc[4]:
    ui.link("gpu_logs", "GPU and logs", ctx, t_from=int(f["first_seen_ns"]), ranks=suspects)

st.plotly_chart(
    charts.finding_onset_chart(
        ev.get("per_step", []), int(f["first_seen_step"]), int(f["last_seen_step"]), str(f["state"])
    ),
    key="onset",
)

left, right = st.columns(2)
with left:
    history = q.cached("finding_history", ctx.store_url, fid)
    st.plotly_chart(charts.finding_history_chart(history), key="history")
with right:
    st.markdown("**Recovery actions**")
    actions = q.cached("finding_actions", ctx.store_url, fid)
    if actions.empty:
        st.caption("no recovery action recorded for this finding (the `actions` table)")
    else:
        st.dataframe(
            actions.assign(time=[ui.fmt_ns(t) for t in actions["ts_ns"]]).drop(columns=["ts_ns"]), hide_index=True
        )

st.markdown("**Evidence**")
st.json({k: v for k, v in ev.items() if k not in ("sql", "per_step")}, expanded=False)
if ev.get("sql"):
    st.markdown("The query that reproduces it (`ranklens sql`):")
    st.code(str(ev["sql"]), language="sql")

recoveries = q.cached("job_recoveries", ctx.store_url, ctx.job_id)
if not recoveries.empty:
    st.markdown(
        "**Recovery** (remediations carried out: fault onset to detection, MTTD, and to training resumed, MTTR)"
    )
    resumed = recoveries[recoveries["mttr_s"].notna()]
    rc = st.columns(5)
    rc[0].metric("remediations", len(recoveries))
    rc[1].metric("resumed training", len(resumed))
    mttd = recoveries["mttd_s"].dropna()
    rc[2].metric("mean MTTD", f"{float(mttd.mean()):.1f} s" if len(mttd) else "—")
    rc[3].metric("mean MTTR", f"{float(resumed['mttr_s'].mean()):.1f} s" if len(resumed) else "—")
    rc[4].metric(
        "GPU time lost to recovery", f"{float(resumed['lost_gpu_s'].sum()):.0f} GPU-s" if len(resumed) else "—"
    )
    st.dataframe(
        recoveries.assign(decided=[ui.fmt_ns(int(t)) for t in recoveries["decided_ns"]]).drop(columns=["decided_ns"]),
        hide_index=True,
    )
