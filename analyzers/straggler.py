"""The first straggler analyzer: blame-based culprit detection with impact.

``find_stragglers`` computes the blame matrix in the store, lets a detector decide, and turns
each detection into a :class:`~ranklens.analyzers.findings.Finding` with evidence.
"""

from __future__ import annotations

import numpy as np

from ranklens.analyzers.blame import BlameMatrix, compute_blame
from ranklens.analyzers.detectors import Detection, PersistentBlameDetector, StragglerDetector
from ranklens.analyzers.findings import Finding, Severity, Suspect, finding_id
from ranklens.store.api import Store

__all__ = ["find_stragglers", "to_finding"]

CRITICAL_PCT = 20.0
RESOLVED_AFTER_STEPS = 5  # a finding closes when the rank stopped being hot this many steps ago


def to_finding(blame: BlameMatrix, d: Detection, detector: StragglerDetector) -> Finding:
    i = int(np.searchsorted(blame.ranks, d.rank))
    sl = slice(d.onset_index, None)
    delay = blame.delay_s[i, sl]
    step_time = blame.step_time_s[sl]
    n = max(len(delay), 1)
    delay_per_step = float(delay.sum() / n)
    step_mean = float(np.nanmean(step_time)) if np.isfinite(step_time).any() else float("nan")
    pct = 100.0 * delay_per_step / step_mean if step_mean and np.isfinite(step_mean) else 0.0
    onset_step = int(blame.steps[d.onset_index])
    last_step = int(blame.steps[d.last_index])
    host = blame.hosts.get(d.rank, "")
    others = len(blame.ranks) - 1
    severity = Severity.CRITICAL if pct >= CRITICAL_PCT else Severity.WARNING
    ongoing = d.last_index >= len(blame.steps) - RESOLVED_AFTER_STEPS
    confidence = round(d.persistence * min(1.0, d.hot_steps / 10.0), 3)
    title = (
        f"rank {d.rank}{f' ({host})' if host else ''} is a straggler: other ranks waited "
        f"{_duration(delay_per_step)}/step for it, {pct:.0f}% of step time, since step {onset_step}"
    )
    per_step = [
        {"step": int(s), "delay_s": round(float(x), 6), "step_time_s": round(float(t), 6)}
        for s, x, t in zip(blame.steps[sl], delay, step_time)
    ]
    top_others = sorted(
        ((int(r), float(blame.delay_s[k, sl].sum())) for k, r in enumerate(blame.ranks) if k != i),
        key=lambda x: -x[1],
    )[:3]
    return Finding(
        id=finding_id(blame.job_id, blame.attempt, "straggler", f"rank:{d.rank}"),
        job_id=blame.job_id,
        attempt=blame.attempt,
        kind="straggler",
        severity=severity,
        confidence=confidence,
        title=title,
        suspects=(Suspect(rank=d.rank, node=host),),
        first_seen_step=onset_step,
        last_seen_step=last_step,
        first_seen_ns=int(blame.step_start_ns[d.onset_index]),
        last_seen_ns=int(blame.step_start_ns[d.last_index]),
        impact_s=float(delay.sum()),
        impact_gpu_s=float(blame.wait_s[i, sl].sum()),
        step_time_pct=pct,
        evidence={
            "delay_per_step_s": round(delay_per_step, 6),
            "mean_step_time_s": round(step_mean, 6),
            "hot_steps": d.hot_steps,
            "steps_since_onset": d.steps_since_onset,
            "persistence": round(d.persistence, 3),
            "victims": others,
            "collectives_last_at": int(blame.last_count[i, sl].sum()),
            "next_most_blamed": [{"rank": r, "delay_s": round(x, 6)} for r, x in top_others],
            "per_step": per_step[:50],
            "sql": blame.sql,
            "thresholds": {
                k: getattr(detector, k)
                for k in ("min_share", "min_delay_s", "persistence", "min_hot_steps")
                if hasattr(detector, k)
            },
        },
        state="open" if ongoing else "resolved",
        detector=detector.name,
    )


def _duration(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def find_stragglers(
    store: Store, job_id: str, attempt: int = 0, *, detector: StragglerDetector | None = None
) -> list[Finding]:
    """Straggler findings of one job attempt, most costly first."""
    detector = detector or PersistentBlameDetector()
    blame = compute_blame(store, job_id, attempt)
    findings = [to_finding(blame, d, detector) for d in detector.detect(blame)]
    return sorted(findings, key=lambda f: -f.impact_s)
