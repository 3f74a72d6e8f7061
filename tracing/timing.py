"""Device-side collective timing: CUDA events, read back asynchronously, mapped to host time.

On a GPU the CPU enqueues work long before the device runs it, so the CPU time of a call says
little about when a rank *arrived* at a collective. :class:`CudaEventTimer` records a CUDA event on
the compute stream when the collective is issued (arrival: when the stream reaches it) and another
right after it (completion), and never waits for them on the training thread: a task on the
process's background worker (``ranklens._worker``) polls ``event.query()`` while anything is pending
and converts the events to host nanoseconds through a calibration.

Calibration: the poller records an event on an otherwise idle stream, waits for that event only
(polling its ``query()``, on the worker's thread; the training streams are untouched) and takes the
host clock before and after. The event ran inside that window, so ``host(E) = anchor_host +
anchor.elapsed_time(E)`` with an error of at most half the window, which is recorded
(``error_ns``) and refreshed every ``recalibrate_s``. The wait is bounded (``calibrate_timeout_s``,
not ``event.synchronize()``): the worker's thread is shared with the 1 ms completion watcher and
the flight-recorder ring reader, which must keep running while a device hangs.

The ``cuda`` argument is the ``torch.cuda`` module or anything with the same ``Event``, ``Stream``
and ``current_stream`` (tests use a fake; on a GPU machine it is torch.cuda itself).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ranklens._worker import IDLE, Worker

__all__ = ["Calibration", "CalibrationTimeout", "CudaEventTimer"]


class CalibrationTimeout(RuntimeError):
    """The calibration event did not complete within ``calibrate_timeout_s`` (a busy or hung device)."""


@dataclass(frozen=True)
class Calibration:
    anchor: Any  # a completed CUDA event
    host_ns: int  # host time of the anchor (middle of the window)
    error_ns: int  # half the window: the anchor ran within +-error_ns of host_ns
    at_ns: int  # when this calibration was taken


class CudaEventTimer:
    """Arrival and completion of collectives on the GPU, resolved off the training thread.

    Args:
        cuda: ``torch.cuda`` (or a stand-in with the same event API).
        on_done: called as ``on_done(row, enter_ns, end_ns, error_ns)`` from the worker's thread.
        worker: the background worker that polls (a periodic task, idle while nothing is pending);
            None: nobody polls in the background, the owner calls :meth:`poll` (tests do).
        poll_s: how often pending events are polled.
        recalibrate_s: how often the host/device clock mapping is refreshed.
        clock: host clock (epoch ns).
        max_pending: beyond this many unresolved collectives new ones are dropped (counted).
        calibrate_timeout_s: the longest a calibration waits for its event.
    """

    def __init__(
        self,
        cuda: Any,
        on_done: Callable[[dict[str, Any], int, int, int], None],
        *,
        worker: Worker | None = None,
        poll_s: float = 0.002,
        recalibrate_s: float = 10.0,
        clock: Callable[[], int] = time.time_ns,
        max_pending: int = 100_000,
        calibrate_timeout_s: float = 0.05,
    ) -> None:
        self.cuda = cuda
        self.on_done = on_done
        self.poll_s = poll_s
        self.recalibrate_ns = int(recalibrate_s * 1e9)
        self.clock = clock
        self.max_pending = max_pending
        self.calibrate_timeout_s = calibrate_timeout_s
        self.dropped = 0
        self.poll_errors = 0
        self._pending: list[tuple[Any, Any, dict[str, Any]]] = []
        self._lock = threading.Lock()
        self._calib: Calibration | None = None
        self._calib_stream: Any = None
        self._worker = worker
        self._task: Any = None  # the worker's periodic task, registered at the first collective
        self._closed = False

    # -- training thread: record, never wait ---------------------------------------------------
    def begin(self) -> Any:
        """Record the arrival event on the current stream; returns a token for :meth:`end`."""
        ev = self.cuda.Event(enable_timing=True)
        ev.record(self.cuda.current_stream())
        return ev

    def end(self, start_event: Any, row: dict[str, Any]) -> None:
        """Record the completion event after the collective was issued; resolution is async."""
        ev = self.cuda.Event(enable_timing=True)
        ev.record(self.cuda.current_stream())
        with self._lock:
            if len(self._pending) >= self.max_pending:
                self.dropped += 1
                return
            self._pending.append((start_event, ev, row))
        task = self._task
        if task is None:
            if self._worker is None or self._closed:
                return
            with self._lock:
                if self._task is None:
                    self._task = self._worker.every(self.poll_s, self._tick, name="cuda-timer")
                task = self._task
        task.wake()

    # -- the worker's thread ---------------------------------------------------------------------
    def calibrate(self) -> Calibration:
        """Anchor the device clock to the host clock (waits on the calling thread only, at most
        ``calibrate_timeout_s``).

        Raises:
            CalibrationTimeout: the event did not complete in time (the previous calibration stays).
        """
        if self._calib_stream is None:
            self._calib_stream = self.cuda.Stream()
        ev = self.cuda.Event(enable_timing=True)
        before = self.clock()
        ev.record(self._calib_stream)
        deadline = time.monotonic() + self.calibrate_timeout_s
        while not ev.query():
            if time.monotonic() > deadline:
                raise CalibrationTimeout(f"the calibration event did not complete within {self.calibrate_timeout_s} s")
            time.sleep(0)  # let the training thread have the GIL between polls
        after = self.clock()
        self._calib = Calibration(ev, (before + after) // 2, (after - before + 1) // 2, after)
        return self._calib

    def to_host_ns(self, event: Any) -> int:
        c = self._calib
        if c is None:
            c = self.calibrate()
        return c.host_ns + round(c.anchor.elapsed_time(event) * 1e6)  # elapsed_time is in ms

    def poll(self) -> int:
        """Resolve every pending collective whose completion event has run; returns how many."""
        if self._calib is None or self.clock() - self._calib.at_ns > self.recalibrate_ns:
            self.calibrate()
        with self._lock:
            pending, self._pending = self._pending, []
        still, done = [], 0
        for start, end, row in pending:
            if end.query():
                assert self._calib is not None
                self.on_done(row, self.to_host_ns(start), self.to_host_ns(end), self._calib.error_ns)
                done += 1
            else:
                still.append((start, end, row))
        with self._lock:
            self._pending = still + self._pending
        return done

    def _tick(self) -> object:
        """The worker's periodic task: poll while anything is pending, then sleep until woken."""
        if self._closed:
            return IDLE
        try:
            self.poll()
        except Exception:  # a failing device read: counted, retried at the next tick
            self.poll_errors += 1
        return IDLE if not self._pending else None

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def close(self, timeout_s: float = 2.0) -> None:
        """Resolve what is pending (on the calling thread, at most ``timeout_s``), then stop polling."""
        deadline = time.monotonic() + timeout_s
        if self._task is not None:
            self._task.cancel()
        while self.pending() and time.monotonic() < deadline:
            try:
                self.poll()
            except Exception:
                break
            time.sleep(self.poll_s)
        self._closed = True
