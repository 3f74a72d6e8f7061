"""A job traced without step markers (every collective at step -1, no steps rows) is a job: it is
listed, analysed from the arrival ledger alone, drawn by the dashboards, and its report says what
the analysis could not see."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ranklens.analyzers import find_stragglers, latest_job
from ranklens.analyzers.coverage import analysis_coverage
from ranklens.analyzers.windows import find_period
from ranklens.dashboards import queries as q
from tests.helpers import synthetic_job


def _stepless(job_id="job-nosteps", **kw):
    rows = synthetic_job(job_id=job_id, **kw)
    # an unmodified script: no steps rows; its loop issues a repeating pattern (2 sizes per iteration)
    for r in rows["collectives"]:
        r["step"] = -1
        r["nbytes"] = 4096 if r["seq"] % 3 else 65536
    rows.pop("steps")
    return rows


def test_period_of_a_repeating_ledger():
    loop = [("all_reduce", 1 << 20), ("all_reduce", 1 << 18), ("all_reduce", 4)]
    assert find_period([("barrier", 0), ("broadcast", 64)] + loop * 10) == (3, 2)
    assert find_period([("all_reduce", 4)] * 30) is None  # one kind: iterations cannot be told apart


def test_slow_rank_named_without_steps(store):
    store.write_many(_stepless(slow_rank=2, slow_from=6, steps=20, collectives_per_step=3))
    (f,) = find_stragglers(store, "job-nosteps")
    assert [s.rank for s in f.suspects] == [2]
    assert f.evidence["step_basis"] == "iterations"
    assert abs(f.first_seen_step - 6) <= 1, f.title
    assert "iteration" in f.title


def test_healthy_job_without_steps_names_nobody(store):
    store.write_many(_stepless(slow_rank=None, steps=30, noise_s=0.01))
    assert find_stragglers(store, "job-nosteps") == []


def test_job_without_steps_is_listed_and_drawn(store):
    store.write_many(synthetic_job(job_id="older"))  # a job with steps, finished earlier
    late = _stepless(slow_rank=1, steps=12)
    for r in late["collectives"]:
        r["enter_ns"] += 10**12
        r["end_ns"] += 10**12
    store.write_many(late)
    assert latest_job(store) == ("job-nosteps", 0)
    jobs = q.list_jobs(store)
    assert set(jobs["job_id"]) == {"older", "job-nosteps"}
    assert jobs["job_id"].iloc[0] == "job-nosteps"
    b = q.job_bounds(store, "job-nosteps", 0)
    assert b.ranks == 4 and b.steps == 0 and b.first_ns > 0
    blame = q.ledger_blame(store, "job-nosteps", 0)
    assert not blame.empty and set(blame["rank"]) <= {0, 1, 2, 3}
    assert blame.groupby("rank")["delay_s"].sum().idxmax() == 1


@pytest.mark.slow
def test_report_says_what_is_missing(store, tmp_path):
    store.write_many(_stepless(slow_rank=None, steps=12))
    cov = analysis_coverage(store, "job-nosteps")
    assert cov.step_source == "none" and cov.degraded
    assert any("no step markers" in n for n in cov.notes)
    assert any("no phases" in n for n in cov.notes)
    out = subprocess.run(
        [sys.executable, "-m", "ranklens.cli", "analyze", "--store", store.url, "--json", "--no-save"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["job_id"] == "job-nosteps" and doc["step_source"] == "none"
    assert doc["coverage"]["degraded"] and doc["coverage"]["notes"]
    text = subprocess.run(
        [sys.executable, "-m", "ranklens.cli", "analyze", "--store", store.url, "--no-save"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "No findings: no rank kept the others waiting" not in text.stdout
    assert "degraded" in text.stdout and "no step markers" in text.stdout


def test_explicit_steps_report_explicit(store):
    store.write_many(synthetic_job(job_id="marked"))
    assert analysis_coverage(store, "marked").step_source == "explicit"


@pytest.mark.slow
def test_dashboard_pages_draw_a_job_without_steps(tmp_path, monkeypatch):
    pytest.importorskip("streamlit")
    from streamlit.testing.v1 import AppTest

    from ranklens.analyzers import save_findings
    from ranklens.dashboards.ui import PAGES
    from ranklens.store import open_store

    store = open_store(f"embedded://{tmp_path}/store")
    store.write_many(_stepless(slow_rank=2, slow_from=4, steps=16))
    save_findings(store, find_stragglers(store, "job-nosteps"))
    monkeypatch.setenv("RANKLENS_STORE", store.url)
    at = AppTest.from_file(str(Path(__file__).resolve().parents[2] / "dashboards" / "app.py"), default_timeout=120)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert any("no step markers" in i.value for i in at.info), [i.value for i in at.info]
    assert "job-nosteps" in at.dataframe[0].value["job_id"].tolist()
    assert at.get("arrow_vega_lite_chart") or at.get("vega_lite_chart"), "no blame chart drawn"
    for script, _title, _path in PAGES.values():
        at.switch_page(script).run()
        assert not at.exception, (script, [e.value for e in at.exception])
        assert not at.error, (script, [e.value for e in at.error])
