"""issue 19 #4, metrics that scale: the collector's series do not grow with ranks or attempts.

GPU series carry the GPU's labels only; ``ranklens_rank_info`` (one series per live rank) says which
rank uses which GPU, and PromQL joins the two on ``uuid``; per-rank training metrics are per-node
aggregates plus the ``top_k`` slowest ranks; ``ranklens_build_info`` and the process's own series
are on the collector's registry. Everything is read from the registry's text exposition, as
Prometheus reads it."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from collections import Counter

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import ranklens
from ranklens.collector.agent import AgentConfig, env_overrides
from ranklens.collector.fake_nvml import fake_nvml
from ranklens.collector.metrics import CollectorMetrics
from ranklens.collector.nvml import GpuSampler, RankResolver
from ranklens.errors import ConfigError
from ranklens.formats.process import pid_namespace
from ranklens.formats.spool import SpoolWriter
from ranklens.records import to_arrow
from ranklens.schema import SCHEMA_VERSION
from tests._sync import wait_until
from tests.collector._agent import agent_config

NODE = "node-a"
RANKS_PER_NODE = 64
GPUS = 8
GPU_LABELS = {"node", "gpu", "uuid", "reason", "clock", "type", "direction"}


def _series(cm: CollectorMetrics) -> list[tuple[str, dict[str, str], float]]:
    text = generate_latest(cm.registry).decode()
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def _ranklens(series):
    """The ranklens series (not prometheus-client's process_*/python_info) and no _created."""
    return [(n, labels, v) for n, labels, v in series if n.startswith("ranklens_") and not n.endswith("_created")]


def _sampler(mapping: dict[int, tuple[str, int]]) -> tuple[GpuSampler, list[str]]:
    fake = fake_nvml(GPUS)
    clock = iter(range(10**18, 10**18 + 10**12, 10**9))
    s = GpuSampler(fake, host=NODE, clock=lambda: next(clock), resolver=RankResolver(static=mapping))
    assert s.start()
    return s, [g.uuid for g in fake.gpus]


def _attempt(cm: CollectorMetrics, job: str, attempt: int, ranks: range, *, slow: int = -1, t0: int = 0) -> None:
    """One attempt's rows as the collector ships them: who runs where, a step, collectives, heartbeats."""
    now = time.time_ns() + t0
    cm.observe_rows(
        "ranks",
        to_arrow(
            "ranks",
            [{"job_id": job, "attempt": attempt, "rank": r, "host": NODE, "started_ns": now} for r in ranks],
        ),
    )
    dur = {r: (3 if r == slow else 1) * 10**9 for r in ranks}
    steps = [
        {"job_id": job, "attempt": attempt, "rank": r, "step": 5, "start_ns": now, "end_ns": now + dur[r]}
        for r in ranks
    ]
    cm.observe_rows("steps", to_arrow("steps", steps))
    colls = [
        {"job_id": job, "attempt": attempt, "rank": r, "pg": "0", "seq": 1, "op": "all_reduce",
         "enter_ns": now, "end_ns": now + 10**8}
        for r in ranks
    ]  # fmt: skip
    cm.observe_rows("collectives", to_arrow("collectives", colls))
    beats = [{"job_id": job, "attempt": attempt, "rank": r, "host": NODE, "ts_ns": now + r} for r in ranks]
    cm.observe_rows("heartbeats", to_arrow("heartbeats", beats))


def test_series_stay_bounded_across_attempts_and_rank_info_holds_the_live_attempt_only():
    mapping = {g: ("big", g) for g in range(GPUS)}  # NVML: GPU g runs rank g of job "big"
    sampler, _ = _sampler(mapping)
    cm = CollectorMetrics(node=NODE, top_k=3)
    counts, distinct = [], set()
    for attempt in range(3):
        _attempt(cm, "big", attempt, range(RANKS_PER_NODE), slow=10 + attempt)
        r = sampler.sample()
        cm.observe_gpus(r.samples, r.extras)
        series = _ranklens(_series(cm))
        counts.append(len(series))
        distinct |= {(n, tuple(sorted(labels.items()))) for n, labels, _ in series}
        info = [labels for n, labels, _ in series if n == "ranklens_rank_info"]
        assert len(info) == RANKS_PER_NODE and {i["attempt"] for i in info} == {str(attempt)}
        assert sorted(int(i["rank"]) for i in info) == list(range(RANKS_PER_NODE))
        # the per-rank families: at most k series each, the slowest rank first among them
        per_family = Counter(n for n, labels, _ in series if "rank" in labels and n != "ranklens_rank_info")
        assert per_family == {"ranklens_rank_step_duration_seconds": 3, "ranklens_rank_heartbeat_timestamp_seconds": 3}
        top = {labels["rank"]: v for n, labels, v in series if n == "ranklens_rank_step_duration_seconds"}
        assert top[str(10 + attempt)] == 3.0 and len(top) == 3
        # no attempt label anywhere but on rank_info: nothing new per attempt
        assert all("attempt" not in labels for n, labels, _ in series if n != "ranklens_rank_info")
    sampler.close()
    assert counts[0] == counts[1] == counts[2], counts
    # what Prometheus would hold after the three attempts: the live set plus one attempt's worth of
    # rank_info and the top-k that changed, not 3 x 64 x every family
    assert len(distinct) <= counts[0] + 2 * (RANKS_PER_NODE + 2 * 3), (len(distinct), counts)
    agg = {(n, labels.get("stat")): v for n, labels, v in _ranklens(_series(cm)) if n.startswith("ranklens_node_")}
    assert agg[("ranklens_node_ranks", None)] == RANKS_PER_NODE
    assert agg[("ranklens_node_step_duration_seconds", "max")] == 3.0
    assert agg[("ranklens_node_step_duration_seconds", "median")] == 1.0
    assert agg[("ranklens_node_steps_total", None)] == 3 * RANKS_PER_NODE  # a counter: every attempt's steps
    assert agg[("ranklens_node_collectives_total", None)] == 3 * RANKS_PER_NODE
    assert agg[("ranklens_node_collective_wait_seconds_total", None)] == pytest.approx(3 * RANKS_PER_NODE * 0.1)


def test_no_job_rank_or_attempt_label_on_any_gpu_series():
    sampler, _ = _sampler({g: ("j", g) for g in range(GPUS)})
    cm = CollectorMetrics(node=NODE)
    _attempt(cm, "j", 0, range(GPUS))
    for _ in range(2):  # the second reading has the throughput rates too
        r = sampler.sample()
        cm.observe_gpus(r.samples, r.extras)
    sampler.close()
    gpu = [(n, labels) for n, labels, _ in _series(cm) if n.startswith("ranklens_gpu_")]
    assert {n for n, _ in gpu} >= {"ranklens_gpu_utilization_ratio", "ranklens_gpu_clocks_event_reason"}
    for n, labels in gpu:
        if n != "ranklens_gpu_events_total":
            assert set(labels) <= GPU_LABELS and {"node", "gpu", "uuid"} <= set(labels), (n, labels)
        assert not {"job_id", "rank", "attempt"} & set(labels), (n, labels)


def _join(series, metric: str) -> dict[str, tuple[str, str]]:
    """``metric * on (uuid) group_left (job_id, rank) ranklens_rank_info{uuid!=""}``, evaluated the
    way Prometheus does: uuid -> (job_id, rank); the right side must be one series per uuid."""
    info = [labels for n, labels, _ in series if n == "ranklens_rank_info" and labels.get("uuid")]
    by_uuid = {i["uuid"]: (i["job_id"], i["rank"]) for i in info}
    assert len(by_uuid) == len(info), "duplicate series for the match group: the join would fail"
    return {
        labels["uuid"]: by_uuid[labels["uuid"]] for n, labels, _ in series if n == metric and labels["uuid"] in by_uuid
    }


def test_the_gpu_series_join_rank_info_on_uuid():
    # GPUs 0-3: job "train" ranks 8-11 (NVML's processes); GPU 4: a rank only NVML knows; 5-7 idle
    mapping = {g: ("train", 8 + g) for g in range(4)} | {4: ("other", 0)}
    sampler, uuids = _sampler(mapping)
    cm = CollectorMetrics(node=NODE)
    _attempt(cm, "train", 1, range(8, 12))
    _attempt(cm, "cpu-job", 0, range(2))  # CPU ranks: rank_info without a uuid, the join unharmed
    r = sampler.sample()
    cm.observe_gpus(r.samples, r.extras)
    sampler.close()
    series = _series(cm)
    joined = _join(series, "ranklens_gpu_utilization_ratio")
    want = {uuids[g]: ("train", str(8 + g)) for g in range(4)} | {uuids[4]: ("other", "0")}
    assert joined == want
    info = {(i["job_id"], i["rank"]): i for n, i, _ in series if n == "ranklens_rank_info"}
    assert info[("train", "9")] == {"job_id": "train", "attempt": "1", "rank": "9", "node": NODE, "gpu": "1",
                                    "uuid": uuids[1]}  # fmt: skip
    assert info[("other", "0")].get("attempt", "") == ""  # no rows from it: the attempt is not known
    assert info[("cpu-job", "1")].get("uuid", "") == "" and len(info) == 4 + 1 + 2


def test_rank_info_follows_the_ranks_lifetime():
    cm = CollectorMetrics(node=NODE)
    _attempt(cm, "j", 0, range(4))

    def ranks() -> list[tuple[str, str, str]]:
        return sorted(
            (labels["job_id"], labels["attempt"], labels["rank"])
            for n, labels, _ in _series(cm)
            if n == "ranklens_rank_info"
        )

    assert ranks() == [("j", "0", str(r)) for r in range(4)]
    now = time.time_ns()
    # rank 0 shuts tracing down (exited 1); the collector's liveness watcher finds rank 1 gone (exited 2)
    last = [{"job_id": "j", "rank": r, "host": NODE, "ts_ns": now + 10**9, "exited": r + 1} for r in (0, 1)]
    cm.observe_rows("heartbeats", to_arrow("heartbeats", last))
    assert ranks() == [("j", "0", "2"), ("j", "0", "3")]
    # a late segment of rank 0 (shipped after its last heartbeat) does not bring it back
    late = [{"job_id": "j", "rank": 0, "step": 9, "start_ns": now, "end_ns": now + 1}]
    cm.observe_rows("steps", to_arrow("steps", late))
    assert ranks() == [("j", "0", "2"), ("j", "0", "3")]
    # a GPU the tracer named: a newer job's rank on the same GPU takes it over
    cm.observe_rows(
        "ranks",
        to_arrow("ranks", [{"job_id": "j", "rank": 2, "host": NODE, "gpu_index": 0, "gpu_uuid": "GPU-x",
                            "started_ns": now}]),
    )  # fmt: skip
    cm.observe_rows(
        "ranks",
        to_arrow("ranks", [{"job_id": "k", "rank": 0, "host": NODE, "gpu_index": 0, "gpu_uuid": "GPU-x",
                            "started_ns": now + 1}]),
    )  # fmt: skip
    assert ranks() == [("j", "0", "3"), ("k", "0", "0")]
    # the job's next attempt replaces every rank of the old one
    _attempt(cm, "j", 1, range(2))
    assert ranks() == [("j", "1", "0"), ("j", "1", "1"), ("k", "0", "0")]
    # a late row of the old attempt does not bring it back either
    _attempt(cm, "j", 0, range(4, 6))
    assert ranks() == [("j", "1", "0"), ("j", "1", "1"), ("k", "0", "0")]


def test_top_k_is_configurable_and_zero_means_no_per_rank_series(monkeypatch):
    cm = CollectorMetrics(node=NODE, top_k=0)
    _attempt(cm, "j", 0, range(16), slow=3)
    series = _ranklens(_series(cm))
    assert not [n for n, labels, _ in series if "rank" in labels and n != "ranklens_rank_info"]
    assert any(n == "ranklens_node_step_duration_seconds" for n, _, _ in series)
    cm = CollectorMetrics(node=NODE, top_k=5)
    _attempt(cm, "j", 0, range(16), slow=3)
    assert len([1 for n, _, _ in _series(cm) if n == "ranklens_rank_step_duration_seconds"]) == 5
    with pytest.raises(ConfigError, match=r"metrics_top_k=-1: allowed 0\.\.1000"):
        AgentConfig(metrics_top_k=-1)
    with pytest.raises(ConfigError, match="metrics_top_k"):
        CollectorMetrics(top_k=True)  # type: ignore[arg-type]
    assert env_overrides({"RANKLENS_COLLECTOR_METRICS_TOP_K": "7"}) == {"metrics_top_k": 7}
    with pytest.raises(ConfigError, match="RANKLENS_COLLECTOR_METRICS_TOP_K"):
        env_overrides({"RANKLENS_COLLECTOR_METRICS_TOP_K": "many"})


def test_build_info_and_process_series_are_on_the_collectors_registry():
    series = _series(CollectorMetrics(node=NODE))
    build = [(labels, v) for n, labels, v in series if n == "ranklens_build_info"]
    assert build == [
        ({"version": ranklens.__version__, "python": platform.python_version(),
          "schema_version": str(SCHEMA_VERSION)}, 1.0)
    ]  # fmt: skip
    names = {n for n, _, _ in series}
    assert "python_info" in names
    if sys.platform.startswith("linux"):
        assert {"process_cpu_seconds_total", "process_resident_memory_bytes", "process_start_time_seconds"} <= names


def test_a_rank_whose_process_vanishes_leaves_rank_info(tmp_path, embedded_store):
    """The agent end to end: the liveness watcher's exited = 2 heartbeat, shipped like any other,
    takes the rank out of ranklens_rank_info."""
    from ranklens.collector.agent import Agent

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=60)  # a pid that is gone
    now, ns = time.time_ns(), pid_namespace()
    for rank, pid in ((0, child.pid), (1, os.getpid())):
        w = SpoolWriter.for_rank(tmp_path / "spool", "live-job", 0, rank)
        w.write(
            "heartbeats", [{"job_id": "live-job", "rank": rank, "host": NODE, "ts_ns": now, "pid": pid, "pid_ns": ns}]
        )
    cfg = agent_config(tmp_path, nvml=False, logs=(), metrics_port=None, liveness_interval_s=0.05)
    agent = Agent(cfg, store=embedded_store)

    def ranks() -> list[str]:
        return sorted(labels["rank"] for n, labels, _ in _series(agent.metrics) if n == "ranklens_rank_info")

    agent.start()
    try:
        wait_until(lambda: ranks() == ["1"], 120, "rank 0's process found gone")
    finally:
        agent.stop()
    assert agent.metrics.ranks_gone._value.get() == 1
