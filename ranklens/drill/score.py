"""Scoring a drill: which finding detected which fault, how fast, whether it named the right rank and
the right kind, and which findings nothing injected explains (false alarms).

Pure functions over the ground truth (:class:`Onset`) and the findings as the live loop first saw
them (:class:`Seen`), so the rules are tested without a job:

- a fault is **detected** by the first finding, seen no earlier than ``EARLY_S`` before its onset,
  whose kind is one of those that can report it (:data:`DETECTS`) and whose suspects name the
  fault's target (:class:`Target`: the rank; for a node fault a rank of the node, the node's host,
  or a link touching it); failing that, by such a finding that names something else (the culprit is
  then wrong); time to detect is from the onset to the live pass that first showed it;
- the **kind is right** when that finding's kind is the fault's own (:data:`KIND`; for a log fault
  also its log class, for a GPU fault its XID); the **culprit is right** when it names the target;
- a finding is **explained** when it detected a fault, names a fault's rank with a kind that can
  report it (seen after the fault's onset), or itself began after a fatal fault (hang, crash,
  desync) did — the peers' errors and timeouts that follow a dead rank are collateral, not alarms —
  or is the job's own ``nan_loss`` log line after a NaN fault, or a straggler on the ranks of a node
  whose link was throttled (:data:`ALSO_EXPLAINS`). Every other finding is **false**.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ranklens.drill.faults import FATAL, DrillFault, DrillKind

__all__ = [
    "ALSO_EXPLAINS",
    "DETECTS",
    "KIND",
    "MIN_COST_PCT",
    "FaultScore",
    "Onset",
    "Seen",
    "Target",
    "costless",
    "score",
    "target_of",
]

MIN_COST_PCT = 1.0  # a straggler / slow-link warning costing the job less than this share of step time

#: the finding kind that is the right answer for each fault kind
KIND = {
    DrillKind.SLOW_GPU: "straggler",
    DrillKind.SLOW_DATA: "straggler",
    DrillKind.HANG: "hang",
    DrillKind.CRASH: "crash",
    DrillKind.DESYNC: "desync",
    DrillKind.SIZE_MISMATCH: "size_mismatch",
    DrillKind.LOG: "log_error",
    DrillKind.GPU: "gpu_error",
    DrillKind.NAN: "nan",
    DrillKind.SLOW_LINK: "slow_link",
}
#: finding kinds that count as a detection (the culprit still has to be named)
DETECTS = {
    DrillKind.SLOW_GPU: {"straggler"},
    DrillKind.SLOW_DATA: {"straggler"},
    DrillKind.HANG: {"hang"},
    DrillKind.CRASH: {"crash", "hang"},
    DrillKind.DESYNC: {"desync", "hang", "crash"},
    DrillKind.SIZE_MISMATCH: {"size_mismatch", "desync", "hang", "crash"},
    DrillKind.LOG: {"log_error"},
    DrillKind.GPU: {"gpu_error", "log_error"},
    DrillKind.NAN: {"nan"},
    DrillKind.SLOW_LINK: {"slow_link"},
}
#: finding kinds that, naming the fault's target, are the fault seen through another lens: explained
#: (not false alarms) but no detection. A throttled node link makes its own ranks' forward wait on
#: the link; per-rank timers can read the first steps after onset as a straggler on that node.
ALSO_EXPLAINS = {DrillKind.SLOW_LINK: {"straggler"}}
#: the log class the log fault's lines are classified as
LOG_CLASS = {"nccl_error": "nccl_error", "nccl_timeout": "nccl_timeout", "cuda_oom": "cuda_oom", "xid": "gpu_xid"}
EARLY_S = 1.0  # a finding this much before the onset still counts (clocks of rank and drill)


@dataclass(frozen=True)
class Onset:
    """When (epoch ns) and at which step a fault took effect in its rank."""

    ts_ns: int
    step: int


@dataclass(frozen=True)
class Seen:
    """A finding as the drill first saw it (``seen_ns``: the live pass that showed it)."""

    id: str
    kind: str
    ranks: tuple[int, ...]
    title: str
    seen_ns: int
    first_ns: int = 0
    evidence: dict[str, Any] = field(default_factory=dict)
    severity: str = ""
    cost_pct: float = float("nan")  # share of step time it costs the job (stragglers, slow links)
    nodes: tuple[str, ...] = ()  # the suspects' hosts and the ends of a suspect link ("network" left out)
    first_step: int = -1  # the step the finding says it began at (-1: it names none)


@dataclass(frozen=True)
class Target:
    """What a finding must name for a fault's culprit to be right: one of these ranks or hosts.
    A rank fault: its rank. A node fault: the node's ranks and its host (as its ranks reported it)."""

    ranks: frozenset[int] = frozenset()
    hosts: frozenset[str] = frozenset()

    def named_by(self, s: Seen) -> bool:
        return bool(self.ranks.intersection(s.ranks)) or bool(self.hosts.intersection(s.nodes))


@dataclass
class FaultScore:
    fault: DrillFault
    onset: Onset | None = None  # None: it never took effect
    finding: Seen | None = None
    ttd_s: float | None = None
    kind_ok: bool = False
    culprit_ok: bool = False
    note: str = ""
    acted_s: float | None = None  # with recovery: onset -> the executor acted
    resumed_s: float | None = None  # with recovery: onset -> training resumed (next attempt's first step)

    @property
    def applied(self) -> bool:
        return self.onset is not None

    @property
    def detected(self) -> bool:
        return self.finding is not None

    @property
    def ok(self) -> bool:
        return self.detected and self.kind_ok and self.culprit_ok

    @property
    def onset_error_steps(self) -> int | None:
        """The finding's onset step minus the fault's (None where either has no step): reported,
        not scored (a window-based detector names the first step of its window)."""
        if self.finding is None or self.onset is None or self.finding.first_step < 0 or self.onset.step < 0:
            return None
        return self.finding.first_step - self.onset.step

    def to_json(self) -> dict[str, Any]:
        return {
            "fault": self.fault.spec,
            "kind": self.fault.kind.value,
            "rank": self.fault.rank,
            "node": self.fault.node,
            "applied": self.applied,
            "onset_ns": self.onset.ts_ns if self.onset else None,
            "onset_step": self.onset.step if self.onset else None,
            "detected": self.detected,
            "time_to_detect_s": None if self.ttd_s is None else round(self.ttd_s, 3),
            "onset_error_steps": self.onset_error_steps,
            "kind_ok": self.kind_ok,
            "culprit_ok": self.culprit_ok,
            "ok": self.ok,
            "finding": None
            if self.finding is None
            else {"id": self.finding.id, "kind": self.finding.kind, "title": self.finding.title},
            "acted_s": None if self.acted_s is None else round(self.acted_s, 3),
            "resumed_s": None if self.resumed_s is None else round(self.resumed_s, 3),
            "note": self.note,
        }


def _right_kind(f: DrillFault, s: Seen) -> bool:
    if s.kind != KIND[f.kind]:
        return False
    if f.kind is DrillKind.LOG:
        return bool(s.evidence.get("class") == LOG_CLASS.get(f.detail))
    if f.kind is DrillKind.GPU:
        return int(s.evidence.get("code", -1)) == int(f.severity)
    return True


def _found(s: Seen) -> str:
    if "class" in s.evidence and s.kind == "log_error":
        return f"log_error ({s.evidence['class']})"
    if "code" in s.evidence and s.kind == "gpu_error":
        return f"gpu_error (XID {s.evidence['code']})"
    return s.kind


def _expected(f: DrillFault) -> str:
    if f.kind is DrillKind.LOG:
        return f"log_error ({LOG_CLASS.get(f.detail, f.detail)})"
    if f.kind is DrillKind.GPU:
        return f"gpu_error (XID {int(f.severity)})"
    return KIND[f.kind]


def costless(false: list[Seen]) -> tuple[list[Seen], list[Seen]]:
    """Split unexplained findings into false alarms and *costless* ones: straggler or slow-link
    warnings that cost the job under ``MIN_COST_PCT`` % of its step time (a rank that computes a
    little longer but that nobody waits for). Those are reported apart, not counted as alarms."""
    alarms: list[Seen] = []
    quiet: list[Seen] = []
    for s in false:
        cheap = s.kind in ("straggler", "slow_link") and s.severity == "warning" and s.cost_pct < MIN_COST_PCT
        (quiet if cheap else alarms).append(s)
    return alarms, quiet


def target_of(f: DrillFault, nodes: dict[int, Target] | None = None) -> Target:
    """The fault's :class:`Target`; ``nodes``: node index -> its ranks and host (from the ranks'
    ``ready`` records); a node nobody reported is named by nothing."""
    if f.node < 0:
        return Target(frozenset({f.rank}))
    return (nodes or {}).get(f.node, Target())


def score(
    faults: list[DrillFault],
    onsets: dict[int, Onset],
    seen: list[Seen],
    nodes: dict[int, Target] | None = None,
) -> tuple[list[FaultScore], list[Seen]]:
    """Score each fault (``onsets[i]``: the ground truth of fault ``i``) against the findings seen;
    ``nodes`` says which ranks and host each node target is. Returns the scores and the false findings."""
    seen = sorted(seen, key=lambda s: (s.seen_ns, s.id))
    scores = [FaultScore(f, onsets.get(i)) for i, f in enumerate(faults)]
    targets = [target_of(f, nodes) for f in faults]
    used: set[str] = set()

    def pick(sc: FaultScore, cands: list[Seen]) -> Seen:
        # the right kind wins among findings of the same pass; otherwise the first one seen
        first_ns = cands[0].seen_ns
        return min(cands, key=lambda s: (s.seen_ns > first_ns, not _right_kind(sc.fault, s), s.seen_ns))

    def window(sc: FaultScore) -> list[Seen]:
        assert sc.onset is not None
        early = sc.onset.ts_ns - int(EARLY_S * 1e9)
        return [s for s in seen if s.kind in DETECTS[sc.fault.kind] and s.seen_ns >= early and s.id not in used]

    # first every fault a finding names; then, for the rest, a finding of the right kind that names
    # another rank (detected, wrong culprit)
    for right_rank in (True, False):
        for sc, tg in zip(scores, targets):
            if sc.onset is None or sc.finding is not None:
                continue
            cands = [s for s in window(sc) if tg.named_by(s) == right_rank]
            if not cands:
                continue
            best = pick(sc, cands)
            sc.finding, sc.ttd_s = best, max(0.0, (best.seen_ns - sc.onset.ts_ns) / 1e9)
            sc.kind_ok, sc.culprit_ok = _right_kind(sc.fault, best), right_rank
            used.add(best.id)
    for sc in scores:
        f = sc.fault
        if sc.onset is None:
            sc.note = "never took effect (the job did not reach its onset, or has no such phase)"
        elif sc.finding is None:
            sc.note = "not detected"
        elif not sc.culprit_ok:
            named = [f"rank(s) {', '.join(map(str, sc.finding.ranks))}"] if sc.finding.ranks else []
            named += [f"node(s) {', '.join(sc.finding.nodes)}"] if f.node >= 0 and sc.finding.nodes else []
            sc.note = f"detected, but it names {' and '.join(named) or 'nobody'}, not {f.target}"
        elif not sc.kind_ok:
            sc.note = f"detected as {_found(sc.finding)}, not {_expected(f)}"
    fatal_from = min((sc.onset.ts_ns for sc in scores if sc.onset and sc.fault.kind in FATAL), default=None)
    false: list[Seen] = []
    for s in seen:
        if s.id in used:
            continue
        if any(
            sc.onset
            and tg.named_by(s)
            and (s.kind in DETECTS[sc.fault.kind] or s.kind in ALSO_EXPLAINS.get(sc.fault.kind, ()))
            and s.seen_ns >= sc.onset.ts_ns - int(EARLY_S * 1e9)
            for sc, tg in zip(scores, targets)
        ):
            continue  # the same fault seen again (another finding of the same kind on its rank)
        if fatal_from is not None and (s.first_ns or s.seen_ns) >= fatal_from - int(EARLY_S * 1e9):
            continue  # collateral of a dead or stuck rank (it began after the fault did)
        if s.kind == "log_error" and any(
            sc.onset
            and sc.fault.kind is DrillKind.NAN
            and s.evidence.get("class") == "nan_loss"
            and s.seen_ns >= sc.onset.ts_ns - int(EARLY_S * 1e9)
            for sc in scores
        ):
            continue  # the job's own "loss is nan" lines after a NaN fault: every rank has it after the all-reduce
        false.append(s)
    return scores, false
