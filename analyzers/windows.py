"""Iterations without step markers: windows over the collective ledger.

A script traced with no step markers stores its collectives with ``step = -1``. A training loop
still repeats itself: the busiest process group issues the same sequence of collectives
(op, size) every iteration (DDP's gradient buckets, a loss all-reduce, ...). The period of that
sequence is the number of collectives per iteration, so windows of that many sequence numbers of
that group are iterations, and their count is an iteration number. Collectives of the other groups
fall into the window whose time span holds their first arrival. When no period is found (one
collective per iteration, or an irregular loop), windows are fixed runs of sequence numbers and
are *not* iterations; :attr:`Windows.basis` says which.

Everything heavy is SQL in the store (one row per collective of one group, bounded); Python
finds the period.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ranklens.store.api import Store
from ranklens.store.api import sql_escape as _esc

__all__ = ["Windows", "collective_windows"]

MAX_SIGNATURE = 4000  # collectives of the main group read to find the period
MAX_PERIOD = 256
MAX_WINDOWS = 2000
MATCH = 0.9  # share of positions where the sequence repeats itself after one period


@dataclass(frozen=True)
class Windows:
    """Windows over a job's collectives.

    ``pg``: the group whose sequence numbers define windows; ``period``: its collectives per
    window; ``first_seq``: the seq of window 0's first collective (earlier ones are the set-up:
    window -1); ``starts_ns``: per window, the first arrival at its first collective (every
    collective whose first arrival is at or after ``starts_ns[k]`` and before ``starts_ns[k+1]``
    is in window k); ``basis``: ``"iterations"`` when the period is the loop's repeating pattern,
    ``"windows"`` when it is a fixed run of collectives.
    """

    pg: str
    period: int
    first_seq: int
    starts_ns: np.ndarray
    basis: str
    setup_collectives: int
    sql: str

    @property
    def empty(self) -> bool:
        return len(self.starts_ns) == 0

    @property
    def durations_s(self) -> np.ndarray:
        """Per window: time to the next window's start (the last one: the median of the others)."""
        if len(self.starts_ns) == 0:
            return np.zeros(0)
        d = np.diff(self.starts_ns).astype(np.float64) / 1e9
        last = float(np.median(d)) if len(d) else float("nan")
        return np.append(d, last)

    def window_of_sql(self, t_expr: str) -> str:
        """SQL: the window index of a time (first arrival of a collective), -1 before window 0."""
        if self.empty:
            return "toInt64(-1)"
        if len(self.starts_ns) == 1:
            return f"if({t_expr} >= {int(self.starts_ns[0])}, toInt64(0), toInt64(-1))"
        arr = ", ".join(f"toInt64({int(x)})" for x in self.starts_ns)
        return f"toInt64(arrayCount(b -> b <= {t_expr}, [{arr}])) - 1"


def _main_group_sql(where: str) -> str:
    return f"""
SELECT pg, count() AS n, max(members) AS width
FROM (SELECT pg, seq, count() AS members FROM collectives
      WHERE {where} AND position(pg, '/p2p:') = 0 GROUP BY pg, seq HAVING members >= 2)
GROUP BY pg
ORDER BY width DESC, n DESC, pg
LIMIT 1
""".strip()


def _signature_sql(where: str, pg: str, limit: int) -> str:
    return f"""
SELECT seq, any(op) AS c_op, max(nbytes) AS c_nbytes, min(enter_ns) AS first_ns
FROM collectives
WHERE {where} AND pg = '{_esc(pg)}'
GROUP BY seq
ORDER BY seq
LIMIT {int(limit)}
""".strip()


def _starts_sql(where: str, pg: str, first_seq: int, period: int) -> str:
    return f"""
SELECT intDiv(seq - {int(first_seq)}, {int(period)}) AS w, min(first_ns) AS start_ns, count() AS n
FROM (SELECT seq, min(enter_ns) AS first_ns FROM collectives
      WHERE {where} AND pg = '{_esc(pg)}' AND seq >= {int(first_seq)} GROUP BY seq)
GROUP BY w
ORDER BY w
""".strip()


def find_period(sig: list[tuple[str, int]], max_period: int = MAX_PERIOD) -> tuple[int, int] | None:
    """(period, start) of a sequence that repeats itself, or None.

    The period is the smallest p > 1 such that ``sig[i] == sig[i + p]`` for at least ``MATCH`` of
    the positions of the sequence's middle (set-up and tear-down differ), and that is not
    a repetition of a shorter pattern. The start is the first position from which the sequence
    repeats with that period (what comes before is the set-up)."""
    n = len(sig)
    if n < 6:
        return None
    codes = {s: k for k, s in enumerate(dict.fromkeys(sig))}
    a = np.array([codes[s] for s in sig], dtype=np.int64)
    if len(codes) == 1:
        return None  # one kind of collective: no way to tell iterations apart by their pattern
    lo, hi = n // 5, n - n // 5
    for p in range(2, min(max_period, n // 3) + 1):
        seg = np.arange(lo, max(lo + 1, hi - p))
        if len(seg) < p:
            break
        if float(np.mean(a[seg] == a[seg + p])) >= MATCH:
            # the set-up: the last mismatch before the middle, then the period's first position
            mism = np.flatnonzero(a[: n - p] != a[p:])
            before = mism[mism < lo]
            start = int(before[-1]) + 1 if len(before) else 0
            return p, start
    return None


def collective_windows(store: Store, job_id: str, attempt: int = 0) -> Windows:
    """Windows (iterations when the loop's pattern can be seen) over the collectives of a job attempt
    that carry no step."""
    where = f"job_id = '{_esc(job_id)}' AND attempt = {int(attempt)} AND step < 0"
    main = store.query(_main_group_sql(where)).rows()
    if not main:
        return Windows("", 0, 0, np.zeros(0, dtype=np.int64), "windows", 0, "")
    pg, n_main, _width = main[0]
    pg, n_main = str(pg), int(n_main)
    rows = store.query(_signature_sql(where, pg, MAX_SIGNATURE)).rows()
    seqs = [int(r[0]) for r in rows]
    sig_of = [(str(r[1]), int(r[2])) for r in rows]
    found = find_period(sig_of)
    if found is not None:
        period, start = found
        basis = "iterations"
        first_seq = seqs[start]
        if n_main / period > MAX_WINDOWS:  # very long job: windows of several iterations
            period *= math.ceil(n_main / period / MAX_WINDOWS)
            basis = "windows"
    else:
        period = max(1, math.ceil(n_main / min(MAX_WINDOWS, max(1, n_main // 3))))
        first_seq = seqs[0] if seqs else 0
        start = 0
        basis = "windows"
    sql = _starts_sql(where, pg, first_seq, period)
    r = store.query(sql)
    starts = r.column("start_ns").astype(np.int64) if r.num_rows else np.zeros(0, dtype=np.int64)
    if basis == "iterations" and start > 0:
        # collectives of the loop's own kinds before the periodic part are its first iteration(s)
        # (DDP reduces all gradients in one bucket in its first iteration, then rebuilds its buckets
        # and broadcasts the new layout); other kinds before the first of them (an init barrier, the
        # broadcast of the model) are the set-up
        kinds = {k for k, _ in (sig_of[i] for i in range(start, min(len(sig_of), start + period)))}
        lead = [i for i in range(start) if sig_of[i][0] in kinds]
        if lead:
            chunks = [lead[k] for k in range(0, len(lead), period)]
            starts = np.concatenate([np.array([int(rows[i][3]) for i in chunks], dtype=np.int64), starts])
            start -= len(lead)
    starts = np.maximum.accumulate(starts) if len(starts) else starts
    return Windows(pg, period, first_seq, starts, basis, start, sql)
