"""Rows of the ``actions`` table, and the history of decisions the guards consult.

Every decision and every delivery attempt is one row (columns as in ``ranklens/schema.py``).
Rows are queued in the outbox in the same transaction as what they describe and then written
to the store, so an unreachable store delays the audit trail but does not lose it. The guards
read the history back from the store *and* from rows still queued, so a decision taken while
the store was down still counts.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ranklens.store.api import Store
from ranklens.store.api import sql_string as _quote

__all__ = ["DECISION_OUTCOMES", "History", "action_row", "load_history"]

logger = logging.getLogger("ranklens.recovery")

DECISION_OUTCOMES = ("decided", "dry_run")
MAX_DETAIL = 4000


def action_row(
    *,
    finding_id: str,
    job_id: str,
    attempt: int,
    action: str,
    target: str,
    idempotency_key: str,
    outcome: str,
    ts_ns: int,
    attempt_no: int = 1,
    detail: str | dict[str, Any] = "",
) -> dict[str, Any]:
    """One ``actions`` row. ``detail`` (text or a dict, stored as JSON) is cut to 4000 characters."""
    text = detail if isinstance(detail, str) else json.dumps(detail, sort_keys=True, default=str)
    return {
        "finding_id": finding_id,
        "job_id": job_id,
        "attempt": int(attempt),
        "action": action,
        "target": target,
        "idempotency_key": idempotency_key,
        "attempt_no": int(attempt_no),
        "outcome": outcome,
        "detail": text[:MAX_DETAIL],
        "ts_ns": int(ts_ns),
    }


def target_scope_is_global(target: str) -> bool:
    """Node targets are shared by every job on the node; rank and job targets belong to one job."""
    return target.startswith("node:")


@dataclass(frozen=True)
class _Past:
    job_id: str
    action: str
    target: str
    key: str
    outcome: str
    ts_ns: int


class History:
    """Past decisions (``decided`` and ``dry_run`` rows), for idempotency and the guards."""

    def __init__(self, rows: Iterable[dict[str, Any]], *, complete: bool = True) -> None:
        self.complete = complete
        self._rows: list[_Past] = []
        for r in rows:
            self.add(r)

    def add(self, r: dict[str, Any]) -> None:
        if r.get("outcome") in DECISION_OUTCOMES:
            self._rows.append(
                _Past(
                    str(r.get("job_id", "")),
                    str(r.get("action", "")),
                    str(r.get("target", "")),
                    str(r.get("idempotency_key", "")),
                    str(r["outcome"]),
                    int(r.get("ts_ns", 0)),
                )
            )

    def has_key(self, key: str) -> bool:
        return any(p.key == key for p in self._rows)

    def _same_target(self, p: _Past, job_id: str, target: str) -> bool:
        return p.target == target and (target_scope_is_global(target) or p.job_id == job_id)

    def last_ns(self, *, job_id: str, target: str, action: str, outcome: str) -> int | None:
        """When ``action`` was last decided for ``target`` (None: never)."""
        ts = [
            p.ts_ns
            for p in self._rows
            if p.action == action and p.outcome == outcome and self._same_target(p, job_id, target)
        ]
        return max(ts) if ts else None

    def count_target(self, *, job_id: str, target: str, action: str, outcome: str, since_ns: int) -> int:
        return sum(
            1
            for p in self._rows
            if p.action == action
            and p.outcome == outcome
            and p.ts_ns >= since_ns
            and self._same_target(p, job_id, target)
        )

    def count_job(self, *, job_id: str, outcome: str, since_ns: int, exclude_actions: Sequence[str] = ()) -> int:
        return sum(
            1
            for p in self._rows
            if p.job_id == job_id and p.outcome == outcome and p.ts_ns >= since_ns and p.action not in exclude_actions
        )


def load_history(
    store: Store | None, job_ids: Iterable[str], *, since_ns: int, queued: Iterable[dict[str, Any]] = ()
) -> History:
    """Decisions of these jobs (all time) and of node targets since ``since_ns``, plus ``queued`` rows.

    When the store cannot be read the history is marked incomplete (the engine then takes no
    remediation decision, only notifications).
    """
    rows: list[dict[str, Any]] = list(queued)
    complete = True
    jobs = sorted(set(job_ids))
    if store is not None and jobs:
        outcomes = ", ".join(_quote(o) for o in DECISION_OUTCOMES)
        sql = (
            "SELECT job_id, action, target, idempotency_key, outcome, ts_ns FROM actions "
            f"WHERE outcome IN ({outcomes}) AND (job_id IN ({', '.join(_quote(j) for j in jobs)}) "
            f"OR (startsWith(target, 'node:') AND ts_ns >= {int(since_ns)}))"
        )
        try:
            rows.extend(store.query(sql).to_pylist())
        except Exception as e:  # the store is a boundary: any failure means "history unknown"
            logger.warning("recovery: cannot read the actions history from the store (%s); acting cautiously", e)
            complete = False
    return History(rows, complete=complete)
