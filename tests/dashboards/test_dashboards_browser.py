"""The real dashboard in a real browser: ``ranklens dashboard``'s server (``streamlit run``) on a free
loopback port, every page loaded in headless Debian Chromium over the DevTools protocol, Plotly
charts waited for, a screenshot of each page saved to ``artifacts/dashboard-screenshots/`` (CI
keeps that folder), and the charts asserted to have drawn data (not a blank page, not an
exception box).

The store holds a simulated 64-rank job on 8 nodes (rank 13 slowed from step 5, node 3's links
slow) analysed by the real straggler analyzer, and a simulated hung job. Skipped when no Chromium
is installed (``apt-get install chromium``); ``RANKLENS_REQUIRE_BROWSER=1`` turns that into a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("streamlit")
pytest.importorskip("plotly")
pytest.importorskip("websockets")

from tests._sync import free_port, wait_until
from tests.cdp import Chromium, find_chromium

pytestmark = [pytest.mark.browser, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SHOTS = Path(os.environ.get("RANKLENS_SCREENSHOT_DIR") or ROOT / "artifacts" / "dashboard-screenshots")
SLOW = 13
REQUIRE = os.environ.get("RANKLENS_REQUIRE_BROWSER", "") == "1"

# url path, page title, charts that must show data
PAGES = [
    ("overview", "Jobs overview", 2),
    ("findings", "Findings", 2),
    ("timeline", "Timeline", 1),
    ("heatmaps", "Heat maps", 1),
    ("links", "Links", 3),
    ("hangs", "Hangs", 2),
    ("gpu-logs", "GPU and logs", 2),
    ("traces", "GPU traces", 1),
]

STATE_JS = """JSON.stringify((() => {
  const plots = Array.from(document.querySelectorAll('.js-plotly-plot'));
  const drawn = plots.filter(p => p.querySelectorAll('.trace path, .trace image, .hm image').length > 0);
  const sized = plots.filter(p => { const r = p.getBoundingClientRect(); return r.width > 200 && r.height > 150; });
  return {
    plots: plots.length,
    drawn: drawn.length,
    sized: sized.length,
    exceptions: document.querySelectorAll('[data-testid="stException"]').length,
    errors: document.querySelectorAll('[data-testid="stAlertContentError"]').length,
    running: document.querySelectorAll('[data-testid="stStatusWidget"]').length,
    titles: Array.from(document.querySelectorAll('h1')).map(h => h.innerText.trim()),
    text: document.body ? document.body.innerText.length : 0,
  };
})())"""


@pytest.fixture(scope="module")
def chromium_path() -> str:
    path = find_chromium()
    if path is None:
        msg = "no Chromium installed (apt-get install chromium): the dashboard browser test needs one"
        if REQUIRE:
            pytest.fail(msg + "; RANKLENS_REQUIRE_BROWSER=1 makes this a failure")
        pytest.skip(msg)
    return path


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    from ranklens.analyzers import find_stragglers, save_findings
    from ranklens.simulate import simulate
    from ranklens.store import open_store

    store = open_store(f"embedded://{tmp_path_factory.mktemp('browser') / 'store'}")
    hung = simulate(store, ranks=16, steps=6, tp=4, ranks_per_node=4, telemetry=True, hang_rank=6, job_id="sim-hung")
    job = simulate(
        store,
        ranks=64,
        steps=30,
        pp=2,
        tp=8,
        ranks_per_node=8,
        faults=[f"slow_gpu:{SLOW}:1.4@5", "slow_link:3:4"],
        telemetry=True,
        gpu_sample_s=1.0,
    )
    findings = find_stragglers(store, job.job_id, 0)
    assert findings and findings[0].suspects[0].rank == SLOW
    save_findings(store, findings)
    store.write(
        "actions",
        [
            {
                "finding_id": findings[0].id,
                "job_id": job.job_id,
                "action": "notify",
                "target": "http://127.0.0.1:9/hook",
                "outcome": "acknowledged",
                "ts_ns": job.last_ns,
            }
        ],
    )
    from ranklens.collector.kineto import ingest_kineto

    # a profiler window of the job: the recorded 2-rank traces, for the GPU traces page
    ingest_kineto(store, [ROOT / "tests" / "data" / "kineto" / "hta_recsys_2rank_of128"], job_id=job.job_id)
    return {"url": store.url, "job": job, "hung": hung, "finding": findings[0]}


@pytest.fixture(scope="module")
def server(jobs, tmp_path_factory):
    from ranklens.dashboards.launch import dashboard_healthy, start_dashboard
    from ranklens.formats.process import stop_process

    port = free_port()
    log_path = tmp_path_factory.mktemp("streamlit") / "server.log"
    with open(log_path, "wb") as log:
        proc = start_dashboard(jobs["url"], "127.0.0.1", port, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        return dashboard_healthy(base)

    try:
        wait_until(  # readiness: streamlit's start on a loaded machine
            healthy,
            300,
            "the dashboard server's health check",
            interval_s=0.3,
            procs=[proc],
            detail=lambda: log_path.read_text()[-3000:],
        )
        yield base
    finally:
        stop_process(proc, timeout_s=15)


def _load(browser: Chromium, url: str, title: str, want: int, timeout_s: float = 180.0) -> dict:
    """Navigate and wait until the page is ready (its script done, ``want`` charts drawn, three polls
    in a row); the deadline bounds readiness only (a loaded machine runs the page slowly), what is
    drawn is asserted by the caller."""
    browser.navigate(url)
    deadline = time.monotonic() + timeout_s
    state: dict = {}
    stable = 0
    while time.monotonic() < deadline:
        state = json.loads(browser.evaluate(STATE_JS))
        ready = title in state["titles"] and state["running"] == 0 and state["drawn"] >= want
        if state["exceptions"]:
            break
        stable = stable + 1 if ready else 0
        if stable >= 3:  # three polls in a row: the script finished and Plotly drew
            break
        time.sleep(0.3)
    time.sleep(0.5)
    return state


@pytest.mark.timeout(1800)
def test_every_page_renders_its_charts(chromium_path, server, jobs):
    job = jobs["job"]
    onset = jobs["finding"].first_seen_step
    params = {
        "overview": {"job": job.job_id},
        "findings": {"job": job.job_id, "finding": jobs["finding"].id},
        "timeline": {"job": job.job_id, "ranks": SLOW, "step_from": onset, "step_to": onset + 1},
        "heatmaps": {"job": job.job_id, "metric": "blame", "highlight": SLOW},
        "links": {"job": job.job_id},
        "hangs": {"job": jobs["hung"].job_id, "pg": "0"},
        "gpu-logs": {"job": job.job_id},
        "traces": {"job": job.job_id, "rank": 1},
    }
    SHOTS.mkdir(parents=True, exist_ok=True)
    problems = []
    with Chromium(chromium_path, width=1400, height=2000) as browser:
        for path, title, want in PAGES:
            url = f"{server}/{path}?{urllib.parse.urlencode(params[path])}"
            t = time.perf_counter()
            state = _load(browser, url, title, want)
            shot = browser.screenshot(SHOTS / f"{path}.png")
            print(f"{path}: {time.perf_counter() - t:.1f} s, {state['drawn']}/{state['plots']} charts drawn, {shot}")
            if title not in state["titles"]:
                problems.append(f"{path}: title {title!r} never appeared ({state['titles']})")
            if state["exceptions"] or state["errors"]:
                problems.append(f"{path}: {state['exceptions']} exception box(es), {state['errors']} error(s)")
            if state["drawn"] < want or state["sized"] < want:
                problems.append(f"{path}: {state['drawn']} charts with data, {state['sized']} sized; want {want}")
            if state["text"] < 100:
                problems.append(f"{path}: blank page")
            assert shot.stat().st_size > 10_000, f"{path}: screenshot looks empty"
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(600)
def test_auto_refresh_shows_new_data_without_a_reload(chromium_path, server, jobs):
    """?refresh=5: steps written to the store while the page is open appear on it by themselves."""
    import re

    from ranklens.store import open_store

    hung = jobs["hung"]
    url = f"{server}/overview?{urllib.parse.urlencode({'job': hung.job_id, 'refresh': 5})}"

    def caption(browser: Chromium) -> str:
        m = re.search(r"steps (\d+)-(\d+)", browser.evaluate("document.body ? document.body.innerText : ''"))
        return m.group(0) if m else ""

    with Chromium(chromium_path, width=1400, height=1200) as browser:
        # ready when the sidebar shows the step range (what this test reads). Not _load(): with
        # refresh=5 on a loaded machine the page is rerunning most of the time, so "script done, three
        # polls in a row" may never hold, and a wrong title ("Overview") made it wait out its deadline
        browser.navigate(url)
        before = wait_until(lambda: caption(browser), 180, "the overview's step range in the sidebar", interval_s=0.3)
        last = int(before.rsplit("-", 1)[1])
        store = open_store(jobs["url"])
        rows = [
            {
                "job_id": hung.job_id,
                "rank": r,
                "step": last + k,
                "start_ns": hung.last_ns + k,
                "end_ns": hung.last_ns + k + 1,
            }
            for k in (1, 2, 3)
            for r in range(16)
        ]
        store.write("steps", rows)
        want = f"steps {before.split(' ')[1].split('-')[0]}-{last + 3}"
        # query cache (10 s) + refresh period (5 s) + a page run, which a loaded machine makes slow
        wait_until(
            lambda: caption(browser) == want,
            180,
            f"the page to show {want!r} without a reload",
            interval_s=1.0,
            detail=lambda: f"the page still shows {caption(browser)!r}",
        )
