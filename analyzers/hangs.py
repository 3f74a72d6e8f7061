"""Hangs, crashes and desyncs from flight-recorder dumps: which rank stopped the job, and where.

Metric, per process group (:func:`group_progress`): the last collective seq every member entered
(its newest entry of the group), the frontier (the highest of them), and per pending seq who
entered it, who is still in it (not retired), who ended it (retired: completed *or failed*, gloo
retires a failed collective too), who never entered it, and whose dump is missing.

Decision (:func:`analyze_flight_recorder`):

- A rank missing from a pending collective is **blocked** when it is itself in flight in another
  pending collective, waiting for someone else. Following "blocked by" links separates the
  origin from the downstream symptoms: a rank that is not blocked (stuck outside collectives,
  ``hang``; or without a dump, ``crash``) is a root cause and everyone blocked behind it is a
  victim. When the links close into a cycle with no such root (two ranks each waiting in a
  collective the other never issued: collectives issued in different orders, ``desync``), the
  rank whose last collective breaks its own periodic pattern (a training step repeats the same
  collectives) is the one that diverged; failing that, the rank most others wait for.
- Entries of one ``(pg, seq)`` with different ops are a ``desync``, with the same op but
  different input sizes or dtypes a ``size_mismatch``; the minority is blamed.
- Each origin is one finding; pendings that are consequences of it (e.g. the collective the
  diverged rank went on to, which its peers never issued) are listed in its evidence only.

Nothing is timed here: FR has no training steps and gloo records no durations. A finding carries
the step (``first_seen_step``, ``evidence["step"]``) only when something else recorded it: the
job's ledger in the store (:func:`steps_from_store`), else it is -1. The world size and the
groups' members come from the dumps' process-group tables and group sizes; a rank whose dump is
unreadable is named as such and not taken for one that left none; a rank without a dump that
died of a peer's mismatched collective is that mismatch's victim, not a crash of its own. The
findings are the same whether dumps came as pickle or JSON.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cmp_to_key
from typing import Any

from ranklens.analyzers.findings import Finding, Severity, Suspect, finding_id
from ranklens.formats.flight_recorder import (
    FRDump,
    FREntry,
    ProcessGroupInfo,
    UnreadableDump,
    infer_process_groups,
    infer_world_size,
)
from ranklens.store.api import Store
from ranklens.store.api import sql_escape as _esc

__all__ = ["GroupProgress", "analyze_flight_recorder", "group_progress", "steps_from_store"]

DETECTOR = "flight_recorder"
# Ops whose input shapes must agree on every member; others (gather, scatter, all_to_all, p2p)
# legitimately differ per rank, so only their op names are compared.
_SAME_SHAPE_OPS = frozenset(
    {
        "all_reduce",
        "allreduce",
        "allreduce_coalesced",
        "all_reduce_coalesced",
        "broadcast",
        "reduce",
        "all_gather",
        "allgather",
        "_allgather_base",
        "all_gather_into_tensor",
        "all_gather_into_tensor_coalesced",
        "reduce_scatter",
        "_reduce_scatter_base",
        "reduce_scatter_tensor",
        "reduce_scatter_tensor_coalesced",
        "barrier",
    }
)
_RETIRED_NOTE = (
    "'completed' lists ranks whose entry is retired; gloo also retires a collective that failed "
    "(timeout, peer closed), so it means ended, not necessarily succeeded"
)
_ACTIONS = {
    "hang": (
        "restart_rank",
        "the rank is alive (it wrote a dump) but stopped issuing collectives: it is stuck in compute, "
        "data loading or host code; restart it (the worker group re-forms its process groups) and "
        "look at its stack (py-spy dump) or log for where it stopped",
    ),
    "crash": (
        "replace_node",
        "the rank left no dump: its process died or its node stopped answering; restart it on another "
        "node unless its log shows a software error (then restart_rank is enough)",
    ),
    "desync": (
        "restart_job",
        "ranks issued different collectives at the same point (a rank- or data-dependent code path): "
        "every communicator is out of step, so all ranks restart from the last checkpoint; the "
        "divergence can recur until the branch at the culprit's stack is fixed",
    ),
    "size_mismatch": (
        "restart_job",
        "ranks passed tensors of different shapes or dtypes to one collective (a rank- or "
        "data-dependent shape): restart all ranks from the last checkpoint; it can recur until fixed",
    ),
}


@dataclass(frozen=True)
class GroupProgress:
    """Where one process group stands at its pending collective ``seq``.

    ``entered`` ranks issued it (``in_flight`` still in it, ``completed`` ended it), ``missing``
    ranks dumped but never issued it, ``no_dump`` members left no dump, ``unknown`` members dumped
    but their ring buffer no longer holds any entry of the group.
    """

    pg: ProcessGroupInfo
    seq: int
    op: str
    profiling_name: str
    input_sizes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    entered: tuple[int, ...]
    in_flight: tuple[int, ...]
    completed: tuple[int, ...]
    missing: tuple[int, ...]
    no_dump: tuple[int, ...]
    unknown: tuple[int, ...]
    last_seq: dict[int, int] = field(compare=False, repr=False)
    waiting_since_ns: int = 0
    first_entered_ns: int = 0
    stack: tuple[str, ...] = ()


class _Rank:
    """One dump indexed for the analysis: collective entries per (pg, seq), and what is in flight."""

    def __init__(self, dump: FRDump) -> None:
        self.dump = dump
        self.by_pg: dict[str, dict[int, list[FREntry]]] = {}
        self.in_flight: list[FREntry] = []
        for e in dump.entries:
            if not e.is_p2p:
                seqs = self.by_pg.get(e.pg_name)
                if seqs is None:
                    seqs = self.by_pg[e.pg_name] = {}
                same = seqs.get(e.collective_seq_id)
                if same is None:
                    seqs[e.collective_seq_id] = [e]
                else:
                    same.append(e)  # coalesced ops can share a seq
            if not e.retired:
                self.in_flight.append(e)
        self.last_seq = {pg: max(seqs) for pg, seqs in self.by_pg.items()}


def _sig(entries: Sequence[FREntry]) -> tuple[Any, ...]:
    if len(entries) == 1:
        e = entries[0]
        return ((e.op, e.input_sizes if e.op in _SAME_SHAPE_OPS else (), e.input_dtypes),)
    return tuple((e.op, e.input_sizes if e.op in _SAME_SHAPE_OPS else (), e.input_dtypes) for e in entries)


def _stack(e: FREntry) -> tuple[str, ...]:
    return tuple(f"{f.name} ({f.filename}:{f.line})" for f in e.frames)


def _progress(g: ProcessGroupInfo, ranks: dict[int, _Rank]) -> list[GroupProgress]:
    last: dict[int, int] = {}
    no_dump, unknown = [], []
    for r in g.members:
        view = ranks.get(r)
        if view is None:
            no_dump.append(r)
        elif g.name in view.last_seq:
            last[r] = view.last_seq[g.name]
        elif not view.dump.wrapped:
            last[r] = 0  # its whole history is in the dump and holds no entry of this group
        else:
            unknown.append(r)
    if not last:
        return []
    frontier = max(last.values())
    pending: dict[int, list[int]] = defaultdict(list)
    for r, s in last.items():
        if s < frontier:
            pending[s + 1].append(r)
    stuck_seq = -1
    if no_dump:
        # Where the others are stuck (the oldest seq still in flight), else the frontier: which
        # collective a rank without a dump stopped at is not knowable, this is where it is missed.
        stuck = [s for r in last for s, es in ranks[r].by_pg.get(g.name, {}).items() if any(not e.retired for e in es)]
        stuck_seq = min(stuck, default=frontier)
        pending.setdefault(stuck_seq, [])
    out = []
    for seq in sorted(pending):
        entered = sorted(r for r, s in last.items() if s >= seq)
        at = {r: ranks[r].by_pg.get(g.name, {}).get(seq, []) for r in entered}
        in_flight = sorted(r for r, es in at.items() if es and any(not e.retired for e in es))
        completed = sorted(r for r, es in at.items() if es and all(e.retired for e in es))
        sigs = Counter(_sig(es) for es in at.values() if es)
        ref: FREntry | None = None
        if sigs:
            common = sigs.most_common(1)[0][0]
            prefer = in_flight + completed
            ref = next(at[r][0] for r in prefer if at[r] and _sig(at[r]) == common)
        waiting = [at[r][0].time_created_ns for r in in_flight if at[r]]
        arrivals = [es[0].time_created_ns for es in at.values() if es]
        out.append(
            GroupProgress(
                pg=g,
                seq=seq,
                op=ref.op if ref else "",
                profiling_name=ref.profiling_name if ref else "",
                input_sizes=ref.input_sizes if ref else (),
                dtypes=ref.input_dtypes if ref else (),
                entered=tuple(entered),
                in_flight=tuple(in_flight),
                completed=tuple(completed),
                missing=tuple(sorted(pending[seq])),
                no_dump=tuple(no_dump) if seq == stuck_seq else (),
                unknown=tuple(unknown),
                last_seq=last,
                waiting_since_ns=min(waiting, default=0),
                first_entered_ns=min(arrivals, default=0),
                stack=_stack(at[in_flight[0]][0]) if in_flight and at[in_flight[0]] else (),
            )
        )
    return out


def group_progress(
    dumps: Sequence[FRDump], *, world_size: int | None = None, known_ranks: Iterable[int] = ()
) -> list[GroupProgress]:
    """The pending collectives of every process group: who entered, who did not, who completed.

    Args:
        dumps: one dump per rank of a job attempt (ranks without a dump are simply absent).
        world_size: the number of ranks; default: inferred (see :func:`analyze_flight_recorder`).
        known_ranks: ranks whose dump exists but cannot be read.

    Returns:
        One :class:`GroupProgress` per (process group, seq) some member has not entered (or, when
        members left no dump, the seq the others are stuck at); empty when every group agrees.

    Raises:
        ValueError: two dumps of the same rank.
    """
    ranks = _index(dumps)
    groups, _ = infer_process_groups(dumps, world_size, known_ranks=known_ranks)
    return [p for g in groups.values() for p in _progress(g, ranks)]


def _index(dumps: Iterable[FRDump]) -> dict[int, _Rank]:
    ranks: dict[int, _Rank] = {}
    for d in dumps:
        if d.rank in ranks:
            raise ValueError(f"two dumps of rank {d.rank}: {ranks[d.rank].dump.source_path} and {d.source_path}")
        ranks[d.rank] = _Rank(d)
    return ranks


# ------------------------------------------------------------------------------------ presenting


def _fmt_ranks(ranks: Iterable[int], limit: int = 12) -> str:
    rs = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.extend([f"{rs[i]}-{rs[j]}"] if j - i >= 2 else [str(r) for r in rs[i : j + 1]])
        i = j + 1
    if len(parts) > limit:
        parts = [*parts[:limit], f"... ({len(rs)} ranks)"]
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(parts)


def _pg_label(g: ProcessGroupInfo) -> str:
    return g.desc or f"pg {g.name}"


def _sizes(s: tuple[tuple[int, ...], ...]) -> list[list[int]]:
    return [list(x) for x in s]


def _entry_json(e: FREntry) -> dict[str, Any]:
    return {
        "pg_name": e.pg_name,
        "pg_desc": e.pg_desc,
        "seq": e.p2p_seq_id if e.is_p2p else e.collective_seq_id,
        "op": e.op,
        "input_sizes": _sizes(e.input_sizes),
        "retired": e.retired,
        "time_created_ns": e.time_created_ns,
    }


def _expected_next(entries: Sequence[FREntry]) -> tuple[bool | None, FREntry | None]:
    """Does the last entry break the rank's own periodic pattern? (None: no pattern found).

    A training step issues the same collectives in the same order, so the history before the last
    entry repeats with some period p; the last entry should then equal the one p entries earlier.
    """
    sigs = [(e.pg_name, e.op, e.input_sizes, e.is_p2p) for e in entries]
    n = len(sigs)
    for p in range(1, 129):
        window = max(2 * p, 6)
        if n - 1 - window - p < 0:
            break
        if all(sigs[i] == sigs[i - p] for i in range(n - 1 - window, n - 1)):
            return sigs[-1] != sigs[-1 - p], entries[n - 1 - p]
    return None, None


def _finding(
    kind: str,
    severity: Severity,
    confidence: float,
    title: str,
    culprits: Sequence[int],
    key: str,
    evidence: dict[str, Any],
    job_id: str,
    attempt: int,
    first_ns: int,
    last_ns: int,
) -> Finding:
    action, reason = _ACTIONS[kind]
    evidence = {"source": "flight_recorder", **evidence, "action": action, "action_reason": reason}
    return Finding(
        id=finding_id(job_id, attempt, kind, key),
        job_id=job_id,
        attempt=attempt,
        kind=kind,
        severity=severity,
        confidence=confidence,
        title=title,
        suspects=tuple(Suspect(rank=r) for r in culprits),
        first_seen_step=-1,
        last_seen_step=-1,
        first_seen_ns=first_ns,
        last_seen_ns=last_ns,
        evidence=evidence,
        detector=DETECTOR,
    )


def _progress_evidence(p: GroupProgress) -> dict[str, Any]:
    return {
        "pg": {
            "name": p.pg.name,
            "desc": p.pg.desc,
            "members": list(p.pg.members),
            "membership": p.pg.source,
        },
        "seq": p.seq,
        "op": p.op,
        "profiling_name": p.profiling_name,
        "input_sizes": _sizes(p.input_sizes),
        "dtypes": list(p.dtypes),
        "entered": list(p.entered),
        "in_flight": list(p.in_flight),
        "completed": list(p.completed),
        "missing": list(p.missing),
        "missing_dump": list(p.no_dump),
        "unknown": list(p.unknown),
        "waiting_since_ns": p.waiting_since_ns,
        "waiting_stack": list(p.stack),
    }


def _consequence(p: GroupProgress, culprits: set[int]) -> dict[str, Any]:
    own = sorted(culprits & {*p.missing, *p.no_dump})
    return {
        "pg": {"name": p.pg.name, "desc": p.pg.desc},
        "seq": p.seq,
        "op": p.op,
        "input_sizes": _sizes(p.input_sizes),
        "entered": list(p.entered),
        "in_flight": list(p.in_flight),
        "missing": list(p.missing),
        "missing_dump": list(p.no_dump),
        "why": (
            f"{_fmt_ranks(own)} is missing here too: it stopped (or diverged) before getting this far"
            if own
            else "its missing ranks are blocked, waiting for the culprit, in this finding's collective"
        ),
    }


# -------------------------------------------------------------------------------------- deciding


def analyze_flight_recorder(
    dumps: Sequence[FRDump],
    *,
    world_size: int | None = None,
    job_id: str = "",
    attempt: int = 0,
    unreadable: Sequence[UnreadableDump] = (),
    step_of: Callable[[str, int], int | None] | None = None,
) -> list[Finding]:
    """Findings (hang, crash, desync, size_mismatch) from the dumps of one job attempt.

    Args:
        dumps: one dump per rank (see :func:`ranklens.collector.flight_recorder.read_dumps`);
            ranks that left no dump are absent.
        world_size: the number of ranks; default: inferred from the dumps' process-group tables
            and group sizes (see :func:`~ranklens.formats.flight_recorder.infer_process_groups`).
        job_id: the job, for the findings' ids.
        attempt: the restart attempt, for the findings' ids.
        unreadable: dumps that could not be read (truncated, corrupt): their ranks exist, but
            nothing is known of them; they are named as such, never as ranks that left no dump.
        step_of: the training step of a ``(pg name, seq)`` when something else knows it (e.g.
            :func:`steps_from_store` over the job's arrival ledger); FR itself has no steps.

    Returns:
        Findings, origins only (downstream symptoms are in their evidence), most certain first;
        empty for consistent dumps.

    Raises:
        ValueError: two dumps of the same rank.
    """
    ranks = _index(dumps)
    bad = {u.rank: u for u in unreadable if u.rank is not None and u.rank not in ranks}
    groups, world = infer_process_groups(dumps, world_size, known_ranks=bad)
    _, world_source = infer_world_size(dumps, world_size, known_ranks=bad)
    progress = [p for g in groups.values() for p in _progress(g, ranks)]
    last_ns = max((e.time_created_ns for d in dumps for e in d.entries[-1:]), default=0)
    context = {
        "world_size": world,
        "world_size_source": world_source,
        "dumped_ranks": sorted(ranks),
        "missing_dumps": sorted(set(range(world)) - set(ranks) - set(bad)),
        "unreadable_dumps": [{"rank": u.rank, "path": u.path, "error": u.error} for u in unreadable],
        "backend": next((d.backend for d in dumps if d.backend), ""),
        "notes": [_RETIRED_NOTE],
    }
    findings = _mismatches(ranks, groups, context, job_id, attempt, last_ns)
    for f in _pending_findings(progress, ranks, context, job_id, attempt, last_ns, set(bad)):
        # A rank already blamed for a mismatch usually stalls its peers afterwards: one finding.
        same = next((m for m in findings if {s.rank for s in f.suspects} <= {s.rank for s in m.suspects}), None)
        cause = None if same is not None or f.kind != "crash" else _mismatch_behind(f, findings, set(bad))
        if same is not None:
            same.evidence.setdefault("related", []).append(
                {"kind": f.kind, "title": f.title, "pg": f.evidence["pg"], "seq": f.evidence["seq"]}
            )
        elif cause is not None:
            findings[findings.index(cause)] = _with_victims(cause, f)
        else:
            findings.append(f)
    if step_of is not None:
        findings = [_with_step(f, step_of) for f in findings]
    return sorted(findings, key=lambda f: (-f.confidence, f.title))


def _mismatch_behind(crash: Finding, mismatches: list[Finding], unreadable: set[int]) -> Finding | None:
    """The mismatched collective that a rank without a dump most likely died of: one of its own
    group at or before the collective it is missing from. A backend aborts the process that
    receives more data than it posted a buffer for (gloo: "Received data size doesn't match
    expected size", SIGABRT), so that rank is a victim of the peer that passed the wrong size;
    it must not be blamed as the cause."""
    dead = {s.rank for s in crash.suspects} - unreadable
    if not dead:
        return None
    pg, seq = crash.evidence["pg"]["name"], crash.evidence["seq"]
    for m in mismatches:
        if m.evidence["pg"]["name"] == pg and m.evidence["seq"] <= seq and dead <= set(m.evidence["pg"]["members"]):
            return m
    return None


def _with_victims(cause: Finding, crash: Finding) -> Finding:
    dead = sorted(s.rank for s in crash.suspects)
    ev = dict(cause.evidence)
    ev["victims"] = [
        *ev.get("victims", []),
        *(
            {
                "rank": r,
                "dump": None,
                "why": f"left no dump after {cause.kind.replace('_', ' ')} #{cause.evidence['seq']} of its group: "
                "a backend aborts a rank that receives data of another size than it expects (gloo: "
                "\"Received data size doesn't match expected size\", SIGABRT), so it died of the culprit's call",
            }
            for r in dead
        ),
    ]
    ev.setdefault("related", []).append(
        {"kind": crash.kind, "title": crash.title, "pg": crash.evidence["pg"], "seq": crash.evidence["seq"]}
    )
    who = "it was" if len(dead) == 1 else "they were"
    title = f"{cause.title}; {_fmt_ranks(dead)} left no dump: {who} most likely aborted by it (a victim, not the cause)"
    return dataclasses.replace(cause, title=title, evidence=ev)


def _with_step(f: Finding, step_of: Callable[[str, int], int | None]) -> Finding:
    pg = f.evidence.get("pg") or {}
    step = step_of(str(pg.get("name", "")), int(f.evidence.get("seq", -1)))
    if step is None or step < 0:
        return f
    ev = {**f.evidence, "step": step, "step_source": "the job's arrival ledger and heartbeats in the store"}
    return dataclasses.replace(f, first_seen_step=step, last_seen_step=step, evidence=ev)


def steps_from_store(store: Store, job_id: str, attempt: int = 0) -> Callable[[str, int], int | None]:
    """The training step of a ``(pg, seq)`` from what ranklens' tracer recorded of the job: the
    step of the members' ledger rows of that collective (completed or failed), else of the
    heartbeats of members that were still in it (an in-flight collective has no row yet). None
    when neither knows (no such job in the store, or no steps marked)."""
    where = f"job_id = '{_esc(job_id)}' AND attempt = {int(attempt)}"

    def step_of(pg: str, seq: int) -> int | None:
        n, top = store.query(
            f"SELECT count(), max(step) FROM collectives WHERE {where} AND pg = '{_esc(pg)}' AND seq = {int(seq)} "
            "AND step >= 0"
        ).rows()[0]
        if n:
            return int(top)
        n, top = store.query(
            f"SELECT count(), max(step) FROM heartbeats WHERE {where} AND step >= 0 AND "
            f"arrayExists((p, s) -> p = '{_esc(pg)}' AND s = {int(seq)}, pending_pgs, pending_seqs)"
        ).rows()[0]
        return int(top) if n else None

    return step_of


def _pending_findings(
    progress: list[GroupProgress],
    ranks: dict[int, _Rank],
    context: dict[str, Any],
    job_id: str,
    attempt: int,
    last_ns: int,
    unreadable: set[int] | frozenset[int] = frozenset(),
) -> list[Finding]:
    # Who is each missing rank waiting for? A missing rank in flight in a pending collective is
    # blocked by that collective's missing ranks; one not in flight anywhere (or without a dump)
    # is a root.
    missing_from: dict[int, list[GroupProgress]] = defaultdict(list)
    for p in progress:
        for r in (*p.missing, *p.no_dump):
            missing_from[r].append(p)
    pending_at = {(p.pg.name, p.seq): p for p in progress}
    blocked_in: dict[int, list[GroupProgress]] = {}
    for r in missing_from:
        view = ranks.get(r)
        if view is not None:
            blocked_in[r] = [
                pending_at[(e.pg_name, e.collective_seq_id)]
                for e in view.in_flight
                if not e.is_p2p and (e.pg_name, e.collective_seq_id) in pending_at
            ]
    blockers = {r: {b for q in qs for b in (*q.missing, *q.no_dump) if b != r} for r, qs in blocked_in.items()}
    # A rank whose dump cannot be read is not known to be free: it is no root while the readable
    # dumps explain the standstill, only when nothing else does.
    roots = {r for r in missing_from if not blockers.get(r) and r not in unreadable}
    # Ranks that can reach a root through "blocked by" are victims of it.
    waited_by: dict[int, list[int]] = defaultdict(list)
    for r, bs in blockers.items():
        for b in bs:
            waited_by[b].append(r)
    victims: set[int] = set()
    todo = deque(roots)
    while todo:
        for v in waited_by[todo.popleft()]:
            if v not in roots and v not in victims:
                victims.add(v)
                todo.append(v)
    cyclic = set(missing_from) - roots - victims - set(unreadable)
    deviation: dict[int, tuple[bool | None, FREntry | None]] = {
        r: _expected_next(ranks[r].dump.entries) for r in cyclic
    }
    diverged = {r for r in cyclic if deviation[r][0]}
    if cyclic and not diverged:
        # No rank broke its own pattern: blame the rank(s) the most others are waiting for.
        weight = {r: sum(len(p.in_flight) for p in missing_from[r]) for r in cyclic}
        top = max(weight.values())
        diverged = {r for r in cyclic if weight[r] == top}
    culprits = roots | diverged
    if not culprits:
        culprits = roots = {r for r in missing_from if r in unreadable}
    # One finding per culprit: at the first collective it is missing from (where others wait).
    home = {r: _first_missed(missing_from[r], ranks) for r in culprits}
    origins = list({id(p): p for p in home.values()}.values())

    findings: list[Finding] = []
    for p in origins:
        ev_base = {**_progress_evidence(p), **context}
        consequences = [
            _consequence(q, culprits)
            for q in progress
            if all(q is not o for o in origins) and _reaches(set(q.missing) | set(q.no_dump), blockers, culprits, p)
        ]
        no_dump = [r for r in p.no_dump if r in culprits and home[r] is p]
        crashed = [r for r in no_dump if r not in unreadable]
        garbled = [r for r in no_dump if r in unreadable]
        hung = [r for r in p.missing if r in roots and home[r] is p]
        desynced = [r for r in p.missing if r in diverged and r not in roots and home[r] is p]
        what = f"{p.op} #{p.seq} of {_pg_label(p.pg)}"
        waiting = _fmt_ranks(p.in_flight) if p.in_flight else ""
        if crashed:
            ev = {
                **ev_base,
                "culprits": [{"rank": r, "dump": None} for r in crashed],
                "consequences": consequences,
                "cannot_know": (
                    f"{_fmt_ranks(crashed)} left no dump: it may have crashed (or been killed), or it is "
                    "alive and its dump was lost; whether it entered this collective is unknown"
                ),
            }
            if p.in_flight:
                title = (
                    f"{_fmt_ranks(crashed)} left no dump and never completed {what}; "
                    f"{waiting} {'is' if len(p.in_flight) == 1 else 'are'} waiting in it "
                    "(crashed, or its dump was lost)"
                )
                sev, conf = Severity.CRITICAL, 0.8
            else:
                title = (
                    f"{_fmt_ranks(crashed)} left no dump; the other members' {what} ended (completed or "
                    "failed), so where it stopped is not in the dumps"
                )
                sev, conf = Severity.WARNING, 0.4
            findings.append(
                _finding(
                    "crash",
                    sev,
                    conf,
                    title,
                    crashed,
                    f"{p.pg.name}#{p.seq}:{crashed}",
                    ev,
                    job_id,
                    attempt,
                    p.waiting_since_ns,
                    last_ns,
                )
            )
        if garbled:
            ev = {
                **ev_base,
                "culprits": [{"rank": r, "dump": "unreadable"} for r in garbled],
                "consequences": consequences,
                "cannot_know": (
                    f"the dump of {_fmt_ranks(garbled)} cannot be read (see unreadable_dumps): whether it "
                    "entered this collective, and why its dump is damaged (it may have died while writing it), "
                    "is unknown"
                ),
            }
            title = (
                f"{_fmt_ranks(garbled)} never completed {what} as far as the other dumps tell, and "
                f"{'its dump is' if len(garbled) == 1 else 'their dumps are'} unreadable"
                + (f"; {waiting} {'is' if len(p.in_flight) == 1 else 'are'} waiting in it" if p.in_flight else "")
            )
            findings.append(
                _finding(
                    "crash",
                    Severity.WARNING,
                    0.5 if p.in_flight else 0.3,
                    title,
                    garbled,
                    f"{p.pg.name}#{p.seq}:{garbled}:unreadable",
                    ev,
                    job_id,
                    attempt,
                    p.waiting_since_ns,
                    last_ns,
                )
            )
        for kind, who in (("hang", hung), ("desync", desynced)):
            if not who:
                continue
            info = [_culprit_info(ranks[r], p, deviation.get(r)) for r in who]
            ev = {**ev_base, "culprits": info, "consequences": consequences}
            verb = "is" if len(p.in_flight) == 1 else "are"
            if kind == "desync":
                elsewhere = next((c["in_flight"][0] for c in info if c["in_flight"]), None)
                went = (
                    f" (it went on to {elsewhere['op']} #{elsewhere['seq']} of "
                    f"{elsewhere['pg_desc'] or 'pg ' + elsewhere['pg_name']})"
                    if elsewhere
                    else ""
                )
                title = f"{_fmt_ranks(who)} never entered {what}{went}; {waiting} {verb} waiting in it"
                conf = 0.9 if any(deviation.get(r, (None, None))[0] for r in who) else 0.6
            elif p.in_flight:
                title = f"{_fmt_ranks(who)} never entered {what}; {waiting} {verb} waiting in it"
                conf = 0.9
            else:
                title = (
                    f"{_fmt_ranks(who)} never entered {what}; {_fmt_ranks(p.entered)} entered it and it "
                    "ended for them (completed or failed)"
                )
                conf = 0.5
            findings.append(
                _finding(
                    kind,
                    Severity.CRITICAL,
                    conf,
                    title,
                    who,
                    f"{p.pg.name}#{p.seq}:{who}",
                    ev,
                    job_id,
                    attempt,
                    p.waiting_since_ns,
                    last_ns,
                )
            )
    return findings


def _first_missed(pendings: list[GroupProgress], ranks: dict[int, _Rank]) -> GroupProgress:
    """Of the pending collectives one rank is missing from, the one it missed first.

    Pendings others are waiting in come first. Between two, the order in which a rank that
    entered both issued them decides; without such a rank, the earlier first arrival (clocks of
    different hosts may disagree by more than the gap, hence the last resort).
    """

    def earlier(a: GroupProgress, b: GroupProgress) -> int:
        if bool(a.in_flight) != bool(b.in_flight):
            return -1 if a.in_flight else 1
        both = set(a.entered) & set(b.entered)
        for x in sorted(both)[:8]:
            ea = ranks[x].by_pg.get(a.pg.name, {}).get(a.seq)
            eb = ranks[x].by_pg.get(b.pg.name, {}).get(b.seq)
            if ea and eb:
                return -1 if ea[0].record_id < eb[0].record_id else 1
        if a.first_entered_ns != b.first_entered_ns:
            return -1 if a.first_entered_ns < b.first_entered_ns else 1
        return len(b.in_flight) - len(a.in_flight)

    return min(pendings, key=cmp_to_key(earlier))


def _reaches(start: set[int], blockers: dict[int, set[int]], culprits: set[int], origin: GroupProgress) -> bool:
    """Whether ranks missing from a pending collective are (transitively) blocked by origin's culprits."""
    targets = culprits & {*origin.missing, *origin.no_dump}
    seen, todo = set(start), deque(start)
    while todo:
        r = todo.popleft()
        if r in targets:
            return True
        for b in blockers.get(r, ()):
            if b not in seen:
                seen.add(b)
                todo.append(b)
    return False


def _culprit_info(
    view: _Rank, p: GroupProgress, deviation: tuple[bool | None, FREntry | None] | None
) -> dict[str, Any]:
    entries = view.dump.entries
    info: dict[str, Any] = {
        "rank": view.dump.rank,
        "dump": view.dump.source_path,
        "last_seq_in_pg": p.last_seq.get(view.dump.rank, -1),
        "last_entry": _entry_json(entries[-1]) if entries else None,
        "in_flight": [_entry_json(e) for e in view.in_flight],
        "stack": list(_stack(view.in_flight[-1] if view.in_flight else entries[-1])) if entries else [],
    }
    if deviation is not None and deviation[0] and deviation[1] is not None:
        info["expected_next"] = _entry_json(deviation[1])
        info["expected_next"]["why"] = "the entry one period earlier in this rank's own repeating history"
    return info


def _mismatches(
    ranks: dict[int, _Rank],
    groups: dict[str, ProcessGroupInfo],
    context: dict[str, Any],
    job_id: str,
    attempt: int,
    last_ns: int,
) -> list[Finding]:
    at: dict[tuple[str, int], dict[tuple[Any, ...], list[int]]] = defaultdict(lambda: defaultdict(list))
    for r, view in ranks.items():
        for pg, seqs in view.by_pg.items():
            for seq, es in seqs.items():
                at[(pg, seq)][_sig(es)].append(r)
    findings = []
    for (pg, seq), by_sig in sorted(at.items()):
        if len(by_sig) < 2:
            continue
        ordered = sorted(by_sig.items(), key=lambda kv: (-len(kv[1]), kv[1]))
        major, rest = ordered[0][1], ordered[1:]
        culprits = sorted(r for _, rs in rest for r in rs)
        total = len(major) + len(culprits)
        if len(major) * 2 > total:
            conf = 0.9
        elif len(major) > len(ordered[1][1]):
            conf = 0.7
        else:
            # A tie: the side whose last entries break their own pattern diverged, if one does.
            dev = {r: _expected_next(ranks[r].dump.entries)[0] for _, rs in ordered for r in rs}
            sides = [rs for _, rs in ordered if any(dev[r] for r in rs)]
            if len(sides) == 1:
                culprits = sorted(sides[0])
                major = sorted(r for _, rs in ordered for r in rs if r not in sides[0])
                conf = 0.7
            else:
                culprits = sorted(r for _, rs in ordered for r in rs)
                conf = 0.4
        ops = {s[0][0] if s else "" for s in by_sig}
        kind = "desync" if len(ops) > 1 else "size_mismatch"
        g = groups.get(pg)
        label = _pg_label(g) if g else f"pg {pg}"
        sample = {tuple(rs): ranks[rs[0]].by_pg[pg][seq][0] for _, rs in ordered}
        calls = [
            {
                "ranks": list(rs),
                "op": e.op,
                "profiling_name": e.profiling_name,
                "input_sizes": _sizes(e.input_sizes),
                "dtypes": list(e.input_dtypes),
                "stack": list(_stack(e)),
            }
            for rs, e in sample.items()
        ]
        major_e = ranks[major[0]].by_pg[pg][seq][0]
        others = [(rs, e) for rs, e in sample.items() if major[0] not in rs]
        if kind == "desync":
            desc = "; ".join(f"{_fmt_ranks(rs)} called {e.op}" for rs, e in others)
            title = f"desync at collective #{seq} of {label}: {desc}, {_fmt_ranks(major)} called {major_e.op}"
        else:
            desc = "; ".join(
                f"{_fmt_ranks(rs)} passed {_sizes(e.input_sizes)} {list(e.input_dtypes)}" for rs, e in others
            )
            title = (
                f"size mismatch at {major_e.op} #{seq} of {label}: {desc}, {_fmt_ranks(major)} passed "
                f"{_sizes(major_e.input_sizes)} {list(major_e.input_dtypes)}"
            )
        ev = {
            "pg": {
                "name": pg,
                "desc": g.desc if g else "",
                "members": list(g.members) if g else [],
                "membership": g.source if g else "",
            },
            "seq": seq,
            "op": major_e.op,
            "input_sizes": _sizes(major_e.input_sizes),
            "dtypes": list(major_e.input_dtypes),
            "calls": calls,
            "majority": list(major),
            "entered": sorted(r for rs in by_sig.values() for r in rs),
            "completed": sorted(
                r for rs in by_sig.values() for r in rs if all(e.retired for e in ranks[r].by_pg[pg][seq])
            ),
            "missing": [r for r in (g.members if g else ()) if r in ranks and seq > ranks[r].last_seq.get(pg, 0)],
            **context,
        }
        first = min(e.time_created_ns for rs in by_sig.values() for r in rs for e in ranks[r].by_pg[pg][seq])
        findings.append(
            _finding(
                kind,
                Severity.CRITICAL,
                conf,
                title,
                culprits,
                f"{pg}#{seq}:{culprits}",
                ev,
                job_id,
                attempt,
                first,
                last_ns,
            )
        )
    return findings
