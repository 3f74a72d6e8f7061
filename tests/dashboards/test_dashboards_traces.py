"""The GPU traces page and its queries (issue 17 #3), on a store holding only recorded profiler
traces (the 2-rank recsys set): the job is listed, the page shows HTA's numbers for both ranks and
draws a rank's GPU timeline of a profiler step."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("streamlit")

from streamlit.testing.v1 import AppTest

from ranklens.collector.kineto import ingest_kineto
from ranklens.dashboards import charts
from ranklens.dashboards import queries as q

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "dashboards" / "app.py"
TRACES = ROOT / "tests" / "data" / "kineto" / "hta_recsys_2rank_of128"


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    from ranklens.store import open_store

    store = open_store(f"embedded://{tmp_path_factory.mktemp('traces') / 'store'}")
    ingest_kineto(store, [TRACES], job_id="recsys")
    return store


def test_a_traces_only_job_is_listed_with_its_bounds(traced):
    jobs = q.list_jobs(traced)
    assert list(jobs["job_id"]) == ["recsys"] and int(jobs["ranks"].iloc[0]) == 2
    b = q.job_bounds(traced, "recsys", 0)
    assert b.ranks == 2 and b.last_ns > b.first_ns > 0


def test_timeline_of_a_profiler_step(traced):
    steps = q.trace_steps(traced, "recsys", 0)
    assert sorted(set(steps["step"])) == [551, 552] and sorted(set(steps["rank"])) == [0, 1]
    s = steps[(steps["rank"] == 1) & (steps["step"] == 551)].iloc[0]
    k = q.trace_timeline(traced, "recsys", 0, 1, int(s["start_ns"]), int(s["end_ns"]))
    assert len(k) > 100 and set(k["kernel_type"]) >= {"COMPUTATION", "COMMUNICATION"}
    assert (k["ts_ns"] >= s["start_ns"]).all() and (k["ts_ns"] < s["end_ns"]).all()
    fig = charts.trace_timeline_chart(k)
    assert {t.name for t in fig.data} >= {"computation", "communication"}


def test_the_page_shows_htas_numbers_per_rank(traced, monkeypatch):
    monkeypatch.setenv("RANKLENS_STORE", traced.url)
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.run()
    at.switch_page(str(ROOT / "dashboards" / "page_traces.py")).run()
    assert not at.exception, [e.value for e in at.exception]
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["traced ranks"] == "2"
    table = at.dataframe[0].value
    assert list(table["idle %"]) == [53.56, 54.72]  # HTA's idle_time_pctg for ranks 0 and 1
    assert list(table["comm/comp overlap %"]) == [11.81, 20.05]
