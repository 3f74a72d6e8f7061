"""Findings: what an analyzer concluded, with evidence, confidence, impact and a stable identity."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from ranklens.formats.severity import Severity
from ranklens.store.api import Store
from ranklens.store.api import sql_escape as _esc

__all__ = [
    "SUSPECTS_KEY",
    "Finding",
    "Severity",
    "Suspect",
    "finding_from_row",
    "finding_id",
    "latest_columns",
    "latest_findings",
    "latest_findings_sql",
    "load_finding",
    "save_findings",
    "strip_latest",
]


@dataclass(frozen=True)
class Suspect:
    """Who or what is suspected: a rank (with its node and GPU), and for link findings the link's
    two ends (``("node3", "network")`` for a node's uplink, ``("node1", "node3")`` between nodes)."""

    rank: int
    node: str = ""
    gpu: str = ""
    link: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """``{"rank": r}`` plus ``node``, ``gpu`` and ``link`` (a list) when known: the stored form."""
        d: dict[str, Any] = {"rank": self.rank}
        if self.node:
            d["node"] = self.node
        if self.gpu:
            d["gpu"] = self.gpu
        if self.link:
            d["link"] = list(self.link)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Suspect:
        return cls(
            rank=int(d["rank"]),
            node=str(d.get("node") or ""),
            gpu=str(d.get("gpu") or ""),
            link=tuple(str(x) for x in d.get("link") or ()),
        )


# The key of ``findings.evidence`` (JSON) that holds the exact suspects, one object per suspect, so
# a row reads back as the Finding that wrote it; the ``suspect_*`` array columns are for SQL
# (``has(suspect_hosts, 'node3')``) and hold sets, which cannot say which node or link was whose.
SUSPECTS_KEY = "suspects"


def finding_id(job_id: str, attempt: int, kind: str, key: str) -> str:
    """Stable id: the same ongoing problem (job, attempt, kind, suspect) keeps one id."""
    return hashlib.sha1(f"{job_id}\0{attempt}\0{kind}\0{key}".encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Finding:
    """One detection. ``evidence`` holds the numbers and the SQL that reproduces them."""

    id: str
    job_id: str
    attempt: int
    kind: str
    severity: Severity
    confidence: float
    title: str
    suspects: tuple[Suspect, ...]
    first_seen_step: int
    last_seen_step: int
    first_seen_ns: int = 0
    last_seen_ns: int = 0
    impact_s: float = 0.0
    impact_gpu_s: float = 0.0
    step_time_pct: float = 0.0
    evidence: dict[str, Any] = field(default_factory=dict)
    state: str = "open"
    detector: str = ""
    updated_ns: int = field(default_factory=time.time_ns)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["severity"] = self.severity.value
        d["suspects"] = [asdict(s) for s in self.suspects]
        d["impact"] = {
            "seconds_lost": round(self.impact_s, 6),
            "gpu_seconds_lost": round(self.impact_gpu_s, 6),
            "step_time_pct": round(self.step_time_pct, 3),
        }
        return d

    def to_row(self) -> dict[str, Any]:
        """The ``findings`` row (one version); :func:`finding_from_row` reads it back unchanged.

        Raises:
            ValueError: ``evidence`` uses the reserved key ``"suspects"``.
        """
        if SUSPECTS_KEY in self.evidence:
            raise ValueError(
                f"finding {self.id}: evidence key {SUSPECTS_KEY!r} is reserved for the stored suspects; rename it"
            )
        return {
            "id": self.id,
            "job_id": self.job_id,
            "attempt": self.attempt,
            "kind": self.kind,
            "severity": self.severity.value,
            "confidence": float(self.confidence),
            "title": self.title,
            "suspect_ranks": [s.rank for s in self.suspects],
            "suspect_hosts": sorted({s.node for s in self.suspects if s.node}),
            "suspect_gpus": [s.gpu for s in self.suspects if s.gpu],
            "suspect_links": sorted({"<->".join(s.link) for s in self.suspects if s.link}),
            "first_seen_step": self.first_seen_step,
            "last_seen_step": self.last_seen_step,
            "first_seen_ns": self.first_seen_ns,
            "last_seen_ns": self.last_seen_ns,
            "impact_s": float(self.impact_s),
            "impact_gpu_s": float(self.impact_gpu_s),
            "step_time_pct": float(self.step_time_pct),
            "evidence": json.dumps({**self.evidence, SUSPECTS_KEY: [s.to_json() for s in self.suspects]}, default=str),
            "state": self.state,
            "detector": self.detector,
            "updated_ns": self.updated_ns,
        }


def finding_from_row(row: dict[str, Any]) -> Finding:
    """A :class:`Finding` back from a ``findings`` row (the newest version of an id), as it was saved.

    Rows saved before the evidence carried the suspects (no ``"suspects"`` key) give their ranks
    back with a node when the row names one node per rank or a single node, and a link when it
    names a single link."""
    try:
        evidence = json.loads(row.get("evidence") or "{}")
    except ValueError:
        evidence = {"raw": row.get("evidence")}
    if not isinstance(evidence, dict):
        evidence = {"raw": evidence}
    stored = evidence.pop(SUSPECTS_KEY, None)
    if isinstance(stored, list):
        suspects = [Suspect.from_json(d) for d in stored]
    else:
        suspects = _guess_suspects(row)
    updated = row.get("updated_ns")
    return Finding(
        id=str(row["id"]),
        job_id=str(row["job_id"]),
        attempt=int(row.get("attempt") or 0),
        kind=str(row["kind"]),
        severity=Severity(str(row.get("severity") or "warning")),
        confidence=float(row.get("confidence") or 0.0),
        title=str(row.get("title") or ""),
        suspects=tuple(suspects),
        first_seen_step=int(row.get("first_seen_step", -1)),
        last_seen_step=int(row.get("last_seen_step", -1)),
        first_seen_ns=int(row.get("first_seen_ns") or 0),
        last_seen_ns=int(row.get("last_seen_ns") or 0),
        impact_s=float(row.get("impact_s") or 0.0),
        impact_gpu_s=float(row.get("impact_gpu_s") or 0.0),
        step_time_pct=float(row.get("step_time_pct") or 0.0),
        evidence=evidence,
        state=str(row.get("state") or "open"),
        detector=str(row.get("detector") or ""),
        updated_ns=int(updated) if updated is not None else time.time_ns(),
    )


def _guess_suspects(row: dict[str, Any]) -> list[Suspect]:
    """Suspects of a row written without ``evidence["suspects"]`` (older versions): from the arrays."""
    ranks = [int(r) for r in row.get("suspect_ranks") or []]
    hosts = [str(h) for h in row.get("suspect_hosts") or []]
    links = [tuple(str(x).split("<->")) for x in row.get("suspect_links") or []]
    if len(hosts) == len(ranks):
        nodes = hosts
    else:
        nodes = [hosts[0] if len(hosts) == 1 else ""] * len(ranks)
    return [Suspect(rank=r, node=n, link=links[0] if len(links) == 1 else ()) for r, n in zip(ranks, nodes)]


def latest_columns(cols: Iterable[str]) -> str:
    """``argMax(c, updated_ns) AS latest_c, ...``: the newest version's value of each column, for a
    ``GROUP BY id`` over ``findings``. Aliases must not shadow column names: ClickHouse would read
    ``argMax(x, t) AS x`` as nested. Strip the prefix with :func:`strip_latest`."""
    return ", ".join(f"argMax({c}, updated_ns) AS latest_{c}" for c in cols)


def strip_latest(row: dict[str, Any]) -> dict[str, Any]:
    return {k.removeprefix("latest_"): v for k, v in row.items()}


def load_finding(store: Store, finding_id: str) -> Finding | None:
    """The newest version of the finding whose id is (or starts with) ``finding_id``; None if none.
    Raises ValueError when a prefix matches several findings."""
    from ranklens.schema import TABLES

    latest = latest_columns(c for c in TABLES["findings"].column_names if c not in ("id", "updated_ns", "ingest_id"))
    r = store.query(
        f"SELECT id, {latest}, max(updated_ns) AS latest_updated_ns FROM findings "
        f"WHERE startsWith(id, '{_esc(finding_id)}') GROUP BY id ORDER BY id LIMIT 2"
    ).to_pylist()
    if not r:
        return None
    if len(r) > 1:
        raise ValueError(f"finding id {finding_id!r} is ambiguous: {r[0]['id']}, {r[1]['id']}, ...")
    return finding_from_row(strip_latest(r[0]))


def save_findings(store: Store, findings: list[Finding]) -> int:
    """Append a new version of each finding (readers take the newest per id)."""
    if not findings:
        return 0
    return store.write("findings", [f.to_row() for f in findings])


def latest_findings_sql(
    job_id: str, attempt: int | None, cols: Iterable[str], *, more: str = "", limit: int | None = None
) -> str:
    """The query for the newest version of every finding of a job (of every attempt when ``attempt``
    is None), most impactful first: ``id``, ``latest_<c>`` of each of ``cols`` (``impact_s``
    among them), ``latest_updated_ns``, then the aggregates in ``more``; at most ``limit`` rows."""
    where = f"job_id = '{_esc(job_id)}'" + (f" AND attempt = {int(attempt)}" if attempt is not None else "")
    return (
        f"SELECT id, {latest_columns(cols)}, max(updated_ns) AS latest_updated_ns{f', {more}' if more else ''} "
        f"FROM findings WHERE {where} GROUP BY id ORDER BY latest_impact_s DESC, id"
        + (f" LIMIT {int(limit)}" if limit is not None else "")
    )


def latest_findings(store: Store, job_id: str, attempt: int | None = None) -> list[dict[str, Any]]:
    """The newest version of every finding of a job, most impactful first."""
    cols = (
        "kind",
        "severity",
        "confidence",
        "title",
        "state",
        "impact_s",
        "impact_gpu_s",
        "suspect_ranks",
        "suspect_hosts",
        "first_seen_step",
        "last_seen_step",
        "evidence",
    )
    r = store.query(latest_findings_sql(job_id, attempt, cols))
    return [strip_latest(row) for row in r.to_pylist()]
