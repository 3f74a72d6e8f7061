"""Straggler analysis: which rank slows the job, in which phase, since when, at what cost.

``find_stragglers`` compares each rank's compute time with its peers' (waiting is not compute, so
victims are never named), attributes the excess to a phase, and adds blame (how long the others
waited for it) as evidence. Without step records it falls back to blame alone.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from ranklens.analyzers.blame import BlameMatrix, compute_blame
from ranklens.analyzers.compute import ComputeMatrix, compute_matrix, phase_excess
from ranklens.analyzers.detectors import (
    Detection,
    PeerComputeDetector,
    PeerDetection,
    PersistentBlameDetector,
    StragglerDetector,
)
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


def to_peer_finding(
    cm: ComputeMatrix,
    blame: BlameMatrix | None,
    d: PeerDetection,
    detector: PeerComputeDetector,
    phases: dict[str, float],
) -> Finding:
    i = int(np.searchsorted(cm.ranks, d.rank))
    sl = slice(d.onset_index, d.last_index + 1)
    steps = cm.steps[sl]
    excess = d.excess_s
    n = max(len(excess), 1)
    excess_per_step = float(np.clip(excess, 0, None).sum() / n)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns: steps not reported yet
        step_mean = float(np.nanmean(np.nanmedian(cm.step_s[:, sl], axis=0)))
    pct = 100.0 * excess_per_step / step_mean if step_mean and np.isfinite(step_mean) else 0.0
    host = cm.hosts.get(d.rank, "")
    world = len(cm.ranks)
    positive = {k: v for k, v in phases.items() if v > 0}
    phase = max(positive, key=lambda k: positive[k]) if positive else ""
    waited = None
    if blame is not None and d.rank in set(blame.ranks.tolist()):
        bi = int(np.searchsorted(blame.ranks, d.rank))
        cols = [j for j, s in enumerate(blame.steps) if int(steps[0]) <= int(s) <= int(steps[-1])]
        if cols:
            waited = float(blame.delay_s[bi, cols].sum() / len(cols))
    in_phase = f" in {phase}" if phase else ""
    title = (
        f"rank {d.rank}{f' ({host})' if host else ''} is a straggler{in_phase}: it computes "
        f"{_duration(excess_per_step)}/step longer than its peers ({d.ratio - 1:+.0%}), "
        f"{pct:.0f}% of step time, since step {int(steps[0])}"
    )
    if waited is not None and waited > 0:
        title += f"; the other ranks wait {_duration(waited)}/step for it"
    ongoing = d.last_index >= len(cm.steps) - RESOLVED_AFTER_STEPS
    peers = int((cm.peer_group == cm.peer_group[i]).sum())
    impact = float(np.clip(excess, 0, None).sum())
    return Finding(
        id=finding_id(cm.job_id, cm.attempt, "straggler", f"rank:{d.rank}"),
        job_id=cm.job_id,
        attempt=cm.attempt,
        kind="straggler",
        severity=Severity.CRITICAL if pct >= CRITICAL_PCT else Severity.WARNING,
        confidence=round(d.persistence * min(1.0, d.hot_steps / 10.0), 3),
        title=title,
        suspects=(Suspect(rank=d.rank, node=host),),
        first_seen_step=int(steps[0]),
        last_seen_step=int(steps[-1]),
        first_seen_ns=int(cm.step_start_ns[d.onset_index]),
        last_seen_ns=int(cm.step_start_ns[d.last_index]),
        impact_s=impact,
        impact_gpu_s=impact * max(world - 1, 0),
        step_time_pct=pct,
        evidence={
            "phase": phase,
            "phase_excess_s": {k: round(v, 6) for k, v in sorted(phases.items())},
            "excess_per_step_s": round(excess_per_step, 6),
            "compute_ratio": round(d.ratio, 4),
            "mean_step_time_s": round(step_mean, 6),
            "others_waited_per_step_s": None if waited is None else round(waited, 6),
            "what_if": "step time if this rank computed like its peers: shorter by excess_per_step_s",
            "peers": peers,
            "peer_group": int(cm.peer_group[i]),
            "hot_steps": d.hot_steps,
            "steps_since_onset": d.steps_since_onset,
            "persistence": round(d.persistence, 3),
            "per_step": [{"step": int(s), "excess_s": round(float(x), 6)} for s, x in zip(steps[:50], excess[:50])],
            "sql": cm.sql,
            "thresholds": {
                k: getattr(detector, k)
                for k in ("min_excess_ratio", "min_excess_s", "z", "persistence", "min_hot_steps")
            },
        },
        state="open" if ongoing else "resolved",
        detector=detector.name,
    )


def find_stragglers(
    store: Store, job_id: str, attempt: int = 0, *, detector: Any = None, window_steps: int | None = None
) -> list[Finding]:
    """Straggler findings of one job attempt, most costly first.

    By default ranks are compared with their peers on compute time (:class:`PeerComputeDetector`),
    which needs the ``steps`` table; without steps (e.g. a script traced with no step markers) the
    blame detector decides. Pass either detector to choose.
    """
    if isinstance(detector, PersistentBlameDetector) or (detector is not None and not hasattr(detector, "z")):
        blame = compute_blame(store, job_id, attempt)
        findings = [to_finding(blame, d, detector) for d in detector.detect(blame)]
        return sorted(findings, key=lambda f: -f.impact_s)
    cm = compute_matrix(store, job_id, attempt, window_steps=window_steps)
    if cm.empty:
        blame_detector = PersistentBlameDetector()
        blame = compute_blame(store, job_id, attempt)
        findings = [to_finding(blame, d, blame_detector) for d in blame_detector.detect(blame)]
        return sorted(findings, key=lambda f: -f.impact_s)
    peer_detector = detector or PeerComputeDetector()
    detections = peer_detector.detect(cm)
    blame = compute_blame(store, job_id, attempt, only_ranks=[d.rank for d in detections]) if detections else None
    findings = [
        to_peer_finding(
            cm, blame, d, peer_detector, phase_excess(store, cm, d.rank, cm.steps[d.onset_index : d.last_index + 1])
        )
        for d in detections
    ]
    return sorted(findings, key=lambda f: -f.impact_s)
