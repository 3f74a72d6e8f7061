"""Host CPU contention: a rank the host starved of CPU is not a straggler (issue 21).

Metric (SQL over the ``cpu`` table, the tracer's samples of the scheduler's per-thread counters,
see ``tracing/_cpu.py``): per rank over a time window, the growth of its training thread's
on-CPU time and run-queue delay (runnable, waiting for a CPU), as rates (seconds per second);
each rank's cumulative counters are interpolated at the window's two ends from the samples
around them, so every rank is measured over the same span.

Decision (:func:`explains`): a straggler or link finding's excess per step ``E`` is explained by
host CPU contention when the suspect's run delay exceeds its peers' (their median) by at least
``MIN_DELAY_SHARE`` of ``E`` per step, while its CPU time does not exceed theirs by more than
``MAX_CPU_SHARE`` of ``E``: the rank did the same work as its peers and was late because it waited
for a CPU. The collective also needs the backend's own threads (gloo's I/O loop, NCCL's proxy), so
the process's run delay (all its threads', above its peers') explains it as well, when the process did
no more CPU work than its peers' (for a compute excess, only a process delay of the whole excess:
:data:`MIN_PROC_DELAY_SHARE_COMPUTE`). A rank slowed by something of its own is not: sleeping or
blocking on I/O is not runnable (no run delay of the training thread; its process's threads do wait
more on a loaded host, inside the collectives it reaches last), extra compute is CPU time. A finding
so explained is not reported; a
:class:`Contention` note is, so the user still sees that the host is oversubscribed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ranklens.analyzers.findings import Finding
from ranklens.store.api import Store
from ranklens.store.api import sql_escape as _esc

__all__ = ["Contention", "CpuWindow", "cpu_window", "cpu_window_sql", "discount_links", "explains"]

MIN_DELAY_SHARE = 0.5  # run delay above the peers' explains at least this share of the excess...
MAX_CPU_SHARE = 0.25  # ...and the rank's extra CPU time is at most this share of it
# a compute excess (step minus collectives) is explained by the process's threads' run delay only when
# it sums to the whole excess: the sum counts every thread's wait (intra-op threads share one stretch
# of compute), and the backend's transfer threads wait inside collectives, which are not compute; a
# rank that slept 20 ms/step in forward under four CPU hogs had its process wait 5-13 ms/step more
# than its peers', its training thread -1..2 ms (a demo run was discounted at 12.7 of 21.4 ms)
MIN_PROC_DELAY_SHARE_COMPUTE = 1.0
PAD_NS = 2_500_000_000  # samples come with the tracer's flush (0.5 s by default): read this far around each end


_COUNTERS = ("cpu_ns", "run_delay_ns", "proc_cpu_ns", "proc_run_delay_ns")


def cpu_window_sql(job_id: str, attempt: int, t0_ns: int, t1_ns: int, pad_ns: int = PAD_NS) -> str:
    """Per rank, at each end ``t`` of the window: the last sample at or before ``t`` and the first
    at or after it (time and counters), so that every rank's counters are interpolated at the same
    two instants (ranks sample at different moments; a rank that ran on past the window's end, or
    idled in it, must not be compared over a different span)."""
    cols = []
    for tag, t in (("a", int(t0_ns)), ("b", int(t1_ns))):
        cols.append(f"maxIf(ts_ns, ts_ns <= {t}) AS {tag}_lo_ts, minIf(ts_ns, ts_ns >= {t}) AS {tag}_hi_ts")
        for c in _COUNTERS:
            lo = f"argMaxIf({c}, ts_ns, ts_ns <= {t}) AS {tag}_lo_{c}"
            cols.append(f"{lo}, argMinIf({c}, ts_ns, ts_ns >= {t}) AS {tag}_hi_{c}")
    return f"""
SELECT rank, any(host) AS host, countIf(ts_ns <= {int(t0_ns)}) AS n_before, countIf(ts_ns >= {int(t1_ns)}) AS n_after,
       min(ts_ns) AS first_ts, max(ts_ns) AS last_ts,
       {", ".join(cols)}
FROM cpu
WHERE job_id = '{_esc(job_id)}' AND attempt = {int(attempt)}
  AND ts_ns >= {int(t0_ns) - int(pad_ns)} AND ts_ns <= {int(t1_ns) + int(pad_ns)}
GROUP BY rank
ORDER BY rank
""".strip()


def _at(t: int, lo_ts: int, hi_ts: int, lo: float, hi: float) -> float:
    """A cumulative counter at ``t``, linear between the samples around it."""
    if hi_ts <= lo_ts:
        return lo
    return lo + (hi - lo) * (t - lo_ts) / (hi_ts - lo_ts)


@dataclass(frozen=True)
class CpuWindow:
    """Per rank (parallel arrays) over a window: CPU and run-delay rates in seconds per second, of
    the training thread and of all the process's threads."""

    ranks: np.ndarray
    hosts: dict[int, str]
    cpu_rate: np.ndarray
    delay_rate: np.ndarray
    proc_cpu_rate: np.ndarray
    proc_delay_rate: np.ndarray
    sql: str

    def index(self, rank: int) -> int | None:
        hit = np.flatnonzero(self.ranks == rank)
        return int(hit[0]) if len(hit) else None

    def above_peers(self, i: int, rates: np.ndarray) -> float:
        """``rates[i]`` (one of this window's rate arrays) minus the median of the other ranks'."""
        return float(rates[i] - np.median(np.delete(rates, i)))


def cpu_window(store: Store, job_id: str, attempt: int, t0_ns: int, t1_ns: int) -> CpuWindow:
    """The ``cpu`` metric over ``[t0_ns, t1_ns]``: every rank's counters interpolated at both ends
    (from the samples within a flush interval or so of each end). A rank without a sample on both
    sides of each end (not sampled: no schedstat where it ran) is left out: it is never discounted."""
    t1_ns = max(t1_ns, t0_ns + 1)
    r = store.query(cpu_window_sql(job_id, attempt, t0_ns, t1_ns))
    rows = r.to_pylist()
    # a window that runs past a rank's last sample (the job ended: its last flush) or starts before
    # its first: narrow it to the span every rank sampled, so all are measured over the same time
    if len(rows) >= 2:
        lo = max(int(x["first_ts"]) for x in rows)
        hi = min(int(x["last_ts"]) for x in rows)
        a, b = max(t0_ns, lo), min(t1_ns, hi)
        if (a, b) != (t0_ns, t1_ns) and b > a:
            t0_ns, t1_ns = a, b
            r = store.query(cpu_window_sql(job_id, attempt, t0_ns, t1_ns))
            rows = r.to_pylist()
    ranks: list[int] = []
    hosts: dict[int, str] = {}
    rates: list[list[float]] = []
    span_s = (t1_ns - t0_ns) / 1e9
    for row in rows:
        if not (row["n_before"] and row["n_after"]):
            continue
        vals = []
        for c in _COUNTERS:
            at_start = _at(t0_ns, row["a_lo_ts"], row["a_hi_ts"], row[f"a_lo_{c}"], row[f"a_hi_{c}"])
            at_end = _at(t1_ns, row["b_lo_ts"], row["b_hi_ts"], row[f"b_lo_{c}"], row[f"b_hi_{c}"])
            vals.append(max(0.0, at_end - at_start) / 1e9 / span_s)
        ranks.append(int(row["rank"]))
        hosts[int(row["rank"])] = str(row["host"])
        rates.append(vals)
    m = np.asarray(rates, dtype=np.float64).reshape(-1, len(_COUNTERS))
    sql = cpu_window_sql(job_id, attempt, t0_ns, t1_ns)
    return CpuWindow(np.asarray(ranks, dtype=np.int64), hosts, m[:, 0], m[:, 1], m[:, 2], m[:, 3], sql)


@dataclass(frozen=True)
class Contention:
    """Why a finding was not reported: its rank(s) waited for a CPU on their host."""

    kind: str  # the finding kind it replaced: straggler, slow_link
    node: str
    ranks: tuple[int, ...]
    excess_per_step_s: float  # what the finding claimed
    run_delay_per_step_s: float  # the suspect's run-queue delay above its peers', per step
    cpu_per_step_s: float  # its CPU time above its peers', per step
    first_seen_ns: int
    last_seen_ns: int
    title: str  # the finding's title, for the record
    sql: str

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "node": self.node,
            "ranks": list(self.ranks),
            "excess_ms_per_step": round(self.excess_per_step_s * 1e3, 3),
            "run_delay_ms_per_step": round(self.run_delay_per_step_s * 1e3, 3),
            "extra_cpu_ms_per_step": round(self.cpu_per_step_s * 1e3, 3),
            "first_seen_ns": self.first_seen_ns,
            "last_seen_ns": self.last_seen_ns,
            "finding_title": self.title,
            "sql": self.sql,
        }

    def line(self) -> str:
        """One line for the CLI's text output."""
        who = ", ".join(map(str, self.ranks))
        return (
            f"host CPU contention on {self.node or '?'}: rank{'s' if len(self.ranks) > 1 else ''} {who} waited "
            f"{self.run_delay_per_step_s * 1e3:.0f} ms/step for a CPU more than the others (of "
            f"{self.excess_per_step_s * 1e3:.0f} ms/step it was behind): the host is oversubscribed, "
            f"not a {self.kind.replace('_', ' ')}"
        )


def explains(
    cw: CpuWindow, rank: int, excess_per_step_s: float, step_s: float, *, proc: bool = False, compute: bool = False
) -> tuple[float, float] | None:
    """(run delay, CPU time) of ``rank`` above its peers' median per step when host CPU contention
    explains an excess of ``excess_per_step_s`` (see the module doc), else None. ``proc``: the
    process's threads (transfers run on the backend's threads), not the training thread's.
    ``compute``: the excess is compute time (the peer detector's, collectives left out), not a
    lateness at the collectives (the blame detector's): the process's threads then explain it only
    with :data:`MIN_PROC_DELAY_SHARE_COMPUTE` of it."""
    i = cw.index(rank)
    if i is None or len(cw.ranks) < 3 or not excess_per_step_s > 0 or not step_s > 0:
        return None
    delay = cw.proc_delay_rate if proc else cw.delay_rate
    cpu = cw.proc_cpu_rate if proc else cw.cpu_rate
    rd_x = cw.above_peers(i, delay) * step_s
    cpu_x = cw.above_peers(i, cpu) * step_s
    if cpu_x > MAX_CPU_SHARE * excess_per_step_s:
        return None
    if rd_x >= MIN_DELAY_SHARE * excess_per_step_s:
        return rd_x, cpu_x
    if not proc:
        # the collective also waits for the backend's threads (gloo's I/O loop, NCCL's proxy): when
        # the process's threads together waited for a CPU for half the excess, without more CPU work
        # than its peers' processes (a rank's own extra thread, e.g. rank 0 saving a checkpoint, is not
        # contention), that is what the rank lost
        proc_x = cw.above_peers(i, cw.proc_delay_rate) * step_s
        proc_cpu_x = cw.above_peers(i, cw.proc_cpu_rate) * step_s
        share = MIN_PROC_DELAY_SHARE_COMPUTE if compute else MIN_DELAY_SHARE
        if proc_x >= share * excess_per_step_s and proc_cpu_x <= MAX_CPU_SHARE * excess_per_step_s:
            return min(proc_x, excess_per_step_s), cpu_x
    return None


def discount_links(store: Store, findings: list[Finding], notes: list[Contention] | None = None) -> list[Finding]:
    """``findings`` without the ``slow_link`` findings host CPU contention explains: a suspect rank
    of the link whose process's threads (the backend's transfer threads) waited for a CPU above its
    peers' for at least half of the time the link's transfers lost, without doing more CPU work
    (:func:`explains` on the process's counters, per second of wall time); a note for each."""
    out = []
    for f in findings:
        ranks = sorted({s.rank for s in f.suspects if s.rank >= 0})
        if f.kind != "slow_link" or not ranks or not f.step_time_pct > 0:
            out.append(f)
            continue
        excess_rate = f.step_time_pct / 100.0  # seconds of transfer lost per second of the job
        cw = cpu_window(store, f.job_id, f.attempt, f.first_seen_ns, f.last_seen_ns)
        hits = [(r, w) for r in ranks if (w := explains(cw, r, excess_rate, 1.0, proc=True)) is not None]
        if not hits:
            out.append(f)
            continue
        if notes is not None:
            worst = max(hits, key=lambda h: h[1][0])
            notes.append(
                Contention(
                    kind="slow_link",
                    node=cw.hosts.get(worst[0], "") or next((s.node for s in f.suspects if s.node), ""),
                    ranks=tuple(r for r, _ in hits),
                    excess_per_step_s=excess_rate,
                    run_delay_per_step_s=worst[1][0],
                    cpu_per_step_s=worst[1][1],
                    first_seen_ns=f.first_seen_ns,
                    last_seen_ns=f.last_seen_ns,
                    title=f.title,
                    sql=cw.sql,
                )
            )
    return out
