"""Findings about a node that was marginal at pre-flight say so.

``ranklens preflight`` stores every check result in the ``preflight`` table. When a finding names
a node (a straggler's node, a link's ends, a hang's rank's node) and that node's latest pre-flight
run before the finding (within ``lookback_s``) had warnings or failures, the finding carries
``evidence["preflight"]`` (per node: the run, its verdict and the marginal checks) and its title
says which checks: a GPU that ran hot at pre-flight and is now the straggler is one story, not two.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from ranklens.analyzers.findings import Finding
from ranklens.errors import StoreError
from ranklens.store.api import Store, sql_string

__all__ = ["annotate_preflight"]

WEEK_S = 7 * 86400.0


def _nodes(f: Finding) -> list[str]:
    out: list[str] = []
    for s in f.suspects:
        for n in (s.node, *[x for x in s.link if x != "network"]):
            if n and n not in out:
                out.append(n)
    return out


def _short(host: str) -> str:
    return host.split(".", 1)[0]


def _checks(marginal: list[dict[str, Any]]) -> list[str]:
    return sorted({m["check"] + (f"[{m['subject']}]" if m["subject"] else "") for m in marginal})


def annotate_preflight(store: Store, findings: list[Finding], *, lookback_s: float = WEEK_S) -> list[Finding]:
    """``findings`` with the pre-flight notes of their nodes (unchanged where there are none).

    A store without pre-flight results, or one that cannot answer, leaves the findings unchanged:
    the note is context, never a reason to lose a finding.
    """
    nodes = sorted({n for f in findings if f.kind != "preflight_failed" for n in _nodes(f)})
    if not nodes:
        return findings
    now = time.time_ns()
    since = min((f.first_seen_ns or now) for f in findings) - int(lookback_s * 1e9)
    # pre-flight may have named a node "gpu017" and the job "gpu017.cluster.local" (or the reverse):
    # they are matched on the short name
    shorts = {_short(n) for n in nodes}
    short_list = ", ".join(sql_string(n) for n in sorted(shorts))
    host_short = "splitByChar('.', host)[1]"
    try:
        runs = store.query(
            f"SELECT host, run_id, ts_ns FROM preflight WHERE {host_short} IN ({short_list}) "
            f"AND ts_ns >= {int(since)} GROUP BY host, run_id, ts_ns ORDER BY host, ts_ns"
        ).rows()
        if not runs:
            return findings
        ids = ", ".join(sql_string(str(r)) for r in sorted({r for _, r, _ in runs}))
        rows = store.query(
            "SELECT host, run_id, check_name, subject, status, verdict, message FROM preflight "
            f"WHERE run_id IN ({ids}) AND {host_short} IN ({short_list}) AND status IN ('warn', 'fail', 'error') "
            "ORDER BY host, check_name, subject"
        ).rows()
    except StoreError:
        return findings
    # per node (short name): its runs, oldest first; per (node, run): the marginal results
    by_node: dict[str, list[tuple[int, str]]] = {}
    for host, run_id, ts in runs:
        by_node.setdefault(_short(str(host)), []).append((int(ts), str(run_id)))
    for v in by_node.values():
        v.sort()
    marginal: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for host, run_id, check, subject, status, verdict, message in rows:
        marginal.setdefault((_short(str(host)), str(run_id)), []).append(
            {"check": check, "subject": subject, "status": status, "verdict": verdict, "message": message}
        )
    out = []
    for f in findings:
        if f.kind == "preflight_failed":
            out.append(f)
            continue
        at = f.first_seen_ns or now
        notes: dict[str, Any] = {}
        for n in _nodes(f):
            # the latest run before the finding began, within the lookback of *this* finding
            before = [(ts, r) for ts, r in by_node.get(_short(n), []) if at - lookback_s * 1e9 <= ts <= at]
            if not before:
                continue
            ts, run_id = before[-1]
            got = marginal.get((_short(n), run_id))
            if got:
                notes[n] = {"run_id": run_id, "ts_ns": ts, "verdict": got[0]["verdict"], "marginal": got}
        if not notes:
            out.append(f)
            continue
        said = "; ".join(
            f"{n} was {v['verdict'] or 'marginal'} at pre-flight ({', '.join(_checks(v['marginal']))})"
            for n, v in notes.items()
        )
        out.append(dataclasses.replace(f, title=f"{f.title} ({said})", evidence={**f.evidence, "preflight": notes}))
    return out
