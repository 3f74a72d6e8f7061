"""Slow links: localize a degraded NIC, cable or path from the arrival ledger.

Metric (SQL, runs inside the store on chDB and on a ClickHouse server >= 18.16): for every
collective ``(pg, seq)``, the *transfer time after the last arrival*

    xfer = done - max(enter_ns)       done = each member's end_ns, their median (a pair: the later)

which is pure communication: a rank that arrives late (a compute straggler) makes the others
*wait*, but does not lengthen ``xfer``. ``xfer`` is normalized by the bytes every member moves
through its link in the usual algorithm (the "bus bytes" of nccl-tests) into an effective
bandwidth ``bw = bus_bytes / xfer``, with ``n`` members and ``nbytes`` the local input:

    all_reduce (ring)          2 (n-1)/n x nbytes
    all_gather, gather/scatter (n-1)   x nbytes    (= (n-1)/n of the gathered output)
    reduce_scatter, all_to_all (n-1)/n x nbytes    (nbytes is the whole input)
    broadcast, reduce          1        x nbytes
    send/recv (p2p pair)       1        x nbytes    a direct measurement of one link

Barriers, collectives under ``min_bytes`` (latency bound) and each group's first collective
(connection set-up: gloo and NCCL connect lazily) are left out. The per-collective
rows are aggregated in SQL per (group, op family, size bucket, window of steps) into *cells*:
median bandwidth, median transfer and arrival spread, sums for the impact. Python maps groups to
nodes (``ranks.host``) and hands the cells to a detector (:mod:`ranklens.analyzers.tomography`)
that decides; :func:`find_slow_links` turns its decisions into findings.

Async collectives that queue behind each other (DDP buckets) inflate ``xfer`` of the later ones
equally on every group, which the comparison between groups cancels. Arrival and end times come
from each rank's clock: across hosts they need the clock alignment of the stragglers analyzer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ranklens.analyzers.blame import P2P_MARK
from ranklens.analyzers.contention import Contention, discount_links
from ranklens.analyzers.findings import Finding, Severity, Suspect, finding_id
from ranklens.analyzers.ranks import rank_hosts
from ranklens.analyzers.tomography import (
    CongestionDetection,
    GroupTestingDetector,
    LinkDetection,
    LinkDetector,
    LinkReport,
    cell_classes,
    node_key,
    value_codes,
)
from ranklens.store.api import QueryResult, Store
from ranklens.store.api import sql_escape as _esc

__all__ = [
    "BUS_FACTORS",
    "GroupInfo",
    "LinkMetrics",
    "compute_link_metrics",
    "find_slow_links",
    "link_metric_sql",
    "to_findings",
    "transfer_sql",
]

DEFAULT_MIN_BYTES = 1 << 18  # 256 KiB: below it a transfer is latency, not bandwidth
DEFAULT_MAX_WINDOWS = 20
# Grouping a 10,240-rank job's 8.7M ledger rows by collective (~2.3M of them, a dozen aggregate
# states each) peaked at ~1.5 GB in chDB in one query (issue 18). Past this many rows the link metric
# runs in parts, each over the process groups of one hash bucket: ~1 GB at three parts, ~1 s more.
PART_ROWS = 3_000_000
CRITICAL_PCT = 20.0

#: bus bytes per input byte, as a function of the group size ``n`` (documented above)
BUS_FACTORS: dict[str, str] = {
    "all_reduce": "2 (n-1)/n",
    "all_gather": "(n-1)",
    "gather": "(n-1)",
    "scatter": "(n-1)",
    "reduce_scatter": "(n-1)/n",
    "all_to_all": "(n-1)/n",
    "broadcast": "1",
    "reduce": "1",
    "p2p": "1",
}

_FAMILY_SQL = """multiIf(pg LIKE '%/p2p:%', 'p2p',
                 any(op) = 'all_reduce', 'all_reduce',
                 any(op) IN ('all_gather', 'all_gather_into_tensor'), 'all_gather',
                 any(op) IN ('reduce_scatter', 'reduce_scatter_tensor'), 'reduce_scatter',
                 any(op) IN ('all_to_all', 'all_to_all_single'), 'all_to_all',
                 any(op) IN ('broadcast', 'reduce', 'gather', 'scatter'), any(op),
                 '')"""

_BUS_SQL = """multiIf(fam = 'all_reduce', 2.0 * (members - 1) / members,
                      fam IN ('all_gather', 'gather', 'scatter'), toFloat64(members - 1),
                      fam IN ('reduce_scatter', 'all_to_all'), toFloat64(members - 1) / members,
                      1.0)"""


def transfer_sql(
    job_id: str,
    attempt: int,
    *,
    min_bytes: int = DEFAULT_MIN_BYTES,
    step_from: int | None = None,
    step_to: int | None = None,
    part: tuple[int, int] | None = None,
) -> str:
    """THE transfer metric of one collective, one row per completed ``(pg, seq)`` with at least two
    members (barriers, each group's first collective and those under ``min_bytes`` left out):
    ``fam`` (op family), ``members``, ``a_rank``/``b_rank`` (lowest and highest member), ``c_nbytes``,
    ``c_step``, ``first_enter_ns``, ``last_enter_ns``, ``done_ns``, ``xfer_ns`` (transfer after the
    last arrival), ``spread_ns`` (arrival spread), ``bus_bytes`` (:data:`BUS_FACTORS`) and
    ``bw_Bps`` = bus bytes / transfer. With ``step_from`` only collectives of steps
    ``step_from..step_to``; with ``part=(i, k)`` only those of the process groups in hash bucket
    ``i`` of ``k`` (a collective is one group's, so the parts hold every row once). The analyzer's
    cells (:func:`link_metric_sql`) and the dashboards' bandwidths aggregate these rows."""
    steps = ""
    if step_from is not None:
        steps = f" AND c_step >= {int(step_from)}" + (f" AND c_step <= {int(step_to)}" if step_to is not None else "")
    bucket = f" AND cityHash64(pg) % {int(part[1])} = {int(part[0])}" if part is not None and part[1] > 1 else ""
    return f"""
SELECT pg, seq, fam, members, a_rank, b_rank, c_nbytes, c_step, first_enter_ns, last_enter_ns, done_ns,
       greatest(done_ns - last_enter_ns, 1000) AS xfer_ns,
       last_enter_ns - first_enter_ns AS spread_ns,
       c_nbytes * {_BUS_SQL} AS bus_bytes,
       bus_bytes * 1e9 / xfer_ns AS bw_Bps
FROM
(
    SELECT pg, seq,
           {_FAMILY_SQL} AS fam,
           count() AS members,
           min(rank) AS a_rank,
           max(rank) AS b_rank,
           max(nbytes) AS c_nbytes,
           max(step) AS c_step,
           min(enter_ns) AS first_enter_ns,
           max(enter_ns) AS last_enter_ns,
           if(count() <= 2, max(end_ns), quantileExact(0.5)(end_ns)) AS done_ns
    FROM collectives
    WHERE job_id = '{_esc(job_id)}' AND attempt = {int(attempt)} AND op != 'barrier'{bucket}
    GROUP BY pg, seq
    HAVING members >= 2 AND min(end_ns) > 0 AND c_nbytes >= {int(min_bytes)} AND seq > 1{steps}
)
WHERE fam != ''
""".strip()


def link_metric_sql(
    job_id: str,
    attempt: int,
    *,
    window_steps: int = 1,
    window_ns: int = 0,
    t0_ns: int = 0,
    min_bytes: int = DEFAULT_MIN_BYTES,
    part: tuple[int, int] | None = None,
) -> str:
    """The link metric: one row per (pg, op family, size bucket, window) cell of :func:`transfer_sql`
    (of one part of the process groups with ``part``: a cell is one group's, so whole in its part).

    Args:
        job_id, attempt: the job.
        window_steps: cells span this many steps (collectives outside a step are left out)...
        window_ns: ...or, when > 0, this many nanoseconds from ``t0_ns`` (jobs without steps).
        t0_ns: origin of time windows.
        min_bytes: collectives moving fewer bytes are left out.
    """
    if window_ns > 0:
        win, step_from = f"intDiv(last_enter_ns - {int(t0_ns)}, {int(window_ns)})", None
    else:
        win, step_from = f"intDiv(c_step, {max(1, int(window_steps))})", 0
    per_collective = transfer_sql(job_id, attempt, min_bytes=min_bytes, step_from=step_from, part=part)
    inner = "\n".join("        " + line for line in per_collective.splitlines())
    return f"""
SELECT pg, fam, size_bucket, win,
       count() AS collectives,
       max(members) AS n_members,
       quantileExact(0.5)(bw_Bps) AS bw_median_Bps,
       quantileExact(0.5)(xfer_ns) AS xfer_median_ns,
       sum(xfer_ns) AS sum_xfer_ns,
       sum(bus_bytes) AS sum_bus_bytes,
       quantileExact(0.5)(spread_ns) AS spread_median_ns,
       min(first_enter_ns) AS cell_first_ns,
       max(done_ns) AS cell_last_ns,
       min(c_step) AS min_step,
       max(c_step) AS max_step
FROM
(
    SELECT pg, fam, members, c_step, first_enter_ns, done_ns, xfer_ns, spread_ns, bus_bytes, bw_Bps,
           toInt64(floor(log2(toFloat64(c_nbytes)) / 2)) AS size_bucket,
           {win} AS win
    FROM
    (
{inner}
    )
)
GROUP BY pg, fam, size_bucket, win
ORDER BY win, pg, fam, size_bucket
""".strip()


@dataclass(frozen=True)
class GroupInfo:
    """A process group (or a p2p pair ``src->dst``): its ranks and the nodes they are on."""

    pg: str
    ranks: tuple[int, ...]
    nodes: tuple[str, ...]
    name: str = ""

    @property
    def is_p2p(self) -> bool:
        """True for a point-to-point pair (``<pg>/p2p:<src>-><dst>``)."""
        return P2P_MARK in self.pg


@dataclass(frozen=True)
class LinkMetrics:
    """The link metric of one job attempt: parallel arrays, one entry per cell.

    A cell is one (process group, op family, size bucket, window). ``bw_Bps`` is the median
    effective bandwidth (bus bytes / transfer after the last arrival) of the cell's collectives,
    ``xfer_s`` their median transfer time, ``spread_s`` their median arrival spread (last minus
    first arrival: the straggler signal, reported beside the link signal).
    """

    job_id: str
    attempt: int
    pg: np.ndarray
    family: np.ndarray
    size_bucket: np.ndarray
    window: np.ndarray
    count: np.ndarray
    members: np.ndarray
    bw_Bps: np.ndarray
    xfer_s: np.ndarray
    sum_xfer_s: np.ndarray
    sum_bus_bytes: np.ndarray
    spread_s: np.ndarray
    first_ns: np.ndarray
    last_ns: np.ndarray
    min_step: np.ndarray
    max_step: np.ndarray
    groups: dict[str, GroupInfo]
    hosts: dict[int, str]
    window_steps: int
    window_ns: int
    sql: str

    def __len__(self) -> int:
        return len(self.pg)

    def nodes_of(self, i: int) -> tuple[str, ...]:
        """The nodes of cell ``i``'s group."""
        g = self.groups.get(str(self.pg[i]))
        return g.nodes if g else ()


def _group_infos(store: Store, job_id: str, attempt: int, pgs: set[str], hosts: dict[int, str]) -> dict[str, GroupInfo]:
    where = f"job_id = '{_esc(job_id)}' AND attempt = {int(attempt)}"
    r = store.query(
        f"SELECT pg, any(name) AS pg_name, any(ranks) AS members FROM process_groups WHERE {where} GROUP BY pg"
    )
    known = {str(pg): (str(name), tuple(sorted(int(x) for x in members))) for pg, name, members in r.rows()}
    missing = [pg for pg in pgs if P2P_MARK not in pg and pg not in known]
    if missing:  # a group the tracer did not register: its members are whoever used it
        in_list = ", ".join(f"'{_esc(pg)}'" for pg in missing)
        q = store.query(
            f"SELECT pg, groupUniqArray(rank) AS members FROM collectives WHERE {where} "
            f"AND pg IN ({in_list}) GROUP BY pg"
        )
        known.update({str(pg): ("", tuple(sorted(int(x) for x in m))) for pg, m in q.rows()})
    out = {}
    ranks: tuple[int, ...]
    for pg in pgs:
        if P2P_MARK in pg:
            pair = pg.rsplit(P2P_MARK, 1)[1]
            src, dst = (int(x) for x in pair.split("->"))
            name, ranks = f"p2p {src}->{dst}", (src, dst)
        else:
            name, ranks = known.get(pg, ("", ()))
        nodes = tuple(sorted({hosts.get(r) or f"rank{r}" for r in ranks}, key=node_key))
        out[pg] = GroupInfo(pg, ranks, nodes, name)
    return out


def compute_link_metrics(
    store: Store,
    job_id: str,
    attempt: int = 0,
    *,
    min_bytes: int = DEFAULT_MIN_BYTES,
    window_steps: int = 0,
    max_windows: int = DEFAULT_MAX_WINDOWS,
) -> LinkMetrics:
    """Run the link metric in the store and shape it as cells for a detector.

    Args:
        store: where the job's ledger is.
        job_id, attempt: the job.
        min_bytes: leave out collectives moving fewer bytes (latency bound).
        window_steps: steps per window; 0 picks one so that there are at most ``max_windows``.
            A job without steps gets time windows instead.
        max_windows: see ``window_steps``.
    """
    where = f"job_id = '{_esc(job_id)}' AND attempt = {int(attempt)}"
    span = store.query(
        f"SELECT min(enter_ns) AS t0, max(enter_ns) AS t1, minIf(step, step >= 0) AS s0, "
        f"maxIf(step, step >= 0) AS s1, countIf(step >= 0) AS with_step, count() AS n FROM collectives WHERE {where}"
    ).rows()[0]
    t0, t1, _s0, s1, with_step, n_rows = (int(x or 0) for x in span)
    if with_step > 0:
        w_steps = window_steps or max(1, math.ceil((s1 + 1) / max(1, max_windows)))
        w_ns = 0
    else:
        w_steps = 0
        w_ns = max(100_000_000, math.ceil(max(t1 - t0, 1) / max(1, max_windows)))

    def cells(part: tuple[int, int] | None = None) -> str:
        return link_metric_sql(
            job_id, attempt, window_steps=w_steps, window_ns=w_ns, t0_ns=t0, min_bytes=min_bytes, part=part
        )

    sql = cells()
    k = max(1, math.ceil(n_rows / PART_ROWS))
    if k == 1:
        res = store.query(sql)
    else:  # the parts' rows in the order of the one query's ORDER BY (bytes order for strings, as ClickHouse's)
        whole = QueryResult.concat(store.query(cells((i, k))) for i in range(k))
        res = QueryResult(whole.arrow.sort_by([(c, "ascending") for c in ("win", "pg", "fam", "size_bucket")]))
    hosts = rank_hosts(store, job_id, attempt)
    pgs = res.column("pg").astype(object) if res.num_rows else np.array([], dtype=object)
    groups = _group_infos(store, job_id, attempt, {str(p) for p in pgs}, hosts)

    def col(name: str, dtype: Any) -> np.ndarray:
        return res.column(name).astype(dtype) if res.num_rows else np.array([], dtype=dtype)

    return LinkMetrics(
        job_id=job_id,
        attempt=attempt,
        pg=pgs,
        family=col("fam", object),
        size_bucket=col("size_bucket", np.int64),
        window=col("win", np.int64),
        count=col("collectives", np.int64),
        members=col("n_members", np.int64),
        bw_Bps=col("bw_median_Bps", np.float64),
        xfer_s=col("xfer_median_ns", np.float64) / 1e9,
        sum_xfer_s=col("sum_xfer_ns", np.float64) / 1e9,
        sum_bus_bytes=col("sum_bus_bytes", np.float64),
        spread_s=col("spread_median_ns", np.float64) / 1e9,
        first_ns=col("cell_first_ns", np.int64),
        last_ns=col("cell_last_ns", np.int64),
        min_step=col("min_step", np.int64),
        max_step=col("max_step", np.int64),
        groups=groups,
        hosts=hosts,
        window_steps=w_steps,
        window_ns=w_ns,
        sql=sql,
    )


def _could_be_slow(m: LinkMetrics, slow_ratio: float) -> bool:
    """False when no cell can be a slow test: within every class of comparable cells (op family,
    group size, number of nodes, size bucket: the classes of :class:`GroupTestingDetector`), the
    fastest cell is less than ``slow_ratio`` times faster than the slowest. A class's baseline is a
    quantile of its cells' bandwidths, never above their maximum, and a slow test is at least
    ``slow_ratio`` below its baseline; without a slow test there is neither a slow link nor a
    congested period. A healthy 10,240-rank job's ~385k cells are decided here with a few array
    operations instead of the detector's per-group work (issue 18)."""
    if len(m) == 0:
        return False
    pg_code, pgs = value_codes(m.pg)  # per distinct group, not per cell
    n_nodes = np.array([len(g.nodes) if (g := m.groups.get(str(p))) else 0 for p in pgs], dtype=np.int64)[pg_code]
    cls = cell_classes(m, n_nodes)
    bw = m.bw_Bps
    top = np.full(int(cls.max()) + 1, -np.inf)
    np.fmax.at(top, cls, bw)  # a NaN bandwidth gives its class no baseline: it cannot raise one
    with np.errstate(divide="ignore", invalid="ignore"):
        bound = np.where(np.isfinite(bw) & (bw > 0), top[cls] / bw, 0.0)
    # a hair of margin for the rounding of the detector's quantile
    return bool((bound >= slow_ratio * (1.0 - 1e-9)).any())


# ----------------------------------------------------------------------------------- presenting


def _rate(bps: float) -> str:
    if not np.isfinite(bps):
        return "?"
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.1f} {unit}"
    return f"{bps:.0f} B/s"


def _duration(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def _window_walls(m: LinkMetrics) -> dict[int, float]:
    out: dict[int, float] = {}
    for w in np.unique(m.window):
        sel = m.window == w
        out[int(w)] = max(0.0, float(m.last_ns[sel].max() - m.first_ns[sel].min()) / 1e9)
    return out


def _cell_row(m: LinkMetrics, r: LinkReport, i: int) -> dict[str, Any]:
    g = m.groups.get(str(m.pg[i]))
    verdict = {1: "slow", -1: "fast"}.get(int(r.verdict[i]), "unclear")
    return {
        "pg": str(m.pg[i]),
        "group": g.name if g else "",
        "op": str(m.family[i]),
        "ranks": list(g.ranks) if g else [],
        "nodes": list(g.nodes) if g else [],
        "window": int(m.window[i]),
        "steps": [int(m.min_step[i]), int(m.max_step[i])],
        "collectives": int(m.count[i]),
        "bandwidth_MBps": round(float(m.bw_Bps[i]) / 1e6, 3),
        "baseline_MBps": round(float(r.baseline_Bps[i]) / 1e6, 3),
        "slowdown": round(float(r.ratio[i]), 2),
        "transfer_ms": round(float(m.xfer_s[i]) * 1e3, 3),
        "arrival_spread_ms": round(float(m.spread_s[i]) * 1e3, 3),
        "verdict": verdict,
    }


def _per_group(m: LinkMetrics, r: LinkReport, cells: np.ndarray, limit: int = 50) -> list[dict[str, Any]]:
    """Cells summarized per group (the first ``limit`` groups by name): median bandwidth, baseline,
    slowdown, transfer and arrival spread."""
    by_pg: dict[str, list[int]] = {}
    for i in cells:
        by_pg.setdefault(str(m.pg[i]), []).append(int(i))
    out = []
    for pg in sorted(by_pg)[:limit]:
        sel = np.asarray(by_pg[pg])
        g = m.groups.get(pg)
        out.append(
            {
                "pg": pg,
                "group": g.name if g else "",
                "op": sorted({str(x) for x in m.family[sel]}),
                "ranks": list(g.ranks) if g else [],
                "nodes": list(g.nodes) if g else [],
                "cells": len(sel),
                "bandwidth_MBps": round(float(np.median(m.bw_Bps[sel])) / 1e6, 3),
                "baseline_MBps": round(float(np.median(r.baseline_Bps[sel])) / 1e6, 3),
                "slowdown": round(float(np.median(r.ratio[sel])), 2),
                "transfer_ms": round(float(np.median(m.xfer_s[sel])) * 1e3, 3),
                "arrival_spread_ms": round(float(np.median(m.spread_s[sel])) * 1e3, 3),
            }
        )
    return out


RESOLVED_AFTER_WINDOWS = 2


def _ongoing(m: LinkMetrics, cells: np.ndarray, last_slow: int) -> bool:
    """Whether a slowdown seen in ``cells`` up to window ``last_slow`` is still going on: it is over
    once its own groups were measured in ``RESOLVED_AFTER_WINDOWS`` later windows (at their normal
    speed, or they would be slow cells). A later window the slow groups have not reported yet proves
    nothing: live, the fast groups finish a window before the slow ones do, and counting the newest
    window of any group resolved a throttled link's finding while it was still throttled."""
    pg_code = value_codes(m.pg)[0]  # integers: np.isin over ~385k strings took ~0.25 s
    later = np.isin(pg_code, np.unique(pg_code[cells])) & (m.window > last_slow)
    return len(np.unique(m.window[later])) < RESOLVED_AFTER_WINDOWS


def _link_finding(
    m: LinkMetrics, r: LinkReport, d: LinkDetection, detector: LinkDetector, walls: dict[int, float]
) -> Finding:
    cells = np.asarray(d.slow_cells, dtype=np.int64)
    fast = np.asarray(d.fast_cells, dtype=np.int64)
    base = r.baseline_Bps[cells]
    excess = np.maximum(m.sum_xfer_s[cells] - m.sum_bus_bytes[cells] / base, 0.0)
    per_window: dict[int, float] = {}
    for i, x in zip(cells, excess):
        w = int(m.window[i])
        per_window[w] = max(per_window.get(w, 0.0), float(x))  # groups run side by side
    impact_s = float(sum(per_window.values()))
    impact_gpu_s = float((excess * m.members[cells]).sum())
    wall = sum(walls.get(w, 0.0) for w in per_window)
    pct = 100.0 * impact_s / wall if wall > 0 else 0.0
    bw = float(np.median(m.bw_Bps[cells]))
    baseline = float(np.median(base))
    slowdown = float(np.median(r.ratio[cells]))
    windows = sorted(per_window)
    ongoing = _ongoing(m, cells, windows[-1])
    by_step = m.window_steps > 0
    first_step = int(m.min_step[cells].min()) if by_step else -1
    last_step = int(m.max_step[cells].max()) if by_step else -1
    link = d.link
    ranks = sorted(rk for rk, h in m.hosts.items() if h in link.nodes)
    groups = {str(m.pg[i]) for i in cells}
    since = f"since step {first_step}" if by_step else f"in {len(windows)} windows of {m.window_ns / 1e9:.1f} s"
    title = (
        f"slow link {link.name} ({link.describe()}): {len(groups)} groups through it moved data at "
        f"{_rate(bw)} vs {_rate(baseline)} on comparable groups ({slowdown:.1f}x slower), {since}; "
        "slow transfer after every rank arrived, not a late arriver"
    )
    p2p = [_cell_row(m, r, int(i)) for i in cells if m.groups.get(str(m.pg[i])) and m.groups[str(m.pg[i])].is_p2p]
    return Finding(
        id=finding_id(m.job_id, m.attempt, "slow_link", f"link:{link.name}"),
        job_id=m.job_id,
        attempt=m.attempt,
        kind="slow_link",
        severity=Severity.CRITICAL if pct >= CRITICAL_PCT else Severity.WARNING,
        confidence=round(d.confidence, 3),
        title=title,
        suspects=tuple(Suspect(rank=rk, node=m.hosts.get(rk, ""), link=tuple(link.name.split("<->"))) for rk in ranks),
        first_seen_step=first_step,
        last_seen_step=last_step,
        first_seen_ns=int(m.first_ns[cells].min()),
        last_seen_ns=int(m.last_ns[cells].max()),
        impact_s=impact_s,
        impact_gpu_s=impact_gpu_s,
        step_time_pct=pct,
        evidence={
            "link": link.name,
            "link_kind": link.kind,
            "nodes": list(link.nodes),
            "suspect_links": [link.name],
            "bandwidth_MBps": round(bw / 1e6, 3),
            "baseline_MBps": round(baseline / 1e6, 3),
            "slowdown": round(slowdown, 2),
            "slow_tests": len(cells),
            "fast_tests": len(fast),
            "purity": round(d.purity, 3),
            "independent_groups": d.independent_groups,
            "windows": windows,
            "window_steps": m.window_steps,
            "slow_groups": _per_group(m, r, cells)[:50],
            "fast_groups_through_other_links": _per_group(m, r, np.asarray(r.reference_cells(d), dtype=np.int64))[:10],
            "exonerating_groups": _per_group(m, r, fast)[:20],
            "p2p_pairs": p2p[:50],
            "transfer_vs_arrival": {
                "median_transfer_ms": round(float(np.median(m.xfer_s[cells])) * 1e3, 3),
                "median_arrival_spread_ms": round(float(np.median(m.spread_s[cells])) * 1e3, 3),
            },
            "bus_bytes_formula": BUS_FACTORS,
            "sql": m.sql,
            "thresholds": detector.thresholds() if hasattr(detector, "thresholds") else {},
        },
        state="open" if ongoing else "resolved",
        detector=detector.name,
    )


def _congestion_finding(
    m: LinkMetrics, r: LinkReport, c: CongestionDetection, detector: LinkDetector, walls: dict[int, float]
) -> Finding:
    cells = np.asarray(c.cells, dtype=np.int64)
    base = r.baseline_Bps[cells]
    excess = np.maximum(m.sum_xfer_s[cells] - m.sum_bus_bytes[cells] / base, 0.0)
    per_window: dict[int, float] = {}
    for i, x in zip(cells, excess):
        per_window[int(m.window[i])] = max(per_window.get(int(m.window[i]), 0.0), float(x))
    impact_s = float(sum(per_window.values()))
    wall = sum(walls.get(w, 0.0) for w in per_window)
    by_step = m.window_steps > 0
    first_step = int(m.min_step[cells].min()) if by_step else -1
    last_step = int(m.max_step[cells].max()) if by_step else -1
    span = f"steps {first_step}-{last_step}" if by_step else "a time window"
    title = (
        f"network congestion: {100 * c.slow_share:.0f}% of inter-node groups ran {c.slowdown:.1f}x slower "
        f"across {c.nodes} nodes in {span}; no single node or link explains it"
    )
    return Finding(
        id=finding_id(m.job_id, m.attempt, "network_congestion", f"windows:{c.windows[0]}"),
        job_id=m.job_id,
        attempt=m.attempt,
        kind="network_congestion",
        severity=Severity.WARNING,
        confidence=round(min(1.0, c.slow_share), 3),
        title=title,
        suspects=(),
        first_seen_step=first_step,
        last_seen_step=last_step,
        first_seen_ns=int(m.first_ns[cells].min()),
        last_seen_ns=int(m.last_ns[cells].max()),
        impact_s=impact_s,
        impact_gpu_s=float((excess * m.members[cells]).sum()),
        step_time_pct=100.0 * impact_s / wall if wall > 0 else 0.0,
        evidence={
            "windows": list(c.windows),
            "slow_share": round(c.slow_share, 3),
            "slowdown": round(c.slowdown, 2),
            "nodes": c.nodes,
            "slow_groups": _per_group(m, r, cells, limit=30),
            "sql": m.sql,
            "thresholds": detector.thresholds() if hasattr(detector, "thresholds") else {},
        },
        state="open" if _ongoing(m, cells, int(c.windows[-1])) else "resolved",
        detector=detector.name,
    )


def to_findings(metrics: LinkMetrics, report: LinkReport, detector: LinkDetector) -> list[Finding]:
    """Findings of a detector's report: one ``slow_link`` per link, one ``network_congestion`` per
    congested period, most costly first."""
    walls = _window_walls(metrics)
    out = [_link_finding(metrics, report, d, detector, walls) for d in report.links]
    out += [_congestion_finding(metrics, report, c, detector, walls) for c in report.congestion]
    return sorted(out, key=lambda f: (-f.impact_s, f.id))


def find_slow_links(
    store: Store,
    job_id: str,
    attempt: int = 0,
    *,
    detector: LinkDetector | None = None,
    min_bytes: int = DEFAULT_MIN_BYTES,
    window_steps: int = 0,
    contention: list[Contention] | None = None,
) -> list[Finding]:
    """Slow-link and network-congestion findings of one job attempt, most costly first.

    Args:
        store: where the job's ledger is.
        job_id, attempt: the job.
        detector: decides from the metric (default: :class:`GroupTestingDetector`).
        min_bytes: collectives moving fewer bytes are latency bound and left out.
        window_steps: steps per window (0: automatic, at most 20 windows).
        contention: a slow link that host CPU contention explains (a rank of the link's nodes
            whose threads waited for a CPU: :func:`ranklens.analyzers.contention.discount_links`)
            is not reported; a note about it is appended here.

    Returns:
        ``slow_link`` findings naming a node's network link (``node3<->network``), a link between
        two nodes (``node1<->node3``) or a node's intra-node link (``node3<->node3``), and
        ``network_congestion`` findings for periods that hit everyone, without suspects.
    """
    detector = detector or GroupTestingDetector()
    metrics = compute_link_metrics(store, job_id, attempt, min_bytes=min_bytes, window_steps=window_steps)
    if len(metrics) == 0:
        return []
    if isinstance(detector, GroupTestingDetector) and not _could_be_slow(metrics, detector.slow_ratio):
        return []  # no cell is slow enough against any baseline: the detector would find nothing
    findings = to_findings(metrics, detector.detect(metrics), detector)
    findings = [_refine_onset(store, metrics, f, min_bytes) for f in findings]
    return discount_links(store, findings, contention)


def _refine_onset(store: Store, m: LinkMetrics, f: Finding, min_bytes: int) -> Finding:
    """A slow link's onset to the step, not the window: a window that straddles the onset has the
    fast median of its first steps (the drill's throttle at step 8 was named "since step 10" with
    2-step windows). The slow groups' transfers of the window before the first slow one are read
    per step; the steps at its end whose median bandwidth is nearer the slow rate than the baseline
    (below their geometric mean) join the finding."""
    if f.kind != "slow_link" or m.window_steps <= 1 or f.first_seen_step <= 0:
        return f
    ev = f.evidence
    pgs = [g["pg"] for g in ev.get("slow_groups", [])]
    slow, base = float(ev.get("bandwidth_MBps") or 0.0), float(ev.get("baseline_MBps") or 0.0)
    if not pgs or not (0 < slow < base):
        return f
    cut = math.sqrt(slow * base) * 1e6
    lo = max(0, f.first_seen_step - m.window_steps)
    inner = transfer_sql(m.job_id, m.attempt, min_bytes=min_bytes, step_from=lo, step_to=f.first_seen_step - 1)
    in_pgs = ", ".join(f"'{_esc(p)}'" for p in pgs)
    rows = store.query(
        f"SELECT c_step, quantileExact(0.5)(bw_Bps) AS bw, min(first_enter_ns) AS t FROM ({inner}) "
        f"WHERE pg IN ({in_pgs}) GROUP BY c_step ORDER BY c_step"
    ).rows()
    per_step = {int(st): (float(bw), int(t)) for st, bw, t in rows}
    first, first_ns = f.first_seen_step, f.first_seen_ns
    while first - 1 in per_step and per_step[first - 1][0] < cut:
        first -= 1
        first_ns = per_step[first][1]
    if first == f.first_seen_step:
        return f
    title = f.title.replace(f"since step {f.first_seen_step}", f"since step {first}", 1)
    return replace(f, first_seen_step=first, first_seen_ns=min(first_ns, f.first_seen_ns), title=title)
