"""Every dashboard page, run by Streamlit's AppTest against a store filled by a real 4-rank job
(rank 2 slowed 1.5x from step 5), plus recorded recovery actions, GPU samples and log lines for
that job, and a simulated hung job for the hang view.

Asserts what an operator should see: the straggler finding and rank 2 where they belong, and no
exception element on any page.
"""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("streamlit")
pytest.importorskip("plotly")

from streamlit.testing.v1 import AppTest

pytestmark = pytest.mark.e2e

APP = Path(__file__).resolve().parents[2] / "dashboards" / "app.py"
SLOW = 2


@pytest.fixture(scope="module")
def dash_store(tmp_path_factory):
    """One real demo job (shared by every test here) plus the extra rows the other pages show."""
    from ranklens.demo import run_demo
    from ranklens.simulate import simulate
    from ranklens.store import open_store

    store = open_store(f"embedded://{tmp_path_factory.mktemp('dash') / 'store'}")
    demo = run_demo(store, ranks=4, slow_rank=SLOW, steps=20)
    assert demo.findings, "the demo job produced no finding"
    finding = demo.findings[0]
    b = store.query(f"SELECT min(start_ns), max(end_ns) FROM steps WHERE job_id = '{demo.job_id}'").rows()[0]
    t0, t1 = int(b[0]), int(b[1])
    store.write(
        "actions",
        [
            {
                "finding_id": finding.id,
                "job_id": demo.job_id,
                "attempt": 0,
                "action": "notify",
                "target": "http://127.0.0.1:9/ranklens-hook",
                "idempotency_key": f"{finding.id}:notify",
                "attempt_no": 1,
                "outcome": "acknowledged",
                "detail": "200",
                "ts_ns": t1,
            }
        ],
    )
    ts = np.linspace(t0, t1, 12).astype(np.int64)
    store.write(
        "gpu_samples",
        [
            {
                "host": "vm",
                "gpu_index": g,
                "ts_ns": int(t),
                "job_id": demo.job_id,
                "rank": g,
                "util_pct": 50.0 if g == SLOW else 95.0,
                "temp_c": 80.0 if g == SLOW else 60.0,
            }
            for g in range(4)
            for t in ts
        ],
    )
    store.write(
        "gpu_events",
        [
            {
                "host": "vm",
                "gpu_index": SLOW,
                "ts_ns": int(ts[3]),
                "rank": SLOW,
                "kind": "xid",
                "code": 79,
                "message": "GPU has fallen off the bus",
                "job_id": demo.job_id,
            }
        ],
    )
    store.write(
        "log_events",
        [
            {
                "job_id": demo.job_id,
                "host": "vm",
                "rank": SLOW,
                "ts_ns": int(ts[4]),
                "klass": "nccl_warning",
                "severity": "warning",
                "message": "NCCL WARN slow rank marker line",
                "context": ["line before"],
            }
        ],
    )
    hung = simulate(
        store, ranks=16, steps=6, tp=4, ranks_per_node=4, telemetry=True, hang_rank=6, job_id="sim-hung-job"
    )
    return {"url": store.url, "job": demo.job_id, "finding": finding, "hung": hung}


def _app(url: str, monkeypatch: pytest.MonkeyPatch, **params: Any) -> AppTest:
    monkeypatch.setenv("RANKLENS_STORE", url)
    at = AppTest.from_file(str(APP), default_timeout=120)
    for k, v in params.items():
        at.query_params[k] = str(v)
    at.run()
    _no_exception(at)
    return at


def _page(at: AppTest, script: str) -> AppTest:
    at.switch_page(script).run()
    _no_exception(at)
    return at


def _no_exception(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


def _figures(at: AppTest) -> list[dict[str, Any]]:
    return [json.loads(c.proto.spec) for c in at.get("plotly_chart")]


def _array(v: Any) -> np.ndarray:
    """A Plotly JSON array: a list, or a typed array (``{"dtype", "bdata", "shape"}``)."""
    if isinstance(v, dict) and "bdata" in v:
        a = np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"]))
        if "shape" in v:
            a = a.reshape([int(x) for x in str(v["shape"]).split(",")])
        return a
    return np.asarray(v)


def _text(at: AppTest) -> str:
    parts = [m.value for m in at.markdown] + [s.value for s in at.subheader] + [c.value for c in at.caption]
    parts += [str(getattr(p.proto, "label", "")) for p in at.get("page_link")]
    return "\n".join(map(str, parts))


def _frames(at: AppTest) -> list[Any]:
    return [d.value for d in at.dataframe]


def test_overview(dash_store, monkeypatch):
    at = _app(dash_store["url"], monkeypatch, job=dash_store["job"])
    assert at.title[0].value == "Jobs overview"
    jobs = _frames(at)[0]
    assert dash_store["job"] in set(jobs["job_id"])
    row = jobs[jobs["job_id"] == dash_store["job"]].iloc[0]
    assert row["open_findings"] >= 1 and row["health"] in ("critical", "degraded")
    figs = _figures(at)
    assert len(figs) == 2
    impact = figs[1]["data"][0]
    assert any(f"rank {SLOW}" in y for y in impact["y"])  # the straggler ranks first by impact
    assert f"rank {SLOW}" in _text(at)


def test_findings_page(dash_store, monkeypatch):
    f = dash_store["finding"]
    at = _app(dash_store["url"], monkeypatch, job=dash_store["job"], finding=f.id)
    _page(at, "page_findings.py")
    head = at.subheader[0].value
    assert "straggler" in head and f"rank {SLOW}" in head
    assert at.metric[0].value.endswith(" s") and float(at.metric[0].value.split()[0]) > 0
    text = _text(at)
    assert f"ranks {SLOW}" in text  # suspects line
    for label in ("Timeline at the onset", "Blame heat map", "Hang view", "GPU and logs"):
        assert label in text
    actions = [d for d in _frames(at) if "action" in d.columns]
    assert actions and actions[0]["action"].tolist() == ["notify"]
    assert actions[0]["outcome"].tolist() == ["acknowledged"]
    onset = _figures(at)[0]
    assert any("onset: step" in a.get("text", "") for a in onset["layout"].get("annotations", []))


def test_timeline_page(dash_store, monkeypatch):
    onset = dash_store["finding"].first_seen_step
    at = _app(dash_store["url"], monkeypatch, job=dash_store["job"], ranks=SLOW, step_from=onset, step_to=onset + 2)
    _page(at, "page_timeline.py")
    assert [n.value for n in at.number_input][:2] == [onset, onset + 2]
    fig = _figures(at)[0]
    names = {t.get("name") for t in fig["data"]}
    assert {"forward", "backward", "waiting for last arriver", "collective after last arrival"} <= names
    rows = set(fig["layout"]["yaxis"]["categoryarray"])
    assert len(rows) == 4 and any(r.startswith(f"rank {SLOW}") and "⚠" in r for r in rows)
    # the most skewed collective is linked across ranks and its last arriver is the slowed rank
    assert any(a.get("text") == f"last arrival: rank {SLOW}" for a in fig["layout"]["annotations"])
    culprits = _frames(at)[0]
    assert culprits.iloc[0]["rank"].startswith(f"rank {SLOW}")


def test_heatmaps_page(dash_store, monkeypatch):
    at = _app(dash_store["url"], monkeypatch, job=dash_store["job"], metric="blame", highlight=SLOW)
    _page(at, "page_heatmaps.py")
    heat = _figures(at)[0]["data"][0]
    z = _array(heat["z"])
    labels = list(heat["y"])
    hottest = labels[int(np.argmax(np.nansum(z, axis=1)))]
    assert hottest.startswith(f"rank {SLOW}")
    for metric in ("step_time", "phase_time", "wait"):
        at.selectbox[0].set_value(metric).run()
        _no_exception(at)
        assert _array(_figures(at)[0]["data"][0]["z"]).shape[0] == 4
    at.selectbox[1].set_value("node").run()  # aggregate rows by node: the demo runs on one node
    _no_exception(at)
    assert len(_figures(at)[0]["data"][0]["y"]) == 1


def test_links_page(dash_store, monkeypatch):
    at = _app(dash_store["url"], monkeypatch, job=dash_store["job"])
    _page(at, "page_links.py")
    figs = _figures(at)
    assert len(figs) == 3
    matrix = _array(figs[0]["data"][0]["z"])  # rank x rank: the demo's pair groups (0,1) and (2,3)
    assert matrix.shape == (4, 4) and np.isfinite(matrix[0, 1]) and np.isfinite(matrix[2, 3])
    groups = _frames(at)[0]
    assert {"default_pg", "pair_0", "pair_1"} <= set(groups["name"])


def test_hangs_page_finished_job(dash_store, monkeypatch):
    at = _app(dash_store["url"], monkeypatch, job=dash_store["job"])
    _page(at, "page_hangs.py")
    groups = _frames(at)[0]
    assert set(groups["name"]) == {"default_pg", "pair_0", "pair_1"}
    assert (groups["completed"] == groups["members"]).all()  # the job finished cleanly
    assert "every rank entered" in _text(at)


def test_hangs_page_hung_job(dash_store, monkeypatch):
    hung = dash_store["hung"]
    at = _app(dash_store["url"], monkeypatch, job=hung.job_id, pg="0")
    _page(at, "page_hangs.py")
    groups = _frames(at)[0]
    world = groups[groups["pg"] == "0"].iloc[0]
    assert world["not entered (ranks)"] == str(hung.hang_rank)
    assert world["entered"] == hung.ranks - 1 and world["completed"] == 0
    activity = _frames(at)[1]
    assert activity["rank"].tolist() == [hung.hang_rank]
    assert activity["phase"].tolist() == ["forward"]


def test_gpu_logs_page(dash_store, monkeypatch):
    at = _app(dash_store["url"], monkeypatch, job=dash_store["job"])
    _page(at, "page_gpu_logs.py")
    gpu, logs = _figures(at)
    series = {t.get("name") for t in gpu["data"]}
    assert {"vm:0", f"vm:{SLOW}", "GPU events"} <= series
    assert gpu["layout"]["xaxis"]["range"] == logs["layout"]["xaxis"]["range"]  # one time axis
    frames = _frames(at)
    assert frames[0]["kind"].tolist() == ["xid"]
    assert "NCCL WARN slow rank marker line" in frames[1]["message"].tolist()
    at.text_input[1].set_value("no such text anywhere").run()
    _no_exception(at)
    assert "no classified log lines" in _text(at)


def test_every_page_without_jobs(tmp_path, monkeypatch):
    """An empty store: every page says so instead of failing."""
    from ranklens.store import open_store

    store = open_store(f"embedded://{tmp_path / 'empty'}")
    at = _app(store.url, monkeypatch)
    for script, _title, _url in __import__("ranklens.dashboards.ui", fromlist=["PAGES"]).PAGES.values():
        _page(at, script)
        assert at.info, script


def test_page_load_is_fast(dash_store, monkeypatch):
    at = _app(dash_store["url"], monkeypatch, job=dash_store["job"])
    for script in ("page_timeline.py", "page_heatmaps.py", "page_hangs.py"):
        t = time.perf_counter()
        _page(at, script)
        assert time.perf_counter() - t < 20


def test_findings_page_shows_the_jobs_recoveries(dash_store, monkeypatch):
    from ranklens.store import open_store

    detail = {"kind": "hang", "mttd_s": 10.0, "mttr_s": 20.0, "lost_gpu_s": 80.0, "resumed_attempt": 1}
    base = {"finding_id": "f-recovered", "job_id": dash_store["job"], "action": "restart_rank", "target": "rank:1"}
    open_store(dash_store["url"], create=False).write(
        "actions",
        [
            {**base, "idempotency_key": "rk1", "outcome": "decided", "ts_ns": 1},
            {**base, "idempotency_key": "rk1", "outcome": "resumed", "ts_ns": 2, "detail": json.dumps(detail)},
        ],
    )
    from ranklens.dashboards import queries as q

    q._cached.clear()  # another test of this module may have cached the job's recoveries before these rows
    at = _app(dash_store["url"], monkeypatch, job=dash_store["job"])
    _page(at, "page_findings.py")
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["remediations"] == "1" and metrics["resumed training"] == "1"
    assert (metrics["mean MTTD"], metrics["mean MTTR"]) == ("10.0 s", "20.0 s")
    assert metrics["GPU time lost to recovery"] == "80 GPU-s"
    table = next(d for d in _frames(at) if "mttr_s" in d.columns)
    assert table["finding_id"].tolist() == ["f-recovered"]
