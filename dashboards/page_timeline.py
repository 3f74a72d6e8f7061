"""Timeline: a Gantt view of phases and collectives per rank over a step window.

Waits for the last arriver are shaded; one collective ``(pg, seq)`` can be linked across ranks.
At scale it shows the ranks that made the others wait longest in the window (plus any asked for),
never every rank.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from ranklens.dashboards import charts, ui

ALL_RANKS_MAX = 32  # jobs up to this size show every rank
MAX_STEPS = 10  # widest step window drawn in detail
MAX_ROWS = 48

st.title("Timeline")
ctx = ui.context()
b = ctx.bounds
info = ctx.query("rank_info")
label = ui.rank_labeler(info)
found = ctx.query("findings")
suspects = sorted({int(r) for rs, s in zip(found["suspect_ranks"], found["state"]) if s == "open" for r in rs})

lo, hi = ui.step_window(ctx, 3, MAX_STEPS, "timeline")
asked = ui.qp_ints("ranks")
typed = st.text_input(
    "ranks to show (comma-separated)" + ("" if b.ranks <= ALL_RANKS_MAX else ", added to the worst ones"),
    value=",".join(map(str, asked)),
    key=f"timeline_ranks_{ui.qp_str('ranks')}",
)
chosen = tuple(int(x) for x in typed.replace(" ", "").split(",") if x.lstrip("-").isdigit())
if b.ranks <= ALL_RANKS_MAX:
    ranks = tuple(int(r) for r in info["rank"]) or tuple(range(b.ranks))
    worst = ctx.query("worst_ranks", lo, hi, 3, b.first_ns)
else:
    k = st.slider("worst ranks to show (most waited-for in the window)", 2, 32, 8)
    worst = ctx.query("worst_ranks", lo, hi, k, b.first_ns)
    ranks = tuple(dict.fromkeys([*chosen, *(int(r) for r in worst["culprit"])]))[:MAX_ROWS]
    st.caption(
        f"{b.ranks:,} ranks: showing {len(ranks)} (the {k} that made the others wait longest in steps "
        f"{lo}-{hi}, plus those typed above); the heat maps show every rank aggregated."
    )

phases = ctx.query("timeline_phases", lo, hi, ranks)
colls = ctx.query("timeline_collectives", lo, hi, ranks)

highlight = None
if not colls.empty:
    g = colls.groupby(["pg", "seq"], sort=False).agg(
        op=("op", "first"),
        first_enter=("enter_ns", "min"),
        last_enter=("last_enter_ns", "first"),
        last_rank=("last_rank", "first"),
        members=("members", "first"),
    )
    g["skew_ms"] = (g["last_enter"] - g["first_enter"]).astype("float64") / 1e6
    g = g.sort_values("skew_ms", ascending=False).head(50).reset_index()
    options = [(str(pg), int(seq)) for pg, seq in zip(g["pg"], g["seq"])]
    skews = {
        (str(pg), int(seq)): (op, ms, lr)
        for pg, seq, op, ms, lr in zip(g["pg"], g["seq"], g["op"], g["skew_ms"], g["last_rank"])
    }
    highlight = st.selectbox(
        "link one collective across ranks (most skewed arrivals first)",
        options,
        format_func=lambda o: (
            f"pg {o[0]} #{o[1]} {skews[o][0]}: arrivals spread {skews[o][1]:.1f} ms, last rank {skews[o][2]}"
        ),
    )

title = f"Steps {lo}-{hi}: phases (upper bar) and collectives (lower bar; red = waiting for the last arriver)"
st.plotly_chart(
    charts.gantt_chart(phases, colls, label, highlight=highlight, culprits=suspects, title=title), key="gantt"
)

if not worst.empty:
    st.markdown("**Who made the others wait in this window**")
    st.dataframe(
        pd.DataFrame(
            {
                "rank": [label(int(r)) for r in worst["culprit"]],
                "others waited (s, mean per collective, summed)": worst["caused_s"].round(4),
                "times last to arrive": worst["times_last"],
            }
        ),
        hide_index=True,
    )
if not phases.empty:
    t0 = int(min(phases["start_ns"].min(), colls["enter_ns"].min() if not colls.empty else phases["start_ns"].min()))
    t1 = int(max(phases["end_ns"].max(), colls["end_ns"].max() if not colls.empty else phases["end_ns"].max()))
    ui.link("gpu_logs", "GPU and logs in this time window", ctx, t_from=t0, t_to=t1, ranks=list(ranks)[:16])
