"""``ranklens analyze --traces``: the CUDA timing view of a job's profiler traces, as text or JSON.

The numbers are Holistic Trace Analysis' (same definitions and defaults, see
:mod:`ranklens.analyzers.traces`), for every traced rank side by side, plus the findings the traces
support (:mod:`ranklens.analyzers.trace_findings`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import click

from ranklens.errors import NotFound
from ranklens.store.api import sql_string

__all__ = ["analyze_traces"]

TOP_KERNELS = 5  # per rank and type in the text report (all of them in --json)


def analyze_traces(
    store: Any,
    job_id: str | None,
    attempt: int | None,
    ranks: Sequence[int],
    *,
    as_json: bool,
    save: bool,
) -> None:
    from ranklens.analyzers import save_findings
    from ranklens.analyzers import traces as T
    from ranklens.analyzers.trace_findings import trace_findings
    from ranklens.analyzers.trace_ledger import collective_kernels

    if job_id is None:
        latest = T.latest_trace_job(store)
        if latest is None:
            raise NotFound(
                f"the store {store.url} holds no profiler traces; "
                f"`ranklens ingest TRACE_DIR --format kineto --store {store.url}` loads torch.profiler traces"
            )
        job_id, found = latest
        attempt = found if attempt is None else attempt
    elif attempt is None:
        r = store.query(f"SELECT max(attempt), count() FROM trace_events WHERE job_id = {sql_string(job_id)}")
        top, n = r.rows()[0]
        if not n:
            raise NotFound(
                f"no profiler traces of job {job_id!r} in {store.url}; "
                f'`ranklens sql --store {store.url} "SELECT DISTINCT job_id FROM trace_events"` lists the traced jobs'
            )
        attempt = int(top)
    sel = list(ranks) or None
    window = T.trace_window(store, job_id, attempt, sel)
    breakdown, kernel_types = T.breakdowns(store, job_id, attempt, sel)
    kernels = T.kernel_breakdown(store, job_id, attempt, sel)
    idle = T.idle_time_breakdown(store, job_id, attempt, sel)
    launches = T.launch_stats(store, job_id, attempt, sel)
    queues = T.queue_length_summary(store, job_id, attempt, sel)
    ledger = T.ledger_window(store, job_id, attempt, sel)
    joined = collective_kernels(store, job_id, attempt, sel)
    findings = trace_findings(store, job_id, attempt, sel, breakdown=breakdown)
    if save:
        save_findings(store, findings)
    if as_json:
        out = {
            "job_id": job_id,
            "attempt": attempt,
            "ranks": list(window.ranks),
            "window": {"profiler_steps": window.profiler_steps, "last_step_left_out": window.windowed},
            "temporal_breakdown": [b.to_json() for b in breakdown],
            "kernel_type_breakdown": [k.to_json() for k in kernel_types],
            "kernel_breakdown": [k.to_json() for k in kernels],
            "idle_time_breakdown": [i.to_json() for i in idle],
            "cuda_kernel_launch_stats": [x.to_json() for x in launches],
            "queue_length_summary": [x.to_json() for x in queues],
            "ledger": ledger.to_json() if ledger is not None else None,
            "collective_kernels": joined.to_json() if joined is not None else None,
            "findings": [f.to_json() for f in findings],
        }
        click.echo(json.dumps(out, default=str))
        return
    say = click.echo
    if not breakdown:  # a CPU-only profile (or a window with no launches in it)
        cats = store.query(
            f"SELECT cat, count() FROM trace_events WHERE job_id = {sql_string(job_id)} AND attempt = {int(attempt)} "
            "GROUP BY cat ORDER BY count() DESC LIMIT 8"
        ).rows()
        seen = ", ".join(f"{c or '(none)'} {n}" for c, n in cats)
        say(
            f"job {job_id} attempt {attempt}: its profiler traces hold no GPU events in the analysed window "
            f"(kernels, memcpy, memset on a CUDA stream), so there is no GPU time to break down; "
            f"events by category: {seen}. Profile with ProfilerActivity.CUDA on a GPU."
        )
        return
    steps = (
        f"{window.profiler_steps} profiler steps, the last left out"
        if window.windowed
        else "no profiler steps to window by: every event"
    )
    say(f"job {job_id} attempt {attempt}: profiler traces of {len(window.ranks)} rank(s) ({steps})")
    missing = sorted(set(window.ranks) - {b.rank for b in breakdown})
    if missing:  # e.g. a rank whose trace has no ProfilerStep while its peers' do: no analysed window
        say(f"  no GPU events in the analysed window on rank(s) {', '.join(map(str, missing[:20]))}")
    say("\nGPU time per rank (% of the window from the first kernel to the last):")
    say(
        f"  {'rank':>6} {'window ms':>10} {'idle %':>7} {'compute %':>9} {'non-compute %':>13} "
        f"{'comm/comp overlap %':>19}"
    )
    for b in breakdown:
        say(
            f"  {b.rank:>6} {b.kernel_time_us / 1000:>10.1f} {b.idle_time_pctg:>7.2f} {b.compute_time_pctg:>9.2f} "
            f"{b.non_compute_time_pctg:>13.2f} {b.comp_comm_overlap_pctg:>19.2f}"
        )
    say("\nKernel types (all ranks, time while exactly these run):")
    for t in kernel_types:
        say(f"  {t.percentage:>5.1f}%  {t.sum_us / 1000:>10.1f} ms  {t.kernel_type}")
    say(f"\nTop kernels per rank and type (the rest as `others`; all of them with --json), first {TOP_KERNELS}:")
    shown: dict[tuple[int, str], int] = {}
    for k in kernels:
        n = shown.get((k.rank, k.kernel_type), 0)
        if n >= TOP_KERNELS:
            continue
        shown[(k.rank, k.kernel_type)] = n + 1
        name = k.name if len(k.name) <= 70 else k.name[:67] + "..."
        say(
            f"  rank {k.rank} {k.kernel_type:<13} {k.sum_us / 1000:>9.1f} ms  x{k.count:<6} "
            f"mean {k.mean_us:>8.1f} us  {name}"
        )
    say("\nIdle time per stream (host_wait: launched after the stream went idle; kernel_wait: gaps < 30 us):")
    by_stream: dict[tuple[int, int], dict[str, int]] = {}
    for i in idle:
        by_stream.setdefault((i.rank, i.stream), {})[i.idle_category] = i.idle_time_us
    for (rank, stream), cats in sorted(by_stream.items()):
        total = sum(cats.values())
        if total <= 0:
            continue
        parts = ", ".join(f"{c} {100.0 * us / total:.0f}%" for c, us in cats.items() if us)
        say(f"  rank {rank} stream {stream}: {total / 1000:.1f} ms idle ({parts})")
    say("\nKernel launches (CPU runtime call -> GPU start; HTA's cutoffs: call > 50 us, delay > 100 us):")
    for x in launches:
        say(
            f"  rank {x.rank}: {x.launches} launches, launch delay median {x.launch_delay_p50_us:.0f} us, "
            f"p99 {x.launch_delay_p99_us:.0f} us; {x.short_gpu_kernels} GPU events shorter than their launch call, "
            f"{x.long_runtime_calls} calls > 50 us, {x.long_launch_delays} delays > 100 us"
        )
    say("\nQueue length per stream (operations launched and not started; mean, max):")
    for q in queues:
        say(f"  rank {q.rank} stream {q.stream}: mean {q.mean:.1f}, max {q.max} ({q.count} changes)")
    if ledger is not None:
        say(f"\nThe job's ledger over the same window (steps {ledger.first_step}-{ledger.last_step}):")
        for r, (n, step_ms, coll_ms) in sorted(ledger.per_rank.items()):
            say(f"  rank {r}: {n} steps, {step_ms:.1f} ms per step, {coll_ms:.1f} ms of it inside collectives")
    if joined is not None:
        _say_joined(say, joined)
    if findings:
        say(f"\nFindings ({len(findings)}):")
        for f in findings:
            say(f"  [{f.severity.value.upper()}] {f.kind}: {f.title}")
            say(f"      confidence {f.confidence:.2f}, id {f.id}")
    else:
        say(
            "\nNo findings: no rank idles or runs its kernels far slower than its peers, "
            "and communication is overlapped."
        )


def _say_joined(say: Any, joined: Any) -> None:
    """The communication kernels joined to the ledger (analyzers/trace_ledger.py), as text."""
    shift = f", the trace's seq = the ledger's {joined.seq_shift:+d}" if joined.seq_shift else ""
    say(
        f"\nCommunication kernels joined to the ledger by (rank, pg, seq): {joined.consistent} of "
        f"{joined.with_seq} paired{shift} (wait: kernel time beyond the collective's shortest kernel; "
        "launch: kernel start after the rank arrived):"
    )
    for r in joined.per_rank:
        say(
            f"  rank {r.rank}: {r.matched} of {r.kernels} kernels, {r.kernel_ms:.1f} ms, of it waiting "
            f"{r.wait_ms:.1f} ms ({r.wait_pctg:.0f}%), launch {r.launch_ms_mean:.2f} ms after arrival"
        )
    if joined.top:
        c = joined.top[0]
        say(
            f"  the collective whose kernels waited longest for rank {c.last_rank}: {c.op} #{c.seq} of pg {c.pg}, "
            f"{c.wait_ms:.1f} ms of waiting over {c.kernels} kernels, transfer {c.transfer_ms:.2f} ms"
        )
