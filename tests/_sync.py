"""Synchronise a test with another process or thread by readiness, not by sleeping.

A fixed ``time.sleep(2)`` "until the server is up" is a guess that fails on a loaded machine and
wastes time on an idle one. Wait for the thing itself (a log line, a file, a port accepting, a row
count in the store) with a generous deadline and a message that says what never happened.
Deadlines here bound *readiness* only; what a test measures keeps its own tight assertions.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

__all__ = ["free_port", "wait_for_file", "wait_for_port", "wait_until"]


def wait_until(
    predicate: Callable[[], T],
    timeout_s: float,
    what: str,
    *,
    interval_s: float = 0.05,
    procs: Iterable[subprocess.Popen] = (),
    detail: Callable[[], str] | None = None,
) -> T:
    """Poll ``predicate`` until it returns something truthy; return that value.

    Args:
        predicate: called every ``interval_s``; exceptions propagate (a broken probe is a bug).
        timeout_s: the deadline for readiness; make it generous (the machine may be loaded).
        what: what is being waited for, for the failure message ("the collector's ready line").
        procs: processes whose early exit means the wait can never succeed (fail at once, saying so).
        detail: called on failure for more context (a log tail).

    Raises:
        AssertionError: after ``timeout_s`` without success, or when one of ``procs`` has exited.
    """
    procs = list(procs)
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    while True:
        got = predicate()
        if got:
            return got
        dead = [p for p in procs if p.poll() is not None]
        if dead and not (got := predicate()):  # a process may do its part and then exit
            codes = ", ".join(f"pid {p.pid} exited {p.returncode}" for p in dead)
            raise AssertionError(f"gave up waiting for {what}: {codes}" + (f"\n{detail()}" if detail else ""))
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout_s:g} s waiting for {what}" + (f"\n{detail()}" if detail else "")
            )
        time.sleep(interval_s)


def wait_for_file(path: Path, timeout_s: float, what: str | None = None, **kw) -> Path:
    """Wait until ``path`` exists (see :func:`wait_until`)."""
    wait_until(path.exists, timeout_s, what or f"{path} to appear", **kw)
    return path


def wait_for_port(host: str, port: int, timeout_s: float, what: str | None = None, **kw) -> None:
    """Wait until a TCP connection to ``host:port`` is accepted (see :func:`wait_until`)."""

    def accepting() -> bool:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return True
        except OSError:
            return False

    wait_until(accepting, timeout_s, what or f"{host}:{port} to accept connections", **kw)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (bound to port 0, then released): for a
    server a test starts, which then says it is ready (see :func:`wait_for_port`)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
