"""OpenTelemetry for training steps: a span per step (``train step``, the step number in
``ranklens.step``, phases as child spans) and, when asked for, OTLP metrics of the step time and
the collective wait time per rank. The provider helpers (also the collector's
:func:`~ranklens.otel.collector_tracer`) are :mod:`ranklens.otel`'s; docs/opentelemetry.md has the
variables, names and attributes.

Off unless asked for: a ``TracerProvider`` is passed to :func:`ranklens.tracing.init`
(``otel_provider=``), or the standard variables ask for export (``OTEL_TRACES_EXPORTER``,
``OTEL_METRICS_EXPORTER``, ``OTEL_EXPORTER_OTLP_ENDPOINT`` …: :mod:`ranklens.otel`). Off costs
nothing: the tracer holds no :class:`StepSpans` then.

The training thread only queues a finished step (a bounded deque; overflow is dropped and counted
as ``spans:queue_full``). Spans and metric points are made from the tracer's periodic flush, on its
background worker (:meth:`StepSpans.flushed`), with the step's own timestamps; the SDK exports
them from its own threads (batch span processor, periodic metric reader). Providers built here are
flushed at the tracer's shutdown, and flushed and shut down at interpreter exit, bounded by
:data:`~ranklens.otel.SHUTDOWN_TIMEOUT_S` (an unreachable endpoint never holds the process longer).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from ranklens.otel import (
    SHUTDOWN_TIMEOUT_S,
    meter_provider_from_env,
    metrics_requested,
    otel_requested,
    provider_from_env,
    ranklens_version,
    resource_attributes,
    shutdown_bounded,
)

__all__ = ["COLLECTIVE_WAIT_METRIC", "STEP_DURATION_METRIC", "STEP_SPAN", "StepSpans"]

log = logging.getLogger("ranklens.tracing")

STEP_SPAN = "train step"
STEP_DURATION_METRIC = "ranklens.step.duration"
COLLECTIVE_WAIT_METRIC = "ranklens.collective.wait_time"
# bucket boundaries in seconds (the SDK's default ones are for milliseconds): steps from 5 ms to
# 10 min, collective waits from 10 us to 10 min
STEP_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
WAIT_BUCKETS_S = (1e-5, 1e-4, 5e-4, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60, 600)
MAX_QUEUED_STEPS = 10_000


class StepSpans:
    """Turns finished steps (with their phases) into spans and, with a meter provider, finished
    steps and collectives into histograms.

    Args:
        provider: a ``TracerProvider`` for the step spans (None: no spans).
        job_id, attempt, rank: this rank's identity (attributes of every span and point).
        meter_provider: a ``MeterProvider`` for ``ranklens.step.duration`` and
            ``ranklens.collective.wait_time`` (None: no metrics).
        owned: the providers among these that were built here: shut down at exit (the others,
            passed in by the user, are only flushed; they are the user's).
        shutdown_timeout_s: the bound on the flush and shutdown at close.
    """

    def __init__(
        self,
        provider: Any,
        *,
        job_id: str,
        attempt: int,
        rank: int,
        meter_provider: Any = None,
        owned: tuple[Any, ...] = (),
        shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S,
    ) -> None:
        self.provider = provider
        self.meter_provider = meter_provider
        self.attrs = {"ranklens.job_id": job_id, "ranklens.attempt": attempt, "ranklens.rank": rank}
        version = ranklens_version()
        self.tracer = provider.get_tracer("ranklens.tracing", version) if provider is not None else None
        self.step_duration: Any = None
        self.collective_wait: Any = None
        if meter_provider is not None:
            meter = meter_provider.get_meter("ranklens.tracing", version)
            self.step_duration = _histogram(
                meter, STEP_DURATION_METRIC, "Wall time of a training step on this rank", STEP_BUCKETS_S
            )
            self.collective_wait = _histogram(
                meter,
                COLLECTIVE_WAIT_METRIC,
                "Time a collective was in flight on this rank, from its arrival to its completion "
                "(the wait for the last arriver plus the transfer)",
                WAIT_BUCKETS_S,
            )
        self._queue: deque[tuple[int, int, int, list[tuple[str, int, int]]]] = deque()
        self._dropped = 0
        self._dropped_reported = 0
        self._lock = threading.Lock()  # the flush and the exit hook drain the queue
        self._owned = [p for p in owned if p is not None]
        self._timeout_s = shutdown_timeout_s
        self._closing = False
        self._flusher: threading.Thread | None = None
        self._exited = False
        self._pid = os.getpid()
        _at_exit_once(self)

    @classmethod
    def create(cls, provider: Any, *, job_id: str, attempt: int, rank: int, world_size: int) -> StepSpans | None:
        """A StepSpans for ``provider`` (spans; metrics too when the variables ask for them), or one
        configured from the OTEL_* variables, or None when nothing is asked for. Never raises."""
        try:
            want_metrics = metrics_requested()
            if provider is None and not otel_requested() and not want_metrics:
                return None
            attrs = resource_attributes(job_id, attempt, rank, world_size)
            built = provider_from_env(attrs) if provider is None and otel_requested() else None
            meters = meter_provider_from_env(attrs) if want_metrics else None
            provider = provider or built
            owned = (built, meters)
            return cls(provider, job_id=job_id, attempt=attempt, rank=rank, meter_provider=meters, owned=owned)
        except ImportError:
            log.warning("ranklens: OpenTelemetry asked for, but opentelemetry-sdk is not installed")
        except Exception:
            log.exception("ranklens: OpenTelemetry setup failed; steps are not exported")
        return None

    # -- the training thread ------------------------------------------------------------------
    def step(self, n: int, start_ns: int, end_ns: int, phases: list[tuple[str, int, int]]) -> None:
        """A finished step (called by the tracer on the training thread): queued, nothing more."""
        if len(self._queue) >= MAX_QUEUED_STEPS:
            self._dropped += 1
            return
        self._queue.append((n, start_ns, end_ns, phases))

    # -- the tracer's background worker -------------------------------------------------------
    def flushed(self, rows: Iterable[tuple[str, dict[str, Any]]], count_drop: Callable[[str, int], None]) -> None:
        """The tracer's periodic flush (on its worker): spans and step-time points of the queued
        steps, wait-time points of the collectives among ``rows``; queue overflow goes to
        ``count_drop``. After :meth:`shutdown`, the providers are flushed in the background. Never
        raises."""
        try:
            dropped = self._dropped  # only the training thread adds to it
            if dropped > self._dropped_reported:
                count_drop("spans:queue_full", dropped - self._dropped_reported)
                self._dropped_reported = dropped
            if not self._lock.acquire(timeout=self._timeout_s):
                return
            try:
                self._drain()
                if self.collective_wait is not None:
                    self._record_collectives(rows)
            finally:
                self._lock.release()
            if self._closing and self._flusher is None:  # the tracer's final flush: out now, in the background
                flusher = threading.Thread(
                    target=shutdown_bounded,
                    args=([self.provider, self.meter_provider], self._timeout_s),
                    kwargs={"own": False},
                    name="ranklens-otel-flush",
                    daemon=True,
                )
                try:
                    flusher.start()
                    self._flusher = flusher
                except RuntimeError:  # at interpreter exit (Python 3.12+ starts no threads): the exit hook sends it
                    pass
        except Exception:
            count_drop("spans:error", 1)
            log.debug("ranklens: OpenTelemetry export of a flush failed", exc_info=True)

    def _drain(self) -> None:
        queue = self._queue
        while queue:
            n, start_ns, end_ns, phases = queue.popleft()
            if self.tracer is not None:
                self._span(n, start_ns, end_ns, phases)
            if self.step_duration is not None and end_ns >= start_ns:
                self.step_duration.record((end_ns - start_ns) / 1e9, self.attrs)

    def _span(self, n: int, start_ns: int, end_ns: int, phases: list[tuple[str, int, int]]) -> None:
        from opentelemetry import trace

        assert self.tracer is not None
        span = self.tracer.start_span(STEP_SPAN, start_time=start_ns, attributes={**self.attrs, "ranklens.step": n})
        ctx = trace.set_span_in_context(span)
        for name, p_start, p_end in phases:
            child = self.tracer.start_span(name, context=ctx, start_time=p_start, attributes={"ranklens.step": n})
            child.end(end_time=p_end)
        span.end(end_time=end_ns)

    def _record_collectives(self, rows: Iterable[tuple[str, dict[str, Any]]]) -> None:
        record = self.collective_wait.record
        by_op: dict[str, dict[str, Any]] = {}
        for table, row in rows:
            if table != "collectives":
                continue
            enter, end = row.get("enter_ns", -1), row.get("end_ns", -1)
            if enter is None or end is None or enter <= 0 or end < enter:  # failed or never completed
                continue
            op = str(row.get("op", ""))
            attrs = by_op.get(op)
            if attrs is None:
                attrs = by_op[op] = {**self.attrs, "ranklens.collective.op": op}
            record((end - enter) / 1e9, attrs)

    # -- closing ------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """The tracer is shutting down: its final flush comes next and sends what it makes at once,
        in the background; interpreter exit waits for that and shuts the providers down, bounded.
        Never raises or blocks."""
        self._closing = True

    def _at_exit(self, deadline: float | None = None) -> None:
        """Interpreter exit (after the tracer's own exit hook: atexit runs the later-registered
        first): what is still queued, then the providers flushed and (when built here) shut down,
        all by ``deadline`` (``time.monotonic()``; default: the shutdown bound from now). Never
        raises."""
        if os.getpid() != self._pid or self._exited:  # a forked child is not this rank
            return
        self._exited = True
        try:
            if deadline is None:
                deadline = time.monotonic() + self._timeout_s
            if self._flusher is not None:
                self._flusher.join(max(deadline - time.monotonic(), 0.001))
            if self._lock.acquire(timeout=max(deadline - time.monotonic(), 0.001)):
                try:
                    self._drain()
                finally:
                    self._lock.release()
            yours = [p for p in (self.provider, self.meter_provider) if p is not None and p not in self._owned]
            shutdown_bounded(yours, max(deadline - time.monotonic(), 0.001), own=False)
            shutdown_bounded(self._owned, max(deadline - time.monotonic(), 0.001))
        except Exception:
            log.debug("ranklens: OpenTelemetry shutdown failed", exc_info=True)


# Every live StepSpans is closed at interpreter exit by one hook, registered at the first one (not at
# import) and run after the tracer's own (atexit runs the later-registered first; init() registers the
# tracer's after making its StepSpans). Strong references: the tracer lets go of its StepSpans at
# shutdown, and what it made must still be exported and its providers shut down at exit.
_LIVE: list[StepSpans] = []
_hook_lock = threading.Lock()
_hooked = False


def _at_exit_once(spans: StepSpans) -> None:
    global _hooked
    with _hook_lock:
        _LIVE.append(spans)
        if not _hooked:
            _hooked = True
            atexit.register(_close_all)


def _close_all() -> None:
    deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S  # one bound for them all
    for spans in list(_LIVE):
        spans._at_exit(deadline)


def _histogram(meter: Any, name: str, description: str, buckets: tuple[float, ...]) -> Any:
    try:
        return meter.create_histogram(
            name, unit="s", description=description, explicit_bucket_boundaries_advisory=buckets
        )
    except TypeError:  # an SDK before 1.23 takes no advisory: its default buckets
        return meter.create_histogram(name, unit="s", description=description)
