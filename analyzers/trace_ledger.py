"""A profiler window's communication kernels joined to the ledger, one collective at a time.

torch (2.5+) writes each collective's process-group name and sequence number (``Process Group
Name``, ``Seq``) on its NCCL kernel in a Kineto trace: the ledger's ``(pg, seq)``. Joined on
``(rank, pg, seq)``, each kernel meets the row of the collective it ran for, and three numbers
follow that neither side has alone:

- **launch** (kernel start minus the ledger's arrival, one rank, one host clock): how long after
  the rank's CPU reached the collective its kernel started on the GPU (the stream's queue ahead of
  it);
- **wait**: an NCCL kernel runs until every member has joined, so of one collective's kernels the
  shortest is the transfer itself and the rest of each kernel's time is waiting for a later
  member; summed per rank, the GPU time its communication kernels spent waiting;
- **who**: the member the others waited for, the ledger's last arrival (clock-aligned as blame
  aligns it), with the waits it cost.

Only collectives whose kernels of at least two members are in the traces are split into transfer
and wait (with one member's kernel there is nothing to compare). Point-to-point kernels (send /
recv) are joined but not split: a receiver waits for its sender by design.

The sequence number the profiler writes is the process group's own counter, which the ledger takes
from the flight recorder; whether both count from the same origin on NCCL has not been checked on a
GPU (the recorded traces predate ``Seq``), so the join tries the shifts -1, 0 and +1 and keeps the
one under which most pairs are consistent (``seq_shift`` in the result): the kernel's collective names
the ledger's op, its element count times a dtype size (1, 2, 4 or 8 bytes) is the ledger's bytes, and
it started after the rank arrived (with 1 ms for the two clocks' conversion). Only consistent pairs
are used.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ranklens.store.api import Store, sql_string

__all__ = [
    "CollectiveKernels",
    "CollectiveWait",
    "RankCollectiveKernels",
    "collective_kernels",
    "consistent",
    "ops_agree",
]

SHIFTS = (0, 1, -1)  # trace seq - ledger seq tried, in order of preference on a tie
CLOCK_SLACK_NS = 1_000_000  # a kernel may seem to start this long before its rank arrived (clock conversion)
TOP_COLLECTIVES = 10
_P2P = ("send", "recv", "sendrecv")


def _norm(op: str) -> str:
    """An op name reduced to letters, lower case: ``all_gather_into_tensor`` -> ``allgatherintotensor``."""
    return re.sub(r"[^a-z]", "", op.lower())


def ops_agree(trace_collective: str, ledger_op: str) -> bool:
    """The kernel's collective (``allreduce``, ``AllGather``, ``SendRecv``) names the ledger's op
    (``all_reduce``, ``all_gather_into_tensor``, ``send``), allowing for torch's spellings."""
    a, b = _norm(trace_collective), _norm(ledger_op)
    if not a or not b:
        return False
    if a in ("sendrecv", "send", "recv") and b in ("send", "recv", "sendrecv", "batchisendirecv"):
        return True
    a = a.replace("alltoallv", "alltoall").replace("alltoallbase", "alltoall")
    b = b.replace("alltoallbase", "alltoall").replace("alltoallsingle", "alltoall")
    return a.startswith(b) or b.startswith(a) or a.removeprefix("reduce").startswith(b.removeprefix("reduce"))


def consistent(row: Sequence[Any]) -> bool:
    """A joined row (:func:`_joined_sql`'s columns) pairs a kernel with its own collective: the ops
    agree, the sizes agree where both are known, and the kernel did not start before the arrival."""
    _rank, _pg, _seq, coll, ts, _dur, op, enter, nelems, nbytes = row
    if not ops_agree(str(coll), str(op)):
        return False
    n, b = int(nelems), int(nbytes)
    if n > 0 and b > 0 and not any(n * size == b for size in (1, 2, 4, 8)):
        return False
    return int(ts) >= int(enter) - CLOCK_SLACK_NS


@dataclass(frozen=True)
class RankCollectiveKernels:
    """One rank's communication kernels in the window: how many carry ``(pg, seq)`` and were found
    in the ledger, their GPU time, of it the time spent waiting for a later member, and the
    launch delay (kernel start minus the rank's arrival in the ledger)."""

    rank: int
    kernels: int
    matched: int
    kernel_ms: float
    wait_ms: float
    launch_ms_mean: float

    @property
    def wait_pctg(self) -> float:
        return round(100.0 * self.wait_ms / self.kernel_ms, 2) if self.kernel_ms > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "kernels": self.kernels,
            "matched": self.matched,
            "kernel_ms": round(self.kernel_ms, 3),
            "wait_ms": round(self.wait_ms, 3),
            "wait_pctg": self.wait_pctg,
            "launch_ms_mean": round(self.launch_ms_mean, 3),
        }


@dataclass(frozen=True)
class CollectiveWait:
    """One collective of the window: its members' kernels, the transfer (shortest kernel), the
    waits summed over members, and the last arriver by the ledger."""

    pg: str
    seq: int
    op: str
    kernels: int
    transfer_ms: float
    wait_ms: float
    last_rank: int

    def to_json(self) -> dict[str, Any]:
        return {
            "pg": self.pg,
            "seq": self.seq,
            "op": self.op,
            "kernels": self.kernels,
            "transfer_ms": round(self.transfer_ms, 3),
            "wait_ms": round(self.wait_ms, 3),
            "last_rank": self.last_rank,
        }


@dataclass(frozen=True)
class CollectiveKernels:
    """The window's communication kernels joined to the ledger (:func:`collective_kernels`)."""

    with_seq: int  # communication kernels carrying a process group and a sequence number
    matched: int  # of them, found in the ledger at (rank, pg, seq + shift)
    consistent: int  # of those, pairs whose op, size and order agree (the ones used)
    seq_shift: int
    per_rank: tuple[RankCollectiveKernels, ...]
    top: tuple[CollectiveWait, ...]
    sql: str

    def to_json(self) -> dict[str, Any]:
        return {
            "kernels_with_seq": self.with_seq,
            "matched": self.matched,
            "consistent": self.consistent,
            "seq_shift": self.seq_shift,
            "ranks": [r.to_json() for r in self.per_rank],
            "top_collectives": [c.to_json() for c in self.top],
        }


def _kernels_sql(job_id: str, attempt: int, ranks: Sequence[int] | None, shift: int) -> str:
    sel = f" AND rank IN ({', '.join(str(int(r)) for r in ranks)})" if ranks else ""
    return (
        f"SELECT rank, pg, seq - ({int(shift)}) AS seq, collective, ts_ns, dur_ns, in_nelems FROM trace_events "
        f"WHERE job_id = {sql_string(job_id)} AND attempt = {int(attempt)} AND cat = 'kernel' "
        f"AND collective != '' AND pg != '' AND seq >= 0{sel}"
    )


def _ledger_sql(job_id: str, attempt: int) -> str:
    return (
        f"SELECT rank, pg, seq, op, enter_ns, nbytes FROM collectives "
        f"WHERE job_id = {sql_string(job_id)} AND attempt = {int(attempt)}"
    )


def _joined_sql(job_id: str, attempt: int, ranks: Sequence[int] | None, shift: int) -> str:
    return f"""
SELECT rank, pg, seq, collective, ts_ns, dur_ns, op, enter_ns, in_nelems, nbytes
FROM ({_kernels_sql(job_id, attempt, ranks, shift)}) AS k
ALL INNER JOIN ({_ledger_sql(job_id, attempt)}) AS c
USING (rank, pg, seq)
""".strip()


def collective_kernels(
    store: Store, job_id: str, attempt: int = 0, ranks: Sequence[int] | None = None
) -> CollectiveKernels | None:
    """The job's communication kernels joined to its ledger by ``(rank, pg, seq)``; None when no
    kernel carries a sequence number (traces of torch before 2.5, CPU-only profiles) or the job has
    no ledger."""
    kernels_per_rank = {
        int(r): int(n)
        for r, n in store.query(
            f"SELECT rank, count() FROM ({_kernels_sql(job_id, attempt, ranks, 0)}) GROUP BY rank"
        ).rows()
    }
    with_seq = sum(kernels_per_rank.values())
    if not with_seq:
        return None
    (in_ledger,) = store.query(
        f"SELECT count() FROM collectives WHERE job_id = {sql_string(job_id)} AND attempt = {int(attempt)}"
    ).rows()[0]
    if not in_ledger:
        return None
    best: tuple[int, int, int, list[tuple[Any, ...]]] | None = None  # consistent, matched, shift, rows
    for shift in SHIFTS:
        rows = store.query(_joined_sql(job_id, attempt, ranks, shift)).rows()
        good = [r for r in rows if consistent(r)]
        if best is None or len(good) > best[0]:
            best = (len(good), len(rows), shift, good)
        if len(good) == with_seq:
            break  # every kernel paired consistently: no other shift can do better
    assert best is not None
    n_good, matched, shift, kept = best
    durations: dict[tuple[str, int], list[int]] = {}  # per collective, its members' kernels
    for _rank, pg, seq, _coll, _ts, dur, _op, _enter, _n, _b in kept:
        durations.setdefault((str(pg), int(seq)), []).append(int(dur))
    shortest = {k: min(v) for k, v in durations.items() if len(v) >= 2}
    acc: dict[int, list[float]] = {}
    waits: dict[tuple[str, int], list[Any]] = {}  # per collective split into wait: op, kernels, wait ms
    for rank, pg, seq, _coll, ts, dur, op, enter, _n, _b in kept:
        a = acc.setdefault(int(rank), [0, 0.0, 0.0, 0.0])
        a[0] += 1
        a[1] += int(dur) / 1e6
        key = (str(pg), int(seq))
        if key in shortest and _norm(str(op)) not in _P2P:
            wait_ms = (int(dur) - shortest[key]) / 1e6
            a[2] += wait_ms
            w = waits.setdefault(key, [str(op), 0, 0.0])
            w[1] += 1
            w[2] += wait_ms
        a[3] += (int(ts) - int(enter)) / 1e6
    per_rank = tuple(
        RankCollectiveKernels(
            r,
            kernels_per_rank.get(r, 0),
            int(acc[r][0]) if r in acc else 0,
            acc[r][1] if r in acc else 0.0,
            acc[r][2] if r in acc else 0.0,
            acc[r][3] / acc[r][0] if r in acc and acc[r][0] else 0.0,
        )
        for r in sorted(kernels_per_rank)
    )
    top = _top(store, job_id, attempt, waits, shortest)
    return CollectiveKernels(
        int(with_seq), matched, n_good, shift, per_rank, top, _joined_sql(job_id, attempt, ranks, shift)
    )


def _top(
    store: Store,
    job_id: str,
    attempt: int,
    waits: dict[tuple[str, int], list[Any]],
    shortest: dict[tuple[str, int], int],
) -> tuple[CollectiveWait, ...]:
    """The collectives whose kernels waited longest (``waits``: per collective, its op, kernels and
    wait ms), each with its last arriver from the ledger (every member's arrival, on clocks aligned
    as blame aligns them)."""
    from ranklens.analyzers.blame import _aligned, blame_offsets

    chosen = sorted(waits.items(), key=lambda kv: -kv[1][2])[:TOP_COLLECTIVES]
    if not chosen:
        return ()
    enter = _aligned(blame_offsets(store, job_id, attempt))
    keys = ", ".join(f"({sql_string(pg)}, {int(seq)})" for (pg, seq), _w in chosen)
    last = {
        (str(pg), int(seq)): int(r)
        for pg, seq, r in store.query(
            f"SELECT pg, seq, argMax(rank, {enter}) FROM collectives "
            f"WHERE job_id = {sql_string(job_id)} AND attempt = {int(attempt)} AND (pg, seq) IN ({keys}) "
            "GROUP BY pg, seq"
        ).rows()
    }
    return tuple(
        CollectiveWait(pg, seq, w[0], int(w[1]), shortest[(pg, seq)] / 1e6, float(w[2]), last.get((pg, seq), -1))
        for (pg, seq), w in chosen
    )
