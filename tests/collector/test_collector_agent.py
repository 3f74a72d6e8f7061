"""The per-node agent end to end: real files, a real embedded store, the fake NVML, a real HTTP
scrape of /metrics, the store going down and coming back, a bounded stop, and kill -9 + restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ranklens.collector.agent import Agent, load_config
from ranklens.collector.fake_nvml import NVML_ERROR_DRIVER_NOT_LOADED, FakeNvml, fake_nvml
from ranklens.collector.metrics import CLOCKS_EVENT_REASONS
from ranklens.errors import ConfigError, StoreError
from ranklens.formats.spool import SpoolWriter
from ranklens.store.testing import DownStore, SlowStore
from tests._sync import wait_until
from tests.collector._agent import agent_config

ROOT = Path(__file__).resolve().parents[2]
ERR = "RuntimeError: CUDA error: an illegal memory access was encountered"
ROW = {"job_id": "j", "attempt": 0, "rank": 0, "pg": "0", "seq": 1, "op": "all_reduce", "enter_ns": 5}


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _metric(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted((k, str(v)) for k, v in labels.items()))), 0.0)


def _wait(cond, what: str, timeout: float = 120.0) -> None:
    wait_until(cond, timeout, what)  # readiness only: generous, the machine may be loaded


def _write_log(tmp_path: Path, name: str, *lines: str) -> Path:
    d = tmp_path / "logs"
    d.mkdir(exist_ok=True)
    p = d / name
    with open(p, "a") as f:
        f.write("".join(line + "\n" for line in lines))
    return p


def test_agent_end_to_end_with_store_nvml_and_metrics(tmp_path, embedded_store):
    SpoolWriter.for_rank(tmp_path / "spool", "j", 0, 0).write("collectives", [ROW, dict(ROW, seq=2)])
    _write_log(tmp_path, "rank-3.log", "step 1 loss 2.0", "step 2 loss 1.9", ERR, "step 3 loss 1.8")
    fake = fake_nvml(2)
    fake.gpus[1].throttle_reasons = 0x4 | 0x40  # NVML: sw_power_cap, hw_thermal_slowdown
    agent = Agent(agent_config(tmp_path), store=embedded_store, nvml=fake)
    agent.start()
    try:
        port = agent.metrics_port
        assert port
        fake.inject_xid(1, 79)

        def shipped() -> bool:
            m = _scrape(port)
            return (
                _metric(m, "ranklens_collector_rows_shipped_total", table="log_events") >= 1
                and _metric(m, "ranklens_collector_rows_shipped_total", table="gpu_events") >= 1
                and _metric(m, "ranklens_collector_rows_shipped_total", table="collectives") == 2
            )

        _wait(shipped, "the agent to ship the log, GPU and collective rows")
        m = _scrape(port)
        assert _metric(m, "ranklens_collector_log_lines_read_total") == 4
        assert _metric(m, "ranklens_collector_log_lines_kept_total", **{"class": "cuda_error"}) == 1
        assert _metric(m, "ranklens_collector_log_lines_dropped_total") == 3
        assert _metric(m, "ranklens_collector_nvml_available") == 1
        assert _metric(m, "ranklens_gpu_events_total", kind="xid") == 1
        gpu_labels = dict(node="node-a", gpu=0, uuid=fake.gpus[0].uuid)  # the GPU's labels only (issue 19)
        assert _metric(m, "ranklens_gpu_memory_total_bytes", **gpu_labels) == 80 << 30
        assert _metric(m, "ranklens_gpu_temperature_celsius", **gpu_labels) == 35
        reasons = {
            dict(k[1])["reason"]: v
            for k, v in m.items()
            if k[0] == "ranklens_gpu_clocks_event_reason" and dict(k[1])["gpu"] == "1"
        }
        assert reasons == {r: float(r in ("sw_power_cap", "hw_thermal_slowdown")) for r, _ in CLOCKS_EVENT_REASONS}
        assert all(dict(k[1]).get("host") is None for k in m if k[0].startswith("ranklens_gpu_"))
        assert _metric(m, "ranklens_collector_last_ship_success_timestamp_seconds") > 0
        t0 = time.monotonic()
    finally:
        clean = agent.stop(timeout=10)
    assert clean and time.monotonic() - t0 < 10
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)  # endpoint closed
    q = embedded_store.query
    assert q("SELECT count() FROM collectives").scalar() == 2
    assert q("SELECT klass, rank, job_id, host FROM log_events").rows() == [("cuda_error", 3, "job-1", "node-a")]
    assert q("SELECT sum(count) FROM drops WHERE what = 'log_lines_dropped'").scalar() == 3
    assert q("SELECT count() FROM gpu_samples").scalar() >= 2
    assert q("SELECT code FROM gpu_events WHERE kind = 'xid'").rows() == [(79,)]
    assert agent.shipper.pending() == []  # everything acknowledged and deleted


def test_store_down_then_back_every_row_once(tmp_path, embedded_store):
    import shutil

    parts = embedded_store.root / "parts" / "log_events"
    moved = tmp_path / "moved"
    shutil.move(parts, moved)  # the store's disk "fails" for log_events
    agent = Agent(agent_config(tmp_path, nvml=False, metrics_port=None), store=embedded_store)
    agent.start()
    try:
        for i in range(20):
            _write_log(tmp_path, "rank-0.log", f"{ERR} #{i}", "ok")
            time.sleep(0.02)
        _wait(lambda: agent.metrics.store_errors._value.get() >= 2, "two failed writes to the broken store")
        assert [p for p in agent.shipper.pending() if p.name.startswith("log_events")]  # kept on disk
        shutil.move(moved, parts)  # it comes back
        _wait(lambda: not agent.shipper.pending(), "the spool to drain once the store is back")
    finally:
        assert agent.stop(timeout=10)
    got = embedded_store.query("SELECT message FROM log_events").rows()
    assert sorted(int(m.rsplit("#", 1)[1]) for (m,) in got) == list(range(20))


def test_a_store_whose_parts_are_gone_is_unavailable_not_refusing(tmp_path, embedded_store):
    """The race behind a lost row in the test above, on a loaded machine: with the disk gone, the
    shipper's in-doubt lookup (a query) failed as a plain StoreError, i.e. "the store refuses these
    segments"; when the disk came back while it sent them one by one, the ones refused before were
    taken for poison and quarantined. A part file that cannot be read is the store being down, and
    the first query once it is back is answered (chDB left the failed query's remains for it)."""
    import shutil

    from ranklens.errors import StoreUnavailable

    embedded_store.write("collectives", [ROW])
    parts = embedded_store.root / "parts" / "collectives"
    shutil.move(parts, tmp_path / "moved")
    with pytest.raises(StoreUnavailable, match="cannot read"):
        embedded_store.query("SELECT count() FROM collectives")
    shutil.move(tmp_path / "moved", parts)
    assert embedded_store.query("SELECT count() FROM collectives").scalar() == 1
    with pytest.raises(StoreError) as ei:  # a bad query is still the caller's error, not an outage
        embedded_store.query("SELECT no_such_column FROM collectives")
    assert not isinstance(ei.value, StoreUnavailable)


def test_without_gpu_or_driver_everything_else_runs(tmp_path, embedded_store, caplog):
    _write_log(tmp_path, "rank-1.log", ERR)
    fake = FakeNvml(init_error=NVML_ERROR_DRIVER_NOT_LOADED)
    with (
        caplog.at_level("WARNING", logger="ranklens.collector.nvml"),
        Agent(agent_config(tmp_path), store=embedded_store, nvml=fake) as agent,
    ):
        _wait(lambda: agent.metrics.rows_shipped.labels("log_events")._value.get() >= 1, "a shipped log event")
        assert _metric(_scrape(agent.metrics_port), "ranklens_collector_nvml_available") == 0
    assert sum("GPU metrics off" in r.getMessage() for r in caplog.records) == 1
    assert embedded_store.query("SELECT count() FROM log_events").scalar() == 1


def test_stop_is_bounded_even_when_the_store_hangs(tmp_path, embedded_store):
    SpoolWriter.for_rank(tmp_path / "spool", "j", 0, 0).write("collectives", [ROW])
    release = threading.Event()
    # a server that accepts the insert and then stalls (until released, at most 30 s)
    store = SlowStore(embedded_store, until=release.is_set, timeout_s=30, ops={"write_many"})
    agent = Agent(agent_config(tmp_path, nvml=False, logs=()), store=store)
    agent.start()
    assert store.entered.wait(10)
    t0 = time.monotonic()
    assert agent.stop(timeout=0.5) is False
    assert time.monotonic() - t0 < 2
    assert agent.shipper.pending()  # not acknowledged, so still on disk
    release.set()


def test_config_file_with_overrides_and_clear_errors(tmp_path):
    cfg = tmp_path / "collector.toml"
    cfg.write_text(
        f"""
[collector]
spool_dir = "{tmp_path / "spool"}"
metrics_port = 9400
nvml = false
commit_interval_s = 5

[[logs]]
glob = "{tmp_path}/logs/*.log"
stream = "stderr"
rank_pattern = "worker-(\\\\d+)"

[filter]
context_lines = 1

[[rules]]
name = "app_fatal"
class = "app_fatal"
pattern = "FATAL"
"""
    )
    c = load_config(cfg, metrics_port=0, log_globs=[str(tmp_path / "more" / "*.out")], host=None)
    assert c.metrics_port == 0 and c.nvml is False and c.commit_interval_s == 5
    assert [s.glob for s in c.logs] == [f"{tmp_path}/logs/*.log", str(tmp_path / "more" / "*.out")]
    assert c.logs[0].rank_of("/x/worker-12.log") == 12
    assert c.rules is not None and c.rules.context_lines == 1 and "app_fatal" in c.rules.classes
    for body, needle in [
        ("[collector]\nship_interval_s = 0", "ship_interval_s=0"),
        ("[collector]\nmetrics_port = 70000", "metrics_port=70000"),
        ("[collector]\nspool = '/x'", "unknown key(s) ['spool']"),
        ("[colector]\n", "unknown section(s) ['colector']"),
        ("[[logs]]\nglob = 'x'\nstream = 'tty'", "logs[0]: log source x: stream='tty'"),
    ]:
        cfg.write_text(body)
        with pytest.raises(ConfigError) as ei:
            load_config(cfg)
        assert needle in str(ei.value), (needle, str(ei.value))


_CHILD = """
import sys, time
from ranklens.collector.agent import Agent, AgentConfig
from ranklens.collector.tailer import LogSource
from ranklens.store import open_store
tmp = sys.argv[1]
store = open_store(f"embedded://{tmp}/store")
cfg = AgentConfig(spool_dir=f"{tmp}/spool", logs=(LogSource(glob=f"{tmp}/logs/*.log"),), host="node-a",
                  nvml=False, ship_interval_s=0.05, log_poll_interval_s=0.02, commit_interval_s=0.05)
agent = Agent(cfg, store=store)
start = agent.start
def started():  # run() installs its SIGTERM handler, then starts: ready only now (a SIGTERM before
    start()     # the handler would kill the process instead of stopping it gracefully)
    print("ready", flush=True)
agent.start = started
agent.run()
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_kill_minus_9_and_restart_loses_no_log_event(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))

    def child() -> subprocess.Popen:
        p = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(tmp_path)], stdout=subprocess.PIPE, env=env, cwd=tmp_path
        )
        assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
        return p

    n = 0

    def write(k: int) -> None:
        nonlocal n
        for _ in range(k):
            _write_log(tmp_path, "rank-0.log", f"{ERR} #{n}", "step ok")
            n += 1
            time.sleep(0.005)

    p = child()
    write(150)
    p.send_signal(signal.SIGKILL)  # mid-run: events staged, segments pending, offsets in flight
    p.wait(30)
    p.stdout.close()
    write(50)  # written while the collector is down
    p = child()
    write(50)
    time.sleep(1.5)  # deliberate: the restarted collector works through the backlog a while (stop ships the rest)
    p.send_signal(signal.SIGTERM)  # graceful: flush, last shipping pass
    assert p.wait(60) == 0
    p.stdout.close()
    from ranklens.store import open_store

    store = open_store(f"embedded://{tmp_path}/store")
    got = [int(m.rsplit("#", 1)[1]) for (m,) in store.query("SELECT message FROM log_events").rows()]
    assert set(got) == set(range(n)), "a log event was lost"
    print(f"kill -9 + restart: {n} events written, {len(got)} rows, {len(got) - len(set(got))} duplicate(s)")
    # The tailer -> spool step is exactly-once (two-phase commit, tests/collector/test_tailer.py) and so is
    # spool -> store (segments in doubt after the kill are looked up by ingest_id): no duplicate.
    assert len(got) == len(set(got)), f"{len(got) - len(set(got))} log event(s) stored twice"


def test_public_names_of_the_collector_modules():
    import importlib

    for mod in ("agent", "logfilter", "rules", "tailer", "outbox", "nvml", "fake_nvml", "metrics"):
        m = importlib.import_module(f"ranklens.collector.{mod}")
        assert m.__all__, mod
        for name in m.__all__:
            assert hasattr(m, name), (mod, name)


def test_metrics_live_on_the_injected_registry_only():
    from prometheus_client import REGISTRY, CollectorRegistry

    from ranklens.collector.metrics import CollectorMetrics

    reg = CollectorRegistry()
    m = CollectorMetrics(reg)
    m.store_errors.inc()
    assert reg.get_sample_value("ranklens_collector_store_errors_total") == 1
    assert REGISTRY.get_sample_value("ranklens_collector_store_errors_total") is None
    CollectorMetrics()  # a second set in the same process does not collide


def test_alert_rules_use_metrics_the_collector_exports():
    import re
    from pathlib import Path

    from prometheus_client import CollectorRegistry

    from ranklens.collector.metrics import CollectorMetrics

    rules = (Path(__file__).resolve().parents[2] / "deploy/prometheus/ranklens-rules.yml").read_text()
    wanted = set(re.findall(r"ranklens_(?:collector|gpu|rank)_[a-z_]+", rules))
    reg = CollectorRegistry()
    CollectorMetrics(reg)
    exported = {s.name for fam in reg.collect() for s in fam.samples} | {fam.name for fam in reg.collect()}
    # a labelled counter shows no sample before its first label; its samples will be <name>_total
    exported |= {fam.name + "_total" for fam in reg.collect() if fam.type == "counter"}
    assert wanted and wanted <= exported, wanted - exported
    assert "ranklens_gpu_clocks_event_reason" in wanted  # the GPU rules read the collector's own series


def test_shipping_loop_spans_when_asked(tmp_path, embedded_store):
    otel = pytest.importorskip("opentelemetry.sdk.trace", reason="opentelemetry-sdk is not installed")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = otel.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    SpoolWriter.for_rank(tmp_path / "spool", "j", 0, 0).write("collectives", [ROW, dict(ROW, seq=2)])
    agent = Agent(
        agent_config(tmp_path, nvml=False, logs=(), metrics_port=None), store=embedded_store, otel_provider=provider
    )
    agent.ship_once()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["ranklens.ship_pass"].attributes["ranklens.rows"] == 2
    write = spans["ranklens.store_write"]
    assert write.parent.span_id == spans["ranklens.ship_pass"].context.span_id
    assert write.attributes["ranklens.tables"] == ("collectives",) and write.attributes["ranklens.rows"] == 2
    off = Agent(agent_config(tmp_path, nvml=False, logs=()), store=embedded_store)
    assert off.shipper.tracer is None  # off by default


@pytest.mark.e2e
def test_per_rank_step_time_and_collective_wait_from_a_real_job(tmp_path, embedded_store):
    """A real 2-rank gloo job (rank 1 slowed 3x from step 0): the collector's /metrics shows, per
    node, the ranks, their step times, steps, time blocked in collectives and heartbeats, the
    slowest ranks' step times, and which rank is where (ranklens_rank_info); never a series per
    rank and attempt (issue 19)."""
    import socket as _socket

    with _socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spool = tmp_path / "spool"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
           "RANKLENS_SPOOL": str(spool), "RANKLENS_JOB_ID": "metrics-job", "OMP_NUM_THREADS": "1"}  # fmt: skip
    steps = 80
    args = ["--steps", str(steps), "--compute-ms", "30", "--slow-rank", "1", "--slowdown", "3", "--slow-from-step", "0"]

    def by_rank(m: dict, name: str) -> dict[str, float]:
        return {dict(k[1])["rank"]: v for k, v in m.items() if k[0] == name and dict(k[1])["job_id"] == "metrics-job"}

    agent = Agent(agent_config(tmp_path, nvml=False, logs=()), store=embedded_store)
    agent.start()  # before the job: its ranks are live while it runs, then end with it
    job = dict(node="node-a", job_id="metrics-job")
    procs = []
    try:
        procs = [
            subprocess.Popen([sys.executable, "-m", "ranklens.demo.worker", *args], env={**env, "RANK": str(r)})
            for r in range(2)
        ]

        def running() -> dict | None:  # both ranks live, a few steps in, both among the slowest (top 3)
            m = _scrape(agent.metrics_port)
            live = _metric(m, "ranklens_node_ranks", **job) == 2
            top = set(by_rank(m, "ranklens_rank_step_duration_seconds"))
            stepping = _metric(m, "ranklens_node_last_step", **job, stat="min") >= 3
            return m if live and stepping and top == {"0", "1"} else None

        m = wait_until(running, 120.0, "both ranks live and stepping on /metrics", procs=procs)
        assert [p.wait(120) for p in procs] == [0, 0]

        def done() -> dict | None:  # every step shipped; both ranks shut down cleanly: no rank_info left
            m = _scrape(agent.metrics_port)
            return m if _metric(m, "ranklens_node_steps_total", **job) == 2 * steps else None

        end = wait_until(done, 120.0, f"both ranks' {steps} steps on /metrics")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        agent.stop()

    assert 0.05 < _metric(m, "ranklens_node_step_duration_seconds", **job, stat="max") < 2.0  # lock-step: slow pace
    assert abs(_metric(m, "ranklens_node_heartbeat_timestamp_seconds", **job, stat="max") - time.time()) < 120
    assert set(by_rank(m, "ranklens_rank_step_duration_seconds")) == {"0", "1"}  # the top 3 slowest: both
    assert set(by_rank(m, "ranklens_rank_heartbeat_timestamp_seconds")) == {"0", "1"}
    assert by_rank(m, "ranklens_rank_info") == {"0": 1.0, "1": 1.0}
    assert _metric(end, "ranklens_node_collectives_total", **job) > 0
    assert _metric(end, "ranklens_node_collective_wait_seconds_total", **job) > 0
    # the job is over: its ranks are gone from rank_info and the aggregates, its counters stay
    assert by_rank(end, "ranklens_rank_info") == {} and _metric(end, "ranklens_node_ranks", **job) == 0
    for m_ in (m, end):
        assert not [k for k in m_ if k[0] != "ranklens_rank_info" and "attempt" in dict(k[1])]


def test_the_documented_config_is_valid(tmp_path):
    import re

    text = (ROOT / "docs" / "collector.md").read_text()
    block = re.search(r"```toml\n(.*?)```", text, re.S)
    assert block, "docs/collector.md has no TOML example"
    cfg = tmp_path / "collector.toml"
    cfg.write_text(block.group(1))
    c = load_config(cfg)
    assert c.spool_max_bytes == 20 * 1024**3 and c.liveness_interval_s == 2.0 and c.metrics_port == 9400
    assert c.rules is not None and "app_fatal" in c.rules.classes and c.logs[0].rank_of("/x/rank-12.log") == 12


def test_shipping_backs_off_while_the_store_is_down_and_logs_once(tmp_path, caplog):
    from ranklens.errors import StoreUnavailable

    # every call (a write, or the look-up of a segment in doubt) refused and counted
    down = DownStore(error=lambda: StoreUnavailable("connection refused"))
    SpoolWriter.for_rank(tmp_path / "spool", "j", 0, 0).write("collectives", [ROW])
    agent = Agent(agent_config(tmp_path, nvml=False, logs=(), metrics_port=None, ship_interval_s=0.05), store=down)
    with caplog.at_level("WARNING", logger="ranklens.collector"):
        agent.start()
        time.sleep(3.0)  # the window the backoff is measured over, not a synchronisation
        agent.stop(timeout=5)
    # without backoff: ~60 passes in 3 s; doubling from 50 ms: a handful
    assert 2 <= down.attempts <= 9, down.attempts
    assert agent.shipper.failures == down.attempts
    assert sum("store unavailable" in r.getMessage() for r in caplog.records) == 1  # said once, not per pass


def test_env_overrides_any_collector_key(tmp_path, monkeypatch):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[collector]\nship_interval_s = 5\nnvml = true\nmetrics_port = 9400\n")
    monkeypatch.setenv("RANKLENS_COLLECTOR_SHIP_INTERVAL_S", "0.5")
    monkeypatch.setenv("RANKLENS_COLLECTOR_NVML", "false")
    monkeypatch.setenv("RANKLENS_COLLECTOR_SPOOL_MAX_BYTES", "2GiB")
    monkeypatch.setenv("RANKLENS_COLLECTOR_METRICS_PORT", "9500")
    c = load_config(cfg, metrics_port=0)  # arguments win over the environment, the environment over the file
    assert (c.ship_interval_s, c.nvml, c.spool_max_bytes, c.metrics_port) == (0.5, False, 2 * 1024**3, 0)
    for var, value, needle in [
        ("RANKLENS_COLLECTOR_SHIP_INTERVAL", "1", "not a collector setting"),
        ("RANKLENS_COLLECTOR_COMMIT_INTERVAL_S", "soon", "expected a value of type float"),
        ("RANKLENS_COLLECTOR_NVML", "maybe", "RANKLENS_COLLECTOR_NVML='maybe'"),
    ]:
        with monkeypatch.context() as m:
            m.setenv(var, value)
            with pytest.raises(ConfigError) as ei:
                load_config(cfg)
            assert needle in str(ei.value), str(ei.value)
