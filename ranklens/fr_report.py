"""The flight-recorder post-mortem: ``ranklens analyze --flight-recorder DIR``.

Reads the dumps in a directory (one damaged dump does not hide the others), finds their job
(dumps written by ranklens' tracer lie in ``<spool>/<job>/<attempt>/fr/``), analyses them (hang,
crash, desync, size_mismatch; with a store, the job's ledger gives each finding its step; the
suspects' Python stacks, where the tracer wrote them beside the dumps, go into ``evidence.stacks``), saves
the findings only into a store named and only from complete input, and renders what was found:
:meth:`FlightRecorderReport.to_text` (the pending collectives of every process group, then the
findings) or :meth:`FlightRecorderReport.to_json`. The CLI parses arguments, prints and exits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ranklens.analyzers import save_findings
from ranklens.analyzers.findings import Finding
from ranklens.analyzers.hangs import analyze_flight_recorder, group_progress, steps_from_store
from ranklens.collector.flight_recorder import infer_job_id, job_from_path, read_dumps
from ranklens.errors import IngestError
from ranklens.formats.flight_recorder import FRDump, UnreadableDump, infer_world_size
from ranklens.formats.stacks import read_stack_dump
from ranklens.store.api import Store

__all__ = ["FlightRecorderReport", "analyze_dumps"]


@dataclass(frozen=True)
class FlightRecorderReport:
    """What the post-mortem of one job attempt's dumps found.

    ``world_size_given`` is the ``--world-size`` asked for (None: inferred); ``world_size`` and
    ``world_size_source`` what was used and where it came from; ``missing_dumps`` the ranks that
    left no dump (readable or not).
    """

    job_id: str
    attempt: int
    dumps: list[FRDump]  # one per rank that left a readable dump
    unreadable: list[UnreadableDump]
    world_size: int
    world_size_source: str
    world_size_given: int | None
    missing_dumps: list[int]
    findings: list[Finding]

    def to_json(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "attempt": self.attempt,
            "dumps": [d.rank for d in self.dumps],
            "world_size": self.world_size,
            "world_size_source": self.world_size_source,
            "missing_dumps": self.missing_dumps,
            "unreadable_dumps": [{"path": u.path, "rank": u.rank, "error": u.error} for u in self.unreadable],
            "findings": [f.to_json() for f in self.findings],
        }

    def to_text(self) -> str:
        """The report as ``ranklens analyze --flight-recorder`` prints it (no trailing newline)."""
        out: list[str] = []
        dumps, job_id = self.dumps, self.job_id
        out.append(f"{len(dumps)} flight-recorder dump(s) from ranks {_ranks(d.rank for d in dumps)}; job {job_id}")
        out.append(
            f"world size {self.world_size} ({self.world_size_source}); no dump from ranks: {_ranks(self.missing_dumps)}"
        )
        for u in self.unreadable:
            out.append(f"unreadable dump{'' if u.rank is None else f' of rank {u.rank}'}: {u.error}")
        known = {u.rank for u in self.unreadable if u.rank is not None}
        pending = group_progress(dumps, world_size=self.world_size_given, known_ranks=known)
        if pending:
            out.append("Pending collectives:")
        for g in pending:
            out.append(
                f"  {g.pg.desc or g.pg.name} (pg {g.pg.name}, ranks {_ranks(g.pg.members)}): {g.op} #{g.seq} "
                f"{[list(x) for x in g.input_sizes]}: entered {_ranks(g.entered)}; in flight {_ranks(g.in_flight)}; "
                f"ended {_ranks(g.completed)}; never entered {_ranks(g.missing)}; "
                f"no dump {_ranks(r for r in g.no_dump if r not in known)}"
                + (f"; dump unreadable {_ranks(r for r in g.no_dump if r in known)}" if known & set(g.no_dump) else "")
            )
        if not self.findings:
            out.append("\nNo findings: every process group is consistent and nothing is pending.")
            return "\n".join(out)
        out.append(f"\nFindings ({len(self.findings)}):")
        for f in self.findings:
            step = f" (step {f.first_seen_step})" if f.first_seen_step >= 0 else ""
            out.append(f"  [{f.severity.value.upper()}] {f.kind}{step}: {f.title}")
            action = f.evidence.get("action")
            if action:
                out.append(f"      recommended: {action} ({f.evidence.get('action_reason', '')})")
            for rank, st in sorted((f.evidence.get("stacks") or {}).items(), key=lambda kv: int(kv[0])):
                main = next((t for t in st["threads"] if t["main"]), None)
                if main and main["frames"]:
                    out.append(f"      rank {rank}'s main thread at the dump ({st['reason']}), innermost last:")
                    out += [f"        {_frame(x)}" for x in main["frames"][-STACK_LINES:]]
            out.append(f"      confidence {f.confidence:.2f}, id {f.id}")
        return "\n".join(out)


def analyze_dumps(
    fr_dir: str,
    *,
    job_id: str | None = None,
    attempt: int | None = None,
    world_size: int | None = None,
    open_store: Callable[[], Store] | None = None,
    save: bool = True,
) -> FlightRecorderReport:
    """The post-mortem of the flight-recorder dumps in ``fr_dir``.

    Args:
        fr_dir: a directory of dumps (pickle or JSON, NCCL or gloo), or one dump.
        job_id: the job (default: from where the dumps lie, else an id made from the dumps).
        attempt: the restart attempt (default: from where the dumps lie, else 0).
        world_size: ranks of the job (default: inferred from the dumps).
        open_store: opens the store (called once the dumps are read; None: no store): its ledger
            gives the findings their steps, and they are saved into it.
        save: save the findings into the store (only when every dump could be read).

    Returns:
        The report; ``report.unreadable`` lists the dumps that could not be read (then nothing
        was saved).

    Raises:
        IngestError: no dump could be read.
    """
    dumps, unreadable = read_dumps(fr_dir)  # one damaged dump does not hide the others
    if not dumps:
        first = unreadable[0] if unreadable else None
        raise IngestError(first.path if first else fr_dir, "", first.error if first else "no readable dump")
    # dumps written by ranklens' tracer lie in <spool>/<job>/<attempt>/fr/: that is their job
    from_path = job_from_path([d.source_path for d in dumps])
    job_id = job_id or (from_path[0] if from_path else infer_job_id(dumps))
    if attempt is None:
        attempt = from_path[1] if from_path and from_path[0] == job_id else 0
    store = open_store() if open_store is not None else None
    step_of = steps_from_store(store, job_id, attempt) if store is not None else None
    findings = analyze_flight_recorder(
        dumps, world_size=world_size, job_id=job_id, attempt=attempt, unreadable=unreadable, step_of=step_of
    )
    sdir = stacks_dir_of(fr_dir)
    if sdir is not None:  # the suspects' Python stacks at the dump: the cause survives a restart
        findings = _with_stacks(list(findings), load_stacks(sdir))
    known = {u.rank for u in unreadable if u.rank is not None}
    world, world_source = infer_world_size(dumps, world_size, known_ranks=known)
    no_dump = sorted(set(range(world)) - {d.rank for d in dumps} - known)
    # post-mortem needs no store; save only into one named, and only from complete input (exit 6
    # means nothing was written)
    if store is not None and save and not unreadable:
        save_findings(store, findings)
    return FlightRecorderReport(
        job_id=job_id,
        attempt=attempt,
        dumps=list(dumps),
        unreadable=list(unreadable),
        world_size=world,
        world_size_source=world_source,
        world_size_given=world_size,
        missing_dumps=no_dump,
        findings=list(findings),
    )


STACK_LINES = 4  # innermost frames of a suspect's main thread in the text report (all are in --json)


def _frame(x: dict[str, Any]) -> str:
    return f"{x['file']}:{x['line']} in {x['func']}" + (f": {x['code']}" if x["code"] else "")


def stacks_dir_of(fr_dir: str) -> Path | None:
    """The tracer's stack dumps beside flight-recorder dumps in ``<attempt>/fr/`` (``<attempt>/stacks/``)."""
    p = Path(fr_dir)
    fr = p if p.is_dir() else p.parent
    if fr.name != "fr":
        return None
    d = fr.parent / "stacks"
    return d if d.is_dir() else None


def load_stacks(directory: Path) -> dict[int, dict[str, Any]]:
    """The stack dumps in ``directory`` by rank; an unreadable one is skipped (context, never a reason
    to fail the post-mortem). Only the training's threads are kept (not ranklens' own)."""
    out: dict[int, dict[str, Any]] = {}
    for path in sorted(directory.glob("stacks_rank_*.json")):
        doc = read_stack_dump(path)
        if doc is not None:
            out[doc["rank"]] = {"ts_ns": doc["ts_ns"], "reason": doc["reason"], "threads": doc["threads"]}
    return out


def _with_stacks(findings: list[Finding], stacks: dict[int, dict[str, Any]]) -> list[Finding]:
    out = []
    for f in findings:
        got = {str(s.rank): stacks[s.rank] for s in f.suspects if s.rank in stacks}
        out.append(dataclasses.replace(f, evidence={**f.evidence, "stacks": got}) if got else f)
    return out


def _ranks(rs: Iterable[int]) -> str:
    return ", ".join(map(str, rs)) or "-"
