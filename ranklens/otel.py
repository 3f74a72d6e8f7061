"""OpenTelemetry provider helpers shared by the tracer's step spans and metrics
(:mod:`ranklens.tracing.otel`) and the collector's own shipping loop (:func:`collector_tracer`: a
span per pass, a child per store call). docs/opentelemetry.md lists the variables, names and
attributes.

Off unless asked for, by the standard variables (read when a component is built, never at import):

- spans: ``OTEL_TRACES_EXPORTER`` (``otlp``, ``console``; ``none`` says no), or an OTLP endpoint
  (``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``);
- metrics: ``OTEL_METRICS_EXPORTER`` (``otlp``, ``console``; ``none`` says no), or an OTLP endpoint
  (``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT``), exported by the SDK's
  periodic reader every ``OTEL_METRIC_EXPORT_INTERVAL`` ms;
- ``OTEL_SDK_DISABLED=true`` turns both off.

``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` win over ranklens' own resource defaults;
the exporters honour their own ``OTEL_EXPORTER_OTLP_*`` variables (headers, timeout, temporality).
Needs ``opentelemetry-sdk`` (and ``opentelemetry-exporter-otlp-proto-http`` for OTLP); without
them a warning is logged once and nothing is exported.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Mapping
from typing import Any

__all__ = [
    "SERVICE_INSTANCE_NAMESPACE",
    "SHUTDOWN_TIMEOUT_S",
    "collector_tracer",
    "meter_provider_from_env",
    "metrics_requested",
    "otel_requested",
    "provider_from_env",
    "ranklens_version",
    "resource",
    "resource_attributes",
    "service_instance_id",
    "shutdown_bounded",
]

log = logging.getLogger("ranklens.otel")

# The namespace semantic conventions name for a UUIDv5 service.instance.id derived from an
# inherent unique id (https://opentelemetry.io/docs/specs/semconv/registry/attributes/service/).
SERVICE_INSTANCE_NAMESPACE = uuid.UUID("4d63009a-8d0f-11ee-aad7-4c796ed8e320")
# Flushing and shutting the providers down never holds the process longer than this.
SHUTDOWN_TIMEOUT_S = 5.0
EXPORTERS = ("otlp", "console", "none")

ENV_SDK_DISABLED = "OTEL_SDK_DISABLED"
ENV_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
ENV_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
_SIGNALS = {
    "traces": ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"),
    "metrics": ("OTEL_METRICS_EXPORTER", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"),
}


def _requested(signal: str, env: Mapping[str, str] | None) -> bool:
    env = os.environ if env is None else env
    if env.get(ENV_SDK_DISABLED, "").strip().lower() == "true":
        return False
    exporter_var, endpoint_var, _ = _SIGNALS[signal]
    names = [n.strip().lower() for n in env.get(exporter_var, "").split(",") if n.strip()]
    if names:
        return any(n != "none" for n in names)
    return bool(env.get(ENV_ENDPOINT) or env.get(endpoint_var))


def otel_requested(env: Mapping[str, str] | None = None) -> bool:
    """True when the standard variables ask for span export: ``OTEL_TRACES_EXPORTER`` other than
    ``none``, or an OTLP endpoint (generic or for traces); ``OTEL_SDK_DISABLED=true`` says no."""
    return _requested("traces", env)


def metrics_requested(env: Mapping[str, str] | None = None) -> bool:
    """True when the standard variables ask for metric export: ``OTEL_METRICS_EXPORTER`` other than
    ``none``, or an OTLP endpoint (generic or for metrics); ``OTEL_SDK_DISABLED=true`` says no."""
    return _requested("metrics", env)


def service_instance_id(job_id: str, attempt: int, rank: int) -> str:
    """The ``service.instance.id`` of a training rank: a UUIDv5 (in the namespace semantic
    conventions give) of ``<job_id>/<attempt>/<rank>``, the identity ranklens joins everything on.
    One rank process has one (job, attempt, rank), so it is unique per rank process and stable for
    its life, and anyone holding ranklens' records can recompute it."""
    return str(uuid.uuid5(SERVICE_INSTANCE_NAMESPACE, f"{job_id}/{attempt}/{rank}"))


def resource_attributes(job_id: str, attempt: int, rank: int, world_size: int) -> dict[str, Any]:
    """The resource attributes of a training rank: its identity (``service.instance.id``, the
    ``ranklens.*`` keys), host, pid and, on Kubernetes, pod, namespace and node."""
    attrs: dict[str, Any] = {
        "service.instance.id": service_instance_id(job_id, attempt, rank),
        "host.name": socket.gethostname(),
        "process.pid": os.getpid(),
        "ranklens.job_id": job_id,
        "ranklens.attempt": attempt,
        "ranklens.rank": rank,
        "ranklens.world_size": world_size,
    }
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        pod = os.environ.get("POD_NAME") or os.environ.get("K8S_POD_NAME") or socket.gethostname()
        attrs["k8s.pod.name"] = pod
        for var, key in (("POD_NAMESPACE", "k8s.namespace.name"), ("NODE_NAME", "k8s.node.name")):
            if os.environ.get(var):
                attrs[key] = os.environ[var]
    return attrs


def ranklens_version() -> str:
    """This ranklens' version (from the installed distribution's metadata; ``unknown`` without it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ranklens")
    except PackageNotFoundError:
        return "unknown"


def resource(attrs: Mapping[str, Any], *, default_service: str) -> Any:
    """The SDK ``Resource`` of a ranklens process: ``telemetry.sdk.*`` from the SDK, ``attrs``, and
    ``service.name`` = ``default_service`` unless ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES``
    say otherwise (those win over every ranklens default). ``service.version`` is ranklens' version
    while the service is ranklens' own (its default name); a service the user named gets the
    version the user gives in ``OTEL_RESOURCE_ATTRIBUTES``, not ranklens'. Raises ImportError
    without opentelemetry-sdk."""
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource

    from_env = dict(OTELResourceDetector().detect().attributes)
    ours: dict[str, Any] = {**attrs, "service.name": default_service}
    if from_env.get("service.name", default_service) == default_service:
        ours["service.version"] = ranklens_version()
    # Resource.create puts its own detectors (OTEL_* variables, a random instance id) under the
    # attributes passed: the environment's are passed again, last, so they win over ours
    return Resource.create({**ours, **from_env})


def _exporter_names(var: str) -> list[str]:
    names = [n.strip().lower() for n in os.environ.get(var, "otlp").split(",") if n.strip()] or ["otlp"]
    for name in names:
        if name not in EXPORTERS:
            log.warning("ranklens: %s=%r is not an exporter ranklens knows (one of %s); ignored", var, name, EXPORTERS)
    return [n for n in names if n in ("otlp", "console")]


def _protocol(signal: str) -> str:
    proto = (os.environ.get(_SIGNALS[signal][2]) or os.environ.get(ENV_PROTOCOL) or "http/protobuf").strip().lower()
    if proto not in ("http/protobuf", "grpc"):
        log.warning("ranklens: OTLP protocol %r is not supported (http/protobuf, grpc); using http/protobuf", proto)
        proto = "http/protobuf"
    return proto


def _otlp_exporter(signal: str) -> Any:
    """The OTLP exporter class of ``signal`` for the configured protocol, or None (logged) when
    its package is not installed."""
    proto = _protocol(signal)
    kind = "trace" if signal == "traces" else "metric"
    name = "OTLPSpanExporter" if signal == "traces" else "OTLPMetricExporter"
    module = f"opentelemetry.exporter.otlp.proto.{'grpc' if proto == 'grpc' else 'http'}.{kind}_exporter"
    try:
        import importlib

        return getattr(importlib.import_module(module), name)
    except ImportError:
        package = "opentelemetry-exporter-otlp-proto-" + ("grpc" if proto == "grpc" else "http")
        log.warning("ranklens: OTLP %s export asked for, but %s is not installed", signal, package)
        return None


def provider_from_env(attrs: Mapping[str, Any], *, default_service: str = "ranklens-training") -> Any:
    """A ``TracerProvider`` exporting as ``OTEL_TRACES_EXPORTER`` says (OTLP by default, console),
    with the :func:`resource` of ``attrs``. The caller shuts it down (:func:`shutdown_bounded`): the
    SDK's own unbounded exit hook is off. Raises ImportError without opentelemetry-sdk."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    provider = TracerProvider(resource=resource(attrs, default_service=default_service), shutdown_on_exit=False)
    for name in _exporter_names("OTEL_TRACES_EXPORTER"):
        if name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        elif (exporter := _otlp_exporter("traces")) is not None:
            provider.add_span_processor(BatchSpanProcessor(exporter()))
    return provider


def meter_provider_from_env(attrs: Mapping[str, Any], *, default_service: str = "ranklens-training") -> Any:
    """A ``MeterProvider`` whose periodic reader (every ``OTEL_METRIC_EXPORT_INTERVAL`` ms, 60 s by
    default; its own thread) exports as ``OTEL_METRICS_EXPORTER`` says (OTLP by default, console),
    with the :func:`resource` of ``attrs``. The caller shuts it down (:func:`shutdown_bounded`).
    Raises ImportError without opentelemetry-sdk."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader

    readers = []
    for name in _exporter_names("OTEL_METRICS_EXPORTER"):
        if name == "console":
            readers.append(PeriodicExportingMetricReader(_parent_only(ConsoleMetricExporter())))
        elif (exporter := _otlp_exporter("metrics")) is not None:
            readers.append(PeriodicExportingMetricReader(_parent_only(exporter())))
    return MeterProvider(
        metric_readers=readers, resource=resource(attrs, default_service=default_service), shutdown_on_exit=False
    )


def _parent_only(exporter: Any) -> Any:
    """``exporter``, exporting only in the process that made it. The SDK restarts the periodic
    reader's thread in a forked child (a DataLoader worker), which would export the child's stale
    copy of the rank's cumulative series, under a new random ``service.instance.id``, every
    interval for the child's life; the child records nothing, so it exports nothing."""
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult

    class ParentOnlyMetricExporter(MetricExporter):
        def __init__(self) -> None:
            super().__init__(
                preferred_temporality=exporter._preferred_temporality,
                preferred_aggregation=exporter._preferred_aggregation,
            )
            self.pid = os.getpid()
            self.inner = exporter

        def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> Any:
            if os.getpid() != self.pid:
                return MetricExportResult.SUCCESS
            return self.inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return os.getpid() != self.pid or bool(self.inner.force_flush(timeout_millis=timeout_millis))

        def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
            if os.getpid() == self.pid:
                self.inner.shutdown(timeout_millis=timeout_millis, **kwargs)

    return ParentOnlyMetricExporter()


def shutdown_bounded(providers: list[Any], timeout_s: float = SHUTDOWN_TIMEOUT_S, *, own: bool = True) -> bool:
    """Flush ``providers`` (tracer or meter providers) and, when ``own``, shut them down, in a
    daemon thread waited for at most ``timeout_s``: an unreachable endpoint never holds the
    process longer. Returns True when everything finished in time. Never raises."""
    providers = [p for p in providers if p is not None]
    if not providers:
        return True
    timeout_ms = max(int(timeout_s * 1000), 1)

    def run() -> None:
        for p in providers:
            try:
                p.force_flush(timeout_millis=timeout_ms)
                if own:
                    p.shutdown()
            except Exception:
                log.exception("ranklens: flushing OpenTelemetry data failed")

    try:
        t = threading.Thread(target=run, name="ranklens-otel-shutdown", daemon=True)
        t.start()
    except RuntimeError:  # no new threads at interpreter shutdown (Python 3.12+): the SDK's own bounds
        run()
        return True
    t.join(timeout_s)
    if t.is_alive():
        log.warning("ranklens: OpenTelemetry export did not finish within %.1f s; the rest is dropped", timeout_s)
        return False
    return True


def collector_tracer(provider: Any = None, *, host: str = "") -> Any:
    """An OpenTelemetry tracer for the collector's own shipping loop, or None when nobody asked
    (no provider given and no OTEL_* export variable set) or the SDK is missing. A provider built
    here (``service.name`` ``ranklens-collector``, a random ``service.instance.id`` per collector
    process) is flushed and shut down at interpreter exit, bounded by :data:`SHUTDOWN_TIMEOUT_S`."""
    try:
        if provider is None:
            if not otel_requested():
                return None
            attrs = {"service.instance.id": str(uuid.uuid4()), "host.name": host or socket.gethostname()}
            provider = provider_from_env(attrs, default_service="ranklens-collector")
            import atexit

            atexit.register(shutdown_bounded, [provider])
        return provider.get_tracer("ranklens.collector", ranklens_version())
    except ImportError:
        log.warning("ranklens: OpenTelemetry asked for, but opentelemetry-sdk is not installed")
    except Exception:
        log.exception("ranklens: OpenTelemetry setup failed; the collector is not traced")
    return None
