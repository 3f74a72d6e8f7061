"""Every query behind the dashboards: aggregating SQL with limits, run in the store, cached.

Each fetch function takes a :class:`~ranklens.store.api.Store` and returns a small pandas DataFrame
(or a frozen record). The aggregation happens in the store (chDB or a ClickHouse server, the same
SQL on both, 18.16 included), and every result has a ``LIMIT``. When a job has more ranks than a
chart can show, the query aggregates (by node, by rank bucket, top-k worst) instead of sending every
rank to the browser. Blame, wait, compute and bandwidth are not redefined here: the queries
aggregate the analyzers' own SQL (:mod:`ranklens.analyzers.blame`, :mod:`~ranklens.analyzers.compute`,
:mod:`~ranklens.analyzers.links`), so a page shows what the findings beside it were computed from.

One module per page concern: :mod:`.jobs`, :mod:`.findings`, :mod:`.timeline`, :mod:`.heatmaps`,
:mod:`.links`, :mod:`.hangs`, :mod:`.gpu_logs`, :mod:`.traces`. The pages call :func:`cached`, which runs a fetch
function of :data:`QUERIES` through ``st.cache_data`` with a short TTL (the job may be running),
keyed by the store URL and the arguments. The queries of :data:`VERSIONED`, which read only a job's
steps, phases, collectives and ranks, are cached by that job's data version as well
(:func:`~ranklens.dashboards.queries._cache.data_version`, itself under the short TTL) for up to
an hour: new rows change the version within ``TTL_S`` and the next page load recomputes, while a
finished job's heat maps, links and timelines are computed once, not every ``TTL_S``. The fetch
functions are plain functions, so tests and the benchmark call them without Streamlit.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ranklens.config import ENV_STORE
from ranklens.dashboards.queries._cache import data_version
from ranklens.dashboards.queries._sql import MAX_CELLS, MAX_SERIES, RANK_DETAIL_MAX, ROW_LIMIT, TTL_S
from ranklens.dashboards.queries.findings import finding_actions, finding_history, findings, job_recoveries
from ranklens.dashboards.queries.gpu_logs import GPU_METRICS, gpu_events, gpu_series, log_classes, log_events
from ranklens.dashboards.queries.hangs import group_names, hang_groups, heartbeat_ages, rank_last_activity
from ranklens.dashboards.queries.heatmaps import HEAT_AXES, HEAT_METRICS, choose_heat_axis, heatmap
from ranklens.dashboards.queries.jobs import (
    JobBounds,
    job_bounds,
    ledger_blame,
    list_jobs,
    phase_names,
    rank_info,
    step_trend,
)
from ranklens.dashboards.queries.links import (
    LinkBandwidth,
    group_bandwidth,
    link_bandwidth,
    pair_bandwidth,
    rank_bandwidth,
)
from ranklens.dashboards.queries.timeline import timeline_collectives, timeline_phases, worst_ranks
from ranklens.dashboards.queries.traces import (
    trace_breakdown,
    trace_kernel_types,
    trace_steps,
    trace_timeline,
    trace_top_kernels,
)
from ranklens.store.api import Store

__all__ = [
    "GPU_METRICS",
    "HEAT_AXES",
    "HEAT_METRICS",
    "MAX_CELLS",
    "MAX_SERIES",
    "QUERIES",
    "RANK_DETAIL_MAX",
    "ROW_LIMIT",
    "TTL_S",
    "VERSIONED",
    "JobBounds",
    "LinkBandwidth",
    "cached",
    "choose_heat_axis",
    "data_version",
    "env_store_url",
    "finding_actions",
    "finding_history",
    "findings",
    "get_store",
    "gpu_events",
    "gpu_series",
    "group_bandwidth",
    "group_names",
    "hang_groups",
    "heartbeat_ages",
    "heatmap",
    "job_bounds",
    "job_recoveries",
    "ledger_blame",
    "link_bandwidth",
    "list_jobs",
    "log_classes",
    "log_events",
    "pair_bandwidth",
    "phase_names",
    "rank_bandwidth",
    "rank_info",
    "rank_last_activity",
    "step_trend",
    "timeline_collectives",
    "timeline_phases",
    "trace_breakdown",
    "trace_kernel_types",
    "trace_steps",
    "trace_timeline",
    "trace_top_kernels",
    "worst_ranks",
]

#: the fetch functions :func:`cached` runs, by name (the pages name them)
QUERIES: dict[str, Callable[..., Any]] = {
    f.__name__: f
    for f in (
        list_jobs,
        job_bounds,
        data_version,
        ledger_blame,
        rank_info,
        phase_names,
        step_trend,
        findings,
        finding_history,
        finding_actions,
        job_recoveries,
        worst_ranks,
        timeline_phases,
        timeline_collectives,
        heatmap,
        link_bandwidth,
        pair_bandwidth,
        group_bandwidth,
        rank_bandwidth,
        hang_groups,
        group_names,
        rank_last_activity,
        heartbeat_ages,
        gpu_series,
        gpu_events,
        log_classes,
        log_events,
        trace_breakdown,
        trace_kernel_types,
        trace_top_kernels,
        trace_steps,
        trace_timeline,
    )
}


#: queries that read only the job's steps, phases, collectives and ranks (what data_version covers):
#: cached per data version, not only for TTL_S
VERSIONED = frozenset(
    {
        "rank_info",
        "phase_names",
        "step_trend",
        "worst_ranks",
        "timeline_phases",
        "timeline_collectives",
        "heatmap",
        "link_bandwidth",
        "pair_bandwidth",
        "group_bandwidth",
        "rank_bandwidth",
    }
)
VERSIONED_TTL_S = 3600.0


def get_store(store_url: str) -> Store:
    """The store at ``store_url``, opened once per dashboard process (``st.cache_resource``)."""
    return _get_store_cached(store_url)


def _open(store_url: str) -> Store:
    from ranklens.store import open_store

    return open_store(store_url, create=False)


def _run(name: str, store_url: str, args: tuple[Any, ...], kwargs: tuple[tuple[str, Any], ...]) -> Any:
    return QUERIES[name](get_store(store_url), *args, **dict(kwargs))


def _run_versioned(
    name: str, store_url: str, args: tuple[Any, ...], kwargs: tuple[tuple[str, Any], ...], version: tuple[int, ...]
) -> Any:
    del version  # part of the cache key only
    return _run(name, store_url, args, kwargs)


_get_store_cached: Callable[[str], Store] = _open
_cached: Callable[[str, str, tuple[Any, ...], tuple[tuple[str, Any], ...]], Any] = _run
_cached_versioned: Callable[..., Any] = _run_versioned
try:  # the dashboards run under Streamlit; the fetch functions do not need it
    import streamlit as st

    _get_store_cached = st.cache_resource(show_spinner=False)(_open)
    _cached = st.cache_data(ttl=TTL_S, max_entries=512, show_spinner=False)(_run)
    _cached_versioned = st.cache_data(ttl=VERSIONED_TTL_S, max_entries=256, show_spinner=False)(_run_versioned)
except ImportError:  # pragma: no cover - depends on the install
    pass


def cached(name: str, store_url: str, *args: Any, **kwargs: Any) -> Any:
    """Run the fetch function ``name`` of :data:`QUERIES` on the store, through the TTL cache.

    Args:
        name: a fetch function's name (e.g. ``"heatmap"``).
        store_url: the store; opened once per process.
        args, kwargs: the function's arguments after the store (hashable values).

    Raises:
        ValueError: ``name`` is not a dashboard query.
    """
    if name not in QUERIES:
        raise ValueError(f"{name!r} is not a dashboard query; one of {', '.join(sorted(QUERIES))}")
    kw = tuple(sorted(kwargs.items()))
    if name in VERSIONED and len(args) >= 2:  # (job_id, attempt, ...)
        version = _cached("data_version", store_url, tuple(args[:2]), ())
        return _cached_versioned(name, store_url, tuple(args), kw, version)
    return _cached(name, store_url, tuple(args), kw)


def env_store_url() -> str:
    """The store the dashboard shows: ``$RANKLENS_STORE`` (set by ``ranklens dashboard``) or the default."""
    from ranklens.store import default_store_url

    return os.environ.get(ENV_STORE) or default_store_url()
