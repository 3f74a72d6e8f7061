"""One warning for a failure that repeats, then a count at most once per interval.

A tracer whose spool cannot be written fails on every flush (twice a second per rank); a
traceback each time buried the training job's own output (issue 22, defect 8). A
:class:`FailureLog` says what failed once, then at most once per ``interval_s`` how many times it
failed since and how many rows that cost, and once more when it works again (or at shutdown).
Stdlib only (the tracer's imports are stdlib, numpy and torch).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["FailureLog"]


class FailureLog:
    """Rate-limited reports of one recurring failure: the first failure is logged at once, every
    later line (a count while it keeps failing, "works again" when it stops) at most once per
    ``interval_s``, so even a failure that comes and goes cannot flood the log.

    Args:
        logger: where the reports go (warnings).
        what: what fails, e.g. ``"ranklens: rank 3 cannot write the spool under /tmp/ranklens-spool"``.
        interval_s: at most one line per this many seconds after the first.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        *,
        interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.what = what
        self.interval_s = interval_s
        self.clock = clock
        self.failures = 0  # in all
        self.rows = 0  # dropped by them, in all
        self.failing = False
        self._unreported = 0  # failures not in a line yet
        self._unreported_rows = 0
        self._last_line: float | None = None
        self._last_error = ""
        self._lock = threading.Lock()

    def failed(self, error: BaseException | str, rows: int = 0, *, traceback: bool = False) -> None:
        """Count one failure that cost ``rows`` rows. The very first is logged at once (with the
        traceback when ``traceback``: for failures that are bugs, not conditions); later ones are
        summed into a line at most once per interval."""
        msg = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        with self._lock:
            now = self.clock()
            self.failures += 1
            self.rows += rows
            self.failing = True
            self._last_error = msg
            if self._last_line is None:
                self._last_line = now
                self.logger.warning(
                    "%s (%s): %s; training goes on; further failures are reported at most once every %.0f s",
                    self.what,
                    msg,
                    f"{rows} row(s) dropped and counted" if rows else "nothing recorded",
                    self.interval_s,
                    exc_info=error if traceback and isinstance(error, BaseException) else None,
                )
                return
            self._unreported += 1
            self._unreported_rows += rows
            if now - self._last_line >= self.interval_s:
                self._report(now, "failing")

    def ok(self) -> None:
        """It worked: say so (within the rate limit; otherwise the next line or :meth:`close` does)."""
        with self._lock:
            if not self.failing:
                return
            self.failing = False
            now = self.clock()
            if self._last_line is not None and now - self._last_line >= self.interval_s:
                self._report(now, "works again")

    def close(self) -> None:
        """At shutdown: one line with what no line has reported yet (nothing when all was reported)."""
        with self._lock:
            if self._unreported:
                self._report(self.clock(), "failing" if self.failing else "works again")

    def _report(self, now: float, state: str) -> None:
        assert self._last_line is not None
        self.logger.warning(
            "%s: %s; %d more failure(s) in the last %.0f s, %d row(s) dropped (in all %d failure(s), %d row(s);"
            " last: %s)",
            self.what,
            state,
            self._unreported,
            now - self._last_line,
            self._unreported_rows,
            self.failures,
            self.rows,
            self._last_error,
        )
        self._unreported = self._unreported_rows = 0
        self._last_line = now
