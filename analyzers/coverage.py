"""What an analysis of a job could see: where its steps came from, which records it has, and
what is missing and what that costs.

An empty list of findings means "nothing is wrong" only when the analysis could have seen a
problem. A script traced without step markers, without phases or with a handful of collectives
is analysed with less: the report says so (:attr:`Coverage.notes`) instead of a bare all-clear.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ranklens.store.api import Store
from ranklens.store.api import sql_escape as _esc

__all__ = ["MIN_COLLECTIVES", "Coverage", "analysis_coverage"]

MIN_COLLECTIVES = 10  # fewer collectives per group than this: too few to tell a straggler from noise


@dataclass(frozen=True)
class Coverage:
    """Records of one job attempt that the analyzers work from.

    ``step_source``: ``"explicit"`` (step markers: ``rlt.step``, a trainer callback), ``"inferred"``
    (step boundaries inferred by the tracer from an unmodified script) or ``"none"`` (no steps
    rows: analysis runs on windows of the collective ledger). ``notes``: what is missing and what
    it costs, one sentence each.
    """

    job_id: str
    attempt: int
    step_source: str
    ranks: int
    steps: int
    phases: list[str]
    collectives: int
    collectives_with_step: int
    windows: int = 0
    window_basis: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def degraded(self) -> bool:
        return bool(self.notes)

    def to_json(self) -> dict[str, Any]:
        return {
            "step_source": self.step_source,
            "ranks": self.ranks,
            "steps": self.steps,
            "phases": self.phases,
            "collectives": self.collectives,
            "collectives_with_step": self.collectives_with_step,
            "windows": self.windows,
            "window_basis": self.window_basis,
            "degraded": self.degraded,
            "notes": self.notes,
        }


def _step_source(store: Store, where: str) -> str:
    from ranklens.schema import TABLES

    if "source" not in TABLES["steps"].column_names:
        n = int(store.query(f"SELECT count() FROM steps WHERE {where}").scalar() or 0)
        return "explicit" if n else "none"
    try:
        rows = store.query(f"SELECT source, count() AS n FROM steps WHERE {where} GROUP BY source").rows()
    except Exception:  # a store whose steps predate the column: every step there was explicit
        n = int(store.query(f"SELECT count() FROM steps WHERE {where}").scalar() or 0)
        return "explicit" if n else "none"
    kinds = {str(s or "explicit"): int(n) for s, n in rows if int(n)}
    if not kinds:
        return "none"
    return "explicit" if "explicit" in kinds or "inferred" not in kinds else "inferred"


def analysis_coverage(store: Store, job_id: str, attempt: int = 0) -> Coverage:
    """What the analysis of a job attempt has to work from, with a note for each gap."""
    where = f"job_id = '{_esc(job_id)}' AND attempt = {int(attempt)}"
    source = _step_source(store, where)
    n_steps, n_step_ranks = store.query(f"SELECT uniqExact(step), uniqExact(rank) FROM steps WHERE {where}").rows()[0]
    phases = sorted(
        str(p) for (p,) in store.query(f"SELECT DISTINCT phase FROM phases WHERE {where} AND step >= 0").rows()
    )
    n_coll, with_step, n_ranks = store.query(
        f"SELECT count(), countIf(step >= 0), uniqExact(rank) FROM collectives WHERE {where}"
    ).rows()[0]
    per_group = store.query(
        f"SELECT max(seqs) FROM (SELECT pg, uniqExact(seq) AS seqs FROM collectives WHERE {where} "
        "AND position(pg, '/p2p:') = 0 GROUP BY pg)"
    ).scalar()
    n_coll, with_step, n_ranks, per_group = (int(x or 0) for x in (n_coll, with_step, n_ranks, per_group))
    ranks = max(n_ranks, int(n_step_ranks or 0))
    notes: list[str] = []
    windows, basis = 0, ""
    if int(n_steps or 0) == 0 or with_step == 0:
        if n_coll:
            from ranklens.analyzers.windows import collective_windows

            w = collective_windows(store, job_id, attempt)
            windows, basis = len(w.starts_ns), w.basis
            if basis == "iterations":
                how = (
                    f"iterations were counted from the collectives' repeating pattern ({windows} iterations of "
                    f"{w.period} collectives on group {w.pg}): onsets are iteration numbers, not step numbers"
                )
            else:
                how = (
                    f"the ledger was cut into {windows} windows of {w.period} collectives of group {w.pg} "
                    "(no repeating pattern to count iterations by): onsets are times, not steps"
                )
            notes.append(
                "no step markers in this job (unmodified script, no optimizer hooks seen): blame comes from "
                f"the arrival ledger alone; {how}; a rank's compute cannot be compared with its peers', so a slow "
                "rank is found only through the time others wait for it"
            )
        else:
            notes.append("no collectives and no steps recorded: nothing to analyze (was the job traced?)")
    elif source == "inferred":
        notes.append(
            "steps were inferred (optimizer steps of an unmodified script), not marked: a step boundary may sit a "
            "little off the loop's own; mark steps with rlt.step for exact onsets"
        )
    if not phases and n_coll:
        notes.append(
            "no phases (data/forward/backward/optimizer) recorded: a finding cannot say in which phase a rank is slow"
        )
    if n_coll and per_group < MIN_COLLECTIVES:
        notes.append(
            f"only {per_group} collectives per group: too few to tell a persistent straggler from noise; "
            "run more steps for a reliable answer"
        )
    if n_coll == 0 and int(n_steps or 0):
        notes.append("no collectives recorded: nobody's waiting can be measured, so blame and slow links are blind")
    return Coverage(
        job_id=job_id,
        attempt=int(attempt),
        step_source=source,
        ranks=ranks,
        steps=int(n_steps or 0),
        phases=phases,
        collectives=n_coll,
        collectives_with_step=with_step,
        windows=windows,
        window_basis=basis,
        notes=notes,
    )
