"""The collector's own rows (log events, GPU samples and events, drop counts) as spool segments.

Rows are written as immutable segments in the open ingest format (the same format as the rank
spools, ``tracing/spool.py``) under ``<spool>/_collector/<host>/``, so the one
:class:`~ranklens.collector.shipper.Shipper` ships them with everything else and deletes a segment
only after the store acknowledged it: a store that is down costs disk, never rows.

A segment is written under a hidden name, fsynced, then linked into place (never over an
existing segment), so a crash leaves either a whole segment or none. The tailer uses the two steps
apart (:meth:`Outbox.stage`, save its offsets, :meth:`Outbox.publish`; :meth:`Outbox.recover`
after a crash), so a log event reaches the spool exactly once even if the collector is killed
between writing events and saving offsets. Names carry the pid and a
time-based sequence number, so a restarted collector (even with the same pid, as in a container)
never reuses the name of a segment that is still waiting to be shipped.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ranklens.records import check_value
from ranklens.schema import table
from ranklens.tracing.spool import clean_rows, encode_segment

__all__ = ["COLLECTOR_DIR", "Outbox"]

COLLECTOR_DIR = "_collector"
STAGED = ".staged."


def _safe(part: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in part) or "_"


class Outbox:
    """Writes rows of ranklens tables as spool segments. Thread-safe.

    Args:
        spool_dir: the spool root the shipper reads.
        host: node name (a sub-directory, so several collectors may share a spool).
        fsync: fsync each segment and its directory (durable across a power loss).
        on_write: called with (table, rows) after each segment is in place (metrics).
    """

    def __init__(
        self,
        spool_dir: str | os.PathLike[str],
        *,
        host: str,
        fsync: bool = True,
        on_write: Callable[[str, int], None] | None = None,
    ) -> None:
        self.dir = Path(spool_dir) / COLLECTOR_DIR / _safe(host)
        self.fsync = fsync
        self.on_write = on_write
        self._lock = threading.Lock()
        self._seq = 0
        self._made = False
        self._staged_rows: dict[str, tuple[str, int]] = {}

    def _next_name(self, table_name: str) -> str:
        with self._lock:
            self._seq = max(self._seq + 1, time.time_ns())
            return f"{table_name}.{os.getpid()}.{self._seq:020d}.jsonl"

    def write(self, table_name: str, rows: Sequence[Mapping[str, Any]]) -> Path | None:
        """Validate ``rows`` against the table's schema and write them as one segment.

        Returns the segment's path (None for no rows). Raises ValueError for an invalid row
        (a bug: nothing is written) and OSError when the disk fails (nothing is in place).
        """
        staged = self.stage(table_name, rows)
        if staged is None:
            return None
        return self.publish([staged])[0]

    def stage(self, table_name: str, rows: Sequence[Mapping[str, Any]]) -> Path | None:
        """Write ``rows`` as a hidden, durable segment the shipper does not see yet (two-phase
        commit with the tailer's offsets: see :meth:`publish` and :meth:`recover`)."""
        if not rows:
            return None
        t = table(table_name)
        rows = clean_rows(rows)  # a file name or message with undecodable bytes: U+FFFD (issue 22 #1)
        for i, row in enumerate(rows):
            for key, value in row.items():
                if not t.has_column(key):
                    raise ValueError(f"{table_name} row {i}: {key!r} is not a column")
                check_value(t.column(key), value)
        if not self._made:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._made = True
        body, _ = encode_segment(table_name, rows)
        staged = self.dir / f"{STAGED}{self._next_name(table_name)}"
        tmp = staged.with_name(staged.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(body)
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, staged)
        if self.fsync:
            _fsync_dir(self.dir)
        self._staged_rows[staged.name] = (table_name, len(rows))
        return staged

    def publish(self, staged: Sequence[Path]) -> list[Path]:
        """Move staged segments into place (never over an existing segment); returns their paths."""
        out = []
        for p in staged:
            name = p.name[len(STAGED) :]
            final = self.dir / name
            while True:
                try:
                    os.link(p, final)  # fails rather than replace a segment that is still pending
                    break
                except FileExistsError:
                    table_name = name.split(".", 1)[0]
                    final = self.dir / self._next_name(table_name)
            os.unlink(p)
            out.append(final)
            info = self._staged_rows.pop(p.name, None)
            if self.on_write and info:
                self.on_write(*info)
        if self.fsync and out:
            _fsync_dir(self.dir)
        return out

    def recover(self, committed: Sequence[str]) -> tuple[int, int]:
        """After a restart: publish the staged segments named in ``committed`` (their offsets were
        saved), delete the other staged ones (their lines will be read again). Returns
        (published, discarded)."""
        if not self.dir.is_dir():
            return 0, 0
        keep = set(committed)
        published = discarded = 0
        for p in sorted(self.dir.iterdir()):
            if not p.name.startswith(STAGED) or p.name.endswith(".tmp"):
                continue
            if p.name in keep:
                self.publish([p])
                published += 1
            else:
                p.unlink()
                discarded += 1
        return published, discarded


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
