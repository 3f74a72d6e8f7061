"""The recovery engine: findings in; decisions, deliveries and ``actions`` rows out.

For each finding: the first matching rule gives a level; a third ``restart_rank`` of the same
target within the escalation window becomes ``replace_node`` (the in-place restarts did not
help); the decision's idempotency key (finding id, level, mode) makes a re-run of the analysis
a no-op; then the guards (cool-down per target and level, cap per job per hour, a readable
history) may suppress it. A decision that goes ahead is recorded together with its webhook
deliveries in the outbox (one transaction), its hooks are called, and every row reaches the
``actions`` table. In dry-run (the policy's default) the same decisions are taken and recorded
as ``dry_run``, and deliveries carry them as ``notify``, so no receiver acts.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ranklens.analyzers.findings import Finding
from ranklens.analyzers.recovery.api import Decision, Level, PayloadTooLarge, idempotency_key
from ranklens.analyzers.recovery.audit import History, action_row, load_history
from ranklens.analyzers.recovery.executors.api import ExecContext, ExecResult, build_executor
from ranklens.analyzers.recovery.hooks import HookRegistry, default_registry
from ranklens.analyzers.recovery.outbox import DeliveryOutbox, NewDelivery
from ranklens.analyzers.recovery.payload import build_payload
from ranklens.analyzers.recovery.policy import Policy
from ranklens.analyzers.recovery.webhooks import DeliveryStats, Transport, WebhookDispatcher
from ranklens.config import node_name
from ranklens.store.api import Store

__all__ = ["RecoveryEngine", "RunReport", "act_on", "target_for"]

logger = logging.getLogger("ranklens.recovery")
HOUR_NS = 3600 * 10**9


def target_for(f: Finding, level: Level) -> str:
    """What a level acts on: ``rank:2`` (or ``rank:1,3``), ``node:<host>``, ``job:<id>``.

    A node whose host is unknown is named after its ranks (``node-of-rank:2``), which, unlike a
    host, is scoped to the job.
    """
    named = {s.rank for s in f.suspects if s.rank >= 0}
    if not named and any(s.node for s in f.suspects):  # a finding about a node: its ranks are evidence
        named = {int(r) for r in f.evidence.get("ranks", [])}
    ranks = ",".join(str(r) for r in sorted(named))
    if level is Level.RESTART_JOB or not ranks:
        return f"job:{f.job_id}"
    if level is Level.REPLACE_NODE:
        hosts = sorted({s.node for s in f.suspects if s.node})
        return f"node:{','.join(hosts)}" if hosts else f"node-of-rank:{ranks}"
    return f"rank:{ranks}"


@dataclass
class RunReport:
    """What :meth:`RecoveryEngine.process` did: decisions taken, those skipped as already taken, deliveries."""

    decisions: list[Decision] = field(default_factory=list)
    already_decided: list[str] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)
    hooks: list[tuple[str, str, str]] = field(default_factory=list)
    executed: list[tuple[str, str, ExecResult]] = field(default_factory=list)
    annotated: list[Finding] = field(default_factory=list)  # findings given evidence by an executor
    deliveries: DeliveryStats = field(default_factory=DeliveryStats)
    audit_rows_written: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "decisions": [
                {
                    "finding_id": d.finding.id,
                    "kind": d.finding.kind,
                    "level": d.level.value,
                    "delivered_level": d.delivered_level.value,
                    "target": d.target,
                    "rule": d.rule,
                    "dry_run": d.dry_run,
                    "suppressed_by": d.suppressed_by,
                    "escalated_from": d.escalated_from.value if d.escalated_from else None,
                    "reason": d.reason,
                    "idempotency_key": d.key,
                }
                for d in self.decisions
            ],
            "already_decided": self.already_decided,
            "unmatched": self.unmatched,
            "hooks": [{"hook": h, "finding_id": f, "outcome": o} for h, f, o in self.hooks],
            "executors": [
                {"executor": x, "finding_id": f, "outcome": r.outcome, "detail": r.detail} for x, f, r in self.executed
            ],
            "deliveries": {
                "acknowledged": self.deliveries.acknowledged,
                "retrying": self.deliveries.retrying,
                "failed": self.deliveries.failed,
            },
        }


class RecoveryEngine:
    """Decides and carries out recovery actions for findings.

    Args:
        policy: rules, guards and endpoints (:func:`~.policy.load_policy`).
        store: where ``actions`` rows go and where the guards read history from (None: the
            outbox alone is the history, and rows stay queued in it).
        outbox_dir: the durable outbox's directory (one per deployment; survives restarts).
        hooks: the hook registry (default: the module-level one ``@hook`` fills).
        transport: HTTP client for webhooks (default: stdlib ``http.client``).
        clock_ns, rng, sleep: injected time, jitter and waiting (tests).
        metrics: optional :class:`~.prometheus.RecoveryMetrics`.
    """

    def __init__(
        self,
        policy: Policy,
        store: Store | None,
        outbox_dir: str | os.PathLike[str],
        *,
        hooks: HookRegistry | None = None,
        transport: Transport | None = None,
        clock_ns: Callable[[], int] = time.time_ns,
        rng: random.Random | None = None,
        sleep: Callable[[float], None] = time.sleep,
        metrics: Any = None,
        context: ExecContext | None = None,
    ) -> None:
        self.policy = policy
        self.context = context or ExecContext(store=store, host=node_name())
        self.executors = [build_executor(x) for x in policy.executors]
        self.store = store
        self.hooks = hooks if hooks is not None else default_registry
        self._clock_ns = clock_ns
        self.outbox = DeliveryOutbox(outbox_dir, clock_ns=clock_ns)
        self.metrics = metrics
        self.dispatcher = WebhookDispatcher(
            self.outbox,
            policy.endpoints,
            transport=transport,
            clock_ns=clock_ns,
            rng=rng,
            sleep=sleep,
            on_outcome=(lambda ep, o: metrics.delivery(ep, o)) if metrics is not None else None,
        )

    # -- deciding ----------------------------------------------------------------------------

    def decide(self, findings: Iterable[Finding], history: History | None = None) -> tuple[list[Decision], RunReport]:
        """Decisions for ``findings`` without acting on them (plus what was skipped, in a report)."""
        findings = list(findings)
        report = RunReport()
        now = self._clock_ns()
        g = self.policy.guards
        if history is None:
            since = now - int(max(g.cooldown_s, g.escalation_window_s, 3600) * 1e9)
            history = load_history(
                self.store, {f.job_id for f in findings}, since_ns=since, queued=self.outbox.pending_audit()
            )
        local_keys = self.outbox.decision_keys()
        mode = "dry_run" if self.policy.dry_run else "decided"
        out: list[Decision] = []
        for f in findings:
            rule = self.policy.match(f)
            if rule is None:
                report.unmatched.append(f.id)
                continue
            level = rule.level_for(f)
            escalated_from = None
            if level is Level.RESTART_RANK and g.escalate_after > 0:
                prior = history.count_target(
                    job_id=f.job_id,
                    target=target_for(f, Level.RESTART_RANK),
                    action=Level.RESTART_RANK.value,
                    outcome=mode,
                    since_ns=now - int(g.escalation_window_s * 1e9),
                )
                if prior >= g.escalate_after:
                    level, escalated_from = Level.REPLACE_NODE, Level.RESTART_RANK
            target = target_for(f, level)
            key = idempotency_key(f.id, level, self.policy.dry_run)
            if key in local_keys or history.has_key(key):
                report.already_decided.append(f.id)
                continue
            reason = (
                f"rule {rule.name}: {f.kind} {getattr(f.severity, 'value', f.severity)}, confidence {f.confidence:.2f}"
            )
            if escalated_from is not None:
                reason += (
                    f"; escalated: {g.escalate_after} restart_rank of {target_for(f, Level.RESTART_RANK)} did not help"
                )
            suppressed, detail = self._guard(f, level, target, mode, history, now)
            d = Decision(
                finding=f,
                level=level,
                target=target,
                rule=rule.name,
                reason=reason,
                dry_run=self.policy.dry_run,
                key=key,
                decided_ns=now,
                escalated_from=escalated_from,
                suppressed_by=suppressed,
                detail=detail,
            )
            out.append(d)
            if not suppressed:
                # later findings of this batch see this decision (cool-down, cap, escalation)
                history.add(
                    {
                        "job_id": f.job_id,
                        "action": level.value,
                        "target": target,
                        "outcome": mode,
                        "ts_ns": now,
                        "idempotency_key": key,
                    }
                )
                local_keys.add(key)
        report.decisions = out
        return out, report

    def _guard(
        self, f: Finding, level: Level, target: str, mode: str, history: History, now: int
    ) -> tuple[str, dict[str, Any]]:
        g = self.policy.guards
        if level.remediates and not history.complete:
            return "history_unavailable", {"why": "the actions history could not be read; only notify goes ahead"}
        last = history.last_ns(job_id=f.job_id, target=target, action=level.value, outcome=mode)
        if last is not None and now - last < g.cooldown_s * 1e9:
            return "cooldown", {
                "why": f"{level.value} of {target} {((now - last) / 1e9):.0f} s ago, cool-down {g.cooldown_s:.0f} s"
            }
        if level.remediates:
            n = history.count_job(
                job_id=f.job_id, outcome=mode, since_ns=now - HOUR_NS, exclude_actions=(Level.NOTIFY.value,)
            )
            if n >= g.max_actions_per_job_per_hour:
                return "rate_cap", {
                    "why": f"{n} actions on job {f.job_id} in the last hour, cap {g.max_actions_per_job_per_hour}"
                }
        return "", {}

    # -- acting ------------------------------------------------------------------------------

    def process(self, findings: Iterable[Finding], *, deliver: bool = True) -> RunReport:
        """Decide, record and carry out actions for ``findings``; one pass of webhook delivery.

        Idempotent: running it again on the same findings takes no new decision. Hooks are
        called synchronously (each bounded by its timeout); webhooks are queued and attempted
        once now, retries happen in later calls or in :meth:`drain`.
        """
        decisions, report = self.decide(findings)
        for d in decisions:
            if d.suppressed_by:
                self._record_suppressed(d)
            else:
                self._record_and_run(d, report)
        if deliver:
            report.deliveries = self.dispatcher.deliver_due()
        report.audit_rows_written = self.flush_audit()
        self._update_gauges()
        return report

    def _decision_row(self, d: Decision, outcome: str) -> dict[str, Any]:
        f = d.finding
        detail = {
            "rule": d.rule,
            "reason": d.reason,
            "dry_run": d.dry_run,
            "delivered_level": d.delivered_level.value,
            "kind": f.kind,
            "severity": getattr(f.severity, "value", str(f.severity)),
            "confidence": round(float(f.confidence), 4),
            **({"escalated_from": d.escalated_from.value} if d.escalated_from else {}),
            **({"suppressed_by": d.suppressed_by} if d.suppressed_by else {}),
            **d.detail,
        }
        return action_row(
            finding_id=f.id,
            job_id=f.job_id,
            attempt=f.attempt,
            action=d.level.value,
            target=d.target,
            idempotency_key=d.key,
            outcome=outcome,
            detail=detail,
            ts_ns=d.decided_ns,
        )

    def _record_suppressed(self, d: Decision) -> None:
        logger.info(
            "recovery: %s of %s for finding %s suppressed (%s)", d.level.value, d.target, d.finding.id, d.suppressed_by
        )
        if self.outbox.record_suppression(d.key, d.suppressed_by, [self._decision_row(d, "suppressed")]):
            self._count(d, "suppressed")

    def _record_and_run(self, d: Decision, report: RunReport) -> None:
        f = d.finding
        outcome = "dry_run" if d.dry_run else "decided"
        deliveries: list[NewDelivery] = []
        endpoints = [e for e in self.policy.endpoints if e.accepts(d.delivered_level, f.kind)]
        if endpoints:
            try:
                body = build_payload(
                    d, dashboard_link=self.policy.dashboard_link(f), max_bytes=self.policy.max_payload_bytes
                )
                deliveries = [NewDelivery(e.name, body) for e in endpoints]
            except PayloadTooLarge as e:
                logger.error("recovery: %s", e)
                self.outbox.add_audit([self._skip_row(d, f"webhook:{ep.name}", str(e)) for ep in endpoints])
        if not self.outbox.record_decision(
            key=d.key,
            finding_id=f.id,
            job_id=f.job_id,
            attempt=f.attempt,
            action=d.level.value,
            target=d.target,
            outcome=outcome,
            audit_rows=[self._decision_row(d, outcome)],
            deliveries=deliveries,
        ):
            report.already_decided.append(f.id)  # another process took it meanwhile
            return
        self._count(d, outcome)
        logger.info(
            "recovery: %s%s of %s for finding %s (%s)",
            "[dry run] " if d.dry_run else "",
            d.level.value,
            d.target,
            f.id,
            d.reason,
        )
        rows = []
        for spec in self.hooks.for_decision(f.kind, d.delivered_level):
            res = self.hooks.run(spec, d)
            report.hooks.append((spec.name, f.id, res.outcome))
            detail = f"{res.detail} ({res.duration_s:.2f} s)" if res.detail else f"{res.duration_s:.2f} s"
            rows.append(self._delivery_row(d, f"hook:{spec.name}", res.outcome, detail))
            if self.metrics is not None:
                self.metrics.delivery(f"hook:{spec.name}", res.outcome)
        for ex in self.executors:
            if not ex.spec.accepts(d.level, f.kind):
                continue
            t0 = time.monotonic()
            xres: ExecResult
            if d.dry_run:
                xres = ExecResult("skipped", f"dry run: would {ex.describe(d)}")
            else:
                try:
                    xres = ex.execute(d, self.context)
                except Exception as e:  # an executor's failure is a row, never an error of the analysis
                    logger.exception("recovery: executor %s failed", ex.spec.name)
                    xres = ExecResult("failed", f"{type(e).__name__}: {e}")
            report.executed.append((ex.spec.name, f.id, xres))
            logger.info("recovery: executor %s: %s: %s", ex.spec.name, xres.outcome, xres.detail)
            xdetail = {"detail": xres.detail, "seconds": round(time.monotonic() - t0, 3), **xres.data}
            rows.append(self._delivery_row(d, f"executor:{ex.spec.name}", xres.outcome, xdetail))
            if self.metrics is not None:
                self.metrics.delivery(f"executor:{ex.spec.name}", xres.outcome)
            stacks = [x for x in xres.data.get("signalled", []) if x.get("innermost")]
            if stacks and self.store is not None:
                report.annotated.append(self._attach_stacks(f, stacks))
        if rows:
            self.outbox.add_audit(rows)

    def _attach_stacks(self, f: Finding, stacks: list[dict[str, Any]]) -> Finding:
        """A new version of the finding with the stuck ranks' stacks, taken before the restart."""
        import dataclasses

        from ranklens.analyzers.findings import save_findings

        ev = dict(f.evidence)
        ev["stacks"] = {str(x["rank"]): {"file": x.get("stacks"), "innermost": x["innermost"]} for x in stacks}
        annotated = dataclasses.replace(f, evidence=ev, updated_ns=self._clock_ns())
        try:
            assert self.store is not None
            save_findings(self.store, [annotated])
        except Exception as e:
            logger.warning("recovery: could not attach the stacks to finding %s: %s", f.id, e)
        return annotated

    def _delivery_row(self, d: Decision, target: str, outcome: str, detail: str | dict[str, Any]) -> dict[str, Any]:
        """The ``actions`` row of one delivery of decision ``d`` (a hook, an executor, a skip), now."""
        f = d.finding
        return action_row(
            finding_id=f.id,
            job_id=f.job_id,
            attempt=f.attempt,
            action=d.level.value,
            target=target,
            idempotency_key=d.key,
            outcome=outcome,
            detail=detail,
            ts_ns=self._clock_ns(),
        )

    def _skip_row(self, d: Decision, target: str, why: str) -> dict[str, Any]:
        return self._delivery_row(d, target, "skipped", why)

    def _count(self, d: Decision, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.decision(d.level.value, outcome)

    def _update_gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.outbox(self.outbox.counts().get("pending", 0), len(self.outbox.pending_audit()))

    # -- delivering --------------------------------------------------------------------------

    def deliver_pending(self) -> DeliveryStats:
        """One pass over due webhook deliveries (e.g. those left by a previous run), then flush audit rows."""
        stats = self.dispatcher.deliver_due()
        self.flush_audit()
        self._update_gauges()
        return stats

    def drain(self, timeout_s: float) -> DeliveryStats:
        """Deliver, waiting out retries, until nothing is pending or ``timeout_s`` passed."""
        stats = self.dispatcher.drain(timeout_s)
        self.flush_audit()
        self._update_gauges()
        return stats

    def flush_audit(self) -> int:
        """Write queued ``actions`` rows to the store; they stay queued when it is unreachable."""
        if self.store is None:
            return 0
        store = self.store
        try:
            return self.outbox.flush_audit(lambda rows: store.write("actions", rows))
        except Exception as e:  # the store is a boundary; rows stay in the outbox for the next flush
            logger.warning("recovery: cannot write actions rows to the store (%s); they stay queued", e)
            return 0

    def pending(self) -> dict[str, int]:
        """Outbox state: deliveries per state and audit rows not yet in the store."""
        return {**self.outbox.counts(), "audit_queued": len(self.outbox.pending_audit())}

    def close(self) -> None:
        self.flush_audit()
        self.outbox.close()

    def __enter__(self) -> RecoveryEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def act_on(
    findings: Sequence[Finding],
    policy: Policy,
    store: Store | None,
    outbox_dir: str | os.PathLike[str],
    *,
    drain_timeout_s: float = 0.0,
    **kwargs: Any,
) -> RunReport:
    """One-shot: build a :class:`RecoveryEngine`, process ``findings``, optionally drain retries, close."""
    with RecoveryEngine(policy, store, outbox_dir, **kwargs) as engine:
        report = engine.process(findings)
        if drain_timeout_s > 0:
            s = engine.drain(drain_timeout_s)
            report.deliveries.acknowledged += s.acknowledged
            report.deliveries.retrying = s.retrying
            report.deliveries.failed += s.failed
        return report
