"""Findings from a job's profiler traces (the CUDA timing view): what a trace shows wrong.

- ``trace_idle``: a rank whose GPU sits idle far more of the profiler window than its peers' (the
  rank waits on its host: data loading, Python, launches) — at least ``idle_gap_pp`` percentage
  points above the peers' median idle and 1.5x it. Needs 3 or more traced ranks.
- ``kernel_straggler``: a rank on which the same computation kernel runs slower than on its peers
  (a slow or throttled GPU shows in every kernel it runs): the rank's mean duration of a kernel at
  least ``kernel_slowdown`` times the peers' median, over kernels each launched ``min_launches``
  times on every rank, weighted by the time they take. Needs 3 or more traced ranks.
- ``exposed_communication``: communication kernels running with no computation beside them for at
  least ``exposed_comm_pct`` % of a rank's profiler window (overlap of communication with compute
  is what hides it; HTA's comm/comp overlap).

Metrics come from :mod:`ranklens.analyzers.traces` (SQL in the store); this module only decides.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from ranklens.analyzers.findings import Finding, Severity, Suspect, finding_id
from ranklens.analyzers.traces import (
    RankBreakdown,
    kernel_launches,
    temporal_breakdown,
    trace_span,
)
from ranklens.store.api import Store

__all__ = ["KernelStraggler", "TraceThresholds", "kernel_stragglers", "trace_findings"]

DETECTOR = "traces"


@dataclass(frozen=True)
class TraceThresholds:
    """When a trace metric becomes a finding (see the module docstring)."""

    idle_gap_pp: float = 20.0
    exposed_comm_pct: float = 10.0
    kernel_slowdown: float = 1.2
    min_launches: int = 5


@dataclass(frozen=True)
class KernelStraggler:
    """A rank whose computation kernels run slower than the same kernels on its peers."""

    rank: int
    slowdown: float  # time-weighted mean of (rank's mean / peers' median) over the compared kernels
    kernels: int  # kernels compared
    excess_us: float  # time the rank spent beyond the peers' median, over its launches of them
    worst_kernel: str
    worst_slowdown: float


def kernel_stragglers(
    store: Store,
    job_id: str,
    attempt: int = 0,
    ranks: Sequence[int] | None = None,
    *,
    min_launches: int = 5,
) -> list[KernelStraggler]:
    """Every traced rank's kernel slowdown against its peers (largest first); empty with fewer
    than 3 ranks (two ranks cannot say which one is slow)."""
    per_kernel = kernel_launches(store, job_id, attempt, ranks)
    all_ranks = sorted({r for by_rank in per_kernel.values() for r in by_rank})
    if len(all_ranks) < 3:
        return []
    ratio_sum: dict[int, float] = dict.fromkeys(all_ranks, 0.0)
    weight: dict[int, float] = dict.fromkeys(all_ranks, 0.0)
    excess: dict[int, float] = dict.fromkeys(all_ranks, 0.0)
    kernels: dict[int, int] = dict.fromkeys(all_ranks, 0)
    worst: dict[int, tuple[float, str]] = {r: (0.0, "") for r in all_ranks}
    for name, by_rank in per_kernel.items():
        if len(by_rank) != len(all_ranks) or min(n for n, _ in by_rank.values()) < min_launches:
            continue  # compare a kernel only where every rank runs it often enough
        median = statistics.median(m for _, m in by_rank.values())
        if median <= 0:
            continue
        for r, (n, mean) in by_rank.items():
            ratio = mean / median
            w = n * median  # the time the kernel should take on this rank
            ratio_sum[r] += ratio * w
            weight[r] += w
            excess[r] += n * (mean - median)
            kernels[r] += 1
            if ratio > worst[r][0]:
                worst[r] = (ratio, name)
    out = [
        KernelStraggler(r, ratio_sum[r] / weight[r], kernels[r], excess[r], worst[r][1], worst[r][0])
        for r in all_ranks
        if weight[r] > 0
    ]
    return sorted(out, key=lambda k: -k.slowdown)


def trace_findings(
    store: Store,
    job_id: str,
    attempt: int = 0,
    ranks: Sequence[int] | None = None,
    *,
    thresholds: TraceThresholds | None = None,
    breakdown: list[RankBreakdown] | None = None,
) -> list[Finding]:
    """The findings the job's profiler traces support (possibly none).

    Raises:
        NotFound: no trace events of this job.
    """
    th = thresholds or TraceThresholds()
    rows = breakdown if breakdown is not None else temporal_breakdown(store, job_id, attempt, ranks)
    span = trace_span(store, job_id, attempt, ranks)
    window_s = max(span.end_ns - span.start_ns, 0) / 1e9
    if span.first_step < 0:
        steps = "the profiler window"
    elif span.first_step == span.last_step:
        steps = f"profiler step {span.first_step}"
    else:
        steps = f"profiler steps {span.first_step}-{span.last_step}"

    def finding(kind: str, key: str, severity: Severity, confidence: float, title: str, **kw: object) -> Finding:
        return Finding(
            id=finding_id(job_id, attempt, kind, key),
            job_id=job_id,
            attempt=attempt,
            kind=kind,
            severity=severity,
            confidence=confidence,
            title=title,
            first_seen_step=span.first_step,
            last_seen_step=span.last_step,
            first_seen_ns=span.start_ns,
            last_seen_ns=span.end_ns,
            detector=DETECTOR,
            **kw,  # type: ignore[arg-type]
        )

    out: list[Finding] = []
    if len(rows) >= 3:
        for b in rows:
            peers = [p.idle_time_pctg for p in rows if p.rank != b.rank]
            median = statistics.median(peers)
            gap = b.idle_time_pctg - median
            if gap >= th.idle_gap_pp and b.idle_time_pctg >= 1.5 * median:
                lost_us = gap / 100.0 * b.kernel_time_us
                out.append(
                    finding(
                        "trace_idle",
                        str(b.rank),
                        Severity.WARNING,
                        min(0.95, 0.5 + gap / 100.0),
                        f"rank {b.rank}'s GPU is idle {b.idle_time_pctg:.1f}% of {steps}, its peers "
                        f"{median:.1f}% (median): the rank waits on its host",
                        suspects=(Suspect(b.rank),),
                        impact_s=lost_us / 1e6,
                        step_time_pct=gap,
                        evidence={
                            "idle_time_pctg": b.idle_time_pctg,
                            "peers_median_idle_time_pctg": median,
                            "kernel_time_us": b.kernel_time_us,
                            "window_s": window_s,
                        },
                    )
                )
        for k in kernel_stragglers(store, job_id, attempt, ranks, min_launches=th.min_launches):
            if k.slowdown < th.kernel_slowdown:
                break
            out.append(
                finding(
                    "kernel_straggler",
                    str(k.rank),
                    Severity.CRITICAL if k.slowdown >= 1.5 else Severity.WARNING,
                    min(0.95, 0.5 + (k.slowdown - 1.0)),
                    f"rank {k.rank}'s kernels run {k.slowdown:.2f}x as long as the same kernels on its peers "
                    f"({k.kernels} kernels compared; worst {k.worst_kernel[:60]} {k.worst_slowdown:.2f}x)",
                    suspects=(Suspect(k.rank),),
                    impact_s=k.excess_us / 1e6,
                    step_time_pct=100.0 * (k.slowdown - 1.0),
                    evidence={
                        "slowdown": round(k.slowdown, 4),
                        "kernels_compared": k.kernels,
                        "excess_us": round(k.excess_us, 1),
                        "worst_kernel": k.worst_kernel,
                        "worst_slowdown": round(k.worst_slowdown, 4),
                    },
                )
            )
    exposed = []
    for b in rows:
        exposed_us = b.comm_time_us - b.comp_comm_overlap_us
        pct = 100.0 * exposed_us / b.kernel_time_us if b.kernel_time_us else 0.0
        if pct >= th.exposed_comm_pct:
            exposed.append((b, exposed_us, pct))
    if exposed:  # one finding for the job: on a 10,000-rank job it is usually every rank
        worst = max(exposed, key=lambda e: e[2])
        who = ", ".join(str(b.rank) for b, _, _ in exposed[:8]) + (" ..." if len(exposed) > 8 else "")
        out.append(
            finding(
                "exposed_communication",
                "job",
                Severity.WARNING,
                0.8,
                f"communication runs with no computation beside it for up to {worst[2]:.1f}% of {steps} "
                f"(rank {worst[0].rank}, comm/comp overlap {worst[0].comp_comm_overlap_pctg:.1f}%); "
                f"{len(exposed)} of {len(rows)} ranks: {who}",
                suspects=tuple(Suspect(b.rank) for b, _, _ in exposed),
                impact_s=sum(us for _, us, _ in exposed) / 1e6,
                step_time_pct=worst[2],
                evidence={
                    "exposed_comm_pctg": {str(b.rank): round(p, 2) for b, _, p in exposed},
                    "comp_comm_overlap_pctg": {str(b.rank): b.comp_comm_overlap_pctg for b, _, _ in exposed},
                    "window_s": window_s,
                },
            )
        )
    return out
