"""GPU and logs: GPU health series and events of the job's nodes, and classified log lines, on the
same time axis (the job's time window, or the one a timeline or finding link passed)."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from ranklens.dashboards import charts, ui
from ranklens.dashboards import queries as q

CONTEXT_SHOWN = 20  # log lines whose context lines are shown in full

st.title("GPU and logs")
ctx = ui.context()
b = ctx.bounds
first = b.first_ns or ui.now_ns() - 3600 * 10**9
last = b.last_ns or ui.now_ns()
pad = max((last - first) // 20, 10**9)
t_from = ui.qp_int("t_from", first - pad)
t_to = ui.qp_int("t_to", last + pad)
if t_to <= t_from:
    t_to = t_from + 10**9
st.caption(f"time window: {ui.fmt_ns(t_from)} - {ui.fmt_ns(t_to)}")

found = ctx.query("findings")
marks = {
    int(ns): f"{k} onset"
    for ns, k, s in zip(found["first_seen_ns"], found["kind"], found["state"])
    if s == "open" and int(ns) > 0
}

st.subheader("GPU health")
metric = st.selectbox("metric", list(q.GPU_METRICS), format_func=lambda m: q.GPU_METRICS[m][0])
series = ctx.query("gpu_series", t_from, t_to, metric)
events = ctx.query("gpu_events", t_from, t_to)
if not series.empty and series["series"].str.startswith("fleet ").any():
    st.caption(f"many GPUs: the fleet's 10th-90th percentiles and the {q.MAX_SERIES} worst GPUs")
st.plotly_chart(
    charts.gpu_chart(series, events, metric_label=q.GPU_METRICS[metric][0], x_range=(t_from, t_to), marks=marks),
    key="gpu",
)
if not events.empty:
    st.dataframe(events.assign(time=[ui.fmt_ns(t) for t in events["ts_ns"]]).drop(columns=["ts_ns"]), hide_index=True)

st.subheader("Log events")
classes = ctx.query("log_classes")
c1, c2, c3, c4 = st.columns(4)
klasses = c1.multiselect("class", sorted(set(classes["klass"])))
sevs = c2.multiselect("severity", sorted(set(classes["severity"])))
ranks_text = c3.text_input("ranks (comma-separated)", value=ui.qp_str("ranks"), key=f"log_ranks_{ui.qp_str('ranks')}")
text = c4.text_input("message contains")
ranks_list, not_ranks = [], []
for part in filter(None, ranks_text.replace(" ", "").split(",")):
    # int(), not str.isdigit(): "²".isdigit() is True and int("²") raises (issue 22 #10)
    try:
        ranks_list.append(int(part))
    except ValueError:
        not_ranks.append(part)
ranks = tuple(ranks_list)
if not_ranks:
    st.caption(f"ignored (not rank numbers): {', '.join(map(repr, not_ranks))}")
logs = ctx.query(
    "log_events", t_from, t_to, klasses=tuple(klasses), severities=tuple(sevs), ranks=ranks, text=text.strip()
)
st.plotly_chart(charts.log_events_chart(logs, x_range=(t_from, t_to), marks=marks), key="logs")
if logs.empty:
    st.caption("no classified log lines match (the collector keeps only lines its rules classify)")
else:
    st.dataframe(
        pd.DataFrame(
            {
                "time": [ui.fmt_ns(t) for t in logs["ts_ns"]],
                "host": logs["host"],
                "rank": logs["rank"],
                "class": logs["klass"],
                "severity": logs["severity"],
                "repeats": logs["repeat_count"],
                "message": logs["message"],
            }
        ),
        hide_index=True,
    )
    with st.expander("context lines"):
        for ts, host, rank, klass, message, context in list(
            zip(logs["ts_ns"], logs["host"], logs["rank"], logs["klass"], logs["message"], logs["context"])
        )[:CONTEXT_SHOWN]:
            st.markdown(f"**{ui.fmt_ns(int(ts))} · {host} rank {rank} · {klass}**")
            st.code("\n".join([*list(context), str(message)]), language="text")
