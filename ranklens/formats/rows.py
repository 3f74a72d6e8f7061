"""Readers of the open ingest format: JSON Lines or Parquet files of ranklens records, one table per file.

JSON Lines: an optional header line ``{"ranklens": "records", "version": 1, "table": "<table>"}``,
then one JSON object per line whose keys are the table's columns (docs/ingest-format.md); the
spool's segments (:mod:`ranklens.formats.spool`) are such files. Parquet: columns named like the
table's columns. The table comes from (in order) the caller's ``table`` argument, the JSONL header /
Parquet metadata key ``ranklens.table``, or the file name's first word (``collectives.jsonl``,
``steps-rank3.parquet``). A malformed file raises :class:`IngestError` naming the file, line/row
and field.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ranklens.errors import IngestError
from ranklens.formats.spool import SPOOL_FORMAT, SPOOL_VERSION  # one format: spool segments are ingestable
from ranklens.records import arrow_array, arrow_schema, check_value, to_arrow
from ranklens.schema import TABLES

__all__ = ["file_format", "jsonl_table_hint", "read_file", "read_jsonl", "read_parquet"]


def _table_from_name(path: Path) -> str | None:
    word = re.split(r"[.\-]", path.name, maxsplit=1)[0]
    return word if word in TABLES else None


def _resolve_table(path: Path, explicit: str | None, declared: str | None) -> str:
    for candidate, source in (
        (explicit, "--table"),
        (declared, "the file's header"),
        (_table_from_name(path), "the file name"),
    ):
        if candidate:
            if candidate not in TABLES:
                raise IngestError(
                    str(path), "", f"unknown table {candidate!r} from {source}; tables: {', '.join(TABLES)}"
                )
            return candidate
    raise IngestError(
        str(path),
        "",
        "cannot tell which table the records belong to: add a header line "
        '{"ranklens": "records", "version": 1, "table": "..."}, name the file <table>.jsonl, or pass --table',
    )


def jsonl_table_hint(path: str | Path, table: str | None, data: bytes) -> str | None:
    """The table a JSON Lines file's rows are for, told from ``--table``, its header line or its
    name without parsing the rows (None when none of them tells): what :func:`read_jsonl` will
    most likely answer, so the file's ingest id can be hashed while the rows are parsed."""
    nl = data.find(b"\n")
    first = data[: nl if nl >= 0 else len(data)]
    declared = None
    if b'"ranklens"' in first:
        try:
            head = json.loads(first)
        except ValueError:
            return None
        declared = head.get("table") if isinstance(head, dict) else None
    try:
        return _resolve_table(Path(path), table, declared if isinstance(declared, str) else None)
    except IngestError:
        return None


def _lines_of_one_object(data: bytes, start: int) -> int:
    """How many lines ``data[start:]`` has when every one of them is exactly one ``{...}`` and
    nothing else, as JSONEachRow writers and the spool write them (0 otherwise: a blank line, an
    object over two lines, spaces or ``\\r`` around one). Arrow's reader takes any whitespace
    between objects, the line-by-line reader does not; a raw newline cannot be inside a JSON string,
    so when every newline sits between ``}`` and ``{`` no object spans two lines, and a table with
    as many rows as lines then has one object a line. Two counts over the bytes, no array as large
    as the file (a one-shot ingest paid ~0.1 s of page faults for numpy's)."""
    end = len(data) - 1 if data.endswith(b"\n") else len(data)
    if end <= start or data[start] != ord("{") or data[end - 1] != ord("}"):
        return 0
    breaks = data.count(b"\n", start, end)  # inside the body: neither its first nor its last byte
    if breaks and data.count(b"}\n{", start, end) != breaks:  # such matches cannot overlap: one newline each
        return 0
    return breaks + 1


def _parse_type(t: Any) -> Any:
    """The type Arrow's JSON reader parses a column of type ``t`` as: integers as 64 bits (its
    converters to narrower integers are ~2.5x slower than to Int64 and a checked cast after)."""
    import pyarrow as pa

    if pa.types.is_list(t):
        return pa.list_(_parse_type(t.value_type))
    if pa.types.is_integer(t) and t != pa.uint64():
        return pa.int64()
    return t


def _read_jsonl_fast(path: Path, table: str | None, content: bytes | None = None) -> tuple[str, Any] | None:
    """Arrow's JSON reader with the table's schema, then columnar checks: about ten times faster
    than validating value by value, with or without a header line. Returns None whenever anything
    is unusual (a type or range problem, a missing required field, an explicit ``null`` where it
    matters, a blank line, a table that cannot be told): the strict reader then says exactly what
    and where, or takes the file; on every file the fast reader takes, the two agree."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.json as pj

    try:
        data = path.read_bytes() if content is None else content
        nl = data.find(b"\n")
        first = data[: nl if nl >= 0 else len(data)]
        head = json.loads(first) if b'"ranklens"' in first else None
        if isinstance(head, dict) and "ranklens" in head:
            if head.get("ranklens") != SPOOL_FORMAT or head.get("version") != SPOOL_VERSION or nl < 0:
                return None
            name, start = table or head.get("table"), nl + 1
        else:  # no header: --table or the file name says which table
            name, start = table or _table_from_name(path), 0
        lines = _lines_of_one_object(data, start)
        if name not in TABLES or not lines:
            return None
        target = arrow_schema(name)
        loose = pa.schema([pa.field(f.name, _parse_type(f.type), nullable=True) for f in target])
        opts = pj.ParseOptions(explicit_schema=loose, unexpected_field_behavior="error")
        # small segments (most of a live spool): Arrow's thread pool costs more than it saves
        threads = pj.ReadOptions(use_threads=len(data) - start > 1 << 20, block_size=8 << 20)
        got = pj.read_json(pa.BufferReader(pa.py_buffer(data)[start:]), read_options=threads, parse_options=opts)
    except Exception:
        return None
    if got.num_rows != lines:  # two objects on one line
        return None
    # a null is a key left out (the column's default) or an explicit null (the strict reader's
    # error, or NaN in a Float64 column): told apart by counting `"name":null` (and `"name": null`);
    # when those do not account for every "null" in the file (a null in a list, in a string, other
    # spacing), the strict reader decides
    cols = {c.name: got.column(c.name) for c in TABLES[name].columns}
    explicit: dict[str, int] = {}
    if any(col.null_count for col in cols.values()):
        total = data.count(b"null", start)
        if total:
            for n, col in cols.items():
                if col.null_count:
                    key = b'"' + n.encode() + b'":'
                    explicit[n] = data.count(key + b"null", start) + data.count(key + b" null", start)
            if sum(explicit.values()) != total:
                return None
    elif any(c.is_array and pc.list_flatten(cols[c.name]).null_count for c in TABLES[name].columns):
        return None  # a null in a list: the strict reader's error (or NaN in an Array(Float64))
    columns = []
    for c, field in zip(TABLES[name].columns, target):
        col = cols[c.name]
        if "String" in c.type:  # Arrow's JSON reader does not check UTF-8 (issue 22 #5): the strict reader says where
            try:
                col.validate(full=True)
            except pa.ArrowInvalid:
                return None
        if col.type != field.type:  # Int32, UInt8, ...: parsed as 64 bits, then a checked cast
            try:
                col = col.cast(field.type, safe=True)
            except pa.ArrowInvalid:  # out of range: the strict reader names the line
                return None
        if col.null_count:
            default = c.default_value()
            nan_either_way = c.type == "Float64" and default != default
            if c.required or (explicit.get(c.name) and not nan_either_way):
                return None
            col = pc.fill_null(col, arrow_array(field.type, [default])[0])
        columns.append(col)
    return name, pa.Table.from_arrays(columns, schema=target)


def read_jsonl(path: str | Path, table: str | None = None, *, content: bytes | None = None) -> tuple[str, Any]:
    """Read and validate a JSON Lines file; return (table name, Arrow table). ``content``: the
    file's bytes when the caller has read them already."""
    path = Path(path)
    fast = _read_jsonl_fast(path, table, content)
    if fast is not None:
        return fast
    return _read_jsonl_strict(path, table)


def _read_jsonl_strict(path: Path, table: str | None) -> tuple[str, Any]:
    """Value-by-value validation, with the line and field of the first problem."""
    declared: str | None = None
    rows: list[dict[str, Any]] = []
    line_nos: list[int] = []
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise IngestError(str(path), "", f"cannot open: {e.strerror}") from None
    with f:
        try:
            for no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise IngestError(
                        str(path), f"line {no}", f"not valid JSON ({e.msg} at column {e.colno})"
                    ) from None
                if not isinstance(obj, dict):
                    raise IngestError(str(path), f"line {no}", f"expected a JSON object, got {type(obj).__name__}")
                if "ranklens" in obj and not rows and declared is None:
                    if obj.get("ranklens") != SPOOL_FORMAT or obj.get("version") != SPOOL_VERSION:
                        raise IngestError(
                            str(path),
                            f"line {no}",
                            f"unsupported header {obj!r}; this ranklens reads version {SPOOL_VERSION}",
                        )
                    declared = obj.get("table")
                    continue
                if not rows and declared is None:
                    # no header: the table is told now or never (a file that cannot say is refused
                    # before its millions of lines are parsed into memory)
                    _resolve_table(path, table, None)
                rows.append(obj)
                line_nos.append(no)
        except UnicodeDecodeError as e:
            raise IngestError(str(path), f"byte {e.start}", "not UTF-8 text") from None
    name = _resolve_table(path, table, declared)
    t = TABLES[name]
    for obj, no in zip(rows, line_nos):
        for key, value in obj.items():
            if not t.has_column(key):
                raise IngestError(str(path), f"line {no}", f"field {key!r} is not a column of {name}")
            try:
                obj[key] = check_value(t.column(key), value)
            except (TypeError, ValueError) as e:
                raise IngestError(str(path), f"line {no}", f"field {key!r}: {e}") from None
        for c in t.columns:
            if c.required and c.name not in obj:
                raise IngestError(str(path), f"line {no}", f"required field {c.name!r} is missing")
    return name, to_arrow(name, rows, validate=False)


def read_parquet(path: str | Path, table: str | None = None) -> tuple[str, Any]:
    """Read and validate a Parquet file; return (table name, Arrow table)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    path = Path(path)
    try:
        data = pq.read_table(path)
    except (OSError, pa.ArrowException) as e:
        raise IngestError(str(path), "", f"not a readable Parquet file: {e}") from None
    meta = data.schema.metadata or {}
    declared = meta.get(b"ranklens.table", b"").decode() or None
    name = _resolve_table(path, table, declared)
    t = TABLES[name]
    target = arrow_schema(name)
    extra = [c for c in data.column_names if not t.has_column(c)]
    if extra:
        raise IngestError(str(path), "", f"column(s) {extra} are not columns of {name}")
    arrays = []
    for c, field in zip(t.columns, target):
        if c.name not in data.column_names:
            if c.required:
                raise IngestError(str(path), "", f"required column {c.name!r} is missing")
            arrays.append(pa.array([c.default_value()] * data.num_rows, type=field.type))
            continue
        col = data.column(c.name)
        if col.null_count:
            first = pc.index(pc.is_null(col), True).as_py()
            raise IngestError(str(path), f"row {first}", f"column {c.name!r} is null (use the default instead)")
        try:
            arrays.append(col.cast(field.type, safe=True))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise IngestError(
                str(path), "", f"column {c.name!r} ({col.type}) cannot be read as {c.type}: {e}"
            ) from None
    return name, pa.Table.from_arrays(arrays, schema=target)


def file_format(path: Path, fmt: str | None = None) -> str:
    """``fmt``, else the format the file's extension names (``jsonl`` unless .parquet/.pq)."""
    return fmt or ("parquet" if path.suffix in (".parquet", ".pq") else "jsonl")


def read_file(
    path: str | Path, fmt: str | None = None, table: str | None = None, *, content: bytes | None = None
) -> tuple[str, Any]:
    """Read one file of the open format; ``fmt`` defaults to the file's extension. ``content``: a
    JSON Lines file's bytes when the caller has read them already."""
    path = Path(path)
    fmt = file_format(path, fmt)
    if fmt == "jsonl":
        return read_jsonl(path, table, content=content)
    if fmt == "parquet":
        return read_parquet(path, table)
    raise IngestError(str(path), "", f"format {fmt!r} is not readable by read_file")
