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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["SPOOL_FORMAT", "SPOOL_VERSION", "SpoolWriter", "clean_rows", "clean_text", "encode_segment", "header_line"]

SPOOL_FORMAT = "records"
SPOOL_VERSION = 1


def header_line(table: str) -> str:
    return json.dumps({"ranklens": SPOOL_FORMAT, "version": SPOOL_VERSION, "table": table}) + "\n"


def clean_text(s: str) -> str:
    """``s`` as valid Unicode. Python smuggles undecodable bytes into ``str`` as lone surrogates
    (``os.environ``, file names: ``b"job\\xff"`` -> ``"job\\udcff"``); JSON would carry them as
    ``\\udcff`` escapes that no strict reader (Arrow, ClickHouse) accepts (issue 22 #1). Bytes that
    form UTF-8 are kept, anything else becomes U+FFFD."""
    if s.isascii():
        return s
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        pass
    try:
        return s.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # surrogates that are not escaped bytes
        return s.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def _clean_value(v: Any) -> Any:
    if isinstance(v, str):
        return clean_text(v)
    if isinstance(v, (list, tuple)):
        return [_clean_value(x) for x in v]
    if isinstance(v, dict):
        return {clean_text(str(k)): _clean_value(x) for k, x in v.items()}
    return v


def clean_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` with every string made valid Unicode (:func:`clean_text`)."""
    return [_clean_value(dict(r)) for r in rows]


def encode_segment(table: str, rows: Sequence[Mapping[str, Any]]) -> tuple[bytes, int]:
    """The one place rows become segment bytes: the header line, then one JSON object per row,
    as UTF-8. Returns (bytes, rows whose strings had to be cleaned). A row never carries a lone
    surrogate into the spool (it would poison the collector): such strings are cleaned."""
    dumps = json.dumps

    def render(rs: Sequence[Mapping[str, Any]]) -> str:
        return header_line(table) + "".join(dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n" for r in rs)

    text = render(rows)
    try:
        return text.encode("utf-8"), 0
    except UnicodeEncodeError:
        pass
    dirty = 0
    for r in rows:
        try:
            dumps(r, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            dirty += 1
    return render(clean_rows(rows)).encode("utf-8"), dirty


def _safe(part: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in part) or "_"


class SpoolWriter:
    """Writes segments for one rank. Not thread-safe: one flusher thread owns it."""

    def __init__(self, root: str | os.PathLike[str], job_id: str, attempt: int, rank: int) -> None:
        self.dir = Path(root) / _safe(job_id) / str(attempt) / f"rank-{rank}"
        self._n = 0
        self._made = False
        self.cleaned_rows = 0  # rows whose strings were not valid Unicode (cleaned, not dropped)

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
        data, cleaned = encode_segment(table, rows)
        self.cleaned_rows += cleaned
        try:
            f = open(tmp, "wb")
        except FileNotFoundError:  # the spool directory was removed under us: make it again
            self.dir.mkdir(parents=True, exist_ok=True)
            f = open(tmp, "wb")
        try:
            with f:
                f.write(data)
            os.replace(tmp, self.dir / name)
        except BaseException:
            try:
                tmp.unlink()
            except OSError:
                pass
            raise
        return self.dir / name
