"""Findings: the newest version of each, a finding's history and its recovery actions."""

from __future__ import annotations

import json
from typing import Any

import pandas as pd

from ranklens.dashboards.queries._sql import esc, frame
from ranklens.store.api import Store

__all__ = ["finding_actions", "finding_history", "findings"]

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
