"""Straggler analysis: which rank slows the job, in which phase, since when, at what cost.

``find_stragglers`` compares each rank's compute time with its peers' (waiting is not compute, so
victims are never named), attributes the excess to a phase, and adds blame (how long the others
waited for it) as evidence. Without step records it falls back to blame alone.
"""

from __future__ import annotations

import warnings
from typing import cast

import numpy as np

from ranklens.analyzers import detectors
from ranklens.analyzers.blame import BlameMatrix, compute_blame
from ranklens.analyzers.compute import ComputeMatrix, compute_matrix, phase_excess
from ranklens.analyzers.contention import Contention, cpu_window, explains
from ranklens.analyzers.detectors import (
    Detection,
    PeerComputeDetector,
    PeerDetection,
    PeerDetector,
    PersistentBlameDetector,
    StragglerDetector,
)
from ranklens.analyzers.findings import Finding, Severity, Suspect, finding_id
from ranklens.store.api import Store

__all__ = ["discount_cpu_contention", "find_stragglers", "to_finding"]

CRITICAL_PCT = 20.0
# a finding closes when the rank stopped being hot this many steps ago
RESOLVED_AFTER_STEPS = detectors.RESOLVED_AFTER_STEPS


def to_finding(blame: BlameMatrix, d: Detection, detector: StragglerDetector) -> Finding:
    i = int(np.searchsorted(blame.ranks, d.rank))
    sl = slice(d.onset_index, None)
    delay = blame.delay_s[i, sl]
    step_time = blame.step_time_s[sl]
    n = max(len(delay), 1)
    delay_per_step = float(delay.sum() / n)
    step_mean = float(np.nanmean(step_time)) if np.isfinite(step_time).any() else float("nan")
    pct = 100.0 * delay_per_step / step_mean if step_mean and np.isfinite(step_mean) else 0.0
    onset_step = int(blame.steps[d.onset_index]) if blame.by_step else -1
    last_step = int(blame.steps[d.last_index]) if blame.by_step else -1
    host = blame.hosts.get(d.rank, "")
    others = len(blame.ranks) - 1
    severity = Severity.CRITICAL if pct >= CRITICAL_PCT else Severity.WARNING
    ongoing = d.last_index >= len(blame.steps) - RESOLVED_AFTER_STEPS
    confidence = round(d.persistence * min(1.0, d.hot_steps / 10.0), 3)
    unit = {"steps": "step", "iterations": "iteration"}.get(blame.step_basis, "window")
    if blame.step_basis == "steps":
        since = f"since step {onset_step}"
    elif blame.step_basis == "iterations":
        since = f"since iteration {onset_step} (no step markers: iterations counted from the collectives)"
    else:
        since = f"in windows {d.onset_index}-{d.last_index} of the collective ledger (no step markers)"
    title = (
        f"rank {d.rank}{f' ({host})' if host else ''} is a straggler: other ranks waited "
        f"{_duration(delay_per_step)}/{unit} for it, {pct:.0f}% of {unit} time, {since}"
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
            "step_basis": blame.step_basis,
            "phase": "",
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
                for k in ("min_share", "min_delay_s", "dominance", "persistence", "min_hot_steps")
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
    detector: PeerDetector,
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
    host = cm.hosts.get(d.rank, "")
    world = len(cm.ranks)
    positive = {k: v for k, v in phases.items() if v > 0}
    phase = max(positive, key=lambda k: positive[k]) if positive else ""
    waited = None
    waited_gpu = 0.0
    if blame is not None and d.rank in set(blame.ranks.tolist()):
        bi = int(np.searchsorted(blame.ranks, d.rank))
        cols = [j for j, s in enumerate(blame.steps) if int(steps[0]) <= int(s) <= int(steps[-1])]
        if cols:
            waited = float(blame.delay_s[bi, cols].sum() / len(cols))
            waited_gpu = float(blame.wait_s[bi, cols].sum() / len(cols))
    seen = _step_excess_seen(cm, d.onset_index, d.last_index)
    # What the rank cost the job: the time the others waited for it; where the ledger cannot show
    # it (no collectives of the rank's), the step-time rise the job saw; never more than its excess.
    # A rank that computes longer but that nobody waits for costs (almost) nothing. (The step-time
    # rise is not credited next to blame: another rank's slowdown at the same time would raise it.)
    if waited is not None:
        cost, basis = min(excess_per_step, waited), "others_waited"
    elif seen is not None:
        cost, basis = min(excess_per_step, seen), "step_time_rise"
    else:
        cost, basis = excess_per_step, "compute_excess"
    pct = 100.0 * cost / step_mean if step_mean and np.isfinite(step_mean) else 0.0
    in_phase = f" in {phase}" if phase else ""
    title = (
        f"rank {d.rank}{f' ({host})' if host else ''} is a straggler{in_phase}: it computes "
        f"{_duration(excess_per_step)}/step longer than its peers ({d.ratio - 1:+.0%}) since step {int(steps[0])}, "
        f"costing the job {_duration(cost)}/step ({pct:.0f}% of step time)"
    )
    if waited is not None and waited > 0:
        title += f"; the other ranks wait {_duration(waited)}/step for it"
    ongoing = d.last_index >= len(cm.steps) - RESOLVED_AFTER_STEPS
    peers = int((cm.peer_group == cm.peer_group[i]).sum())
    impact = cost * len(steps)
    if basis == "others_waited" and waited:
        impact_gpu = waited_gpu * len(steps) * min(1.0, cost / waited)
    else:
        impact_gpu = impact * max(world - 1, 0)
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
        impact_gpu_s=impact_gpu,
        step_time_pct=pct,
        evidence={
            "step_basis": "steps",
            "phase": phase,
            "cost_per_step_s": round(cost, 6),
            "cost_basis": basis,
            "step_time_rise_s": None if seen is None else round(seen, 6),
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
                for k in (
                    "min_excess_ratio",
                    "min_excess_s",
                    "z",
                    "pooled_z",
                    "shift_z",
                    "persistence",
                    "min_hot_steps",
                )
            },
        },
        state="open" if ongoing else "resolved",
        detector=detector.name,
    )


def _step_excess_seen(cm: ComputeMatrix, a: int, b: int) -> float | None:
    """How much longer the job's steps (median over ranks) were over steps ``a..b`` than before
    ``a``; None without at least three steps before."""
    if a < 3:
        return None
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        per_step = np.nanmedian(cm.step_s, axis=0)
        before = float(np.nanmedian(per_step[:a]))
        during = float(np.nanmedian(per_step[a : b + 1]))
    if not (np.isfinite(before) and np.isfinite(during)):
        return None
    return max(0.0, during - before)


NODE_SHARE = 0.75  # a node whose ranks are (nearly) all stragglers together is one finding about the node


def merge_node_findings(findings: list[Finding], hosts: dict[int, str]) -> list[Finding]:
    """All (or nearly all: ``NODE_SHARE``) ranks of one node slowed together: one finding about the
    node, suspects ``(node,)`` with rank -1, its ranks and their findings as evidence. A node that
    holds every rank of the job is not merged (there is no other node to compare it with)."""
    by_host: dict[str, list[Finding]] = {}
    for f in findings:
        if f.kind == "straggler" and len(f.suspects) == 1 and f.suspects[0].rank >= 0 and f.suspects[0].node:
            by_host.setdefault(f.suspects[0].node, []).append(f)
    on_host: dict[str, list[int]] = {}
    for r, h in hosts.items():
        on_host.setdefault(h, []).append(r)
    out = [f for f in findings if not any(f in fs for fs in by_host.values())]
    for host, fs in by_host.items():
        members = on_host.get(host, [])
        if len(fs) < 2 or len(fs) < NODE_SHARE * len(members) or len(members) >= len(hosts):
            out.extend(fs)
            continue
        out.append(_node_finding(host, fs, members))
    return sorted(out, key=lambda f: -f.impact_s)


def _node_finding(host: str, fs: list[Finding], members: list[int]) -> Finding:
    fs = sorted(fs, key=lambda f: f.suspects[0].rank)
    ranks = [f.suspects[0].rank for f in fs]
    worst = max(fs, key=lambda f: f.impact_s)
    phases = [str(f.evidence.get("phase") or "") for f in fs]
    phase = max(set(phases), key=phases.count) if any(phases) else ""
    onset = min(f.first_seen_step for f in fs)
    per_step = [float(f.evidence.get("cost_per_step_s", f.evidence.get("delay_per_step_s", 0.0)) or 0.0) for f in fs]
    cost = max(per_step) if per_step else 0.0
    in_phase = f" in {phase}" if phase else ""
    since = f"since step {onset}" if onset >= 0 else "(no step markers)"
    title = (
        f"node {host} is slow{in_phase}: {len(ranks)} of its {len(members)} ranks ({_rank_list(ranks)}) are slower "
        f"than their peers on other nodes together {since}, costing the job {_duration(cost)}/step "
        f"({worst.step_time_pct:.0f}% of step time); one cause on the node (GPU clocks, host, power), "
        f"not {len(ranks)} ranks"
    )
    job, attempt = fs[0].job_id, fs[0].attempt
    return Finding(
        id=finding_id(job, attempt, "straggler", f"node:{host}"),
        job_id=job,
        attempt=attempt,
        kind="straggler",
        severity=max(
            (f.severity for f in fs), key=lambda s: [Severity.INFO, Severity.WARNING, Severity.CRITICAL].index(s)
        ),
        confidence=round(float(np.mean([f.confidence for f in fs])), 3),
        title=title,
        suspects=(Suspect(rank=-1, node=host),),
        first_seen_step=onset,
        last_seen_step=max(f.last_seen_step for f in fs),
        first_seen_ns=min(f.first_seen_ns for f in fs),
        last_seen_ns=max(f.last_seen_ns for f in fs),
        # the node's ranks run side by side: the job loses what the slowest of them costs, not the sum
        impact_s=worst.impact_s,
        impact_gpu_s=worst.impact_gpu_s,
        step_time_pct=worst.step_time_pct,
        evidence={
            "node": host,
            "ranks": ranks,
            "ranks_on_node": sorted(members),
            "phase": phase,
            "step_basis": fs[0].evidence.get("step_basis", "steps"),
            "cost_per_step_s": round(cost, 6),
            "rank_findings": [
                {
                    "rank": f.suspects[0].rank,
                    "first_seen_step": f.first_seen_step,
                    "phase": f.evidence.get("phase", ""),
                    "excess_per_step_s": f.evidence.get("excess_per_step_s", f.evidence.get("delay_per_step_s")),
                    "cost_per_step_s": f.evidence.get("cost_per_step_s"),
                    "confidence": f.confidence,
                    "title": f.title,
                }
                for f in fs
            ],
            "sql": worst.evidence.get("sql", ""),
            "thresholds": worst.evidence.get("thresholds", {}),
        },
        state="open" if any(f.state == "open" for f in fs) else "resolved",
        detector=worst.detector,
    )


def _rank_list(ranks: list[int]) -> str:
    """``24-31`` for a run, ``1, 3, 5`` otherwise."""
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def find_stragglers(
    store: Store,
    job_id: str,
    attempt: int = 0,
    *,
    detector: StragglerDetector | PeerDetector | None = None,
    window_steps: int | None = None,
    contention: list[Contention] | None = None,
) -> list[Finding]:
    """Straggler findings of one job attempt, most costly first.

    By default ranks are compared with their peers on compute time (:class:`PeerComputeDetector`),
    which needs the ``steps`` table; without steps (e.g. a script traced with no step markers) the
    blame detector decides. Pass a detector to choose: its ``metric`` says which matrix it decides
    over (``"blame"``: a :class:`StragglerDetector`; ``"compute"``: a :class:`PeerDetector`). A rank
    that was behind because its host starved it of CPU (:mod:`ranklens.analyzers.contention`) is not
    a straggler: its finding is left out and, when ``contention`` is given, a note about it is
    appended there. ``window_steps`` (a live pass) analyses the last steps only, and of those only
    the ones the rank's ledger has passed (:func:`~ranklens.analyzers.compute.compute_matrix`'s
    ``settled``): a step whose collectives are still on their way is not compute.
    """
    metric = getattr(detector, "metric", None) if detector is not None else "compute"
    if metric not in ("blame", "compute"):
        raise ValueError(
            f"detector {detector!r} has metric={metric!r}; allowed: 'blame' (a StragglerDetector, decides over the "
            "blame matrix) or 'compute' (a PeerDetector, over the compute matrix)"
        )
    if metric == "blame":
        blame_det = cast(StragglerDetector, detector)
        blame = compute_blame(store, job_id, attempt)
        findings = [to_finding(blame, d, blame_det) for d in blame_det.detect(blame)]
        return merge_node_findings(discount_cpu_contention(store, findings, contention), blame.hosts)
    # a live window (window_steps) takes only the steps whose collectives are in (compute_matrix)
    cm = compute_matrix(store, job_id, attempt, window_steps=window_steps, settled=window_steps is not None)
    if cm.empty and cm.unsettled:
        return []  # steps, none settled yet: the next pass decides (not the blame detector on half a ledger)
    if cm.empty:
        blame_detector = PersistentBlameDetector()
        blame = compute_blame(store, job_id, attempt)
        findings = [to_finding(blame, d, blame_detector) for d in blame_detector.detect(blame)]
        return merge_node_findings(discount_cpu_contention(store, findings, contention), blame.hosts)
    peer_detector = cast(PeerDetector, detector) if detector is not None else PeerComputeDetector()
    detections = peer_detector.detect(cm)
    blamed = compute_blame(store, job_id, attempt, only_ranks=[d.rank for d in detections]) if detections else None
    findings = [
        to_peer_finding(
            cm, blamed, d, peer_detector, phase_excess(store, cm, d.rank, cm.steps[d.onset_index : d.last_index + 1])
        )
        for d in detections
    ]
    out = merge_node_findings(discount_cpu_contention(store, findings, contention), cm.hosts)
    if cm.settled_on:  # a live pass: what it waited for (a false finding's diagnosis starts here)
        live = {"settled_on": cm.settled_on, "unsettled_rows": cm.unsettled, "last_step": int(cm.steps[-1])}
        for f in out:
            f.evidence["live"] = live
    return out


def discount_cpu_contention(
    store: Store, findings: list[Finding], notes: list[Contention] | None = None
) -> list[Finding]:
    """``findings`` without the rank findings that host CPU contention explains (its run-queue delay
    above its peers' is most of the excess, and it did no more CPU work than they did:
    :func:`ranklens.analyzers.contention.explains`); each one left out becomes a note in ``notes``.
    The findings kept carry what the scheduler counters said in ``evidence["cpu"]``."""
    out = []
    for f in findings:
        if f.kind != "straggler" or len(f.suspects) != 1 or f.suspects[0].rank < 0:
            out.append(f)
            continue
        rank = f.suspects[0].rank
        ev = f.evidence
        excess = float(ev.get("excess_per_step_s", ev.get("delay_per_step_s")) or 0.0)
        step_s = float(ev.get("mean_step_time_s") or 0.0)
        if not (np.isfinite(step_s) and step_s > 0):
            out.append(f)
            continue
        t1 = f.last_seen_ns + int(step_s * 1e9)
        cw = cpu_window(store, f.job_id, f.attempt, f.first_seen_ns, t1)
        why = explains(cw, rank, excess, step_s, compute="excess_per_step_s" in ev)
        if why is None:
            i = cw.index(rank)
            if i is not None and len(cw.ranks) >= 3:
                ev["cpu"] = {
                    name: round(cw.above_peers(i, rates) * step_s, 6)
                    for name, rates in (
                        ("run_delay_above_peers_per_step_s", cw.delay_rate),
                        ("cpu_above_peers_per_step_s", cw.cpu_rate),
                        ("process_run_delay_above_peers_per_step_s", cw.proc_delay_rate),
                    )
                }
            out.append(f)
            continue
        if notes is not None:
            notes.append(
                Contention(
                    kind="straggler",
                    node=f.suspects[0].node or cw.hosts.get(rank, ""),
                    ranks=(rank,),
                    excess_per_step_s=excess,
                    run_delay_per_step_s=why[0],
                    cpu_per_step_s=why[1],
                    first_seen_ns=f.first_seen_ns,
                    last_seen_ns=f.last_seen_ns,
                    title=f.title,
                    sql=cw.sql,
                )
            )
    return out
