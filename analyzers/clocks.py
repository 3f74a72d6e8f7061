"""Clock alignment across hosts, from collective completions.

Every member of a collective leaves it at nearly the same instant, so on each host the median
difference between its ranks' completion times and the collective's median completion is that
host's clock offset. The estimator is robust (medians), reports how many collectives support each
host's estimate and the spread (interquartile range) as its confidence, and is relative to the
median host (offsets have no absolute reference). Cross-rank comparisons of arrival times (blame)
subtract it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ranklens.analyzers.ranks import rank_hosts
from ranklens.store.api import Store
from ranklens.store.api import sql_escape as _esc

__all__ = ["HostOffset", "clock_offsets", "offsets_sql", "rank_offsets"]


@dataclass(frozen=True)
class HostOffset:
    host: str
    offset_ns: int  # this host's clock minus the reference (median host) clock
    samples: int  # collectives that supported the estimate
    spread_ns: int  # interquartile range of the per-collective estimates

    @property
    def confidence(self) -> float:
        """0..1: many samples and a tight spread relative to the offset give a high confidence."""
        if self.samples == 0:
            return 0.0
        tight = 1.0 / (1.0 + self.spread_ns / max(abs(self.offset_ns), 1_000_000))
        return round(min(1.0, self.samples / 50.0) * tight, 3)


def offsets_sql(job_id: str, attempt: int, max_collectives: int = 20000) -> str:
    w = f"job_id = '{_esc(job_id)}' AND attempt = {int(attempt)}"
    # ClickHouse 18.16 allows one JOIN per SELECT: the joins are nested
    return f"""
SELECT host, quantileExact(0.5)(dh) AS offset_ns, count() AS samples,
       quantileExact(0.75)(dh) - quantileExact(0.25)(dh) AS spread_ns
FROM
(
    SELECT host, pg, seq, quantileExact(0.5)(d) AS dh
    FROM
    (
        SELECT rank, pg, seq, end_ns - med_end AS d
        FROM
        (
            SELECT rank, pg, seq, end_ns FROM collectives
            WHERE {w} AND end_ns > 0 AND position(pg, '/p2p:') = 0
        ) AS c
        ALL INNER JOIN
        (
            SELECT pg, seq, quantileExact(0.5)(end_ns) AS med_end, count() AS members FROM collectives
            WHERE {w} AND end_ns > 0 AND position(pg, '/p2p:') = 0
            GROUP BY pg, seq HAVING members >= 2 ORDER BY seq DESC LIMIT {int(max_collectives)}
        ) AS g USING (pg, seq)
    ) AS cd
    ALL INNER JOIN (SELECT rank, any(host) AS host FROM ranks WHERE {w} GROUP BY rank) AS r USING (rank)
    GROUP BY host, pg, seq
)
GROUP BY host
ORDER BY host
""".strip()


def clock_offsets(store: Store, job_id: str, attempt: int = 0) -> dict[str, HostOffset]:
    """Per-host clock offsets of a job, relative to the median host."""
    rows = store.query(offsets_sql(job_id, attempt)).rows()
    if not rows:
        return {}
    raw = {str(h): (int(o), int(n), int(sp)) for h, o, n, sp in rows}
    ref = sorted(o for o, _, _ in raw.values())[len(raw) // 2]
    return {h: HostOffset(h, o - ref, n, sp) for h, (o, n, sp) in raw.items()}


def rank_offsets(store: Store, job_id: str, attempt: int, offsets: dict[str, HostOffset]) -> dict[int, int]:
    """Offsets per rank (the rank's host's offset)."""
    hosts = rank_hosts(store, job_id, attempt)
    return {r: offsets[h].offset_ns for r, h in hosts.items() if h in offsets}
