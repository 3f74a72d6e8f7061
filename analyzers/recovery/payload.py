"""The versioned JSON payload of a webhook delivery (documented in ``docs/recovery.md``).

One place builds it: the finding (identity, severity, impact, suspects), a bounded summary of
its evidence (scalars and short lists; long series such as ``per_step`` are left out and named in
``evidence_omitted``), the action (level, target, rule, reason, escalation, dry-run) and links.
The body is built once, when the decision is queued, and sent byte for byte on every retry.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ranklens.analyzers.recovery.api import Decision, PayloadTooLarge

__all__ = ["PAYLOAD_SCHEMA", "PAYLOAD_VERSION", "build_payload", "summarize_evidence"]

PAYLOAD_SCHEMA = "ranklens.recovery.action"
PAYLOAD_VERSION = 1
MAX_STRING = 2000
MAX_LIST = 20


def summarize_evidence(evidence: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Evidence cut down for a payload: (kept, names of the keys left out or cut)."""
    kept: dict[str, Any] = {}
    omitted: list[str] = []
    for k, v in evidence.items():
        s = _small(v, depth=0)
        if s is _DROP:
            omitted.append(str(k))
        else:
            kept[str(k)] = s
            if isinstance(v, str) and len(v) > MAX_STRING:
                omitted.append(f"{k} (truncated)")
    return kept, sorted(omitted)


_DROP = object()


def _small(v: Any, depth: int) -> Any:
    if v is None or isinstance(v, (bool, int)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, str):
        return v if len(v) <= MAX_STRING else v[:MAX_STRING] + "…"
    if depth >= 2:
        return _DROP
    if isinstance(v, (list, tuple)):
        if len(v) > MAX_LIST:
            return _DROP
        out = [_small(x, depth + 1) for x in v]
        return _DROP if any(x is _DROP for x in out) else out
    if isinstance(v, dict):
        if len(v) > MAX_LIST:
            return _DROP
        d = {str(k): _small(x, depth + 1) for k, x in v.items()}
        return _DROP if any(x is _DROP for x in d.values()) else d
    return _DROP


def build_payload(decision: Decision, *, dashboard_link: str = "", max_bytes: int = 65536) -> bytes:
    """The UTF-8 JSON body for ``decision``.

    Raises:
        PayloadTooLarge: still over ``max_bytes`` with the evidence reduced to its action fields.
    """
    f = decision.finding
    evidence, omitted = summarize_evidence(dict(f.evidence))
    doc: dict[str, Any] = {
        "schema": PAYLOAD_SCHEMA,
        "version": PAYLOAD_VERSION,
        "idempotency_key": decision.key,
        "created_ns": decision.decided_ns,
        "dry_run": decision.dry_run,
        "action": {
            "level": decision.delivered_level.value,
            "proposed_level": decision.level.value,
            "target": decision.target,
            "rule": decision.rule,
            "reason": decision.reason,
            "escalated_from": decision.escalated_from.value if decision.escalated_from else None,
        },
        "finding": {
            "id": f.id,
            "job_id": f.job_id,
            "attempt": f.attempt,
            "kind": f.kind,
            "severity": getattr(f.severity, "value", str(f.severity)),
            "confidence": round(float(f.confidence), 4),
            "title": f.title,
            "state": f.state,
            "detector": f.detector,
            "suspects": [{"rank": s.rank, "node": s.node, "gpu": s.gpu} for s in f.suspects],
            "first_seen_step": f.first_seen_step,
            "last_seen_step": f.last_seen_step,
            "first_seen_ns": f.first_seen_ns,
            "last_seen_ns": f.last_seen_ns,
            "impact": {
                "seconds_lost": round(float(f.impact_s), 6),
                "gpu_seconds_lost": round(float(f.impact_gpu_s), 6),
                "step_time_pct": round(float(f.step_time_pct), 3),
            },
        },
        "evidence": evidence,
        "evidence_omitted": omitted,
        "links": {"dashboard": dashboard_link},
    }
    body = _dump(doc)
    if len(body) > max_bytes:
        keep = {k: evidence[k] for k in ("action", "action_reason") if k in evidence}
        doc["evidence_omitted"] = sorted(set(omitted) | (set(evidence) - set(keep)))
        doc["evidence"] = keep
        body = _dump(doc)
    if len(body) > max_bytes:
        raise PayloadTooLarge(
            f"payload for finding {f.id} is {len(body)} bytes with its evidence removed, over max_payload_bytes "
            f"{max_bytes}; raise max_payload_bytes in the policy"
        )
    return body


def _dump(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str).encode("utf-8")
