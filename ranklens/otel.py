"""OpenTelemetry provider helpers shared by the tracer's step spans (:mod:`ranklens.tracing.otel`) and
the collector's own shipping loop (:func:`collector_tracer`: a span per pass, a child per store call).

Off unless asked for: a ``TracerProvider`` is passed in, or the standard variables ask for export —
``OTEL_TRACES_EXPORTER`` (``otlp``, ``console``) or ``OTEL_EXPORTER_OTLP_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``. ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` are
honoured by the SDK. Needs ``opentelemetry-sdk`` (and ``opentelemetry-exporter-otlp`` for OTLP);
without them a warning is logged once.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

__all__ = ["collector_tracer", "otel_requested", "provider_from_env", "resource_attributes"]

log = logging.getLogger("ranklens.otel")


def otel_requested(env: dict[str, str] | None = None) -> bool:
    """True when the standard OTEL_* variables ask for span export (``OTEL_TRACES_EXPORTER=none`` says no)."""
    env = dict(os.environ) if env is None else env
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    return bool(exporter) or bool(
        env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def resource_attributes(job_id: str, attempt: int, rank: int, world_size: int) -> dict[str, Any]:
    """The standard resource attributes of a training rank (host, pid, Kubernetes pod) and its identity."""
    attrs: dict[str, Any] = {
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


def collector_tracer(provider: Any = None, *, host: str = "") -> Any:
    """An OpenTelemetry tracer for the collector's own shipping loop, or None when nobody asked
    (no provider given and no OTEL_* export variable set) or the SDK is missing."""
    try:
        if provider is None:
            if not otel_requested():
                return None
            attrs = {"service.name": os.environ.get("OTEL_SERVICE_NAME", "ranklens-collector")}
            provider = provider_from_env({**attrs, "host.name": host or socket.gethostname()}, default_service=None)
        return provider.get_tracer("ranklens.collector")
    except ImportError:
        log.warning("ranklens: OpenTelemetry asked for, but opentelemetry-sdk is not installed")
    except Exception:
        log.exception("ranklens: OpenTelemetry setup failed; the collector is not traced")
    return None


def provider_from_env(attrs: dict[str, Any], *, default_service: str | None = "ranklens-training") -> Any:
    """A ``TracerProvider`` exporting as ``OTEL_TRACES_EXPORTER`` says (OTLP by default, console). Raises
    ImportError without opentelemetry-sdk."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    if default_service is not None:
        attrs = {"service.name": os.environ.get("OTEL_SERVICE_NAME", default_service), **attrs}
    provider = TracerProvider(resource=Resource.create(attrs))
    kind = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
    for name in (k.strip() for k in kind.split(",")):
        if name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        elif name == "otlp":
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            except ImportError:
                try:
                    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[no-redef, unused-ignore]
                        OTLPSpanExporter,
                    )
                except ImportError:
                    log.warning("ranklens: OTLP export asked for, but opentelemetry-exporter-otlp is not installed")
                    continue
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider
