"""The rank's last rows when it is told to stop: SIGTERM flushes the tracer, then ends the process.

A launcher that tears a job down (torch elastic after one rank failed, Slurm at the time limit or
on ``scancel``, Kubernetes deleting a pod) sends SIGTERM. Python's default for it ends the process
at once: no ``atexit``, so the rows buffered since the last flush and the collectives the ledger has
not read from the flight-recorder ring yet (up to ``max_delay_s``, 2 s) are lost, and they are the
seconds around the failure, what the analysis needs most.

When the process's SIGTERM disposition is the default (nobody else owns it), :func:`install`
takes it:

- the handler works when the main thread is blocked in C (a victim waits inside a collective,
  where Python handlers do not run): it is a wakeup fd (``signal.set_wakeup_fd``, only when none is
  set) read by a daemon thread, and the Python-level handler only writes the same byte;
- the thread runs the tracer's shutdown (bounded: ``timeout_s``), then restores the default
  disposition and raises SIGTERM again, so the process ends as it would have (killed by signal 15,
  which is what the launcher reports); a hard deadline ends it even if the flush is stuck;
- a handler the user installs later wins: the thread then only flushes and leaves the process alone;
- a forked child (a DataLoader worker) drops all of it, so its SIGTERM never reaches the parent.

``RANKLENS_SIGTERM_FLUSH=0`` leaves SIGTERM alone.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["install", "installed"]

log = logging.getLogger("ranklens.tracing")

_state: dict[str, Any] = {}  # pid, rfd, wfd, thread, handler, once
_HARD_DEADLINE_S = 10.0


def installed() -> bool:
    """Whether this process's SIGTERM is ranklens's (the flush-then-die handler)."""
    return bool(_state) and _state.get("pid") == os.getpid() and signal.getsignal(signal.SIGTERM) is _state["handler"]


def _die() -> None:
    """End the process by SIGTERM's default action, from any thread."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
        libc.signal(int(signal.SIGTERM), None)  # SIG_DFL is 0
        os.kill(os.getpid(), signal.SIGTERM)
    except Exception:  # never expected on Linux; still end as the signal asked
        pass
    os._exit(128 + int(signal.SIGTERM))


def _run(flush: Callable[[], None], shutdown: Callable[[], None]) -> None:
    rfd = _state["rfd"]
    while True:
        try:
            select.select([rfd], [], [])
            data = os.read(rfd, 512)
        except InterruptedError:
            continue
        except OSError:
            return  # the pipe is gone (a child reset it): nothing to watch
        if int(signal.SIGTERM) not in data or _state.get("pid") != os.getpid():
            continue
        if not installed():  # the user's own handler took SIGTERM: their call, we only save rows
            try:
                flush()
            except Exception:
                log.exception("ranklens: the flush on SIGTERM failed")
            continue
        if _state.get("once"):
            continue
        _state["once"] = True
        killer = threading.Timer(_HARD_DEADLINE_S, _die)
        killer.daemon = True
        killer.start()
        try:
            shutdown()
        except Exception:
            log.exception("ranklens: the flush on SIGTERM failed")
        finally:
            _die()


def install(flush: Callable[[], None], shutdown: Callable[[], None]) -> bool:
    """Take SIGTERM as the module doc says; False (nothing changed) when SIGTERM or the wakeup fd
    is someone else's, or not called from the main thread. Never raises."""
    try:
        if _state and _state.get("pid") == os.getpid():
            return installed()
        if threading.current_thread() is not threading.main_thread():
            return False
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return False
        rfd, wfd = os.pipe()
        os.set_blocking(wfd, False)
        old = signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
        if old != -1:  # asyncio or the user watches signals this way: leave it to them
            signal.set_wakeup_fd(old)
            os.close(rfd)
            os.close(wfd)
            return False

        def handler(signum: int, frame: Any) -> None:  # main thread, when it runs Python again
            try:
                os.write(wfd, bytes([int(signal.SIGTERM)]))
            except OSError:
                pass

        _state.update(pid=os.getpid(), rfd=rfd, wfd=wfd, handler=handler, once=False)
        signal.signal(signal.SIGTERM, handler)
        t = threading.Thread(target=_run, args=(flush, shutdown), name="ranklens-sigterm", daemon=True)
        _state["thread"] = t
        t.start()
        return True
    except Exception:
        log.exception("ranklens: could not take SIGTERM; a terminated rank loses its last rows")
        return False


def _reset_in_child() -> None:
    """A forked child (DataLoader worker) must not wake the parent's thread nor die by our handler."""
    if not _state:
        return
    wfd, rfd = int(_state["wfd"]), _state.get("rfd")
    try:
        # first point the write end at /dev/null: whatever happens below, a signal in the child
        # no longer writes into the parent's pipe
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, wfd)
        os.close(null)
        if rfd is not None:
            os.close(rfd)
        if signal.getsignal(signal.SIGTERM) is _state.get("handler"):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        prev = signal.set_wakeup_fd(-1)
        if prev != wfd:
            signal.set_wakeup_fd(prev)  # the user's own, not ours
        else:
            os.close(wfd)
    except Exception:
        pass
    _state.clear()


os.register_at_fork(after_in_child=_reset_in_child)
