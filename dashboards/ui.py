"""Shared pieces of the dashboard pages: the page list, the job picker, query parameters, links.

Every page reads its filters from the URL's query parameters first (so a finding can link to a
pre-filtered timeline, heat map or hang view, and a URL can be shared), then from its widgets.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pandas as pd
import streamlit as st

from ranklens.dashboards import queries as q

__all__ = [
    "PAGES",
    "Context",
    "context",
    "fmt_ns",
    "link",
    "now_ns",
    "qp_int",
    "qp_ints",
    "qp_str",
    "rank_labeler",
    "select_job",
    "step_window",
    "store_url",
]

# key -> (script next to app.py, title, url path). The order is the navigation order.
PAGES: dict[str, tuple[str, str, str]] = {
    "overview": ("page_overview.py", "Jobs overview", "overview"),
    "findings": ("page_findings.py", "Findings", "findings"),
    "timeline": ("page_timeline.py", "Timeline", "timeline"),
    "heatmaps": ("page_heatmaps.py", "Heat maps", "heatmaps"),
    "links": ("page_links.py", "Links", "links"),
    "hangs": ("page_hangs.py", "Hangs", "hangs"),
    "gpu_logs": ("page_gpu_logs.py", "GPU and logs", "gpu-logs"),
    "traces": ("page_traces.py", "GPU traces", "traces"),
}
_CTX_KEY = "_ranklens_ctx"
_JOB_KEY = "ranklens_job"
_QP_SEEN_KEY = "_ranklens_job_from_url"


@dataclass(frozen=True)
class Context:
    """What every page works on: the store and the selected job attempt with its extent."""

    store_url: str
    job_id: str
    attempt: int
    bounds: q.JobBounds

    def query(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Run a cached query of :mod:`ranklens.dashboards.queries` for this job attempt."""
        return q.cached(name, self.store_url, self.job_id, self.attempt, *args, **kwargs)


def store_url() -> str:
    """The store this dashboard shows (``$RANKLENS_STORE``, set by ``ranklens dashboard``)."""
    return q.env_store_url()


def qp_str(name: str, default: str = "") -> str:
    """A query parameter as text."""
    value = st.query_params.get(name)
    return str(value) if value not in (None, "") else default


def qp_int(name: str, default: int) -> int:
    """A query parameter as an integer (the default when absent or malformed)."""
    try:
        return int(st.query_params.get(name, default))
    except (TypeError, ValueError):
        return default


def qp_ints(name: str) -> tuple[int, ...]:
    """A comma-separated list of integers (``ranks=2,5``); malformed items are ignored."""
    out = []
    for part in qp_str(name).split(","):
        try:
            out.append(int(part))
        except ValueError:
            continue
    return tuple(out)


def select_job() -> Context | None:
    """The job picker in the sidebar; remembers the choice for every page of the session.

    ``?job=ID&attempt=N`` in the URL preselects a job (once per distinct URL value).
    """
    url = store_url()
    st.sidebar.caption(f"store: `{url}`")
    try:
        jobs = q.cached("list_jobs", url)
    except Exception as e:  # the store is down or not a ranklens store: say so, do not crash the app
        st.error(f"cannot read the store {url}: {e}")
        st.session_state.pop(_CTX_KEY, None)
        return None
    if jobs.empty:
        st.sidebar.info("no jobs in this store yet")
        st.session_state.pop(_CTX_KEY, None)
        return None
    keys = [f"{j}#{int(a)}" for j, a in zip(jobs["job_id"], jobs["attempt"])]
    health = dict(zip(keys, jobs["health"]))
    wanted = qp_str("job")
    if wanted:
        key = f"{wanted}#{qp_int('attempt', 0)}"
        if key in keys and st.session_state.get(_QP_SEEN_KEY) != key:
            st.session_state[_JOB_KEY] = key
            st.session_state[_QP_SEEN_KEY] = key
    if st.session_state.get(_JOB_KEY) not in keys:
        st.session_state[_JOB_KEY] = keys[0]
    choice = st.sidebar.selectbox(
        "Job",
        keys,
        key=_JOB_KEY,
        format_func=lambda k: f"{k.rsplit('#', 1)[0]} (attempt {k.rsplit('#', 1)[1]}) · {health.get(k, '')}",
    )
    job_id, attempt = choice.rsplit("#", 1)
    if st.sidebar.button("Refresh now", help="queries are cached for a few seconds; this drops the cache"):
        st.cache_data.clear()
    bounds = q.cached("job_bounds", url, job_id, int(attempt))
    ctx = Context(url, job_id, int(attempt), bounds)
    st.sidebar.caption(
        f"{bounds.ranks:,} ranks on {bounds.hosts:,} nodes · steps {bounds.first_step}-{bounds.last_step}"
    )
    st.session_state[_CTX_KEY] = ctx
    return ctx


REFRESH_EVERY_S = (0, 5, 10, 30, 60)
_REFRESH_KEY = "ranklens_refresh"
_LAST_RUN_KEY = "_ranklens_last_full_run"
_tickers: dict[int, Callable[[], None]] = {}


def _ticker(every: int) -> Callable[[], None]:
    """A fragment that Streamlit reruns every ``every`` seconds; when it fires (and not as part of
    a full run that just happened), it reruns the whole page."""
    tick = _tickers.get(every)
    if tick is None:

        def _tick() -> None:
            if time.monotonic() - st.session_state.get(_LAST_RUN_KEY, 0.0) >= every * 0.9:
                st.rerun(scope="app")

        tick = _tickers[every] = st.fragment(run_every=every)(_tick)
    return tick


def auto_refresh() -> int:
    """The sidebar's auto-refresh control: rerun the page every N seconds while a job runs
    (``?refresh=N`` in the URL preselects it; queries are cached for ``TTL_S`` seconds). Returns N
    (0: off)."""
    options = list(REFRESH_EVERY_S)
    wanted = qp_int("refresh", 0)
    if wanted >= 2 and wanted not in options:
        options = sorted({*options, wanted})
    if st.session_state.get(_REFRESH_KEY) not in options:
        st.session_state[_REFRESH_KEY] = wanted if wanted in options else 0
    every = st.sidebar.selectbox(
        "Auto-refresh",
        options,
        key=_REFRESH_KEY,
        format_func=lambda s: "off" if not s else f"every {s} s",
        help=f"rerun this page periodically (query results are at most {q.TTL_S:.0f} s old)",
    )
    st.session_state[_LAST_RUN_KEY] = time.monotonic()
    if every:
        with st.sidebar:
            _ticker(int(every))()
    return int(every)


def context() -> Context:
    """The selected job of this session; stops the page (with a note) when there is none."""
    ctx = st.session_state.get(_CTX_KEY)
    if ctx is None:
        st.info("No job to show: the store has no steps yet. Run `ranklens demo` or point `--store` at a store.")
        st.stop()
    assert isinstance(ctx, Context)
    return ctx


def link(page: str, label: str, ctx: Context, **params: Any) -> None:
    """A link to another page, pre-filtered by ``params`` (and the current job)."""
    script = PAGES[page][0]
    qp = {"job": ctx.job_id, "attempt": str(ctx.attempt)}
    qp.update({k: ",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v) for k, v in params.items()})
    st.page_link(script, label=label, query_params=qp)


def rank_labeler(info: pd.DataFrame) -> Callable[[int], str]:
    """``rank 5 (node-3:1)`` labels from :func:`~ranklens.dashboards.queries.rank_info` rows."""
    nodes = dict(zip(info["rank"].astype(int), info["node"])) if not info.empty else {}
    local = dict(zip(info["rank"].astype(int), info["node_rank"])) if not info.empty else {}

    def label(rank: int) -> str:
        node = nodes.get(int(rank))
        if not node:
            return f"rank {rank}"
        lr = local.get(int(rank), -1)
        return f"rank {rank} ({node}{':' + str(lr) if lr is not None and int(lr) >= 0 else ''})"

    return label


def now_ns() -> int:
    """The wall clock (a function so pages stay simple to read)."""
    return time.time_ns()


def fmt_ns(ns: int) -> str:
    """A UTC time of day with milliseconds."""
    if not ns:
        return "—"
    return pd.Timestamp(int(ns), unit="ns", tz="UTC").strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


def step_window(ctx: Context, default_width: int, max_width: int, prefix: str) -> tuple[int, int]:
    """A step range picked with two number inputs, defaulting to the URL's ``step_from``/``step_to``
    (else the last ``default_width`` steps); wider than ``max_width`` is narrowed from the left."""
    b = ctx.bounds
    lo_default = qp_int("step_from", max(b.first_step, b.last_step - default_width + 1))
    hi_default = qp_int("step_to", b.last_step)
    lo_default = min(max(lo_default, b.first_step), max(b.last_step, b.first_step))
    hi_default = min(max(hi_default, lo_default), max(b.last_step, b.first_step))
    # the URL's values are part of the widget keys: following a new link resets the window
    suffix = f"{ctx.job_id}_{ctx.attempt}_{qp_str('step_from')}_{qp_str('step_to')}"
    lo, hi = (
        int(
            col.number_input(
                f"{end} step",
                min_value=b.first_step,
                max_value=max(b.last_step, b.first_step),
                value=default,
                key=f"{prefix}_{end}_{suffix}",
            )
        )
        for col, end, default in zip(st.columns(2), ("from", "to"), (lo_default, hi_default))
    )
    if hi < lo:
        lo, hi = hi, lo
    if hi - lo + 1 > max_width:
        st.caption(f"window narrowed to the last {max_width} steps of the range (detail limit)")
        lo = hi - max_width + 1
    return lo, hi
