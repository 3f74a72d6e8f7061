"""Root-cause correlation: GPU events and classified log errors tied to findings.

For each finding, the GPU events (XID, ECC, row remapping, ...: table ``gpu_events``) and the
classified log lines (``log_events``: nccl_error, cuda_error, gpu_xid, ...) of the job's nodes in
the finding's time window (``before_s`` before its onset to ``after_s`` after it was last seen)
are fetched with SQL. Ordered by time across all ranks and nodes, the *earliest* error is the
likely origin; later ones are collateral (a GPU that falls off the bus makes its peers' NCCL
calls fail seconds later). The enriched finding carries them in ``evidence["related_events"]``
and ``evidence["root_cause"]``, and its title says where the origin is: on the finding's own
suspects, or elsewhere (then the finding's suspects are likely victims).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ranklens.analyzers.findings import Finding
from ranklens.analyzers.ranks import rank_hosts
from ranklens.store.api import Store
from ranklens.store.api import sql_escape as _esc

__all__ = ["RelatedEvent", "correlate_findings", "gpu_event_severity", "related_events"]

_SEVERITY_RANK = {"info": 0, "warning": 1, "error": 2, "critical": 3}

# GPU event kinds (collector/nvml.py) -> severity; anything else is a warning
_GPU_SEVERITY = {
    "xid": "error",
    "ecc_dbe": "critical",
    "row_remap_failure": "critical",
    "ecc_sbe": "warning",
    "row_remap": "warning",
    "page_retirement": "warning",
}

# XIDs that mean the hardware or driver failed (not an application fault such as 13/31/43)
_CRITICAL_XIDS = {48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140}


def gpu_event_severity(kind: str, code: int) -> str:
    """Severity of a GPU event: XIDs of failing hardware (79 fell off the bus, 74 NVLink, 48/94/95
    ECC, ...) are critical, other XIDs errors; ECC double-bit errors critical, corrected ones warnings."""
    if kind == "xid" and int(code) in _CRITICAL_XIDS:
        return "critical"
    return _GPU_SEVERITY.get(kind, "warning")


@dataclass(frozen=True)
class RelatedEvent:
    """A GPU event or classified log line near a finding.

    ``role`` is ``"origin"`` for the earliest error of the window (across all ranks and nodes of
    the job) and ``"collateral"`` for the later ones; ``on_suspect`` says whether it happened on
    one of the finding's suspect nodes or ranks; ``offset_s`` is its time relative to the
    finding's onset (negative: before).
    """

    source: str  # "gpu" or "log"
    ts_ns: int
    host: str
    rank: int
    kind: str  # gpu_events.kind or log_events.klass
    code: int
    severity: str
    message: str
    on_suspect: bool
    role: str
    offset_s: float

    def label(self) -> str:
        """``XID 79`` / ``ecc_dbe`` / ``nccl_error`` and where: ``on node3 (rank 6)``."""
        what = f"XID {self.code}" if self.kind == "xid" else self.kind
        where = self.host or "?"
        if self.rank >= 0:
            where += f" (rank {self.rank})"
        return f"{what} on {where}"


def _in_list(values: Iterable[str]) -> str:
    vals = sorted(set(values))
    return ", ".join(f"'{_esc(v)}'" for v in vals) if vals else "''"


def _window(f: Finding, before_s: float, after_s: float) -> tuple[int, int, int]:
    onset = f.first_seen_ns or f.last_seen_ns or f.updated_ns
    last = max(f.last_seen_ns, onset)
    return onset - int(before_s * 1e9), last + int(after_s * 1e9), onset


def related_events(
    store: Store,
    job_id: str,
    start_ns: int,
    end_ns: int,
    *,
    hosts: Iterable[str] = (),
    min_severity: str = "error",
    limit: int = 1000,
    job_start_ns: int | None = None,
) -> list[dict[str, Any]]:
    """GPU events and classified log lines of a job (or of its ``hosts``) in ``[start_ns, end_ns]``,
    at ``min_severity`` or above, oldest first. Each row: source, ts_ns, host, rank, kind, code,
    severity, message. Other jobs' GPU events count from ``job_start_ns`` on (default: the job's
    first heartbeat, looked up here)."""
    if min_severity not in _SEVERITY_RANK:
        raise ValueError(f"min_severity={min_severity!r}; allowed: {', '.join(_SEVERITY_RANK)}")
    host_list = _in_list(hosts)
    j = _esc(job_id)
    # another job's GPU events on these hosts count from this job's first heartbeat on: an XID of a
    # job that ended before this one started is not the origin of what happens in this one
    began = _job_start(store, job_id) if job_start_ns is None else job_start_ns
    others_from = max(int(start_ns), began)
    gpu = store.query(
        f"SELECT ts_ns, host, gpu_index, rank, kind, code, message FROM gpu_events "
        f"WHERE ts_ns >= {int(start_ns)} AND ts_ns <= {int(end_ns)} "
        f"AND (job_id = '{j}' OR (host IN ({host_list}) AND ts_ns >= {others_from})) "
        f"ORDER BY ts_ns LIMIT {int(limit)}"
    ).to_pylist()
    sev_ok = [s for s, r in _SEVERITY_RANK.items() if r >= _SEVERITY_RANK[min_severity]]
    logs = store.query(
        f"SELECT ts_ns, host, rank, klass, severity, message, repeat_count FROM log_events "
        f"WHERE ts_ns >= {int(start_ns)} AND ts_ns <= {int(end_ns)} "
        f"AND (job_id = '{j}' OR (job_id = '' AND host IN ({host_list}))) AND severity IN ({_in_list(sev_ok)}) "
        f"ORDER BY ts_ns LIMIT {int(limit)}"
    ).to_pylist()
    out = []
    for e in gpu:
        sev = gpu_event_severity(str(e["kind"]), int(e["code"]))
        if _SEVERITY_RANK[sev] < _SEVERITY_RANK[min_severity]:
            continue
        out.append(_event_row("gpu", e, str(e["kind"]), int(e["code"]), sev, f"GPU {e['gpu_index']}: {e['message']}"))
    for e in logs:
        msg = str(e["message"])
        if int(e["repeat_count"]) > 1:
            msg += f" (x{int(e['repeat_count'])})"
        out.append(_event_row("log", e, str(e["klass"]), 0, str(e["severity"]), msg[:500]))
    out.sort(key=lambda e: (e["ts_ns"], e["source"], e["host"], e["rank"]))
    return out


def _job_start(store: Store, job_id: str) -> int:
    """The job's first heartbeat (0: none yet)."""
    return int(store.query(f"SELECT min(ts_ns) FROM heartbeats WHERE job_id = '{_esc(job_id)}'").scalar() or 0)


def _event_row(source: str, e: dict[str, Any], kind: str, code: int, severity: str, message: str) -> dict[str, Any]:
    """A row of :func:`related_events` from a stored event ``e`` (its time, host and rank)."""
    return {
        "source": source,
        "ts_ns": int(e["ts_ns"]),
        "host": str(e["host"]),
        "rank": int(e["rank"]),
        "kind": kind,
        "code": code,
        "severity": severity,
        "message": message,
    }


def _enrich(f: Finding, rows: list[dict[str, Any]], hosts: dict[int, str], onset: int, max_events: int) -> Finding:
    s_hosts = {s.node for s in f.suspects if s.node} | {hosts[s.rank] for s in f.suspects if s.rank in hosts}
    s_ranks = {s.rank for s in f.suspects if s.rank >= 0}
    events = []
    for k, e in enumerate(rows):
        host = e["host"] or hosts.get(e["rank"], "")
        on = bool(host and host in s_hosts) or (e["rank"] >= 0 and e["rank"] in s_ranks)
        events.append(
            RelatedEvent(
                source=e["source"],
                ts_ns=e["ts_ns"],
                host=host,
                rank=e["rank"],
                kind=e["kind"],
                code=e["code"],
                severity=e["severity"],
                message=e["message"],
                on_suspect=on,
                role="origin" if k == 0 else "collateral",
                offset_s=round((e["ts_ns"] - onset) / 1e9, 3),
            )
        )
    origin = events[0]
    on_suspect = [e for e in events if e.on_suspect]
    if origin.on_suspect:
        clause = f"likely origin: {origin.label()} {_when(origin.offset_s)}"
    elif on_suspect:
        clause = (
            f"likely origin elsewhere: {origin.label()} {_when(origin.offset_s)}; "
            f"{len(on_suspect)} error(s) on the suspects are collateral"
        )
    else:
        clause = f"related: {origin.label()} {_when(origin.offset_s)} (not on the suspects)"
    # keep the origin and the suspects' own events when trimming
    keep = [origin] + on_suspect + [e for e in events[1:] if not e.on_suspect]
    seen: set[int] = set()
    trimmed = []
    for ev in keep:
        if id(ev) not in seen:
            seen.add(id(ev))
            trimmed.append(ev)
    trimmed = sorted(trimmed[:max_events], key=lambda x: x.ts_ns)
    evidence = {
        **f.evidence,
        "related_events": [dataclasses.asdict(x) for x in trimmed],
        "root_cause": {
            "origin": dataclasses.asdict(origin),
            "origin_on_suspect": origin.on_suspect,
            "events": len(events),
            "events_on_suspects": len(on_suspect),
            "collateral": len(events) - 1,
            "summary": clause,
        },
    }
    return dataclasses.replace(f, title=f"{f.title}; {clause}", evidence=evidence)


def _when(offset_s: float) -> str:
    if offset_s < 0:
        return f"{-offset_s:.1f} s before onset"
    return f"{offset_s:.1f} s after onset"


def correlate_findings(
    store: Store,
    findings: list[Finding],
    *,
    before_s: float = 300.0,
    after_s: float = 60.0,
    min_severity: str = "error",
    max_events: int = 50,
) -> list[Finding]:
    """Findings enriched with the GPU events and classified log errors of their time window.

    Args:
        store: where gpu_events, log_events and ranks are.
        findings: any analyzer's findings (slow_link, straggler, hang, ...).
        before_s, after_s: the window: from ``before_s`` before a finding's onset to ``after_s``
            after it was last seen.
        min_severity: the least severity kept (info, warning, error, critical).
        max_events: at most this many events in the evidence (the origin and the suspects' own
            events first).

    Returns:
        The findings in the same order; one without related events is returned unchanged, the
        others carry ``evidence["related_events"]`` (oldest first, each with ``role`` origin or
        collateral and ``on_suspect``) and ``evidence["root_cause"]``, and their title names the
        likely origin.
    """
    hosts_by_job: dict[str, dict[int, str]] = {}
    start_by_job: dict[str, int] = {}
    out = []
    for f in findings:
        hosts = hosts_by_job.get(f.job_id)
        if hosts is None:
            hosts = hosts_by_job[f.job_id] = rank_hosts(store, f.job_id)
            start_by_job[f.job_id] = _job_start(store, f.job_id)
        start, end, onset = _window(f, before_s, after_s)
        job_hosts = set(hosts.values()) | {s.node for s in f.suspects if s.node}
        rows = related_events(
            store,
            f.job_id,
            start,
            end,
            hosts=job_hosts,
            min_severity=min_severity,
            job_start_ns=start_by_job[f.job_id],
        )
        out.append(_enrich(f, rows, hosts, onset, max_events) if rows else f)
    return out
