"""Findings: the newest version of each, a finding's history, its recovery actions, and a job's
remediations with their MTTD / MTTR."""

from __future__ import annotations

import json
from typing import Any

import pandas as pd

from ranklens.dashboards.queries._sql import esc, frame
from ranklens.store.api import Store

__all__ = ["finding_actions", "finding_history", "findings", "job_recoveries"]

_FINDING_COLS = (
    "attempt",
    "kind",
    "severity",
    "confidence",
    "title",
    "state",
    "impact_s",
    "impact_gpu_s",
    "step_time_pct",
    "suspect_ranks",
    "suspect_hosts",
    "suspect_gpus",
    "suspect_links",
    "first_seen_step",
    "last_seen_step",
    "first_seen_ns",
    "last_seen_ns",
    "evidence",
    "detector",
)


def findings(store: Store, job_id: str, attempt: int | None = None, limit: int = 500) -> pd.DataFrame:
    """The newest version of every finding of a job, most costly first (``evidence`` parsed)."""
    from ranklens.analyzers.findings import latest_findings_sql

    df = frame(
        store,
        latest_findings_sql(
            job_id,
            attempt,
            _FINDING_COLS,
            more="min(updated_ns) AS first_reported_ns, count() AS versions",
            limit=limit,
        ),
    )
    df.columns = [c.removeprefix("latest_") for c in df.columns]
    df["evidence"] = [_parse_json(e) for e in df["evidence"]]
    return df


def _parse_json(text: Any) -> dict[str, Any]:
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {"raw": str(text)}
    return value if isinstance(value, dict) else {"value": value}


def finding_history(store: Store, finding_id: str, limit: int = 1000) -> pd.DataFrame:
    """Every stored version of one finding, oldest first: how it opened, grew and resolved."""
    return frame(
        store,
        f"SELECT updated_ns, state, severity, confidence, impact_s, last_seen_step FROM findings "
        f"WHERE id = '{esc(finding_id)}' ORDER BY updated_ns LIMIT {int(limit)}",
    )


def finding_actions(store: Store, finding_id: str, limit: int = 500) -> pd.DataFrame:
    """Recovery actions delivered for a finding (the ``actions`` table), oldest first."""
    return frame(
        store,
        f"SELECT ts_ns, action, target, attempt_no, outcome, detail, idempotency_key FROM actions "
        f"WHERE finding_id = '{esc(finding_id)}' ORDER BY ts_ns LIMIT {int(limit)}",
    )


#: what the ``resumed`` rows' detail holds (written by ``ranklens run --recover``, ranklens/recover.py)
_RECOVERY_FIELDS = ("kind", "mttd_s", "mttr_s", "lost_gpu_s", "resumed_attempt")


def job_recoveries(store: Store, job_id: str, limit: int = 500) -> pd.DataFrame:
    """Every live remediation decision of a job (not ``notify``), oldest first, with the MTTD, MTTR
    and lost GPU time of those after which training resumed (their ``resumed`` row; the others have
    empty figures): ``finding_id, action, target, decided_ns`` and :data:`_RECOVERY_FIELDS`."""
    j = esc(job_id)
    df = frame(
        store,
        "SELECT finding_id, d_action AS action, d_target AS target, decided_ns, resumed_detail FROM ("
        # aliases unlike the columns: ClickHouse would read the WHERE's `action` as the aggregate
        "SELECT finding_id, idempotency_key, any(action) AS d_action, any(target) AS d_target, "
        "min(ts_ns) AS decided_ns "
        f"FROM actions WHERE job_id = '{j}' AND outcome = 'decided' AND action != 'notify' "
        "GROUP BY finding_id, idempotency_key) AS d ALL LEFT JOIN ("
        "SELECT idempotency_key, any(detail) AS resumed_detail FROM actions "
        f"WHERE job_id = '{j}' AND outcome = 'resumed' GROUP BY idempotency_key) AS r USING idempotency_key "
        f"ORDER BY decided_ns LIMIT {int(limit)}",
    )
    details = [_parse_json(t) for t in df.get("resumed_detail", [])]
    for k in _RECOVERY_FIELDS:
        df[k] = [d.get(k) for d in details] if details else []
    return df.drop(columns=["resumed_detail"], errors="ignore")
