"""Dashboard benchmark: query + figure-build time of every page on a simulated 10,240-rank job.

    python bench/dashboard_bench.py [--ranks 10240] [--steps 50] [--ranks-per-node 8] [--store DIR]
                                    [--server clickhouse://default@127.0.0.1:9000/db] [--no-apptest]
                                    [--browser] [--reuse]

Writes a simulated job (``ranklens.simulate`` with telemetry: ranks on nodes, steps, phases, the
tensor- and data-parallel collectives, heartbeats, GPU samples, log lines; one straggler rank and one
slow node link) into a fresh store, runs the straggler analyzer on it, then per page:

* the queries the page runs (uncached) and the Plotly figures it builds, with the cells/points
  and the JSON bytes sent to the browser;
* the whole page script under Streamlit's AppTest with a cold cache (queries + Python-side
  rendering, what a first page load costs on the server; the browser's drawing is not included);
* with ``--browser``, what a user sees: ``ranklens dashboard``'s server (``streamlit run``) and a
  headless Chromium driven over the DevTools protocol (``tests/cdp.py``), each page's URL navigated
  to and timed until its charts are drawn (the title shown, the script done, every chart with data).
  Each page is loaded twice: the first visit runs its queries (the server's cache holds only what
  earlier pages shared, e.g. the job list and bounds), the second is served from the cache. Then,
  as a user moves between the pages of an open dashboard, each page is reached by a click on its
  sidebar link (no page reload: Streamlit's front end and Plotly's code stay loaded), first with the
  query cache emptied just before ("Refresh now"), then again.
  ``--reuse`` keeps the job already in ``--store`` (simulated by an earlier run) instead of writing
  a new one.

Prints one line per measurement; nothing is timed inside the test suite.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import plotly.graph_objects as go

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/cdp.py: the Chromium driver

from ranklens.dashboards import charts
from ranklens.dashboards import queries as q
from ranklens.simulate import SimResult, simulate
from ranklens.store import open_store
from ranklens.store.api import Store

APP = Path(__file__).resolve().parents[1] / "dashboards" / "app.py"


class Timer:
    def __init__(self) -> None:
        self.query_s = 0.0
        self.figure_s = 0.0
        self.json_bytes = 0
        self.queries = 0

    def query(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        out = fn(*args, **kw)
        self.query_s += time.perf_counter() - t
        self.queries += 1
        return out

    def figure(self, build: Callable[[], go.Figure]) -> go.Figure:
        t = time.perf_counter()
        fig = build()
        self.json_bytes += len(fig.to_json())  # what st.plotly_chart serialises for the browser
        self.figure_s += time.perf_counter() - t
        return fig


def page_overview(store: Store, job: str, t: Timer) -> None:
    t.query(q.list_jobs, store)
    found = t.query(q.findings, store, job, 0)
    trend = t.query(q.step_trend, store, job, 0)
    t.figure(lambda: charts.step_trend_chart(trend, {int(s): "onset" for s in found["first_seen_step"]}))
    t.figure(lambda: charts.findings_impact_chart(found))


def page_findings(store: Store, job: str, t: Timer) -> None:
    found = t.query(q.findings, store, job, 0)
    if found.empty:
        return
    f = found.iloc[0]
    hist = t.query(q.finding_history, store, f["id"])
    t.query(q.finding_actions, store, f["id"])
    t.figure(
        lambda: charts.finding_onset_chart(
            f["evidence"].get("per_step", []), int(f["first_seen_step"]), int(f["last_seen_step"])
        )
    )
    t.figure(lambda: charts.finding_history_chart(hist))


def page_timeline(store: Store, job: str, t: Timer, b: q.JobBounds, slow: int) -> None:
    lo, hi = b.last_step - 2, b.last_step
    info = t.query(q.rank_info, store, job, 0)
    worst = t.query(q.worst_ranks, store, job, 0, lo, hi, 8, b.first_ns)
    ranks = tuple(dict.fromkeys([slow, *(int(r) for r in worst["culprit"])]))
    phases = t.query(q.timeline_phases, store, job, 0, lo, hi, ranks)
    colls = t.query(q.timeline_collectives, store, job, 0, lo, hi, ranks)
    label = _labeler(info)
    first = colls.iloc[0]
    t.figure(lambda: charts.gantt_chart(phases, colls, label, highlight=(first["pg"], int(first["seq"]))))


def page_heatmaps(store: Store, job: str, t: Timer, b: q.JobBounds, metric: str) -> None:
    lo, hi = max(b.first_step, b.last_step - 199), b.last_step
    axis, bucket = q.choose_heat_axis(b.ranks, b.hosts, hi - lo + 1)
    df = t.query(
        q.heatmap, store, job, 0, metric, lo, hi, axis=axis, rank_bucket=bucket, phase="backward", t0_ns=b.first_ns
    )
    t.query(q.rank_info, store, job, 0)

    def build() -> go.Figure:
        z, rows, steps = charts.pivot_heat(df)
        return charts.heatmap_chart(z, [str(r) for r in rows], steps, title=metric)

    t.figure(build)


def page_links(store: Store, job: str, t: Timer, b: q.JobBounds) -> None:
    lo, hi = max(b.first_step, b.last_step - 49), b.last_step
    info = t.query(q.rank_info, store, job, 0)
    nodes = dict(zip(info["rank"].astype(int), info["node"]))
    bw = t.query(q.link_bandwidth, store, job, 0, lo, hi)
    per_rank, pairs, groups = bw.per_rank, bw.pairs, bw.groups
    t.query(q.group_names, store, job, 0)

    def matrix() -> go.Figure:
        per = per_rank.assign(key=[nodes.get(int(r), "?") for r in per_rank["rank"]])
        agg = per.groupby("key")[["total_bytes", "total_xfer_ns"]].sum()
        bps = (agg["total_bytes"] / (agg["total_xfer_ns"] / 1e9)).sort_values()
        keys = sorted(bps.index[:64])
        m, labels = charts.bandwidth_matrix(pairs, lambda r: nodes.get(int(r), "?"), keys)
        return charts.bandwidth_matrix_chart(m, labels, "node x node")

    t.figure(matrix)
    t.figure(lambda: charts.group_bandwidth_chart(groups.head(30)))


def page_hangs(store: Store, job: str, t: Timer) -> None:
    groups = t.query(q.hang_groups, store, job, 0)
    ages = t.query(q.heartbeat_ages, store, job, 0)
    missing = tuple(sorted({int(r) for rs in groups["not_entered"] for r in rs}))[:64]
    t.query(q.rank_last_activity, store, job, 0, missing or (0,))
    now = time.time_ns()
    t.figure(lambda: charts.hang_groups_chart(groups.head(60)))
    t.figure(lambda: charts.heartbeat_age_chart(ages, now))


def page_gpu_logs(store: Store, job: str, t: Timer, b: q.JobBounds) -> None:
    lo, hi = b.first_ns, b.last_ns
    series = t.query(q.gpu_series, store, job, 0, lo, hi, "util_pct")
    events = t.query(q.gpu_events, store, job, 0, lo, hi)
    t.query(q.log_classes, store, job, 0)
    logs = t.query(q.log_events, store, job, 0, lo, hi)
    t.figure(lambda: charts.gpu_chart(series, events, metric_label="util", x_range=(lo, hi)))
    t.figure(lambda: charts.log_events_chart(logs, x_range=(lo, hi)))


def _heat(store: Store, job: str, b: q.JobBounds, metric: str, t: Timer) -> None:
    page_heatmaps(store, job, t, b, metric)


def _labeler(info: Any) -> Callable[[int], str]:
    nodes = dict(zip(info["rank"].astype(int), info["node"]))
    return lambda r: f"rank {r} ({nodes.get(int(r), '?')})"


def run_apptest(store_url: str, job: str) -> None:
    """Each page's script end to end under AppTest, cold cache: server-side page load time."""
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    from ranklens.dashboards.ui import PAGES

    os.environ["RANKLENS_STORE"] = store_url
    at = AppTest.from_file(str(APP), default_timeout=600)
    at.query_params["job"] = job
    at.run()
    for key, (script, _title, _url) in PAGES.items():
        st.cache_data.clear()
        t = time.perf_counter()
        at.switch_page(script).run()
        dt = time.perf_counter() - t
        errors = [e.value for e in at.exception]
        print(
            f"apptest  {key:9s} page load (cold cache, queries + render): {dt:6.2f} s"
            + (f"  EXCEPTION {errors[0][:200]}" if errors else "")
        )


# url path, page title, charts that must be drawn (as tests/dashboards/test_dashboards_browser.py)
BROWSER_PAGES = (
    ("overview", "Jobs overview", 2),
    ("findings", "Findings", 2),
    ("timeline", "Timeline", 1),
    ("heatmaps", "Heat maps", 1),  # once per metric
    ("links", "Links", 2),  # the pair matrix draws only where two-member groups or p2p pairs exist
    ("hangs", "Hangs", 2),
    ("gpu-logs", "GPU and logs", 2),
)

# elements of the previous run that the current one has not replaced yet carry data-stale="true"
# (an in-app page switch keeps the old page on screen until the new one draws): not counted
READY_JS = """JSON.stringify((() => {
  const live = e => e.closest('[data-stale="true"]') === null;
  const plots = Array.from(document.querySelectorAll('.js-plotly-plot')).filter(live);
  return {
    drawn: plots.filter(p => p.querySelectorAll('.trace path, .trace image, .hm image').length > 0).length,
    exceptions: Array.from(document.querySelectorAll('[data-testid="stException"]')).filter(live).length,
    running: document.querySelectorAll('[data-testid="stStatusWidget"]').length,
    titles: Array.from(document.querySelectorAll('h1')).filter(live).map(h => h.innerText.trim()),
  };
})())"""

# an in-app page switch: the sidebar's link to the page, clicked as a user does (no page reload:
# Streamlit's front end, its connection and Plotly's code stay loaded; the page script reruns)
CLICK_JS = """(() => {
  const a = Array.from(document.querySelectorAll('a[data-testid="stSidebarNavLink"]'))
    .find(a => new URL(a.href).pathname.replace(/\\/$/, '') === %s);
  if (!a) return 0;
  a.click();
  return 1;
})()"""
REFRESH_JS = """(() => {
  const b = Array.from(document.querySelectorAll('button')).find(b => b.innerText.trim() === 'Refresh now');
  if (!b) return 0;
  b.click();
  return 1;
})()"""


def _browser_urls(store: Store, job: str, b: q.JobBounds, slow: int) -> list[tuple[str, str, str, int]]:
    """(name, url path with query, title, charts wanted) of every page the browser loads."""
    import urllib.parse

    found = q.findings(store, job, 0)
    fid = str(found["id"].iloc[0]) if not found.empty else ""
    onset = int(found["first_seen_step"].iloc[0]) if not found.empty else b.last_step - 1
    params: dict[str, dict[str, Any]] = {
        "overview": {"job": job},
        "findings": {"job": job, **({"finding": fid} if fid else {})},
        "timeline": {"job": job, "ranks": slow, "step_from": onset, "step_to": onset + 1},
        "links": {"job": job},
        "hangs": {"job": job},
        "gpu-logs": {"job": job},
    }
    out = []
    for path, title, want in BROWSER_PAGES:
        if path == "heatmaps":
            for m in q.HEAT_METRICS:
                qs = urllib.parse.urlencode({"job": job, "metric": m, "highlight": slow})
                out.append((f"heat:{m}", f"{path}?{qs}", title, want))
        else:
            out.append((path, f"{path}?{urllib.parse.urlencode(params[path])}", title, want))
    return out


def run_browser(store_url: str, pages: list[tuple[str, str, str, int]], timeout_s: float = 120.0) -> int:
    """Each page in headless Chromium against the real dashboard server: navigation to charts drawn."""
    import json
    import subprocess

    from ranklens.dashboards.launch import dashboard_healthy, start_dashboard
    from ranklens.formats.process import stop_process
    from tests._sync import free_port, wait_until
    from tests.cdp import Chromium, find_chromium

    binary = find_chromium()
    if binary is None:
        print("browser   no Chromium installed (apt-get install chromium): browser timings skipped")
        return 1
    port = free_port()
    log = tempfile.TemporaryFile()
    proc = start_dashboard(store_url, "127.0.0.1", port, stdout=log, stderr=subprocess.STDOUT, die_with_parent=True)
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        return dashboard_healthy(base)

    failed = 0
    try:
        wait_until(healthy, 300, "the dashboard server's health check", interval_s=0.2, procs=[proc])
        with Chromium(binary, width=1400, height=2000) as browser:
            # the browser's own start and Streamlit's static files, to a finished first run (a script
            # still running would slow the first measured page)
            browser.navigate(f"{base}/overview")

            def settled() -> bool:
                state = json.loads(browser.evaluate(READY_JS))
                return bool(state["titles"]) and state["running"] == 0 and state["drawn"] >= 1

            wait_until(settled, 300, "the first page", interval_s=0.1)
            for name, path, title, want in pages:
                times, titled = [], []
                state: dict[str, Any] = {}
                for _visit in ("first", "again"):
                    t = time.perf_counter()
                    browser.navigate(f"{base}/{path}")
                    dt, seen, state = _wait_drawn(browser, t, title, want, timeout_s)
                    times.append(dt)
                    titled.append(seen)
                ok = not state.get("exceptions") and state.get("drawn", 0) >= want
                failed += not ok
                # "title": Streamlit's front end loaded, connected and the page script started; what
                # follows is the page's queries, figures and Plotly's drawing
                print(
                    f"browser   {name:16s} navigation to charts drawn: first visit {times[0]:5.2f} s "
                    f"(title {titled[0]:4.2f} s), again (cached) {times[1]:5.2f} s (title {titled[1]:4.2f} s)"
                    f"   {state.get('drawn', 0)}/{want} charts"
                    + ("" if ok else "  NOT DRAWN" + (" (exception on the page)" if state.get("exceptions") else ""))
                )
            failed += _in_app(browser, base, pages, timeout_s)
    finally:
        stop_process(proc, timeout_s=15)
        log.close()
    return failed


def _wait_drawn(browser: Any, t: float, title: str, want: int, timeout_s: float) -> tuple[float, float, dict[str, Any]]:
    """Poll the page from ``t`` until its title is shown, its script done and ``want`` charts drawn
    (or an exception shown): (seconds to that, seconds to the title, 0 if never; the last state)."""
    import json

    state: dict[str, Any] = {}
    seen = 0.0
    while time.perf_counter() - t < timeout_s:
        state = json.loads(browser.evaluate(READY_JS))
        if not seen and title in state["titles"]:
            seen = time.perf_counter() - t
        if state["exceptions"] or (title in state["titles"] and state["running"] == 0 and state["drawn"] >= want):
            break
        time.sleep(0.02)
    return time.perf_counter() - t, seen, state


def _in_app(browser: Any, base: str, pages: list[tuple[str, str, str, int]], timeout_s: float) -> int:
    """Each page reached from the sidebar's link, as a user moves between pages once the dashboard
    is open: first with the query cache emptied just before ("Refresh now" on the page the user
    is on: what that page's rerun reads again, the job list and bounds every page shares, is
    cached as for any user), then again. The heat-map page shows its default metric (the others
    are a widget away)."""
    import json

    failed = 0
    seen: set[str] = set()
    in_app = []
    for name, path, title, want in pages:
        p = path.split("?", 1)[0]
        if p not in seen:
            seen.add(p)
            in_app.append((name.split(":", 1)[0], "/" + p if p != "overview" else "", title, want))
    # start on the last page, so that every click goes to another page
    browser.navigate(f"{base}/{pages[-1][1]}")
    current = in_app[-1]
    _wait_drawn(browser, time.perf_counter(), current[2], current[3], timeout_s)
    times: dict[str, list[float]] = {}
    states: dict[str, dict[str, Any]] = {}
    for visit in ("first", "again"):
        for name, p, title, want in in_app:
            if visit == "first":  # the query cache emptied on the page the user is on, which reruns
                browser.evaluate(REFRESH_JS)
                time.sleep(0.1)
                _wait_drawn(browser, time.perf_counter(), current[2], current[3], timeout_s)
            current = (name, p, title, want)
            t = time.perf_counter()
            if not browser.evaluate(CLICK_JS % json.dumps(p)):
                print(f"in-app    {name:16s} no sidebar link to {p or '/'}")
                failed += 1
                continue
            dt, _seen, state = _wait_drawn(browser, t, title, want, timeout_s)
            times.setdefault(name, []).append(dt)
            states[name] = state
    for name, _p, _title, want in in_app:
        ts, state = times.get(name, []), states.get(name, {})
        if len(ts) < 2:
            continue
        ok = not state.get("exceptions") and state.get("drawn", 0) >= want
        failed += not ok
        print(
            f"in-app    {name:16s} sidebar click to charts drawn: first visit {ts[0]:5.2f} s (query cache "
            f"emptied), again {ts[1]:5.2f} s   {state.get('drawn', 0)}/{want} charts"
            + ("" if ok else "  NOT DRAWN" + (" (exception on the page)" if state.get("exceptions") else ""))
        )
    return failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=10_240)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--store", help="embedded store directory (default: a temporary one, removed after)")
    p.add_argument("--server", default=os.environ.get("RANKLENS_BENCH_CLICKHOUSE"), help="a ClickHouse store URL")
    p.add_argument("--no-apptest", action="store_true", help="skip the end-to-end page runs")
    p.add_argument("--browser", action="store_true", help="time every page in headless Chromium (a real server)")
    p.add_argument("--no-pages", action="store_true", help="skip the per-page query and figure timings")
    p.add_argument("--reuse", action="store_true", help="use the job already in --store/--server (no new one)")
    args = p.parse_args(argv)
    if args.reuse and not (args.store or args.server):
        p.error("--reuse needs --store DIR or --server URL holding a job from an earlier run")

    tmp = None
    if args.server:
        url = args.server
    else:
        tmp = tempfile.mkdtemp(prefix="ranklens-dash-bench-") if not args.store else None
        url = f"embedded://{args.store or tmp}"
    store = open_store(url)
    try:
        slow = args.ranks // 3 + 1
        jobs = q.list_jobs(store) if args.reuse else None
        if jobs is not None and not jobs.empty:
            job_id = str(jobs["job_id"].iloc[0])
            print(f"reuse     job {job_id} in {url} ({int(jobs['ranks'].iloc[0]):,} ranks)")
        else:
            t = time.perf_counter()
            sim: SimResult = simulate(
                store,
                ranks=args.ranks,
                steps=args.steps,
                tp=args.ranks_per_node,  # a node is a tensor-parallel group; data parallel across nodes
                ranks_per_node=args.ranks_per_node,
                faults=[f"slow_gpu:{slow}:1.4@5", f"slow_link:{(args.ranks // args.ranks_per_node) // 2}:4"],
                telemetry=True,
                gpu_sample_s=5.0,
            )
            job_id = sim.job_id
            total = sum(sim.rows.values())
            dt = time.perf_counter() - t
            print(f"simulate  {args.ranks:,} ranks x {args.steps} steps: {total:,} rows in {dt:.1f} s")
            print("          " + ", ".join(f"{k} {v:,}" for k, v in sim.rows.items()))
            try:
                from ranklens.analyzers import find_stragglers, save_findings

                t = time.perf_counter()
                found = find_stragglers(store, job_id, 0)
                save_findings(store, found)
                ok = any(f.suspects and f.suspects[0].rank == slow for f in found)
                print(
                    f"analyze   straggler analyzer: {time.perf_counter() - t:.2f} s, {len(found)} finding(s), "
                    f"slowed rank {slow} {'found' if ok else 'NOT found'}"
                )
            except Exception as e:  # the analyzer is not under test here; the pages work without findings
                print(f"analyze   straggler analyzer failed: {e}")
        b = q.job_bounds(store, job_id, 0)
        pages: list[tuple[str, Callable[[Timer], None]]] = [
            ("overview", lambda tm: page_overview(store, job_id, tm)),
            ("findings", lambda tm: page_findings(store, job_id, tm)),
            ("timeline", lambda tm: page_timeline(store, job_id, tm, b, slow)),
            *((f"heat:{m}", functools.partial(_heat, store, job_id, b, m)) for m in q.HEAT_METRICS),
            ("links", lambda tm: page_links(store, job_id, tm, b)),
            ("hangs", lambda tm: page_hangs(store, job_id, tm)),
            ("gpu_logs", lambda tm: page_gpu_logs(store, job_id, tm, b)),
        ]
        print(f"pages     backend {store.backend}; heat-map rows: {q.choose_heat_axis(b.ranks, b.hosts, b.steps)}")
        for name, run in [] if args.no_pages else pages:
            tm = Timer()
            run(tm)
            print(
                f"page      {name:16s} queries {tm.query_s:6.2f} s ({tm.queries:2d})   figures {tm.figure_s:5.2f} s   "
                f"to browser {tm.json_bytes / 1e6:6.2f} MB   total {tm.query_s + tm.figure_s:6.2f} s"
            )
        if not args.no_apptest and store.backend == "embedded":
            run_apptest(url, job_id)
        urls = _browser_urls(store, job_id, b, slow) if args.browser else []
        store.close()  # the dashboard server opens the store itself
        return run_browser(url, urls) if args.browser else 0
    finally:
        store.close()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
