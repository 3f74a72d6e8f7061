"""The spool's two locks: one shipper at a time, and one node agent per spool.

``<spool>/.ranklens-ship.lock`` (:func:`spool_lock`) is held for the length of one shipping pass
by whoever ships the spool (the node agent, a one-off ``ranklens collect``, the shipper of
``ranklens run``): two shippers would send the same segments. ``<spool>/.collector.lock``
(:func:`hold_collector_lock`) is held by the node agent for as long as it runs, so ``ranklens run``
does not start a second shipper next to it. Both are ``flock`` locks: the kernel drops them when
their holder dies, however it dies.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["COLLECTOR_LOCK", "LOCK_FILE", "hold_collector_lock", "spool_lock"]

log = logging.getLogger("ranklens.collector")

LOCK_FILE = ".ranklens-ship.lock"
COLLECTOR_LOCK = ".collector.lock"  # held by the node agent; ranklens run ships only when it can take it


@contextlib.contextmanager
def spool_lock(spool_dir: Path, wait_s: float) -> Iterator[bool]:
    """Hold ``<spool>/.ranklens-ship.lock``, waiting up to ``wait_s`` seconds for it. Yields False
    when another process holds it after that; True when held (or when there is nothing to guard:
    no spool yet, or a lock file that cannot be opened, which is logged)."""
    if not spool_dir.is_dir():
        yield True  # nothing to ship, nothing to guard
        return
    try:
        fd = _open_lock(spool_dir / LOCK_FILE)
    except OSError as e:
        log.warning("ranklens collector: cannot open the spool lock (%s); shipping without it", e)
        yield True
        return
    with _flock(fd, wait_s, BlockingIOError) as held:
        yield held


@contextlib.contextmanager
def hold_collector_lock(spool_dir: str | os.PathLike[str]) -> Iterator[bool]:
    """Hold ``<spool>/.collector.lock`` (the node agent, for as long as it runs): ``ranklens run``
    starts its own shipper only when it can take this lock, so it does not ship next to a running
    collector. Yields False when another process holds it (the agent runs anyway: the spool's
    ship lock and journal keep two shippers from sending anything twice)."""
    try:
        Path(spool_dir).mkdir(parents=True, exist_ok=True)
        fd = _open_lock(Path(spool_dir) / COLLECTOR_LOCK)
    except OSError as e:
        log.warning("ranklens collector: cannot open %s (%s)", Path(spool_dir) / COLLECTOR_LOCK, e)
        yield False
        return
    with _flock(fd, 0.0, OSError) as held:  # any failure to take it: run as if another held it
        yield held


def _open_lock(path: Path) -> int:
    """Open (creating) a lock file; one that another user created, which this one may not write,
    is opened read-only: ``flock`` needs no write access (a training pod in the collector's group
    sees the collector's ``.collector.lock`` that way)."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except PermissionError:
        return os.open(path, os.O_RDONLY)


@contextlib.contextmanager
def _flock(fd: int, wait_s: float, busy: type[OSError]) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on the open file ``fd``, trying every 50 ms for up to ``wait_s``
    seconds while it fails with ``busy`` (another process holds it); yields whether it is held, and
    closes ``fd`` after."""
    import fcntl

    deadline = time.monotonic() + wait_s
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except busy:
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(0.05)
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
