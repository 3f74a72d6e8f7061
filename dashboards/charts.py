"""Plotly figures of the dashboards: pure functions of query results (DataFrames in, figures out).

Nothing here queries a store or imports Streamlit, so every figure can be built and checked in a
unit test or timed in the benchmark. Times on time axes are absolute (UTC), so the timeline, the
GPU series and the log events of one window line up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go

__all__ = [
    "PHASE_COLORS",
    "bandwidth_matrix",
    "bandwidth_matrix_chart",
    "empty_figure",
    "finding_history_chart",
    "finding_onset_chart",
    "findings_impact_chart",
    "gantt_chart",
    "gpu_chart",
    "group_bandwidth_chart",
    "hang_groups_chart",
    "heartbeat_age_chart",
    "heatmap_chart",
    "log_events_chart",
    "pivot_heat",
    "rank_bandwidth_chart",
    "step_trend_chart",
    "to_datetime",
    "trace_timeline_chart",
]

PHASE_COLORS = {
    "data": "#9ecae1",
    "forward": "#4292c6",
    "backward": "#08519c",
    "optimizer": "#74c476",
}
_EXTRA_PHASE_COLORS = ("#a1d99b", "#fdd0a2", "#bcbddc", "#d9d9d9")
WAIT_COLOR = "rgba(214, 39, 40, 0.55)"
XFER_COLOR = "#ff7f0e"
SEVERITY_COLORS = {"critical": "#d62728", "warning": "#ff7f0e", "info": "#1f77b4"}
_LAYOUT = {"template": "plotly_white", "margin": {"l": 10, "r": 10, "t": 50, "b": 10}}


def to_datetime(ns: Iterable[int] | pd.Series | np.ndarray) -> pd.DatetimeIndex:
    """Nanoseconds since the epoch as UTC datetimes (what Plotly's date axes take)."""
    return pd.to_datetime(np.asarray(ns, dtype="int64"), unit="ns", utc=True)


def empty_figure(message: str, title: str = "") -> go.Figure:
    """A figure that says there is nothing to draw (instead of an empty plot)."""
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper", font={"size": 14})
    fig.update_layout(title=title, xaxis={"visible": False}, yaxis={"visible": False}, height=220, **_LAYOUT)
    return fig


def _vline(fig: go.Figure, x: Any, text: str, color: str = "#d62728", **kw: Any) -> None:
    fig.add_shape(
        type="line", x0=x, x1=x, y0=0, y1=1, yref="paper", line={"color": color, "dash": "dash", "width": 1.5}, **kw
    )
    fig.add_annotation(x=x, y=1, yref="paper", text=text, showarrow=False, yanchor="bottom", font={"color": color})


# -- jobs and findings ------------------------------------------------------------------------------


def step_trend_chart(trend: pd.DataFrame, onsets: Mapping[int, str] | None = None) -> go.Figure:
    """Step time over the job: median, p90 and max over ranks, with finding onsets marked.

    Args:
        trend: :func:`~ranklens.dashboards.queries.step_trend` (``step, p50_s, p90_s, max_s``).
        onsets: step -> label of a finding that started there.
    """
    if trend.empty:
        return empty_figure("no steps recorded yet", "Step time")
    fig = go.Figure()
    x = trend["step"]
    fig.add_trace(go.Scatter(x=x, y=trend["max_s"] * 1e3, name="slowest rank", line={"color": "#d62728", "width": 1}))
    fig.add_trace(go.Scatter(x=x, y=trend["p90_s"] * 1e3, name="p90", line={"color": "#ff7f0e", "width": 1}))
    fig.add_trace(go.Scatter(x=x, y=trend["p50_s"] * 1e3, name="median", line={"color": "#1f77b4", "width": 2}))
    for step, label in (onsets or {}).items():
        _vline(fig, step, label)
    fig.update_layout(title="Step time (ms)", xaxis_title="step", yaxis_title="ms", height=360, **_LAYOUT)
    return fig


def findings_impact_chart(findings: pd.DataFrame) -> go.Figure:
    """Open findings ranked by the job time they cost (seconds), colored by severity."""
    if findings.empty:
        return empty_figure("no findings for this job", "Findings by impact")
    df = findings.sort_values("impact_s")
    labels = [f"{k}: {_short(t, 60)}" for k, t in zip(df["kind"], df["title"])]
    fig = go.Figure(
        go.Bar(
            x=df["impact_s"],
            y=labels,
            orientation="h",
            marker_color=[SEVERITY_COLORS.get(s, "#7f7f7f") for s in df["severity"]],
            customdata=np.stack([df["state"], df["impact_gpu_s"].round(2)], axis=1),
            hovertemplate="%{y}<br>%{x:.2f} s lost, %{customdata[1]} GPU-s<br>%{customdata[0]}<extra></extra>",
        )
    )
    fig.update_layout(
        title="Findings by impact (seconds of job time lost)",
        xaxis_title="seconds",
        height=max(220, 90 + 36 * len(df)),
        **_LAYOUT,
    )
    return fig


def finding_onset_chart(
    per_step: Sequence[Mapping[str, Any]], onset_step: int, last_step: int, state: str = "open"
) -> go.Figure:
    """A finding's evidence per step: the delay it caused against the step time, onset and end marked."""
    if not per_step:
        return empty_figure("this finding has no per-step evidence", "Onset")
    df = pd.DataFrame(list(per_step))
    fig = go.Figure()
    # the evidence's per-step numbers depend on the detector (delay_s, excess_s, step_time_s, ...):
    # step times as lines, everything else in seconds as bars
    for col in [c for c in df.columns if c != "step" and c.endswith("_s")]:
        values = pd.to_numeric(df[col], errors="coerce") * 1e3
        name = col.removesuffix("_s").replace("_", " ")
        if "step_time" in col:
            fig.add_trace(go.Scatter(x=df["step"], y=values, name=name, line={"color": "#1f77b4"}))
        else:
            fig.add_trace(go.Bar(x=df["step"], y=values, name=name, opacity=0.8))
    _vline(fig, onset_step, f"onset: step {onset_step}")
    if state == "resolved":
        _vline(fig, last_step, f"resolved after step {last_step}", color="#2ca02c")
    fig.update_layout(title="Onset and evolution (ms per step)", xaxis_title="step", height=340, **_LAYOUT)
    return fig


def finding_history_chart(history: pd.DataFrame) -> go.Figure:
    """Every stored version of a finding: impact over time, colored by state."""
    if history.empty:
        return empty_figure("no versions", "History")
    colors = np.where(history["state"] == "open", "#d62728", "#2ca02c")
    fig = go.Figure(
        go.Scatter(
            x=to_datetime(history["updated_ns"]),
            y=history["impact_s"],
            mode="lines+markers",
            marker={"color": colors, "size": 9},
            text=history["state"],
            hovertemplate="%{x}<br>%{y:.2f} s lost<br>%{text}<extra></extra>",
        )
    )
    fig.update_layout(title="Reported versions (impact so far, s)", height=280, **_LAYOUT)
    return fig


# -- timeline -------------------------------------------------------------------------------------


def gantt_chart(
    phases: pd.DataFrame,
    collectives: pd.DataFrame,
    row_label: Callable[[int], str] = lambda r: f"rank {r}",
    *,
    highlight: tuple[str, int] | None = None,
    culprits: Iterable[int] = (),
    title: str = "Timeline",
) -> go.Figure:
    """Gantt view of phases (upper half of each row) and collectives (lower half) per rank.

    A collective is drawn in two parts: the wait for the group's last arriver (shaded red, from
    this rank's arrival to the last arrival) and the rest (from the last arrival to completion).
    ``highlight`` = ``(pg, seq)`` links one collective across ranks: its arrivals are joined by a
    line and the last arrival is marked.

    Args:
        phases: :func:`~ranklens.dashboards.queries.timeline_phases`.
        collectives: :func:`~ranklens.dashboards.queries.timeline_collectives`.
        row_label: the label of a rank's row.
        culprits: ranks to flag in their row label (e.g. a finding's suspects).
    """
    if phases.empty and collectives.empty:
        return empty_figure("no phases or collectives in this window", title)
    flagged = set(int(r) for r in culprits)
    ranks = sorted(set(phases["rank"].astype(int)) | set(collectives["rank"].astype(int)))
    labels = {r: row_label(r) + (" ⚠" if r in flagged else "") for r in ranks}
    fig = go.Figure()
    names = list(dict.fromkeys(phases["phase"])) if not phases.empty else []
    extra = iter(_EXTRA_PHASE_COLORS * 8)
    for name in names:
        p = phases[phases["phase"] == name]
        dur_ms = (p["end_ns"] - p["start_ns"]).astype("float64") / 1e6
        fig.add_trace(
            go.Bar(
                orientation="h",
                y=[labels[int(r)] for r in p["rank"]],
                base=to_datetime(p["start_ns"]),
                x=dur_ms,
                offset=0.02,
                width=0.4,
                name=name,
                marker_color=PHASE_COLORS.get(name) or next(extra),
                customdata=np.stack([p["step"], dur_ms.round(2)], axis=1),
                hovertemplate=f"{name}, step %{{customdata[0]}}: %{{customdata[1]}} ms<extra>%{{y}}</extra>",
            )
        )
    if not collectives.empty:
        c = collectives[collectives["end_ns"] > 0]
        enter = c["enter_ns"].astype("int64")
        last = np.maximum(c["last_enter_ns"].astype("int64"), enter)
        end = np.maximum(c["end_ns"].astype("int64"), last)
        wait_ms = (last - enter).astype("float64") / 1e6
        xfer_ms = (end - last).astype("float64") / 1e6
        ys = [labels[int(r)] for r in c["rank"]]
        info = np.stack(
            [c["op"], c["pg"], c["seq"], c["last_rank"], wait_ms.round(2), xfer_ms.round(2), c["nbytes"]], axis=1
        )
        hover = (
            "%{customdata[0]} pg %{customdata[1]} #%{customdata[2]} (%{customdata[6]} B)<br>"
            "waited %{customdata[4]} ms for rank %{customdata[3]} (last arriver)<br>"
            "then %{customdata[5]} ms to complete<extra>%{y}</extra>"
        )
        # each collective is two bars end to end: the wait for the last arriver, then the transfer
        for start, dur_ms, name, marker in (
            (enter, wait_ms, "waiting for last arriver", {"color": WAIT_COLOR, "pattern": {"shape": "/"}}),
            (last, xfer_ms, "collective after last arrival", {"color": XFER_COLOR}),
        ):
            fig.add_trace(
                go.Bar(
                    orientation="h",
                    y=ys,
                    base=to_datetime(start),
                    x=dur_ms,
                    offset=-0.42,
                    width=0.4,
                    name=name,
                    marker=marker,
                    customdata=info,
                    hovertemplate=hover,
                )
            )
        if highlight is not None:
            h = c[(c["pg"] == highlight[0]) & (c["seq"] == int(highlight[1]))].sort_values("rank")
            if not h.empty:
                fig.add_trace(
                    go.Scatter(
                        x=to_datetime(h["enter_ns"]),
                        y=[labels[int(r)] for r in h["rank"]],
                        mode="lines+markers",
                        name=f"arrivals at pg {highlight[0]} #{highlight[1]}",
                        line={"color": "#000000", "width": 1.5},
                        marker={"symbol": "diamond", "size": 9},
                    )
                )
                last_at = to_datetime([int(h["last_enter_ns"].iloc[0])])[0]
                _vline(fig, last_at, f"last arrival: rank {int(h['last_rank'].iloc[0])}", color="#000000")
    fig.update_layout(
        title=title,
        barmode="overlay",
        height=max(300, 120 + 46 * len(ranks)),
        xaxis={"type": "date"},
        yaxis={
            "type": "category",
            "categoryorder": "array",
            "categoryarray": [labels[r] for r in reversed(ranks)],
        },
        legend={"orientation": "h", "y": -0.12, "yanchor": "top"},
        **_LAYOUT,
    )
    return fig


# -- heat maps ------------------------------------------------------------------------------------


def pivot_heat(df: pd.DataFrame, row_order: Sequence[Any] | None = None) -> tuple[np.ndarray, list[Any], list[int]]:
    """Long ``(row_key, step_key, value)`` rows as a matrix (rows x steps, NaN where absent)."""
    rows = list(row_order) if row_order is not None else sorted(set(df["row_key"]))
    steps = sorted(int(s) for s in set(df["step_key"]))
    ri = {r: i for i, r in enumerate(rows)}
    si = {s: j for j, s in enumerate(steps)}
    z = np.full((len(rows), len(steps)), np.nan)
    if len(df):  # vectorised: 80,000 cells in a Python loop were ~0.1 s of a page
        i = df["row_key"].map(ri)
        keep = i.notna().to_numpy()
        j = df["step_key"].astype("int64").map(si).to_numpy()[keep].astype(np.intp)
        z[i.to_numpy()[keep].astype(np.intp), j] = df["value"].to_numpy(dtype=float)[keep]
    return z, rows, steps


def heatmap_chart(
    z: np.ndarray,
    row_labels: Sequence[str],
    steps: Sequence[int],
    *,
    title: str,
    unit: str = "ms",
    scale: float = 1e3,
    highlight_rows: Iterable[int] = (),
) -> go.Figure:
    """Rows (ranks, nodes or rank buckets) x steps, colored by a metric in seconds (shown in ``unit``).

    ``highlight_rows``: row indexes outlined (e.g. a finding's suspect).
    """
    if z.size == 0:
        return empty_figure("nothing to show in this window", title)
    fig = go.Figure(
        go.Heatmap(
            # float32: half the bytes sent to the browser (plotly encodes arrays as typed base64);
            # 7 digits are more than the one decimal shown
            z=(z * scale).astype(np.float32),
            x=list(steps),
            y=list(row_labels),
            colorscale="YlOrRd",
            colorbar={"title": unit},
            hovertemplate="%{y}, step %{x}: %{z:.1f} " + unit + "<extra></extra>",
        )
    )
    for i in highlight_rows:
        fig.add_shape(
            type="rect",
            x0=-0.5,
            x1=1.0,
            xref="paper",
            y0=i - 0.5,
            y1=i + 0.5,
            line={"color": "#000000", "width": 2},
        )
    n = len(row_labels)
    fig.update_layout(
        title=title,
        xaxis_title="step",
        yaxis={"type": "category", "autorange": "reversed", "automargin": True},
        height=int(min(1400, max(320, 140 + 18 * n))),
        **_LAYOUT,
    )
    return fig


# -- links ----------------------------------------------------------------------------------------


def bandwidth_matrix(
    pairs: pd.DataFrame, key_of: Callable[[int], Any], keys: Sequence[Any] | None = None
) -> tuple[np.ndarray, list[Any]]:
    """Symmetric matrix of effective bandwidth (bytes/s) between keys (ranks or nodes).

    Args:
        pairs: :func:`~ranklens.dashboards.queries.pair_bandwidth` rows.
        key_of: maps a rank to its key (itself, or its node).
        keys: the keys to keep, in order (default: every key seen, sorted).
    """
    agg: dict[tuple[Any, Any], list[float]] = {}
    for a, b, nbytes, xfer in zip(pairs["a_rank"], pairs["b_rank"], pairs["total_bytes"], pairs["total_xfer_ns"]):
        ka, kb = key_of(int(a)), key_of(int(b))
        cell = agg.setdefault((ka, kb), [0.0, 0.0])
        cell[0] += float(nbytes)
        cell[1] += float(xfer)
    if keys is None:
        keys = sorted({k for pair in agg for k in pair}, key=str)
    ki = {k: i for i, k in enumerate(keys)}
    m = np.full((len(keys), len(keys)), np.nan)
    for (ka, kb), (nbytes, xfer) in agg.items():
        if ka in ki and kb in ki and xfer > 0:
            m[ki[ka], ki[kb]] = m[ki[kb], ki[ka]] = nbytes / (xfer / 1e9)
    return m, list(keys)


def bandwidth_matrix_chart(m: np.ndarray, labels: Sequence[str], title: str) -> go.Figure:
    """Heat map of a bandwidth matrix (MB/s; low is bad, so the scale is reversed)."""
    if m.size == 0 or np.isnan(m).all():
        return empty_figure("no two-member collectives or p2p transfers in this window", title)
    fig = go.Figure(
        go.Heatmap(
            z=m / 1e6,
            x=list(labels),
            y=list(labels),
            colorscale="RdYlGn",
            colorbar={"title": "MB/s"},
            hovertemplate="%{y} ↔ %{x}: %{z:.3g} MB/s<extra></extra>",
        )
    )
    n = len(labels)
    fig.update_layout(
        title=title,
        xaxis={"type": "category"},
        yaxis={"type": "category", "autorange": "reversed"},
        height=int(min(1000, max(360, 160 + 22 * n))),
        **_LAYOUT,
    )
    return fig


def group_bandwidth_chart(groups: pd.DataFrame, names: Mapping[str, str] | None = None) -> go.Figure:
    """Effective bandwidth per process group, slowest at the top."""
    if groups.empty:
        return empty_figure("no completed collectives in this window", "Process groups")
    names = names or {}
    df = groups.sort_values("bytes_per_s", ascending=False)
    labels = [f"pg {pg}{' ' + names[pg] if names.get(pg) else ''} ({n})" for pg, n in zip(df["pg"], df["size"])]
    fig = go.Figure(
        go.Bar(
            x=df["bytes_per_s"] / 1e6,
            y=labels,
            orientation="h",
            marker_color="#1f77b4",
            customdata=np.stack([df["calls"], df["total_bytes"]], axis=1),
            hovertemplate="%{y}: %{x:.3g} MB/s over %{customdata[0]} calls (%{customdata[1]} B)<extra></extra>",
        )
    )
    fig.update_layout(
        title="Effective bandwidth per process group (MB/s, slowest at the top)",
        xaxis_title="MB/s",
        yaxis={"type": "category"},
        height=max(260, 100 + 26 * len(df)),
        **_LAYOUT,
    )
    return fig


def rank_bandwidth_chart(keys: Sequence[str], bytes_per_s: Sequence[float], title: str) -> go.Figure:
    """Effective bandwidth per rank or node (bytes over time after the group's last arrival)."""
    if len(keys) == 0:
        return empty_figure("no completed collectives in this window", title)
    fig = go.Figure(go.Bar(x=list(keys), y=np.asarray(bytes_per_s, dtype=float) / 1e6, marker_color="#2ca02c"))
    fig.update_layout(title=title, yaxis_title="MB/s", xaxis={"type": "category"}, height=320, **_LAYOUT)
    return fig


# -- hangs ----------------------------------------------------------------------------------------


def hang_groups_chart(groups: pd.DataFrame) -> go.Figure:
    """Per process group at its frontier seq: members completed, in flight, not entered."""
    if groups.empty:
        return empty_figure("no heartbeats for this job", "Process groups")
    labels = [
        f"pg {pg}{' ' + d if d else ''} #{int(f)}"
        for pg, d, f in zip(groups["pg_name"], groups["pg_desc"], groups["frontier"])
    ]
    fig = go.Figure()
    for col, name, color in (
        ("completed_n", "completed", "#2ca02c"),
        ("in_flight_n", "entered, not completed", "#ff7f0e"),
        ("not_entered_n", "not entered", "#d62728"),
    ):
        fig.add_trace(go.Bar(y=labels, x=groups[col].astype(int), name=name, orientation="h", marker_color=color))
    fig.update_layout(
        title="Members at each group's newest collective (from the newest heartbeats)",
        barmode="stack",
        xaxis_title="ranks",
        yaxis={"type": "category", "autorange": "reversed"},
        height=max(260, 110 + 30 * len(groups)),
        **_LAYOUT,
    )
    return fig


def heartbeat_age_chart(ages: pd.DataFrame, now_ns: int, detail_max: int = 256) -> go.Figure:
    """Seconds since each rank's newest heartbeat: a bar per rank, or a histogram past ``detail_max``."""
    if ages.empty:
        return empty_figure("no heartbeats for this job", "Heartbeat age")
    age_s = (now_ns - ages["hb_ns"].astype("int64")).astype("float64") / 1e9
    if len(ages) <= detail_max:
        fig = go.Figure(go.Bar(x=[f"rank {r}" for r in ages["rank"]], y=age_s, marker_color="#7f7f7f"))
        fig.update_layout(xaxis={"type": "category"}, yaxis_title="seconds")
    else:
        fig = go.Figure(go.Histogram(x=age_s, nbinsx=60, marker_color="#7f7f7f"))
        fig.update_layout(xaxis_title="seconds since the newest heartbeat", yaxis_title="ranks")
    fig.update_layout(title="Heartbeat age", height=300, **_LAYOUT)
    return fig


# -- GPU and logs ---------------------------------------------------------------------------------


def gpu_chart(
    series: pd.DataFrame,
    events: pd.DataFrame,
    *,
    metric_label: str,
    x_range: tuple[int, int],
    marks: Mapping[int, str] | None = None,
) -> go.Figure:
    """A GPU metric over time (per GPU, or fleet percentiles plus the worst GPUs) with GPU events
    as markers, on the shared time axis ``x_range`` (ns)."""
    if series.empty and events.empty:
        return empty_figure("no GPU samples or events for this job's nodes in this window", metric_label)
    fig = go.Figure()
    fleet = series[series["series"].str.startswith("fleet ")] if not series.empty else series
    if not fleet.empty:
        lo, mid, hi = (fleet[fleet["series"] == f"fleet {q}"] for q in ("p10", "p50", "p90"))
        fig.add_trace(go.Scatter(x=to_datetime(lo["t_ns"]), y=lo["value"], line={"width": 0}, showlegend=False))
        fig.add_trace(
            go.Scatter(
                x=to_datetime(hi["t_ns"]),
                y=hi["value"],
                fill="tonexty",
                fillcolor="rgba(31,119,180,0.2)",
                line={"width": 0},
                name="fleet p10-p90",
            )
        )
        fig.add_trace(go.Scatter(x=to_datetime(mid["t_ns"]), y=mid["value"], name="fleet median", line={"width": 2}))
    for name, g in series[~series["series"].str.startswith("fleet ")].groupby("series", sort=True):
        fig.add_trace(go.Scatter(x=to_datetime(g["t_ns"]), y=g["value"], name=str(name), mode="lines"))
    if not events.empty:
        y = series["value"].max() if not series.empty else 1.0
        fig.add_trace(
            go.Scatter(
                x=to_datetime(events["ts_ns"]),
                y=np.full(len(events), y),
                mode="markers",
                name="GPU events",
                marker={"symbol": "x", "size": 11, "color": "#d62728"},
                text=[
                    f"{h}:{g} {k} {c} {_short(m, 80)}"
                    for h, g, k, c, m in zip(
                        events["host"], events["gpu_index"], events["kind"], events["code"], events["message"]
                    )
                ],
                hovertemplate="%{x}<br>%{text}<extra></extra>",
            )
        )
    for ns, label in (marks or {}).items():
        _vline(fig, to_datetime([ns])[0], label)
    fig.update_layout(
        title=metric_label,
        xaxis={"type": "date", "range": list(to_datetime(list(x_range)))},
        height=360,
        **_LAYOUT,
    )
    return fig


def log_events_chart(
    logs: pd.DataFrame, *, x_range: tuple[int, int], marks: Mapping[int, str] | None = None
) -> go.Figure:
    """Classified log lines over time (one lane per class, colored by severity), same time axis."""
    if logs.empty:
        return empty_figure("no classified log lines in this window", "Log events")
    fig = go.Figure()
    for sev, g in logs.groupby("severity", sort=True):
        fig.add_trace(
            go.Scatter(
                x=to_datetime(g["ts_ns"]),
                y=g["klass"],
                mode="markers",
                name=str(sev) or "unknown",
                marker={
                    "size": np.clip(6 + 2 * np.log2(g["repeat_count"].clip(lower=1).astype(float)), 6, 20),
                    "color": SEVERITY_COLORS.get(str(sev), "#7f7f7f"),
                },
                text=[f"{h} rank {r}: {_short(m, 120)}" for h, r, m in zip(g["host"], g["rank"], g["message"])],
                hovertemplate="%{x}<br>%{text}<extra>%{y}</extra>",
            )
        )
    for ns, label in (marks or {}).items():
        _vline(fig, to_datetime([ns])[0], label)
    fig.update_layout(
        title="Log events",
        xaxis={"type": "date", "range": list(to_datetime(list(x_range)))},
        yaxis={"type": "category"},
        height=max(260, 120 + 40 * logs["klass"].nunique()),
        **_LAYOUT,
    )
    return fig


def _short(text: Any, n: int) -> str:
    s = str(text).replace("\n", " ")
    return s if len(s) <= n else s[: n - 1] + "…"


# -- profiler traces ------------------------------------------------------------------------------

KERNEL_TYPE_COLORS = {"COMPUTATION": "#2ca02c", "COMMUNICATION": "#ff7f0e", "MEMORY": "#9467bd", "OTHER": "#7f7f7f"}


def trace_timeline_chart(kernels: pd.DataFrame, title: str = "GPU timeline") -> go.Figure:
    """One rank's GPU events, one row per CUDA stream, coloured by kernel type (HTA's types).

    Args:
        kernels: :func:`~ranklens.dashboards.queries.trace_timeline`.
    """
    if kernels.empty:
        return empty_figure("no GPU events in this profiler step", title)
    streams = sorted(set(kernels["stream"].astype(int)))
    fig = go.Figure()
    for kind, color in KERNEL_TYPE_COLORS.items():
        k = kernels[kernels["kernel_type"] == kind]
        if k.empty:
            continue
        dur_ms = k["dur_ns"].astype("float64") / 1e6
        fig.add_trace(
            go.Bar(
                orientation="h",
                y=[f"stream {int(s)}" for s in k["stream"]],
                base=to_datetime(k["ts_ns"]),
                x=dur_ms,
                name=kind.lower(),
                marker_color=color,
                customdata=np.stack([[_short(n, 90) for n in k["name"]], (dur_ms * 1000).round(1)], axis=1),
                hovertemplate="%{customdata[0]}<br>%{customdata[1]} us<extra>%{y}</extra>",
            )
        )
    fig.update_layout(
        title=title,
        barmode="overlay",
        height=max(260, 120 + 40 * len(streams)),
        xaxis={"type": "date"},
        yaxis={
            "type": "category",
            "categoryorder": "array",
            "categoryarray": [f"stream {s}" for s in reversed(streams)],
        },
        legend={"orientation": "h", "y": -0.15, "yanchor": "top"},
        **_LAYOUT,
    )
    return fig
