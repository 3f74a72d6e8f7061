"""Hangs: per process group, who entered its newest collective, who did not, who completed it;
and what the missing ranks were last doing (from every rank's newest heartbeat)."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from ranklens.dashboards import charts, ui

HANG_KINDS = ("hang", "crash", "desync")

st.title("Hangs")
ctx = ui.context()
now = ui.now_ns()
groups = ctx.query("hang_groups")
ages = ctx.query("heartbeat_ages")
if ages.empty:
    st.info("No heartbeats for this job: its ranks run a ranklens without heartbeats, or have not started.")
    st.stop()

newest = int(ages["hb_ns"].max())
age_s = (now - newest) / 1e9
stuck = groups[groups["completed_n"] < groups["members_n"]] if not groups.empty else groups
c = st.columns(4)
c[0].metric("newest heartbeat", f"{age_s:,.1f} s ago")
c[1].metric("ranks reporting", f"{len(ages):,} / {ctx.bounds.ranks:,}")
c[2].metric("groups not complete at their newest collective", f"{len(stuck):,} / {len(groups):,}")
c[3].metric("ranks missing somewhere", f"{int(stuck['not_entered_n'].sum()) if not stuck.empty else 0:,}")
if age_s > 120:
    st.caption("No rank has sent a heartbeat for a while: the job is not running; this is its last known state.")

found = ctx.query("findings")
hangs = found[found["kind"].isin(HANG_KINDS)] if not found.empty else found
for fid, title, sev in zip(hangs["id"], hangs["title"], hangs["severity"]):
    ui.link("findings", f"[{str(sev).upper()}] {title}", ctx, finding=fid)

pg_first = ui.qp_str("pg")
if pg_first and not groups.empty:
    groups = pd.concat([groups[groups["pg_name"] == pg_first], groups[groups["pg_name"] != pg_first]])
st.plotly_chart(charts.hang_groups_chart(groups.head(60)), key="groups")
if not groups.empty:
    st.dataframe(
        pd.DataFrame(
            {
                "pg": groups["pg_name"],
                "name": groups["pg_desc"],
                "newest seq": groups["frontier"],
                "members": groups["members_n"],
                "entered": groups["entered_n"],
                "completed": groups["completed_n"],
                "not entered": groups["not_entered_n"],
                "not entered (ranks)": [", ".join(map(str, r)) for r in groups["not_entered"]],
                "entered, not completed (ranks)": [", ".join(map(str, r)) for r in groups["in_flight"]],
                "no heartbeat at all": groups["silent_n"],
            }
        ),
        hide_index=True,
    )

missing = sorted({int(r) for rs in stuck["not_entered"] for r in rs})[:64] if not stuck.empty else []
stale = ages[(now - ages["hb_ns"]) > (now - newest) + 5e9]["rank"].astype(int).tolist()[:64]
watch = tuple(sorted(set(missing) | set(stale)))[:64]
st.markdown("**Last known activity of the missing ranks**")
if not watch:
    st.caption("every rank entered its groups' newest collective and no rank's heartbeat lags the others")
else:
    act = ctx.query("rank_last_activity", watch)
    st.dataframe(
        pd.DataFrame(
            {
                "rank": act["rank"],
                "node": act["node"],
                "pid": act["last_pid"],
                "heartbeat age (s)": ((now - act["hb_ns"]) / 1e9).round(1),
                "step": act["last_step"],
                "phase": act["last_phase"],
                "in phase for (s)": [
                    round((now - int(t)) / 1e9, 1) if int(t) > 0 else None for t in act["last_phase_start_ns"]
                ],
                "last progress (s ago)": [
                    round((now - int(t)) / 1e9, 1) if int(t) > 0 else None for t in act["progress_ns"]
                ],
                "in flight": [
                    ", ".join(f"{o} pg {p} #{s}" for p, s, o in zip(pgs, seqs, ops))
                    for pgs, seqs, ops in zip(act["in_flight_pgs"], act["in_flight_seqs"], act["in_flight_ops"])
                ],
            }
        ),
        hide_index=True,
    )
st.plotly_chart(charts.heartbeat_age_chart(ages, now), key="ages")
