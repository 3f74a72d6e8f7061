"""The spool: immutable JSON Lines segments on local disk, written by the ranks' tracers and by the
node's collector, shipped by the collector's shipper.

A segment is one record type (table), written under a hidden name and linked into place (never
over an existing segment), so a reader never sees half a segment and a crash loses at most the
rows not yet flushed. The segment format is the open ingest format (docs/ingest-format.md): a
header line, then one JSON object per row::

    {"ranklens": "records", "version": 1, "table": "collectives"}
    {"job_id": "j1", "rank": 0, "pg": "0", "seq": 1, "op": "all_reduce", "enter_ns": ...}

Layout::

    <spool>/<job_id>/<attempt>/rank-<r>/<table>.<pid>.<seq>.jsonl   a rank's tracer (SpoolWriter.for_rank)
    <spool>/_collector/<host>/<table>.<pid>.<seq>.jsonl             the collector's own rows (its Outbox)

``<seq>`` is 20 digits, at least the writer's clock in nanoseconds, so a restarted writer (even with
the same pid, as in a container) never reuses the name of a segment still waiting to be shipped.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "COLLECTOR_DIR",
    "SPOOL_FORMAT",
    "SPOOL_VERSION",
    "SpoolWriter",
    "clean_rows",
    "clean_text",
    "encode_segment",
    "header_line",
    "safe_part",
]

SPOOL_FORMAT = "records"
SPOOL_VERSION = 1
COLLECTOR_DIR = "_collector"  # <spool>/_collector/<host>/: the collector's own segments
STAGED = ".staged."  # prefix of a segment written but not yet published (SpoolWriter.stage)


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


def safe_part(part: str) -> str:
    """``part`` (a job id, a host name) as one safe path component."""
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in part) or "_"


def _validate(table_name: str, rows: Sequence[Mapping[str, Any]]) -> None:
    from ranklens.records import check_value
    from ranklens.schema import table

    t = table(table_name)
    for i, row in enumerate(rows):
        for key, value in row.items():
            if not t.has_column(key):
                raise ValueError(f"{table_name} row {i}: {key!r} is not a column")
            check_value(t.column(key), value)


class SpoolWriter:
    """Writes spool segments into one directory: the one writer of the spool format. Thread-safe.

    A segment is written under a hidden name and hard-linked into place, so it never replaces a
    segment that is still waiting to be shipped. :meth:`write` does both at once; the collector's
    tailer uses the two steps apart (:meth:`stage`, save its offsets, :meth:`publish`; :meth:`recover`
    after a crash), so a log event reaches the spool exactly once even if the collector is killed
    between writing events and saving offsets.

    Args:
        directory: where the segments go (see :meth:`for_rank`; the collector's ``Outbox``).
        fsync: fsync each segment and its directory (durable across a power loss; the collector's
            rows), or leave it to the OS (a rank's tracer: the flusher must not stall on the disk).
        validate: check every row against its table's schema before anything is written (a
            ``ValueError`` names the row and the column); the tracer's rows are built from the
            schema's keys and are not checked again.
        on_write: called with (table, rows) after each segment is in place (metrics).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        fsync: bool = False,
        validate: bool = False,
        on_write: Callable[[str, int], None] | None = None,
    ) -> None:
        self.dir = Path(directory)
        self.fsync = fsync
        self.validate = validate
        self.on_write = on_write
        self.cleaned_rows = 0  # rows whose strings were not valid Unicode (cleaned, not dropped)
        self._lock = threading.Lock()
        self._seq = 0
        self._made = False
        self._staged_rows: dict[str, tuple[str, int]] = {}

    @classmethod
    def for_rank(cls, root: str | os.PathLike[str], job_id: str, attempt: int, rank: int, **kwargs: Any) -> SpoolWriter:
        """The writer of one rank's segments: ``<root>/<job_id>/<attempt>/rank-<rank>/``."""
        return cls(Path(root) / safe_part(job_id) / str(attempt) / f"rank-{rank}", **kwargs)

    def _next_name(self, table_name: str) -> str:
        with self._lock:
            self._seq = max(self._seq + 1, time.time_ns())
            return f"{table_name}.{os.getpid()}.{self._seq:020d}.jsonl"

    def _encode(self, table_name: str, rows: Sequence[Mapping[str, Any]]) -> bytes:
        if self.validate:
            rows = clean_rows(rows)  # a file name or message with undecodable bytes: U+FFFD (issue 22 #1)
            _validate(table_name, rows)
        body, cleaned = encode_segment(table_name, rows)
        self.cleaned_rows += cleaned
        return body

    def _write_hidden(self, path: Path, body: bytes) -> None:
        if not self._made:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._made = True
        try:
            f = open(path, "wb")
        except FileNotFoundError:  # the spool directory was removed under us: make it again
            self.dir.mkdir(parents=True, exist_ok=True)
            f = open(path, "wb")
        try:
            with f:
                f.write(body)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
        except BaseException:
            try:
                path.unlink()
            except OSError:
                pass
            raise

    def _link_into_place(self, hidden: Path, name: str) -> Path:
        final = self.dir / name
        while True:
            try:
                os.link(hidden, final)  # fails rather than replace a segment that is still pending
                break
            except FileExistsError:
                final = self.dir / self._next_name(name.split(".", 1)[0])
            except OSError:
                # a file system without hard links (EPERM, ENOTSUP): a rename into a free name
                # (the names are this writer's own, the check is not raced by another writer)
                if final.exists():
                    final = self.dir / self._next_name(name.split(".", 1)[0])
                    continue
                os.replace(hidden, final)
                return final
        os.unlink(hidden)
        return final

    def write(self, table: str, rows: Sequence[Mapping[str, Any]]) -> Path | None:
        """Write ``rows`` as one segment; returns its path (None when ``rows`` is empty).

        Raises:
            ValueError: with ``validate``, a row that does not fit the table (nothing is written).
            OSError: the disk failed (nothing is in place).
        """
        if not rows:
            return None
        body = self._encode(table, rows)
        name = self._next_name(table)
        tmp = self.dir / f".{name}.tmp"
        self._write_hidden(tmp, body)
        try:
            final = self._link_into_place(tmp, name)
        except BaseException:
            try:
                tmp.unlink()
            except OSError:
                pass
            raise
        if self.fsync:
            _fsync_dir(self.dir)
        if self.on_write:
            self.on_write(table, len(rows))
        return final

    def stage(self, table: str, rows: Sequence[Mapping[str, Any]]) -> Path | None:
        """Write ``rows`` as a hidden, whole segment the shipper does not see yet (two-phase
        commit with the tailer's offsets: see :meth:`publish` and :meth:`recover`)."""
        if not rows:
            return None
        body = self._encode(table, rows)
        staged = self.dir / f"{STAGED}{self._next_name(table)}"
        tmp = staged.with_name(staged.name + ".tmp")
        self._write_hidden(tmp, body)
        os.replace(tmp, staged)
        if self.fsync:
            _fsync_dir(self.dir)
        self._staged_rows[staged.name] = (table, len(rows))
        return staged

    def publish(self, staged: Sequence[Path]) -> list[Path]:
        """Move staged segments into place (never over an existing segment); returns their paths."""
        out = []
        for p in staged:
            out.append(self._link_into_place(p, p.name[len(STAGED) :]))
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
