"""How much CPU the host gave this rank: the scheduler's own counters, sampled off the hot path.

Linux keeps, per thread, ``/proc/self/task/<tid>/schedstat``: three numbers, the nanoseconds the
thread ran on a CPU, the nanoseconds it was *runnable but waiting for a CPU* (the run-queue delay)
and the number of times it was scheduled. A rank whose host is oversubscribed (noisy neighbours, a
CPU hog, more ranks than cores) falls behind its peers although it does no more work: its run
delay grows while its CPU time does not. A rank that is slow for a reason of its own does not look
like that: sleeping or waiting on I/O is not runnable (no run delay), extra compute is CPU time.
The analyzers use these counters to tell host CPU contention from a straggler (issue 21).

:class:`CpuSampler` reads the counters of the training thread (the thread that built it) and the
sum over all of the process's threads (gloo's and the DataLoader's threads do the transfers and the
loading). It is called from the tracer's periodic flush, never from the training thread; one
sample is one small file read per thread. Where ``/proc`` has no schedstat (not Linux, a kernel
without schedstats), sampling turns itself off after the first try and says so once through the
``disabled`` reason (counted as a drop by the tracer). It never raises.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["CpuSampler", "read_schedstat"]


def read_schedstat(path: str) -> tuple[int, int] | None:
    """(on-CPU ns, run-queue delay ns) from a ``schedstat`` file, None when it cannot be read."""
    try:
        with open(path, "rb") as f:
            parts = f.read(128).split()
        return int(parts[0]), int(parts[1])
    except (OSError, ValueError, IndexError):
        return None


class CpuSampler:
    """Cumulative scheduler counters of one rank, one ``cpu`` row per :meth:`sample`.

    Args:
        ident: ``job_id``, ``attempt``, ``rank`` of the rows.
        host: the node name of the rows.
        tid: the training thread's native id (default: the calling thread's).
        proc_root: where ``/proc/self`` is (tests point it elsewhere).
    """

    def __init__(
        self, ident: dict[str, Any], host: str, *, tid: int | None = None, proc_root: str = "/proc/self"
    ) -> None:
        self._ident = dict(ident)
        self._host = host
        self._tid = threading.get_native_id() if tid is None else int(tid)
        self._task_dir = os.path.join(proc_root, "task")
        self.disabled: str = ""
        # per thread: its last counters; threads come and go, so the process totals are the sum of
        # every thread's growth since it was first seen (monotone, unlike a sum over live threads)
        self._last: dict[str, tuple[int, int]] = {}
        self._proc_cpu = 0
        self._proc_delay = 0
        self.errors = 0

    def sample(self, now_ns: int) -> dict[str, Any] | None:
        """One row (cumulative counters at ``now_ns``), or None when sampling is off. Never raises."""
        if self.disabled:
            return None
        try:
            return self._sample(now_ns)
        except Exception as e:  # never into the tracer's flush: count, and stop after a persistent failure
            self.errors += 1
            if self.errors >= 3:
                self.disabled = f"cpu sampling failed: {type(e).__name__}: {e}"
            return None

    def _sample(self, now_ns: int) -> dict[str, Any] | None:
        main = read_schedstat(os.path.join(self._task_dir, str(self._tid), "schedstat"))
        if main is None:
            self.disabled = f"no scheduler statistics at {self._task_dir}/{self._tid}/schedstat"
            return None
        try:
            tids = os.listdir(self._task_dir)
        except OSError:
            tids = [str(self._tid)]
        seen: dict[str, tuple[int, int]] = {}
        for t in tids:
            v = main if t == str(self._tid) else read_schedstat(os.path.join(self._task_dir, t, "schedstat"))
            if v is None:
                continue  # the thread ended between the listing and the read
            seen[t] = v
            prev = self._last.get(t)
            if prev is None:
                self._proc_cpu += v[0]
                self._proc_delay += v[1]
            else:
                self._proc_cpu += max(0, v[0] - prev[0])
                self._proc_delay += max(0, v[1] - prev[1])
        self._last = seen
        return {
            **self._ident,
            "host": self._host,
            "ts_ns": int(now_ns),
            "cpu_ns": main[0],
            "run_delay_ns": main[1],
            "proc_cpu_ns": self._proc_cpu,
            "proc_run_delay_ns": self._proc_delay,
            "threads": len(seen),
        }


def make_sampler(ident: dict[str, Any], host: str, count_drop: Callable[[str], None]) -> CpuSampler | None:
    """A sampler for the calling (training) thread; None, with one drop counted, where there is none."""
    s = CpuSampler(ident, host)
    if s.sample(0) is None:
        count_drop("cpu:unavailable")
        return None
    s._last.clear()  # the probe is not a sample: the first real one counts every thread once
    s._proc_cpu = s._proc_delay = 0
    return s
