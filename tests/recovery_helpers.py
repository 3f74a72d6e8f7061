"""Builders shared by the recovery tests: findings, a settable clock, a policy with one endpoint."""

from __future__ import annotations

import time
from typing import Any

from ranklens.analyzers.findings import Finding, Severity, Suspect, finding_id
from ranklens.analyzers.recovery import Endpoint, Guards, Level, Policy, PolicyRule

SECRET = "s3cret-for-tests-0123456789abcdef"


class Clock:
    """Wall clock that moves only when told (ns); ``sleep`` advances it instead of waiting."""

    def __init__(self, start_ns: int | None = None) -> None:
        self.ns = start_ns if start_ns is not None else time.time_ns()
        self.slept: list[float] = []

    def __call__(self) -> int:
        return self.ns

    def advance(self, s: float) -> None:
        self.ns += int(s * 1e9)

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.advance(s)


def finding(
    *,
    job_id: str = "job-r",
    attempt: int = 0,
    kind: str = "straggler",
    rank: int = 2,
    node: str = "node1",
    severity: Severity = Severity.CRITICAL,
    confidence: float = 0.95,
    duration_s: float = 600.0,
    steps: int = 50,
    state: str = "open",
    evidence: dict[str, Any] | None = None,
    now_ns: int | None = None,
) -> Finding:
    now = now_ns if now_ns is not None else time.time_ns()
    return Finding(
        id=finding_id(job_id, attempt, kind, f"rank:{rank}"),
        job_id=job_id,
        attempt=attempt,
        kind=kind,
        severity=severity,
        confidence=confidence,
        title=f"rank {rank} ({node}) is a {kind}",
        suspects=(Suspect(rank=rank, node=node),),
        first_seen_step=5,
        last_seen_step=5 + steps - 1,
        first_seen_ns=now - int(duration_s * 1e9),
        last_seen_ns=now,
        impact_s=12.5,
        impact_gpu_s=37.5,
        step_time_pct=29.0,
        evidence=evidence if evidence is not None else {"delay_per_step_s": 0.03, "per_step": list(range(50))},
        state=state,
        detector="persistent_blame",
    )


def policy(
    *,
    url: str | None = None,
    dry_run: bool = False,
    level: Level = Level.RESTART_RANK,
    guards: Guards | None = None,
    timeout_s: float = 2.0,
    max_attempts: int = 5,
    backoff_base_s: float = 0.01,
    rules: tuple[PolicyRule, ...] | None = None,
) -> Policy:
    endpoints = ()
    if url is not None:
        endpoints = (
            Endpoint(
                name="rx",
                url=url,
                secret=SECRET,
                timeout_s=timeout_s,
                max_attempts=max_attempts,
                backoff_base_s=backoff_base_s,
                backoff_max_s=1.0,
            ),
        )
    return Policy(
        rules=rules or (PolicyRule(name="stragglers", kinds=("straggler",), min_confidence=0.8, level=level),),
        guards=guards or Guards(cooldown_s=1800, max_actions_per_job_per_hour=3, escalate_after=2),
        endpoints=endpoints,
        dry_run=dry_run,
        dashboard_url="https://grafana.example/d/ranklens?var-job={job_id}&var-finding={finding_id}",
    )
