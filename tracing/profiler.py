"""torch.profiler windows on demand: every N steps, when a trigger file appears, or on a signal.

A window profiles ``active_steps`` consecutive steps and exports a Kineto (Chrome trace) JSON file
to ``<spool>/<job>/<attempt>/kineto/rank<r>-step<n>.pt.trace.json``, which the collector ingests
into ``trace_events``. Starting and stopping happen at step boundaries on the training thread
(torch.profiler requires it); between windows the cost is one integer test and one ``os.stat`` of
the trigger file every ``check_every`` steps. Errors are logged and counted, never raised.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

from ranklens.tracing._failures import FailureLog

__all__ = ["ProfilerWindows"]

log = logging.getLogger("ranklens.tracing")


class ProfilerWindows:
    """Decides when to profile and runs torch.profiler for the chosen steps.

    Args:
        out_dir: where traces go.
        rank: this rank (file names).
        every: profile a window every this many steps (0: only on trigger).
        active_steps: steps per window.
        trigger_file: a path whose appearance starts a window (it is removed when seen).
        signum: a signal (e.g. ``signal.SIGUSR2``) that starts a window; only installed from the
            main thread, None for none.
        check_every: how often (in steps) the trigger file is looked at.
    """

    def __init__(
        self,
        out_dir: str,
        rank: int,
        *,
        every: int = 0,
        active_steps: int = 1,
        trigger_file: str | None = None,
        signum: int | None = None,
        check_every: int = 1,
    ) -> None:
        if every < 0 or active_steps < 1 or check_every < 1:
            raise ValueError("every must be >= 0, active_steps and check_every >= 1")
        self.out_dir = out_dir
        self.rank = rank
        self.every = every
        self.active_steps = active_steps
        self.trigger_file = trigger_file
        self.check_every = check_every
        self._requested = False
        self._prof: Any = None
        self._left = 0
        self._first_step = -1
        self.exported: list[str] = []
        self.failures = 0
        # a window that cannot start or be written fails every N steps: warn once, then count
        # (issue 22, defect 8)
        self._start_failures = FailureLog(log, f"ranklens: rank {rank} could not start torch.profiler")
        self._export_failures = FailureLog(log, f"ranklens: rank {rank} could not export a torch.profiler trace")
        if signum is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signum, lambda *_: self.request())

    def request(self) -> None:
        """Profile the next step (signal-safe: only sets a flag)."""
        self._requested = True

    def _wanted(self, step: int) -> bool:
        if self._requested:
            self._requested = False
            return True
        if self.every and step % self.every == 0:
            return True
        if self.trigger_file and step % self.check_every == 0 and os.path.exists(self.trigger_file):
            try:
                os.unlink(self.trigger_file)
            except OSError:
                pass
            return True
        return False

    def step_started(self, step: int) -> None:
        if self._prof is not None or not self._wanted(step):
            return
        try:
            import torch
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
            self._prof = profile(activities=activities)
            self._prof.__enter__()
            self._left = self.active_steps
            self._first_step = step
        except Exception as e:
            self._prof = None
            self.failures += 1
            self._start_failures.failed(e, traceback=True)

    def step_ended(self, step: int) -> None:
        if self._prof is None:
            return
        self._left -= 1
        if self._left > 0:
            return
        prof, self._prof = self._prof, None
        try:
            prof.__exit__(None, None, None)
            os.makedirs(self.out_dir, exist_ok=True)
            path = os.path.join(self.out_dir, f"rank{self.rank}-step{self._first_step}.pt.trace.json")
            tmp = path + ".tmp"
            prof.export_chrome_trace(tmp)
            os.replace(tmp, path)  # the collector only sees complete traces
            self.exported.append(path)
            self._export_failures.ok()
        except Exception as e:
            self.failures += 1
            self._export_failures.failed(e, traceback=not isinstance(e, OSError))

    def close(self) -> None:
        if self._prof is not None:
            self._left = 1
            self.step_ended(self._first_step)
        self._start_failures.close()
        self._export_failures.close()
