"""Dashboard queries on both store backends (chDB and the ClickHouse server, 18.16 in CI), the
Plotly figure builders as pure functions, and the launcher — without Streamlit's runtime.

The data comes from the one simulator (``ranklens.simulate``, with telemetry): 32 ranks on 8 nodes
(pp 2 x dp 4 x tp 4, 4 ranks a node: a node is a tensor-parallel group), rank 5 computing 1.4x
slower from step 3, node 2's network link 4x slower; and a simulated hung job.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("plotly")

from ranklens.dashboards import charts
from ranklens.dashboards import queries as q
from ranklens.simulate import simulate

SLOW, SLOW_NODE, HANG = 5, 2, 6


@pytest.fixture
def sim(store):
    job = simulate(
        store,
        ranks=32,
        steps=8,
        pp=2,
        tp=4,
        ranks_per_node=4,
        faults=[f"slow_gpu:{SLOW}:1.4@3", f"slow_link:{SLOW_NODE}:4"],
        telemetry=True,
        gpu_sample_s=0.5,
    )
    hung = simulate(store, ranks=16, steps=4, tp=4, ranks_per_node=4, telemetry=True, hang_rank=HANG, job_id="sim-hung")
    return store, job, hung


def test_jobs_bounds_and_ranks(sim):
    store, job, hung = sim
    jobs = q.list_jobs(store)
    assert {job.job_id, hung.job_id} <= set(jobs["job_id"])
    row = jobs[jobs["job_id"] == job.job_id].iloc[0]
    assert row["ranks"] == 32 and row["last_step"] == 7 and row["health"] in ("healthy", "finished")
    b = q.job_bounds(store, job.job_id, 0)
    assert (b.ranks, b.hosts, b.first_step, b.last_step, b.steps) == (32, 8, 0, 7, 8)
    info = q.rank_info(store, job.job_id, 0)
    assert len(info) == 32 and info.loc[info["rank"] == SLOW, "node"].item() == job.host(SLOW)
    trend = q.step_trend(store, job.job_id, 0)
    assert trend["step"].tolist() == list(range(8)) and (trend["max_s"] >= trend["p50_s"]).all()
    assert len(q.step_trend(store, job.job_id, 0, max_points=3)) <= 4  # bucketed
    assert set(q.phase_names(store, job.job_id, 0)["phase"]) == {"data", "forward", "backward", "optimizer"}


def test_findings_history_and_actions(sim):
    from ranklens.analyzers import find_stragglers, save_findings

    store, job, _ = sim
    found = find_stragglers(store, job.job_id, 0)
    save_findings(store, found)
    store.write(
        "actions",
        [{"finding_id": found[0].id, "job_id": job.job_id, "action": "notify", "outcome": "sent", "ts_ns": 1}],
    )
    df = q.findings(store, job.job_id, 0)
    assert df.iloc[0]["suspect_ranks"].tolist() == [SLOW]
    assert isinstance(df.iloc[0]["evidence"], dict) and df.iloc[0]["versions"] == 1
    assert len(q.finding_history(store, found[0].id)) == 1
    assert q.finding_actions(store, found[0].id)["action"].tolist() == ["notify"]


def test_timeline_and_blame(sim):
    store, job, _ = sim
    b = q.job_bounds(store, job.job_id, 0)
    worst = q.worst_ranks(store, job.job_id, 0, 3, 7, 3, b.first_ns)
    assert int(worst.iloc[0]["culprit"]) == SLOW
    phases = q.timeline_phases(store, job.job_id, 0, 4, 5, (SLOW, 4))
    assert set(phases["rank"]) == {SLOW, 4} and len(phases) == 2 * 2 * 4
    colls = q.timeline_collectives(store, job.job_id, 0, 4, 5, (SLOW, 4))
    # ranks 4 and 5 share node 1's tensor-parallel group: the slowed rank arrives last at every one
    tp = colls[(colls["members"] == 4) & colls["rank"].eq(4)]["pg"].value_counts().idxmax()
    group = colls[colls["pg"] == tp]
    assert len(group) > 0 and (group["last_rank"] == SLOW).all()
    assert (colls["last_enter_ns"] >= colls["enter_ns"]).all()


@pytest.mark.parametrize("metric", q.HEAT_METRICS)
def test_heatmap_every_metric_and_axis(sim, metric):
    store, job, _ = sim
    b = q.job_bounds(store, job.job_id, 0)
    kw = {"phase": "backward", "t0_ns": b.first_ns}
    by_rank = q.heatmap(store, job.job_id, 0, metric, 0, 7, axis="rank", **kw)
    _z, rows, steps = charts.pivot_heat(by_rank)
    assert len(rows) == 32 and steps == list(range(8))
    by_node = q.heatmap(store, job.job_id, 0, metric, 0, 7, axis="node", **kw)
    assert set(by_node["row_key"]) <= {job.host(r) for r in range(32)} and len(set(by_node["row_key"])) >= 7
    buckets = q.heatmap(store, job.job_id, 0, metric, 0, 7, axis="bucket", rank_bucket=8, step_bucket=2, **kw)
    assert set(buckets["row_key"]) <= {0, 8, 16, 24} and set(buckets["step_key"]) <= {0, 2, 4, 6}
    late = by_rank[by_rank["step_key"] >= 4]
    hottest = int(late.groupby("row_key")["value"].sum().idxmax())
    hot_node = by_node[by_node["step_key"] >= 4].groupby("row_key")["value"].sum().idxmax()
    # the culprit's own row, not its victims' (a phase or a step lasts as long on the ranks that
    # wait for the straggler inside it: those metrics light up the whole pipeline stage)
    if metric in ("blame", "compute"):
        assert hottest == SLOW and hot_node == job.host(SLOW)


def _nodes_of(names: pd.DataFrame, store, job_id: str) -> dict[str, set[str]]:
    groups = store.query(f"SELECT pg, ranks FROM process_groups WHERE job_id = '{job_id}'").rows()
    hosts = dict(store.query(f"SELECT rank, host FROM ranks WHERE job_id = '{job_id}'").rows())
    return {str(pg): {hosts[int(r)] for r in members} for pg, members in groups}


def test_links(sim):
    store, job, _ = sim
    pairs = q.pair_bandwidth(store, job.job_id, 0, 0, 7)
    # 16 pipeline pairs (stage 0 <-> stage 1), each a forward and a backward exchange per step, the
    # first of each direction left out (connection set-up)
    assert len(pairs) == 16 and (pairs["calls"] == 2 * 7).all()
    nodes = {r: job.host(r) for r in range(32)}
    m, keys = charts.bandwidth_matrix(pairs, lambda r: nodes[r])
    assert np.allclose(np.nan_to_num(m), np.nan_to_num(m.T))
    slow = keys.index(job.host(SLOW_NODE * 4))
    peer = keys.index(job.host(SLOW_NODE * 4 + 16))  # the same (dp, tp) coordinate in stage 1
    other = keys.index(job.host(0))
    assert m[slow, peer] < 0.5 * m[other, keys.index(job.host(16))]
    groups = q.group_bandwidth(store, job.job_id, 0, 0, 7)
    names = q.group_names(store, job.job_id, 0)
    desc = dict(zip(names["pg"], names["pg_desc"]))
    members = _nodes_of(names, store, job.job_id)
    dp = groups[[desc.get(pg, "").startswith("dp_") for pg in groups["pg"]]]
    slow_dp = set(dp[dp["bytes_per_s"] < 0.5 * dp["bytes_per_s"].max()]["pg"])
    assert slow_dp and all(job.host(SLOW_NODE * 4) in members[pg] for pg in slow_dp)
    assert {desc[pg] for pg in slow_dp} == {"dp_0", "dp_1", "dp_2", "dp_3"}  # stage 0's: through node 2
    p2p = groups[groups["op_kind"] == "p2p"]
    slow_p2p = set(p2p[p2p["bytes_per_s"] < 0.5 * p2p["bytes_per_s"].max()]["pg"])
    ends = {int(x) for pg in slow_p2p for x in pg.rsplit(":", 1)[1].split("->")}
    assert ends == {*range(8, 12), *range(24, 28)}  # node 2's ranks and their stage-1 partners
    per_rank = q.rank_bandwidth(store, job.job_id, 0, 0, 7)
    assert len(per_rank) == 32 and (per_rank["total_xfer_ns"] > 0).all()
    assert names.loc[names["pg"] == "0", "size"].item() == 32


def test_hang_groups(sim):
    store, job, hung = sim
    g = q.hang_groups(store, hung.job_id, 0)
    world = g[g["pg_name"] == "0"].iloc[0]
    assert world["not_entered"] == [HANG] and world["not_entered_n"] == 1
    assert world["entered_n"] == 15 and world["completed_n"] == 0 and world["members_n"] == 16
    assert (g[g["pg_name"] != "0"]["completed_n"] == g[g["pg_name"] != "0"]["members_n"]).all()
    act = q.rank_last_activity(store, hung.job_id, 0, (HANG, 0))
    assert act["rank"].tolist() == [0, HANG]
    assert list(act.loc[act["rank"] == 0, "in_flight_pgs"].item()) == ["0"]
    assert len(q.heartbeat_ages(store, hung.job_id, 0)) == 16
    healthy = q.hang_groups(store, job.job_id, 0)
    assert len(healthy) > 1 and (healthy["not_entered_n"] == 0).all()


def test_gpu_and_logs(sim):
    store, job, hung = sim
    b = q.job_bounds(store, job.job_id, 0)
    lo, hi = b.first_ns - 10**12, b.last_ns + 10**12
    series = q.gpu_series(store, job.job_id, 0, lo, hi, "util_pct", max_series=8)
    names = set(series["series"])
    assert {"fleet p10", "fleet p50", "fleet p90"} <= names  # 32 GPUs > 8: summarised
    assert f"{job.host(SLOW)}:{SLOW % 4}" in names  # the straggler's GPU is among the worst
    few = q.gpu_series(store, job.job_id, 0, lo, hi, "temp_c", max_series=64)
    assert len(set(few["series"])) == 32
    assert q.gpu_events(store, job.job_id, 0, lo, hi)["rank"].tolist() == [SLOW]
    assert len(q.log_classes(store, job.job_id, 0)) == 1
    logs = q.log_events(store, hung.job_id, 0, 0, 2**62, klasses=("nccl_timeout",), text="MISSING")
    assert logs["rank"].tolist() == [HANG]
    assert q.log_events(store, hung.job_id, 0, 0, 2**62, severities=("error",), ranks=(0,)).empty


def test_cached_rejects_unknown_names():
    with pytest.raises(ValueError, match="not a dashboard query"):
        q.cached("get_store", "embedded:///nowhere")
    with pytest.raises(ValueError, match="not a dashboard query"):
        q.cached("os", "embedded:///nowhere")
    with pytest.raises(ValueError, match="not a dashboard query"):
        q.cached("choose_heat_axis", "embedded:///nowhere")
    assert {"heatmap", "worst_ranks", "group_bandwidth"} <= set(q.QUERIES)


def test_choose_heat_axis_keeps_cells_bounded():
    assert q.choose_heat_axis(64, 8, 50) == ("rank", 1)
    assert q.choose_heat_axis(10_240, 1_280, 50) == ("node", 1)
    axis, bucket = q.choose_heat_axis(10_240, 1, 400)
    assert axis == "bucket" and (10_240 / bucket) * 400 <= q.MAX_CELLS
    axis, bucket = q.choose_heat_axis(100_000, 12_500, 400)
    assert axis == "bucket" and (100_000 / bucket) * 400 <= q.MAX_CELLS


def test_charts_are_pure_functions_of_frames():
    t = 1_800_000_000_000_000_000
    phases = pd.DataFrame(
        {
            "rank": [0, 0, 1, 1],
            "step": [1, 1, 1, 1],
            "phase": ["forward", "backward", "forward", "backward"],
            "start_ns": [t, t + 10, t, t + 30],
            "end_ns": [t + 10, t + 20, t + 30, t + 60],
        }
    )
    colls = pd.DataFrame(
        {
            "rank": [0, 1],
            "pg": ["0", "0"],
            "seq": [3, 3],
            "op": ["all_reduce"] * 2,
            "nbytes": [8, 8],
            "step": [1, 1],
            "enter_ns": [t + 20, t + 60],
            "end_ns": [t + 70, t + 70],
            "last_enter_ns": [t + 60, t + 60],
            "last_rank": [1, 1],
            "members": [2, 2],
        }
    )
    fig = charts.gantt_chart(phases, colls, highlight=("0", 3), culprits=[1])
    names = [tr.name for tr in fig.data]
    assert names[:2] == ["forward", "backward"] and "waiting for last arriver" in names
    wait = next(tr for tr in fig.data if tr.name == "waiting for last arriver")
    assert list(wait.x) == pytest.approx([40e-6, 0.0])  # rank 0 waited 40 ns for rank 1
    assert "rank 1 ⚠" in fig.layout.yaxis.categoryarray
    z, rows, steps = charts.pivot_heat(
        pd.DataFrame({"row_key": [0, 1, 1], "step_key": [5, 5, 6], "value": [1.0, 2.0, 3.0]})
    )
    assert rows == [0, 1] and steps == [5, 6] and np.isnan(z[0, 1]) and z[1, 1] == 3.0
    heat = charts.heatmap_chart(z, ["a", "b"], steps, title="t", highlight_rows=[1])
    assert len(heat.layout.shapes) == 1
    for empty in (
        charts.step_trend_chart(pd.DataFrame(columns=["step", "p50_s", "p90_s", "max_s"])),
        charts.findings_impact_chart(pd.DataFrame()),
        charts.gantt_chart(phases.head(0), colls.head(0)),
        charts.hang_groups_chart(pd.DataFrame()),
        charts.log_events_chart(pd.DataFrame(), x_range=(t, t + 1)),
    ):
        assert empty.layout.annotations and not empty.data
    onset = charts.finding_onset_chart([{"step": 1, "excess_s": 0.2}, {"step": 2, "excess_s": 0.3}], 1, 2)
    assert [tr.name for tr in onset.data] == ["excess"]


def test_launcher_command_and_errors(tmp_path):
    from ranklens.dashboards.launch import APP_PATH, dashboard_command, start_dashboard
    from ranklens.errors import ConfigError, StoreUnavailable

    cmd = dashboard_command("127.0.0.1", 8600)
    assert cmd[1:5] == ["-m", "streamlit", "run", str(APP_PATH)]
    assert cmd[cmd.index("--server.port") + 1] == "8600"
    assert cmd[cmd.index("--server.address") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--browser.gatherUsageStats") + 1] == "false"
    with pytest.raises(ConfigError, match="--port"):
        dashboard_command("127.0.0.1", 0)
    with pytest.raises(ConfigError, match="--host"):
        dashboard_command("", 8501)
    with pytest.raises(StoreUnavailable, match="no ranklens store"):
        start_dashboard(f"embedded://{tmp_path / 'missing'}", "127.0.0.1", 8601)


def test_job_recoveries_pair_each_remediation_with_its_mttd_and_mttr(store):
    import json

    def row(fid, key, outcome, ts, action="restart_rank", detail=""):
        return {
            "finding_id": fid,
            "job_id": "rec-job",
            "action": action,
            "target": "rank:2",
            "idempotency_key": key,
            "outcome": outcome,
            "ts_ns": ts,
            "detail": detail,
        }

    resumed = {"kind": "hang", "mttd_s": 10.5, "mttr_s": 18.25, "lost_gpu_s": 73.0, "resumed_attempt": 1}
    store.write(
        "actions",
        [
            row("f1", "k1", "decided", 100),
            row("f1", "k1", "acknowledged", 101),
            row("f1", "k1", "resumed", 200, detail=json.dumps(resumed)),
            row("f2", "k2", "decided", 300, action="replace_node"),  # training did not resume (yet)
            row("f3", "k3", "decided", 400, action="notify"),  # not a remediation
            {**row("f4", "k4", "decided", 50), "job_id": "another-job"},
        ],
    )
    df = q.job_recoveries(store, "rec-job")
    assert df["finding_id"].tolist() == ["f1", "f2"] and df["action"].tolist() == ["restart_rank", "replace_node"]
    first = df.iloc[0]
    assert (first["kind"], first["mttd_s"], first["mttr_s"], first["lost_gpu_s"]) == ("hang", 10.5, 18.25, 73.0)
    assert pd.isna(df.iloc[1]["mttr_s"]) and pd.isna(df.iloc[1]["kind"])
    assert q.job_recoveries(store, "no-such-job").empty
