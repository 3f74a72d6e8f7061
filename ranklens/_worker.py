"""The one background worker of a process: periodic tasks and a bounded queue of one-off jobs.

Every component that needs work done off the caller's thread (the tracer's flush, its 1 ms
completion watcher, the flight-recorder ring reader, the CUDA event poller, the collector agent's
loops, the recovery dispatcher) registers it here instead of starting a thread of its own
(issue 13; the shape follows OpenTelemetry's shared ``BatchProcessor``):

- ``every(period_s, fn, name=)`` runs ``fn`` every ``period_s`` on the *tick* thread. Tick tasks
  must be short (a poll, a status read): they share one thread and keep its cadence. A task that
  may block (disk, network) is registered with ``blocking=True``: when due it is *queued* to a
  *job* thread instead, so a slow disk delays only the jobs, never the 1 ms watcher (measured in
  tests/ground/test_worker.py). Jobs run on the default lane's thread; work that must not wait behind
  another blocking call (NVML behind a store that does not answer) names a lane of its own.
  A due run whose previous run has not finished, or a tick that ran late by
  a whole period, is an *overrun* (counted; runs are skipped, never piled up).
- ``submit(fn)`` queues a one-off job; it never blocks: when the lane's queue is full the job is
  dropped and counted.
- A task's or job's exception is caught, counted and logged (the first time per name), and never
  ends the thread.
- Fork-safe: ``os.register_at_fork`` is registered once per process (at import) and holds the
  workers by weak reference; in a forked child every worker is reset to empty (no inherited
  thread, lock, task or job: the parent's work is the parent's) and starts again lazily when the
  child registers work.
- ``close(timeout_s, final=)`` stops the tick thread, lets the lanes finish their queues, runs
  ``final`` (a last flush) on the default lane when nothing else runs, and joins every thread
  within ``timeout_s``; the returned :class:`CloseReport` says what did not finish.

Ground floor: standard library only. Threads start lazily (the tick thread at the first
``every``, a lane's thread at its first queued job), so a process that registers nothing runs
nothing.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["IDLE", "CloseReport", "Task", "Worker", "WorkerStats"]

log = logging.getLogger("ranklens.worker")

JOBS = "jobs"  # the default job lane (where ``close``'s final job runs)

IDLE = object()
"""Returned by a periodic task's function: pause the task until :meth:`Task.wake` (a poller with
nothing pending costs no wake-ups)."""


@dataclass(frozen=True)
class WorkerStats:
    """Counters of a worker (monotonic over its life in this process)."""

    jobs_run: int
    jobs_dropped: int  # submit() on a full queue (or after close)
    task_errors: int  # exceptions raised by tasks and jobs (caught)
    overruns: int  # periodic runs skipped: the previous one still running, or the tick ran late
    queued: int  # jobs waiting now
    errors_by_name: dict[str, int] = field(default_factory=dict)
    overruns_by_name: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class CloseReport:
    """What :meth:`Worker.close` left unfinished (empty ``unfinished`` = a clean stop)."""

    clean: bool
    unfinished: tuple[str, ...]  # names of the job/task still running, or queued and never run
    final_ran: bool  # whether the ``final`` function ran to its end


class Task:
    """A periodic task registered with :meth:`Worker.every` (cancel it, or wake it from IDLE)."""

    __slots__ = (
        "_wakes",
        "blocking",
        "cancelled",
        "fn",
        "lane",
        "name",
        "next_due",
        "paused",
        "period_s",
        "queued",
        "worker",
    )

    def __init__(
        self, worker: Worker, fn: Callable[[], Any], period_s: float, name: str, blocking: bool, lane: str
    ) -> None:
        self.worker = worker
        self.lane = lane
        self.fn = fn
        self.period_s = period_s
        self.name = name
        self.blocking = blocking
        self.next_due = 0.0
        self.paused = False
        self.cancelled = False
        self.queued = False  # blocking task: a run is queued or running on the job thread
        self._wakes = 0

    def wake(self) -> None:
        """Run a task paused by :data:`IDLE` at its next period (cheap: callable from the hot path)."""
        self._wakes += 1
        if self.paused:
            self.worker._wake_task(self)

    def cancel(self) -> None:
        """Run no more (a run in progress finishes)."""
        self.cancelled = True


class Worker:
    """One tick thread for short periodic tasks and a job thread per lane for bounded queues.

    Args:
        name: thread names are ``<name>-tick`` and ``<name>-<lane>`` (``<name>-jobs`` by default).
        max_queue: jobs held at most per lane; beyond it ``submit`` drops and counts.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, name: str = "ranklens", *, max_queue: int = 1024, clock: Callable[[], float] = time.monotonic):
        if max_queue < 1:
            raise ValueError(f"Worker max_queue must be >= 1, got {max_queue!r}")
        self.name = name
        self.max_queue = max_queue
        self.clock = clock
        self._reset()
        _ALL.add(self)

    def _reset(self) -> None:
        """Fresh state (also the forked child's): nothing inherited from another thread."""
        self._lock = threading.Lock()
        self._tick_cv = threading.Condition(self._lock)
        self._tasks: list[Task] = []
        self._lanes: dict[str, _Lane] = {}
        self._tick_thread: threading.Thread | None = None
        self._closing = False  # no new work; the tick thread ends
        self._final: Callable[[], Any] | None = None
        self._final_ran = False
        self._running_task = ""
        self._jobs_run = 0
        self._dropped = 0
        self._errors: collections.Counter[str] = collections.Counter()
        self._overruns: collections.Counter[str] = collections.Counter()

    # -- registering work (any thread) ---------------------------------------------------------
    def every(
        self, period_s: float, fn: Callable[[], Any], *, name: str, blocking: bool = False, lane: str = JOBS
    ) -> Task:
        """Run ``fn`` every ``period_s`` seconds (first run one period from now).

        Args:
            period_s: the period (> 0).
            fn: the task; returning :data:`IDLE` pauses it until :meth:`Task.wake`.
            name: for counters, logs and the close report.
            blocking: the task may block (I/O): run it as a queued job on a job thread.
            lane: the job thread (for ``blocking`` tasks): work that must not wait behind another
                blocking call (a store that does not answer) gets a lane of its own.

        Raises:
            ValueError: ``period_s`` is not positive.
        """
        if not period_s > 0:
            raise ValueError(f"Worker.every period_s must be > 0 seconds, got {period_s!r}")
        task = Task(self, fn, float(period_s), name, blocking, lane)
        with self._lock:
            task.next_due = self.clock() + task.period_s
            self._tasks.append(task)
            if not self._closing:
                self._ensure_tick()
            self._tick_cv.notify()
        return task

    def submit(self, fn: Callable[[], Any], *, name: str = "job", lane: str = JOBS) -> bool:
        """Queue a one-off job on ``lane``'s thread; never blocks. Returns False when it was
        dropped (the lane's queue full, or the worker closing) - the drop is counted."""
        with self._lock:
            if self._closing:
                self._dropped += 1
                return False
            return self._queue(lane, name, fn)

    def _queue(self, lane_name: str, name: str, fn: Callable[[], Any]) -> bool:
        lane = self._lanes.get(lane_name)
        if lane is None:
            lane = self._lanes[lane_name] = _Lane(self, lane_name)
        if len(lane.jobs) >= self.max_queue:
            self._dropped += 1
            return False
        lane.jobs.append((name, fn))
        lane.ensure_thread()
        lane.cv.notify()
        return True

    def stats(self) -> WorkerStats:
        with self._lock:
            return WorkerStats(
                jobs_run=self._jobs_run,
                jobs_dropped=self._dropped,
                task_errors=sum(self._errors.values()),
                overruns=sum(self._overruns.values()),
                queued=sum(len(lane.jobs) for lane in self._lanes.values()),
                errors_by_name=dict(self._errors),
                overruns_by_name=dict(self._overruns),
            )

    # -- threads (started lazily, under self._lock) -----------------------------------------------
    def _ensure_tick(self) -> None:
        if self._tick_thread is None:
            self._tick_thread = threading.Thread(target=self._tick_loop, name=f"{self.name}-tick", daemon=True)
            self._tick_thread.start()

    def _wake_task(self, task: Task) -> None:
        with self._lock:
            if task.paused:
                task.paused = False
                task.next_due = self.clock() + task.period_s
                self._tick_cv.notify()

    def _failed(self, name: str) -> None:
        with self._lock:
            self._errors[name] += 1
            first = self._errors[name] == 1
        if first:
            log.exception("ranklens: background task %r failed (counted; later failures are not logged)", name)

    def _tick_loop(self) -> None:
        while True:
            with self._lock:
                while True:
                    if self._closing:
                        return
                    now = self.clock()
                    self._tasks = [t for t in self._tasks if not t.cancelled]
                    live = [t for t in self._tasks if not t.paused]
                    due = min(live, key=lambda t: t.next_due) if live else None
                    if due is not None and due.next_due <= now:
                        break
                    self._tick_cv.wait(None if due is None else due.next_due - now)
                task = due
                # the next run is one period after this one was due; a tick that fell a whole
                # period behind skips the missed runs (counted) instead of bursting to catch up
                task.next_due += task.period_s
                if task.next_due <= now:
                    self._overruns[task.name] += int((now - task.next_due) / task.period_s) + 1
                    task.next_due = now + task.period_s
                if task.blocking:
                    if task.queued:
                        self._overruns[task.name] += 1
                    elif self._queue(task.lane, task.name, self._task_job(task)):
                        task.queued = True
                    continue
                wakes = task._wakes
                self._running_task = task.name
            try:
                result = task.fn()
            except Exception:
                result = None
                self._failed(task.name)
            with self._lock:
                self._running_task = ""
                if result is IDLE and task._wakes == wakes:  # not woken meanwhile
                    task.paused = True

    def _task_job(self, task: Task) -> Callable[[], Any]:
        def run() -> None:
            wakes, result = task._wakes, None
            try:
                result = None if task.cancelled else task.fn()
            finally:
                with self._lock:
                    task.queued = False
                    if result is IDLE and task._wakes == wakes:
                        task.paused = True

        return run

    def _job_loop(self, lane: _Lane) -> None:
        while True:
            with self._lock:
                while not lane.jobs and not lane.draining:
                    lane.cv.wait()
                final = None
                if lane.jobs:
                    name, fn = lane.jobs.popleft()
                elif lane.name == JOBS and self._final is not None:  # drained: the final job, then stop
                    final, self._final = self._final, None
                    name, fn = "final", final
                else:
                    return
                lane.running = name
            try:
                fn()
                if final is not None:
                    self._final_ran = True
            except Exception:
                self._failed(name)
            with self._lock:
                lane.running = ""
                self._jobs_run += 1
                if final is not None:
                    return

    # -- stopping -----------------------------------------------------------------------------------
    def close(self, timeout_s: float = 5.0, final: Callable[[], Any] | None = None) -> CloseReport:
        """Stop: no new work; the tick thread ends (after a task in progress), then every lane
        other than the default one runs what it has queued, then the default lane does and runs
        ``final`` (e.g. a last flush: no periodic task or other lane runs beside it), all within
        ``timeout_s``. Never raises; a task or job stuck past the timeout is left running (daemon
        threads) and named in the report. Called from a worker thread itself it does not wait for
        that thread."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        me = threading.current_thread()
        with self._lock:
            self._closing = True
            self._tick_cv.notify_all()
            tick = self._tick_thread
        if tick is not None and tick is not me:
            tick.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            self._final = final
            if final is not None and JOBS not in self._lanes:
                self._lanes[JOBS] = _Lane(self, JOBS)
            lanes = sorted(self._lanes.values(), key=lambda lane: lane.name == JOBS)  # the default last
        side, main = [lane for lane in lanes if lane.name != JOBS], [lane for lane in lanes if lane.name == JOBS]
        for group in (side, main):  # the side lanes drain together, then the default one runs final
            with self._lock:
                for lane in group:
                    lane.draining = True
                    if lane.jobs or (lane.name == JOBS and final is not None):
                        lane.ensure_thread()
                    lane.cv.notify_all()
                threads = [lane.thread for lane in group if lane.thread is not None and lane.thread is not me]
            for thread in threads:
                thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            unfinished = []
            if self._running_task and self._tick_thread is not None and self._tick_thread.is_alive():
                unfinished.append(self._running_task)
            for lane in lanes:
                if lane.running and lane.thread is not None and lane.thread.is_alive():
                    unfinished.append(lane.running)
            for lane in lanes:
                unfinished += [name for name, _ in lane.jobs]
            if self._final is not None:
                unfinished.append("final")
            report = CloseReport(not unfinished, tuple(unfinished), self._final_ran)
        if unfinished:
            log.warning("ranklens: worker %s stopped with unfinished work: %s", self.name, ", ".join(unfinished))
        return report

    @property
    def closed(self) -> bool:
        return self._closing

    def _after_fork_in_child(self) -> None:
        self._reset()


class _Lane:
    """One job thread and its bounded queue (state guarded by the worker's lock)."""

    def __init__(self, worker: Worker, name: str) -> None:
        self.worker = worker
        self.name = name
        self.cv = threading.Condition(worker._lock)
        self.jobs: collections.deque[tuple[str, Callable[[], Any]]] = collections.deque()
        self.thread: threading.Thread | None = None
        self.draining = False  # closing: run what is queued, then end
        self.running = ""  # the job running now ("" none)

    def ensure_thread(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(
                target=self.worker._job_loop, args=(self,), name=f"{self.worker.name}-{self.name}", daemon=True
            )
            self.thread.start()


_ALL: weakref.WeakSet[Worker] = weakref.WeakSet()


def _reset_all_in_child() -> None:
    for w in list(_ALL):
        w._after_fork_in_child()


# once per process, at import; workers are held weakly (a closed, dropped worker is not kept alive)
os.register_at_fork(after_in_child=_reset_all_in_child)
