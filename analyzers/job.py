"""All analyzers over one job, once or continuously, with stable finding identity.

:func:`analyze_job` runs the straggler analysis and live hang detection over a job in the store.
:class:`FindingTracker` turns successive passes into events: a finding is *new* the first time its
id appears, *changed* when its title, severity or state changes, and *resolved* when it stops
appearing (the behaviour stopped); the same ongoing problem keeps one id and updates one finding.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from ranklens.analyzers.contention import Contention
from ranklens.analyzers.correlate import correlate_findings
from ranklens.analyzers.detectors import StragglerDetector
from ranklens.analyzers.findings import Finding
from ranklens.analyzers.incidents import find_incidents
from ranklens.analyzers.links import find_slow_links
from ranklens.analyzers.live_hangs import HangConfig, detect_live_hangs
from ranklens.analyzers.preflight_notes import annotate_preflight
from ranklens.analyzers.straggler import find_stragglers
from ranklens.store.api import Store

__all__ = ["FindingTracker", "Update", "analyze_job"]


def analyze_job(
    store: Store,
    job_id: str,
    attempt: int = 0,
    *,
    detector: StragglerDetector | None = None,
    hang_config: HangConfig | None = None,
    now_ns: int | None = None,
    window_steps: int | None = None,
    contention: list[Contention] | None = None,
) -> list[Finding]:
    """Every finding of one job attempt: hangs/crashes/desyncs first, then stragglers and slow links
    by impact, each with the GPU events and log errors of its ranks/nodes and time window, then the
    GPU and log errors themselves (``gpu_error``, ``log_error``).

    ``window_steps`` limits the straggler analysis to the most recent steps (the live loop uses
    it so each pass costs the same however long the job has run). Straggler and link findings that
    host CPU contention explains are left out; with ``contention`` a note for each is appended there."""
    hangs = detect_live_hangs(store, job_id, attempt, config=hang_config, now_ns=now_ns)
    stragglers = find_stragglers(
        store, job_id, attempt, detector=detector, window_steps=window_steps, contention=contention
    )
    # window_steps is the stragglers' recency window (500 steps in the live loop), not the link
    # analyzer's cell size: passed on, a live pass saw no slow link before step 1000
    links = find_slow_links(store, job_id, attempt, contention=contention)
    # GPU events and classified log errors around each finding: the earliest is the likely origin
    # stragglers and slow links ranked together by what they cost the job
    ranked = sorted(stragglers + links, key=lambda f: (-f.impact_s, f.id))
    # a node that was marginal at pre-flight: the finding says so
    # errors that need no timing (an XID, an OOM or NCCL error in a rank's log): findings of their own
    # the ledger's desync at (pg, seq) is the live detector's own when both saw it: one finding
    live = {f.id for f in hangs}
    incidents = [f for f in find_incidents(store, job_id, attempt) if f.id not in live]
    return _causes_first(annotate_preflight(store, correlate_findings(store, hangs + ranked)) + incidents)


def _causes_first(findings: list[Finding]) -> list[Finding]:
    """A desync or size mismatch in the ledger comes first, and the crashes of other ranks that
    followed it (gloo aborts a peer of the rank that passed the wrong size) say they came after it."""
    causes = [f for f in findings if f.kind in ("size_mismatch", "desync")]
    if not causes:
        return findings
    first = min(causes, key=lambda f: f.first_seen_ns)
    blamed = {s.rank for s in first.suspects}
    out = []
    for f in findings:
        if f.kind == "crash" and not blamed & {s.rank for s in f.suspects} and f.first_seen_ns >= first.first_seen_ns:
            f = dataclasses.replace(
                f,
                title=f"{f.title} (after the {first.kind.replace('_', ' ')} at collective #{first.evidence.get('seq')} "
                f"of pg {first.evidence.get('pg')}: a consequence)",
                evidence={**f.evidence, "after": first.id},
            )
        out.append(f)
    return [f for f in out if f.kind in ("size_mismatch", "desync")] + [
        f for f in out if f.kind not in ("size_mismatch", "desync")
    ]


@dataclass
class Update:
    new: list[Finding] = field(default_factory=list)
    changed: list[Finding] = field(default_factory=list)
    resolved: list[Finding] = field(default_factory=list)
    # host CPU contention first seen this pass: a finding it explains was left out (not an event)
    notes: list[Contention] = field(default_factory=list)

    def all(self) -> list[Finding]:
        return self.new + self.changed + self.resolved


# evidence keys that are attached to a finding after the analysis made it (recovery executors)
_KEPT = frozenset({"stacks"})


class FindingTracker:
    """Remembers the open findings between passes (one per id)."""

    def __init__(self) -> None:
        self.open: dict[str, Finding] = {}

    def annotate(self, f: Finding) -> None:
        """Replace the open finding ``f.id`` with ``f`` (evidence attached since the pass made it)."""
        if f.id in self.open:
            self.open[f.id] = f

    def update(self, findings: list[Finding]) -> Update:
        u = Update()
        seen = set()
        for f in findings:
            seen.add(f.id)
            old = self.open.get(f.id)
            # evidence attached after the analysis (the stacks taken before a restart) stays
            kept = {k: old.evidence[k] for k in _KEPT if k in old.evidence and k not in f.evidence} if old else {}
            if kept:
                f = dataclasses.replace(f, evidence={**f.evidence, **kept})
            if old is None:
                if f.state != "resolved":
                    u.new.append(f)
            elif (old.title, old.severity, old.state) != (f.title, f.severity, f.state):
                u.changed.append(f)
            if f.state == "resolved":
                self.open.pop(f.id, None)
            else:
                self.open[f.id] = f
        for fid in list(self.open):
            if fid not in seen:
                gone = dataclasses.replace(self.open.pop(fid), state="resolved", updated_ns=time.time_ns())
                u.resolved.append(gone)
        return u
