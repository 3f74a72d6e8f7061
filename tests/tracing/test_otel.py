"""OpenTelemetry from the tracer, through the real SDK: step spans (in-memory exporter), per-rank
metrics (in-memory reader), the resource, the bounded shutdown, and a real 2-rank job under
``ranklens run`` exporting to a real OTLP/HTTP receiver that decodes opentelemetry-proto."""

from __future__ import annotations

import gzip
import os
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import ranklens.tracing as rlt
from ranklens.otel import (
    SERVICE_INSTANCE_NAMESPACE,
    collector_tracer,
    metrics_requested,
    otel_requested,
    ranklens_version,
    resource,
    service_instance_id,
    shutdown_bounded,
)
from ranklens.tracing.otel import COLLECTIVE_WAIT_METRIC, STEP_DURATION_METRIC, STEP_SPAN, StepSpans
from ranklens.tracing.tracer import Tracer
from tests._jobs import TORCHRUN, ranklens_run
from tests.tracing._fakes import FakeClock

ROOT = Path(__file__).resolve().parents[2]
OTEL_VARS = (
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
    "OTEL_METRICS_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
)


@pytest.fixture
def no_otel_env(monkeypatch):
    for var in OTEL_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_a_span_per_step_named_train_step_with_phase_children(tmp_path, no_otel_env):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    t = rlt.init(job_id="otel", spool_dir=str(tmp_path), rank=1, world_size=2, patch_distributed=False,
                 otel_provider=provider)  # fmt: skip
    assert t is not None and t.spans is not None
    try:
        for i in range(2):
            with rlt.step(i), rlt.phase("forward"), rlt.phase("attention"):
                pass
    finally:
        rlt.shutdown()  # its final flush makes the spans (the training thread only queued the steps)
    t.spans._at_exit()  # what interpreter exit does: the user's provider is flushed, not shut down
    provider.get_tracer("user").start_span("after").end()
    assert exporter.get_finished_spans()[-1].name == "after"
    spans = exporter.get_finished_spans()[:-1]
    steps = [s for s in spans if s.name == STEP_SPAN]
    assert STEP_SPAN == "train step"
    assert [s.attributes["ranklens.step"] for s in steps] == [0, 1]
    assert steps[0].attributes["ranklens.rank"] == 1 and steps[0].attributes["ranklens.job_id"] == "otel"
    assert steps[0].instrumentation_scope.name == "ranklens.tracing"
    children = [s for s in spans if s.parent is not None and s.parent.span_id == steps[0].context.span_id]
    assert sorted(c.name for c in children) == ["attention", "forward"]
    assert all(c.attributes["ranklens.step"] == 0 for c in children)
    assert all(steps[0].start_time <= c.start_time <= c.end_time <= steps[0].end_time for c in children)


def test_off_by_default_and_what_asks_for_it(tmp_path, no_otel_env):
    assert not otel_requested() and not metrics_requested()
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}
    assert otel_requested(endpoint) and metrics_requested(endpoint)
    assert otel_requested({"OTEL_TRACES_EXPORTER": "console"}) and not metrics_requested({"OTEL_TRACES_EXPORTER": "x"})
    assert metrics_requested({"OTEL_METRICS_EXPORTER": "otlp"}) and not otel_requested(
        {"OTEL_METRICS_EXPORTER": "otlp"}
    )
    assert metrics_requested({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://c:4318/v1/metrics"})
    assert not otel_requested({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://c:4318/v1/metrics"})
    assert not otel_requested({"OTEL_TRACES_EXPORTER": "none", **endpoint})
    assert not metrics_requested({"OTEL_METRICS_EXPORTER": "none", **endpoint})
    assert not otel_requested({"OTEL_SDK_DISABLED": "true", **endpoint})
    assert not metrics_requested({"OTEL_SDK_DISABLED": "TRUE", "OTEL_METRICS_EXPORTER": "otlp"})
    t = rlt.init(job_id="j", spool_dir=str(tmp_path), rank=0, world_size=1, patch_distributed=False)
    try:
        assert t is not None and t.spans is None  # nothing asked: no OpenTelemetry object at all
    finally:
        rlt.shutdown()


def test_metrics_alone_from_the_variables_and_bad_values_named(no_otel_env, caplog):
    no_otel_env.setenv("OTEL_METRICS_EXPORTER", "console,prometheus")
    no_otel_env.setenv("OTEL_TRACES_EXPORTER", "none")
    no_otel_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with caplog.at_level("WARNING", logger="ranklens.otel"):
        spans = StepSpans.create(None, job_id="env", attempt=0, rank=5, world_size=8)
    assert spans is not None and spans.tracer is None and spans.collective_wait is not None
    res = spans.meter_provider._sdk_config.resource.attributes
    assert res["service.instance.id"] == service_instance_id("env", 0, 5) and res["ranklens.world_size"] == 8
    assert "OTEL_METRICS_EXPORTER='prometheus' is not an exporter ranklens knows" in caplog.text
    spans._at_exit()  # what interpreter exit does: flush and shut down what it built, bounded
    assert spans.meter_provider._shutdown  # built here: shut down
    no_otel_env.setenv("OTEL_METRICS_EXPORTER", "otlp")
    with caplog.at_level("WARNING", logger="ranklens.otel"):
        spans = StepSpans.create(None, job_id="env", attempt=0, rank=5, world_size=8)
    assert "OTLP protocol 'http/json' is not supported (http/protobuf, grpc); using http/protobuf" in caplog.text
    assert spans is not None
    spans._at_exit()


def _metrics(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    """metric name -> its data points, from the reader's one collection."""
    out: dict[str, list[Any]] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data is not None else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out.setdefault(m.name, []).extend(m.data.data_points)
    return out


def test_step_time_and_collective_wait_histograms_per_rank(tmp_path):
    reader = InMemoryMetricReader()
    meters = MeterProvider(metric_readers=[reader])
    t = Tracer(job_id="m", attempt=2, rank=3, world_size=4, spool_dir=str(tmp_path), flush_interval_s=60,
               clock=FakeClock())  # fmt: skip
    t.spans = StepSpans(None, job_id="m", attempt=2, rank=3, meter_provider=meters)
    for n in range(3):
        with t.step(n):
            row = t.collective_entered("0", n + 1, "all_reduce", 1024, "float32", -1, False)
            t.collective_completed(row, end_ns=row["enter_ns"] + 2_000_000_000)  # 2 s in flight
    failed = t.collective_entered("0", 4, "broadcast", 8, "float32", -1, False)
    t.collective_failed(failed)  # no completion: no wait time
    assert _metrics(reader) == {}  # nothing is recorded on the training thread
    t.flush()
    got = _metrics(reader)
    ident = {"ranklens.job_id": "m", "ranklens.attempt": 2, "ranklens.rank": 3}
    (steps,) = got[STEP_DURATION_METRIC]
    assert steps.count == 3 and dict(steps.attributes) == ident
    assert 0 < steps.sum < 1e-5  # the fake clock's steps last nanoseconds, in seconds
    (wait,) = got[COLLECTIVE_WAIT_METRIC]
    assert wait.count == 3 and wait.sum == pytest.approx(6.0)
    assert dict(wait.attributes) == {**ident, "ranklens.collective.op": "all_reduce"}
    assert list(wait.explicit_bounds)[:2] == [1e-5, 1e-4]  # seconds, not the SDK's millisecond buckets
    t.shutdown()


def test_a_full_step_queue_drops_and_counts_never_blocks(tmp_path, monkeypatch):
    import ranklens.tracing.otel as rl_otel

    monkeypatch.setattr(rl_otel, "MAX_QUEUED_STEPS", 2)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    t = Tracer(job_id="q", attempt=0, rank=0, world_size=1, spool_dir=str(tmp_path), flush_interval_s=60)
    t.spans = StepSpans(provider, job_id="q", attempt=0, rank=0)
    for n in range(5):
        with t.step(n):
            pass
    t.flush()
    assert [s.attributes["ranklens.step"] for s in exporter.get_finished_spans()] == [0, 1]
    assert t._drops["spans:queue_full"] == 3
    t.shutdown()


def test_resource_identity_and_the_environment_wins(no_otel_env):
    attrs = {"service.instance.id": service_instance_id("job-a", 1, 7), "ranklens.rank": 7}
    r = resource(attrs, default_service="ranklens-training").attributes
    assert r["service.name"] == "ranklens-training" and r["service.version"] == ranklens_version() != "unknown"
    assert r["service.instance.id"] == str(uuid.uuid5(SERVICE_INSTANCE_NAMESPACE, "job-a/1/7"))
    assert uuid.UUID(r["service.instance.id"]).version == 5
    assert service_instance_id("job-a", 1, 6) != r["service.instance.id"] != service_instance_id("job-a", 2, 7)
    assert r["telemetry.sdk.name"] == "opentelemetry" and r["telemetry.sdk.language"] == "python"
    assert r["telemetry.sdk.version"] and r["ranklens.rank"] == 7
    # the user names the service: their name and version, not ranklens' version
    no_otel_env.setenv("OTEL_SERVICE_NAME", "llm-pretrain")
    no_otel_env.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.version=2.3,deployment.environment.name=prod")
    r = resource(attrs, default_service="ranklens-training").attributes
    assert r["service.name"] == "llm-pretrain" and r["service.version"] == "2.3"
    assert r["deployment.environment.name"] == "prod" and r["ranklens.rank"] == 7
    no_otel_env.delenv("OTEL_RESOURCE_ATTRIBUTES")
    assert "service.version" not in resource(attrs, default_service="ranklens-training").attributes


def test_the_collector_provider_has_its_own_service_and_instance(no_otel_env):
    no_otel_env.setenv("OTEL_TRACES_EXPORTER", "console")
    tracer = collector_tracer(host="node-7")
    r = tracer.resource.attributes
    assert r["service.name"] == "ranklens-collector" and r["service.version"] == ranklens_version()
    assert r["host.name"] == "node-7" and uuid.UUID(r["service.instance.id"]).version == 4
    assert collector_tracer(host="node-7").resource.attributes["service.instance.id"] != r["service.instance.id"]


class _Stuck:
    """A provider whose flush hangs until released (an endpoint that never answers)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.shut = False

    def force_flush(self, timeout_millis: int = 0) -> bool:
        self.release.wait()
        return True

    def shutdown(self) -> None:
        self.shut = True


def test_shutdown_is_bounded_and_flushes_only_what_it_does_not_own():
    stuck = _Stuck()
    assert shutdown_bounded([stuck], timeout_s=0.05) is False  # returned at the bound, still flushing
    stuck.release.set()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    provider.get_tracer("t").start_span("s").end()
    released = _Stuck()
    released.release.set()
    assert shutdown_bounded([provider, released], own=False) is True and not released.shut
    assert shutdown_bounded([released]) is True and released.shut


def test_a_forked_child_exports_no_metrics():
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult

    from ranklens.otel import _parent_only

    class Recorder(MetricExporter):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def export(self, metrics_data, timeout_millis=10_000, **kw):
            self.calls += 1
            return MetricExportResult.SUCCESS

        def force_flush(self, timeout_millis=10_000):
            return True

        def shutdown(self, timeout_millis=30_000, **kw):
            pass

    inner = Recorder()
    guarded = _parent_only(inner)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a DataLoader worker, say: the SDK's reader thread runs again here
        os.close(r)
        guarded.export(None)
        os.write(w, str(inner.calls).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        child_calls = f.read()
    os.waitpid(pid, 0)
    assert child_calls == "0"
    assert guarded.export(None) == MetricExportResult.SUCCESS and inner.calls == 1
    assert guarded._preferred_temporality == inner._preferred_temporality


class _Receiver(BaseHTTPRequestHandler):
    """An OTLP/HTTP receiver: decodes each POST body with opentelemetry-proto."""

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        stall = self.server.stall  # type: ignore[attr-defined]
        if stall is not None:  # an endpoint that takes the request and never answers
            self.server.stalled.set()  # type: ignore[attr-defined]
            stall.wait()
            return
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        if self.path == "/v1/metrics":
            req, resp = ExportMetricsServiceRequest(), ExportMetricsServiceResponse()
        elif self.path == "/v1/traces":
            req, resp = ExportTraceServiceRequest(), ExportTraceServiceResponse()  # type: ignore[assignment]
        else:
            self.send_error(404)
            return
        req.ParseFromString(body)
        self.server.got.setdefault(self.path, []).append(req)  # type: ignore[attr-defined]
        out = resp.SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: Any) -> None:
        pass


def _value(v: Any) -> Any:
    return getattr(v, v.WhichOneof("value"))


def _receiver(stall: threading.Event | None = None) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    server.got = {}  # type: ignore[attr-defined]
    server.stall = stall  # type: ignore[attr-defined]
    server.stalled = threading.Event()  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _run_job(tmp_path: Path, server: ThreadingHTTPServer, steps: int) -> Any:
    """The 2-rank job under ``ranklens run``, exporting spans and metrics to ``server``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        OMP_NUM_THREADS="1",
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{server.server_address[1]}",
        OTEL_METRICS_EXPORTER="otlp",
        OTEL_TRACES_EXPORTER="otlp",
        # no periodic export during the job: what arrives was sent by the shutdown flush at exit
        OTEL_METRIC_EXPORT_INTERVAL="600000",
        OTEL_BSP_SCHEDULE_DELAY="600000",
    )
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", str(ROOT / "tests" / "otel_job.py"), str(steps)]
    return ranklens_run(f"embedded://{tmp_path}/store", tmp_path / "spool", cmd, job_id="otel-e2e",
                        timeout=300, env=env)  # fmt: skip


@pytest.mark.e2e
def test_a_real_job_exports_per_rank_metrics_and_spans_over_otlp_at_exit(tmp_path):
    server = _receiver()
    steps = 4
    try:
        proc = _run_job(tmp_path, server, steps)
    finally:
        server.shutdown()
        server.server_close()
    assert proc.returncode == 0, proc.stderr[-3000:]
    got: dict[str, list[Any]] = server.got  # type: ignore[attr-defined]
    assert "/v1/metrics" in got and "/v1/traces" in got, (sorted(got), proc.stderr[-3000:])

    # cumulative temporality: every export repeats a series' total so far; the newest one counts
    by_rank: dict[int, dict[str, Any]] = {}
    newest: dict[tuple[int, str, tuple[Any, ...]], Any] = {}
    for req in got["/v1/metrics"]:
        for rm in req.resource_metrics:
            res = {a.key: _value(a.value) for a in rm.resource.attributes}
            rank = res["ranklens.rank"]
            by_rank.setdefault(rank, {"resource": res})
            for sm in rm.scope_metrics:
                assert sm.scope.name == "ranklens.tracing" and sm.scope.version == ranklens_version()
                for m in sm.metrics:
                    assert m.unit == "s" and m.histogram.aggregation_temporality == 2  # cumulative
                    for p in m.histogram.data_points:
                        attrs = {a.key: _value(a.value) for a in p.attributes}
                        assert attrs["ranklens.rank"] == rank and attrs["ranklens.job_id"] == "otel-e2e"
                        key = (rank, m.name, tuple(sorted(attrs.items())))
                        if key not in newest or p.time_unix_nano >= newest[key][1].time_unix_nano:
                            newest[key] = (attrs, p)
    for (rank, name, _), (attrs, p) in newest.items():
        by_rank[rank].setdefault(name, []).append((attrs, p.count, p.sum))
    assert sorted(by_rank) == [0, 1]
    for rank, got_rank in by_rank.items():
        res = got_rank["resource"]
        assert res["service.name"] == "ranklens-training" and res["service.version"] == ranklens_version()
        assert res["service.instance.id"] == service_instance_id("otel-e2e", 0, rank)
        assert res["telemetry.sdk.name"] == "opentelemetry" and res["telemetry.sdk.language"] == "python"
        assert res["ranklens.job_id"] == "otel-e2e" and res["ranklens.world_size"] == 2
        ((_, count, total),) = got_rank[STEP_DURATION_METRIC]
        assert count == steps
        if rank == 1:
            assert total >= steps * 0.2  # each of its steps sleeps 0.2 s in its forward
        waits = {a["ranklens.collective.op"]: (n, s) for a, n, s in got_rank[COLLECTIVE_WAIT_METRIC]}
        assert waits["all_reduce"][0] == steps and waits["barrier"][0] == steps
    # the fast rank waits for the slow one (0.2 s a step) at each all-reduce: more wait time on rank 0
    r0 = dict((a["ranklens.collective.op"], s) for a, _, s in by_rank[0][COLLECTIVE_WAIT_METRIC])
    r1 = dict((a["ranklens.collective.op"], s) for a, _, s in by_rank[1][COLLECTIVE_WAIT_METRIC])
    assert r0["all_reduce"] > r1["all_reduce"]

    spans = [
        (s, {a.key: _value(a.value) for a in s.attributes})
        for req in got["/v1/traces"]
        for rs in req.resource_spans
        for ss in rs.scope_spans
        for s in ss.spans
    ]
    step_spans = [(s, a) for s, a in spans if s.name == STEP_SPAN]
    assert sorted((a["ranklens.rank"], a["ranklens.step"]) for _, a in step_spans) == [
        (r, n) for r in (0, 1) for n in range(steps)
    ]
    ids = {s.span_id for s, _ in step_spans}
    children = sorted(s.name for s, _ in spans if s.parent_span_id in ids)
    assert children == sorted(["backward", "forward"] * steps * 2)


@pytest.mark.e2e
@pytest.mark.slow
def test_an_endpoint_that_never_answers_holds_the_exit_no_longer_than_the_bound(tmp_path):
    """The SDK's own export timeout (10 s) would hold every rank's exit; ranklens waits at most
    SHUTDOWN_TIMEOUT_S (5 s), says so, and the job ends with its own exit code."""
    release = threading.Event()
    server = _receiver(stall=release)
    try:
        proc = _run_job(tmp_path, server, 2)
        stalled = server.stalled.is_set()  # type: ignore[attr-defined]
    finally:
        release.set()
        server.shutdown()
        server.server_close()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert stalled  # the export reached the endpoint and hung there
    assert "OpenTelemetry export did not finish within" in proc.stderr, proc.stderr[-3000:]
