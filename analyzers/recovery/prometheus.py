"""Findings and recovery activity as Prometheus metrics (prometheus-client, injected registry).

:class:`FindingsExporter` is a custom collector over the latest findings snapshot. Every series
of a finding has the same stable labels::

    job_id, attempt, kind, severity, finding_id, rank, node

(``rank``/``node``: the first suspect's, ``""`` when none; ``node`` is the label name every
ranklens series uses for a host, the collector's GPU series too; the finding id is stable while the
problem lasts, so a series does not churn between analyses). Metrics:

- ``ranklens_finding_open``: 1 while the finding is open, 0 once resolved
- ``ranklens_finding_confidence``: 0..1
- ``ranklens_finding_impact_seconds``, ``ranklens_finding_impact_gpu_seconds``: time lost so far
- ``ranklens_finding_step_time_ratio``: share of step time lost (0..1)
- ``ranklens_finding_last_seen_timestamp_seconds``
- ``ranklens_analyzer_last_run_timestamp_seconds`` and ``ranklens_analyzer_findings`` (per
  kind and severity, open findings): the analyzer's health

:class:`RecoveryMetrics` counts decisions and delivery outcomes and shows the outbox backlog.
The shipped alert rules (``deploy/prometheus/ranklens-rules.yml``) use these names. Serve a
registry with :func:`ranklens._metrics_http.serve_metrics` (re-exported by the package): it serves
no ``_created`` series (the counters here would each get one from prometheus-client) and adds
``ranklens_build_info``.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from ranklens.analyzers.findings import Finding

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import CollectorRegistry

__all__ = ["FINDING_LABELS", "FindingsExporter", "RecoveryMetrics"]

FINDING_LABELS = ("job_id", "attempt", "kind", "severity", "finding_id", "rank", "node")


def _labels(f: Finding) -> list[str]:
    s = f.suspects[0] if f.suspects else None
    return [
        f.job_id,
        str(f.attempt),
        f.kind,
        getattr(f.severity, "value", str(f.severity)),
        f.id,
        str(s.rank) if s is not None else "",
        s.node if s is not None else "",
    ]


class FindingsExporter:
    """A collector exporting the findings last given to :meth:`update`.

    Args:
        registry: where to register (None: not registered; call ``registry.register`` yourself).
        clock_s: wall clock in seconds (tests).
        max_findings: most impactful findings exported per update (bounds the series count).
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        clock_s: Callable[[], float] = time.time,
        max_findings: int = 500,
    ) -> None:
        self._lock = threading.Lock()
        self._findings: dict[str, Finding] = {}
        self._last_run_s: float | None = None
        self._clock_s = clock_s
        self._max = max_findings
        if registry is not None:
            registry.register(self)

    def update(self, findings: Iterable[Finding], *, replace: bool = True) -> None:
        """Set the exported findings (``replace=False``: merge by id, newest wins)."""
        fs = sorted(findings, key=lambda f: -f.impact_s)[: self._max]
        with self._lock:
            if replace:
                self._findings = {}
            for f in fs:
                self._findings[f.id] = f
            self._last_run_s = self._clock_s()

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import GaugeMetricFamily

        with self._lock:
            findings = list(self._findings.values())
            last = self._last_run_s
        fams = {
            "open": GaugeMetricFamily(
                "ranklens_finding_open", "1 while a finding is open, 0 once resolved", labels=FINDING_LABELS
            ),
            "confidence": GaugeMetricFamily(
                "ranklens_finding_confidence", "Confidence of a finding, 0..1", labels=FINDING_LABELS
            ),
            "impact": GaugeMetricFamily(
                "ranklens_finding_impact_seconds", "Job time lost to a finding so far", labels=FINDING_LABELS
            ),
            "gpu": GaugeMetricFamily(
                "ranklens_finding_impact_gpu_seconds", "GPU time lost to a finding so far", labels=FINDING_LABELS
            ),
            "ratio": GaugeMetricFamily(
                "ranklens_finding_step_time_ratio", "Share of step time lost, 0..1", labels=FINDING_LABELS
            ),
            "seen": GaugeMetricFamily(
                "ranklens_finding_last_seen_timestamp_seconds",
                "When a finding was last observed (Unix seconds; 0: unknown)",
                labels=FINDING_LABELS,
            ),
        }
        per_kind: Counter[tuple[str, str]] = Counter()
        for f in findings:
            lv = _labels(f)
            is_open = f.state == "open"
            fams["open"].add_metric(lv, 1.0 if is_open else 0.0)
            fams["confidence"].add_metric(lv, float(f.confidence))
            fams["impact"].add_metric(lv, float(f.impact_s))
            fams["gpu"].add_metric(lv, float(f.impact_gpu_s))
            fams["ratio"].add_metric(lv, float(f.step_time_pct) / 100.0)
            fams["seen"].add_metric(lv, f.last_seen_ns / 1e9 if f.last_seen_ns > 0 else 0.0)
            if is_open:
                per_kind[(f.kind, getattr(f.severity, "value", str(f.severity)))] += 1
        yield from fams.values()
        count = GaugeMetricFamily(
            "ranklens_analyzer_findings", "Open findings per kind and severity", labels=("kind", "severity")
        )
        for (k, s), n in sorted(per_kind.items()):
            count.add_metric([k, s], float(n))
        yield count
        if last is not None:
            g = GaugeMetricFamily(
                "ranklens_analyzer_last_run_timestamp_seconds", "When the analyzer last updated the findings"
            )
            g.add_metric([], last)
            yield g

    def describe(self) -> list[Metric]:
        return []  # dynamic: no describe-time validation of names


class RecoveryMetrics:
    """Counters of recovery decisions and deliveries, and the outbox backlog, on ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        from prometheus_client import Counter as PCounter
        from prometheus_client import Gauge

        self._decisions = PCounter(
            "ranklens_recovery_decisions",
            "Recovery decisions by level and outcome (decided, dry_run, suppressed)",
            ("level", "outcome"),
            registry=registry,
        )
        self._deliveries = PCounter(
            "ranklens_recovery_deliveries",
            "Webhook and hook delivery attempts by target and outcome",
            ("target", "outcome"),
            registry=registry,
        )
        self._pending = Gauge(
            "ranklens_recovery_outbox_pending", "Webhook deliveries waiting in the outbox", registry=registry
        )
        self._audit = Gauge(
            "ranklens_recovery_audit_queued", "actions rows waiting to be written to the store", registry=registry
        )

    def decision(self, level: str, outcome: str) -> None:
        self._decisions.labels(level, outcome).inc()

    def delivery(self, target: str, outcome: str) -> None:
        self._deliveries.labels(target, outcome).inc()

    def outbox(self, pending: int, audit_queued: int) -> None:
        self._pending.set(pending)
        self._audit.set(audit_queued)
