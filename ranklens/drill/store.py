"""The ``drills`` table: one row per fault of each drill, so drills compare over releases."""

from __future__ import annotations

import math
import shlex
import time
from typing import TYPE_CHECKING, Any

from ranklens.store.api import Store

if TYPE_CHECKING:
    from ranklens.drill.runner import DrillResult

__all__ = ["drill_rows", "save_drill"]


def drill_rows(result: DrillResult, *, suite: str = "") -> list[dict[str, Any]]:
    from ranklens import __version__

    ts = time.time_ns() - int(result.wall_s * 1e9)
    return [
        {
            "drill_id": result.drill_id,
            "ts_ns": ts,
            "suite": suite,
            "name": result.name,
            "job_id": result.job_id,
            "fault": s.fault.spec,
            "kind": s.fault.kind.value,
            "rank": s.fault.rank,
            "applied": int(s.applied),
            "onset_ns": s.onset.ts_ns if s.onset else 0,
            "detected": int(s.detected),
            "ttd_s": math.nan if s.ttd_s is None else float(s.ttd_s),
            "resumed_s": math.nan if s.resumed_s is None else float(s.resumed_s),
            "kind_ok": int(s.kind_ok),
            "culprit_ok": int(s.culprit_ok),
            "finding_id": s.finding.id if s.finding else "",
            "finding_kind": s.finding.kind if s.finding else "",
            "false_findings": len(result.false_findings),
            "passed": int(result.passed),
            "exit_code": result.exit_code if result.exit_code is not None else 0,
            "job_failed": result.job_failed,
            "version": __version__,
            "command": shlex.join(result.command),
        }
        for s in result.scores
    ]


def save_drill(store: Store, result: DrillResult, *, suite: str = "") -> int:
    """Write the drill's rows; returns how many."""
    return store.write("drills", drill_rows(result, suite=suite))
