"""OpenTelemetry spans for training steps (one span per step, phases as child spans) and for the
collector's own shipping loop (:func:`collector_tracer`: a span per pass, a child per store call).

Off unless asked for: either a ``TracerProvider`` is passed to :func:`ranklens.tracing.init`
(``otel_provider=``), or the standard variables ask for export — ``OTEL_TRACES_EXPORTER`` (``otlp``,
``console``) or ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``.
``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` are honoured by the SDK. Spans are created
after the step ends, with the step's own timestamps, so nothing is added inside the step; export
runs in the SDK's background batch processor. Needs ``opentelemetry-sdk`` (and
``opentelemetry-exporter-otlp`` for OTLP); without them a warning is logged once.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

__all__ = ["StepSpans", "collector_tracer", "otel_requested"]

log = logging.getLogger("ranklens.tracing")


def otel_requested(env: dict[str, str] | None = None) -> bool:
    env = dict(os.environ) if env is None else env
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    return bool(exporter) or bool(
        env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def _resource_attributes(job_id: str, attempt: int, rank: int, world_size: int) -> dict[str, Any]:
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
            provider = _provider_from_env({**attrs, "host.name": host or socket.gethostname()}, default_service=None)
        return provider.get_tracer("ranklens.collector")
    except ImportError:
        log.warning("ranklens: OpenTelemetry asked for, but opentelemetry-sdk is not installed")
    except Exception:
        log.exception("ranklens: OpenTelemetry setup failed; the collector is not traced")
    return None


def _provider_from_env(attrs: dict[str, Any], *, default_service: str | None = "ranklens-training") -> Any:
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
                    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[no-redef]
                        OTLPSpanExporter,
                    )
                except ImportError:
                    log.warning("ranklens: OTLP export asked for, but opentelemetry-exporter-otlp is not installed")
                    continue
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider


class StepSpans:
    """Turns finished steps (with their phases) into spans."""

    def __init__(self, provider: Any, *, job_id: str, attempt: int, rank: int) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("ranklens.tracing")
        self.attrs = {"ranklens.job_id": job_id, "ranklens.attempt": attempt, "ranklens.rank": rank}

    @classmethod
    def create(cls, provider: Any, *, job_id: str, attempt: int, rank: int, world_size: int) -> StepSpans | None:
        """A StepSpans for ``provider``, or one configured from OTEL_* variables, or None."""
        try:
            if provider is None:
                if not otel_requested():
                    return None
                provider = _provider_from_env(_resource_attributes(job_id, attempt, rank, world_size))
            return cls(provider, job_id=job_id, attempt=attempt, rank=rank)
        except ImportError:
            log.warning("ranklens: OpenTelemetry asked for, but opentelemetry-sdk is not installed")
        except Exception:
            log.exception("ranklens: OpenTelemetry setup failed; steps are not exported as spans")
        return None

    def step(self, n: int, start_ns: int, end_ns: int, phases: list[tuple[str, int, int]]) -> None:
        from opentelemetry import trace

        span = self.tracer.start_span(f"step {n}", start_time=start_ns, attributes={**self.attrs, "ranklens.step": n})
        ctx = trace.set_span_in_context(span)
        for name, p_start, p_end in phases:
            child = self.tracer.start_span(name, context=ctx, start_time=p_start, attributes={"ranklens.step": n})
            child.end(end_time=p_end)
        span.end(end_time=end_ns)

    def shutdown(self) -> None:
        try:
            self.provider.force_flush()
        except Exception:
            pass
