"""OpenTelemetry spans for training steps (one span per step, phases as child spans); the provider
helpers (also the collector's :func:`~ranklens.otel.collector_tracer`) are :mod:`ranklens.otel`'s.

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
from typing import Any

from ranklens.otel import otel_requested, provider_from_env, resource_attributes

__all__ = ["StepSpans"]

log = logging.getLogger("ranklens.tracing")


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
                provider = provider_from_env(resource_attributes(job_id, attempt, rank, world_size))
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
