"""``ranklens ingest``: files of the open ingest format into the store. The format and its readers
(JSON Lines, Parquet: ``read_file``, ``read_jsonl``, ``read_parquet``) are the ground floor's,
:mod:`ranklens.formats.rows`.

Everything is read and validated before anything is written: a malformed file raises
:class:`IngestError` naming the file, line/row and field, and the store is untouched.

Ingesting is idempotent, like the collector's shipping: every row of a file is stamped with the
file's ``ingest_id`` (63 bits of BLAKE2b over its table and content, the shipper's scheme), and a
file whose rows the store already holds is not written again (a file the store holds in part, an
interrupted ingest, is discarded and written again), however it was renamed or moved meanwhile.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ranklens.errors import IngestError
from ranklens.formats.digest import feed_file
from ranklens.formats.rows import file_format, jsonl_table_hint, read_file
from ranklens.store.api import Store, SupportsDiscardIngest
from ranklens.store.once import stamp, stored_ingest_rows

__all__ = ["FORMATS", "expand", "file_ingest_id", "ingest_paths"]

FORMATS = ("jsonl", "parquet", "flight-recorder", "kineto")


def expand(paths: Sequence[str | Path]) -> list[Path]:
    """Files named, and the *.jsonl / *.parquet files under directories named (sorted)."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(sorted(q for q in p.rglob("*") if q.is_file() and q.suffix in (".jsonl", ".parquet", ".pq")))
        elif p.exists():
            out.append(p)
        else:
            raise IngestError(str(p), "", "no such file or directory")
    return out


def file_ingest_id(path: str | Path, table: str) -> int:
    """The ``ingest_id`` of a file's rows: 63 bits of BLAKE2b over its table and content (never 0),
    the scheme the shipper uses for spool segments; independent of the file's name and place."""
    h = _ingest_hash(table)
    try:
        feed_file(h, path)
    except OSError as e:
        raise IngestError(str(path), "", f"cannot read: {e.strerror}") from None
    return _id_of(h)


def content_ingest_id(content: bytes, table: str) -> int:
    """:func:`file_ingest_id` of a file whose bytes are ``content``."""
    h = _ingest_hash(table)
    h.update(content)  # hashlib lets go of the GIL on large data: this runs beside the parse
    return _id_of(h)


def _ingest_hash(table: str) -> Any:
    h = hashlib.blake2b(digest_size=8)
    h.update(b"ranklens ingest\0" + table.encode() + b"\0")
    return h


def _id_of(h: Any) -> int:
    """The ingest id of a finished hash: its 63 low bits, never 0."""
    return (int.from_bytes(h.digest(), "little") & (2**63 - 1)) or 1


def _read_one(p: Path, fmt: str | None, table: str | None) -> tuple[str, Any, int]:
    """(table, rows, ingest id) of one file. A JSON Lines file is read once: its ingest id is hashed
    from those bytes in a thread while Arrow parses them, for the table its header, ``--table`` or
    name tells (hashed again, after, in the rare case that the parse tells another)."""
    if file_format(p, fmt) != "jsonl":
        name, data = read_file(p, fmt, table)
        return name, data, file_ingest_id(p, name)
    try:
        content = p.read_bytes()
    except OSError as e:
        raise IngestError(str(p), "", f"cannot read: {e.strerror}") from None
    hint = jsonl_table_hint(p, table, content)
    box: dict[str, int] = {}
    worker = None
    if hint is not None:
        worker = threading.Thread(target=lambda: box.setdefault("iid", content_ingest_id(content, hint)), daemon=True)
        worker.start()
    try:
        name, data = read_file(p, fmt, table, content=content)
    finally:
        if worker is not None:
            worker.join()
    iid = box.get("iid") if name == hint else None
    return name, data, iid if iid is not None else content_ingest_id(content, name)


def ingest_paths(
    store: Store,
    paths: Sequence[str | Path],
    *,
    fmt: str | None = None,
    table: str | None = None,
    progress: Callable[[Path], None] | None = None,
    already: dict[str, int] | None = None,
) -> dict[str, int]:
    """Validate every file, then write those the store does not hold yet; returns rows written per
    table (``already``, when given, receives the rows per table that were in the store before).

    Raises:
        IngestError: on the first malformed file (nothing was written).
    """
    import pyarrow as pa

    files: dict[str, dict[int, Any]] = {}  # table -> ingest_id -> rows (the same file twice: once)
    for p in expand(paths):
        name, data, iid = _read_one(p, fmt, table)
        data = stamp(data, iid)
        if data.num_rows:
            files.setdefault(name, {})[iid] = data
        if progress:
            progress(p)
    merged: dict[str, Any] = {}
    for name, by_id in files.items():
        stored = stored_ingest_rows(store, name, sorted(by_id))
        partial = [i for i, n in stored.items() if 0 < n < by_id[i].num_rows]
        if partial:  # an ingest interrupted half-way (a server applies a block atomically; several blocks not)
            if not isinstance(store, SupportsDiscardIngest):
                raise IngestError(name, "", "the store holds part of these files' rows and cannot discard them")
            store.discard_ingest(name, partial)
        fresh = [d for i, d in by_id.items() if i in partial or not stored.get(i)]
        if already is not None:
            n = sum(d.num_rows for i, d in by_id.items() if i not in partial and stored.get(i))
            if n:
                already[name] = already.get(name, 0) + n
        if fresh:
            merged[name] = pa.concat_tables(fresh)
    return store.write_many(merged) if merged else {}
