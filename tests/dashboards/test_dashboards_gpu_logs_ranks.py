"""The GPU + logs page with a malformed ``?ranks=`` link (issue 22 #10): ``"²".isdigit()`` is True
but ``int("²")`` raises, and the page crashed. It must ignore what is not a rank number, say so,
and still filter by the ranks that are."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("streamlit")
pytest.importorskip("plotly")

from streamlit.testing.v1 import AppTest

APP = Path(__file__).resolve().parents[2] / "dashboards" / "app.py"


@pytest.fixture(scope="module")
def store_url(tmp_path_factory):
    from ranklens.simulate import simulate
    from ranklens.store import open_store

    store = open_store(f"embedded://{tmp_path_factory.mktemp('gpulogs') / 'store'}")
    job = simulate(store, ranks=4, steps=6, ranks_per_node=2, telemetry=True, job_id="job-ranks")
    t = int(store.query("SELECT min(start_ns) FROM steps").scalar())
    store.write(
        "log_events",
        [
            {
                "job_id": job.job_id,
                "host": f"node{r // 2}",
                "rank": r,
                "ts_ns": t + 10**9 * (r + 1),
                "klass": "nccl_warning",
                "severity": "warning",
                "message": f"NCCL WARN marker of rank {r}",
                "context": [],
            }
            for r in range(4)
        ],
    )
    return store.url


@pytest.mark.parametrize("ranks", ["²", "²,1", "1,x,²"])
def test_gpu_logs_page_ignores_ranks_that_are_not_numbers(store_url, monkeypatch, ranks):
    monkeypatch.setenv("RANKLENS_STORE", store_url)
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.query_params["job"] = "job-ranks"
    at.query_params["ranks"] = ranks
    at.run()
    at.switch_page("page_gpu_logs.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    captions = "\n".join(str(c.value) for c in at.caption)
    assert "ignored (not rank numbers): " in captions and "'²'" in captions
    logs = [d.value for d in at.dataframe][-1]
    messages = [m for m in logs["message"].tolist() if "marker" in m]  # simulate_job logs lines too
    if "1" in ranks.split(","):
        assert messages == ["NCCL WARN marker of rank 1"] and set(logs["rank"]) == {1}
    else:  # no rank left to filter by: every rank's line
        assert sorted(messages) == [f"NCCL WARN marker of rank {r}" for r in range(4)]
