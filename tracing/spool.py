"""The per-rank spool: immutable JSON Lines segments on local disk, picked up by the collector.

A segment is one record type (table), written under a temporary name and renamed into place, so a
reader never sees half a segment and a crash loses at most the rows not yet flushed. The segment
format is the open ingest format (docs/ingest-format.md): a header line, then one JSON object
per row::

    {"ranklens": "records", "version": 1, "table": "collectives"}
    {"job_id": "j1", "rank": 0, "pg": "0", "seq": 1, "op": "all_reduce", "enter_ns": ...}

Layout: ``<spool>/<job_id>/<attempt>/rank-<r>/<table>.<pid>.<n>.jsonl``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["SPOOL_FORMAT", "SPOOL_VERSION", "SpoolWriter", "header_line"]

SPOOL_FORMAT = "records"
SPOOL_VERSION = 1


def header_line(table: str) -> str:
    return json.dumps({"ranklens": SPOOL_FORMAT, "version": SPOOL_VERSION, "table": table}) + "\n"


def _safe(part: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in part) or "_"


class SpoolWriter:
    """Writes segments for one rank. Not thread-safe: one flusher thread owns it."""

    def __init__(self, root: str | os.PathLike[str], job_id: str, attempt: int, rank: int) -> None:
        self.dir = Path(root) / _safe(job_id) / str(attempt) / f"rank-{rank}"
        self._n = 0
        self._made = False

    def write(self, table: str, rows: list[dict[str, Any]]) -> Path | None:
        """Write one segment; returns its path (None when ``rows`` is empty). Raises OSError."""
        if not rows:
            return None
        if not self._made:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._made = True
        self._n += 1
        name = f"{table}.{os.getpid()}.{self._n:08d}.jsonl"
        tmp = self.dir / f".{name}.tmp"
        dumps = json.dumps
        text = header_line(table) + "\n".join(dumps(r, separators=(",", ":")) for r in rows) + "\n"
        try:
            f = open(tmp, "w")
        except FileNotFoundError:  # the spool directory was removed under us: make it again
            self.dir.mkdir(parents=True, exist_ok=True)
            f = open(tmp, "w")
        try:
            with f:
                f.write(text)
            os.replace(tmp, self.dir / name)
        except BaseException:
            try:
                tmp.unlink()
            except OSError:
                pass
            raise
        return self.dir / name
