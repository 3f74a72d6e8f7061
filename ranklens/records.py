"""Records: one frozen dataclass per table, and the one place rows become Arrow batches.

The dataclasses (``CollectivesRecord``, ``StepsRecord``, ...) are plain source generated from
:mod:`ranklens.schema` by scripts/gen_records.py into :mod:`ranklens.formats.records_gen` (a type
checker sees every field), and tests/ground/test_records_gen.py fails when they drift from the schema.
Rows travel as plain dicts keyed by column name (the tracer writes them as JSON Lines without
importing anything heavy); :func:`to_arrow` validates and converts them.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, cast

from ranklens.schema import TABLES, Column, table

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa

    from ranklens.formats.records_gen import *  # noqa: F403  (the record classes, re-exported)

# The record classes are made on first use (PEP 562 ``__getattr__`` below): building the ~16 frozen,
# slotted dataclasses takes ~35 ms, which a one-shot ingest or analyze never needs (issue 18). The
# names follow scripts/gen_records.py's (tests/ground/test_records_gen.py checks they are the same).
_RECORD_NAMES = (
    "RECORD_TYPES",
    "Record",
    *("".join(p.capitalize() for p in name.split("_")) + "Record" for name in TABLES),
)


def __getattr__(name: str) -> Any:
    if name in _RECORD_NAMES:
        from ranklens.formats import records_gen

        return getattr(records_gen, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "arrow_array",
    "arrow_schema",
    "check_value",
    "decode_replacing",
    "empty_arrow",
    "numpy_array",
    "record_type",
    "repair_utf8",
    "to_arrow",
    *_RECORD_NAMES,
]


def record_type(table_name: str) -> type:
    """The frozen dataclass of ``table_name`` (e.g. ``CollectivesRecord``)."""
    from ranklens.formats.records_gen import RECORD_TYPES

    return RECORD_TYPES[table(table_name).name]


_INT_RANGES = {
    "Int32": (-(2**31), 2**31 - 1),
    "Int64": (-(2**63), 2**63 - 1),
    "UInt8": (0, 255),
    "UInt32": (0, 2**32 - 1),
    "UInt64": (0, 2**64 - 1),
}


def _check_scalar(type_: str, value: Any) -> Any:
    if type_ == "String":
        if not isinstance(value, str):
            raise TypeError(f"expected a string, got {type(value).__name__} {value!r:.60}")
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate: no store can hold it (issue 22 #1)
                raise ValueError(
                    f"not valid Unicode: {value[e.start : e.end]!r} at character {e.start} of {value!r:.60}"
                ) from None
        return value
    if type_ == "Float64":
        if value is None:
            return math.nan
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"expected a number, got {type(value).__name__} {value!r:.60}")
        return float(value)
    lo, hi = _INT_RANGES[type_]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer ({type_}), got {type(value).__name__} {value!r:.60}")
    if not lo <= value <= hi:
        raise ValueError(f"{value} is out of range for {type_} [{lo}, {hi}]")
    return value


def check_value(column: Column, value: Any) -> Any:
    """Validate one value for ``column``; return it normalised. Raises TypeError/ValueError."""
    if column.is_array:
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"expected a list ({column.type}), got {type(value).__name__}")
        return [_check_scalar(column.scalar_type, v) for v in value]
    return _check_scalar(column.type, value)


def _arrow_scalar(type_: str) -> pa.DataType:
    import pyarrow as pa

    return {
        "Int32": pa.int32(),
        "Int64": pa.int64(),
        "UInt8": pa.uint8(),
        "UInt32": pa.uint32(),
        "UInt64": pa.uint64(),
        "Float64": pa.float64(),
        "String": pa.string(),
    }[type_]


def arrow_type(column: Column) -> pa.DataType:
    import pyarrow as pa

    inner = _arrow_scalar(column.scalar_type)
    return pa.list_(inner) if column.is_array else inner


def arrow_schema(table_name: str) -> pa.Schema:
    """The Arrow schema of ``table_name`` (embedded parts are written with it)."""
    import pyarrow as pa

    t = table(table_name)
    return pa.schema(
        [pa.field(c.name, arrow_type(c), nullable=False) for c in t.columns],
        metadata={b"ranklens.table": t.name.encode()},
    )


def arrow_table(data: Mapping[str, Any] | list[Mapping[str, Any]], *, schema: pa.Schema) -> pa.Table:
    """``pa.table(data, schema=schema)`` for a ranklens table's schema, where the optional columns
    ``data`` lacks take their defaults (so columns added to the schema later do not break callers
    that build columns directly). ``data``: columns (name -> Arrow array, NumPy array or Python
    list) or rows (dicts). Columns are built with :func:`arrow_array` (no pandas import)."""
    import pyarrow as pa

    name = schema.metadata[b"ranklens.table"].decode()
    t = table(name)
    if isinstance(data, list):
        rows = [dict(r) for r in data]
        for c in t.columns:
            if not c.required:
                for r in rows:
                    r.setdefault(c.name, c.default_value())
        return pa.Table.from_pylist(rows, schema=schema)
    cols = dict(data)
    if unknown := sorted(set(cols) - set(schema.names)):
        raise ValueError(f"{name}: no column {', '.join(unknown)} (columns: {', '.join(schema.names)})")
    n = len(next(iter(cols.values()))) if cols else 0
    arrays = []
    for field in schema:
        if field.name in cols:
            arrays.append(arrow_array(field.type, cols[field.name]))
            continue
        c = t.column(field.name)
        if c.required:
            raise ValueError(f"{name}: the required column {field.name} is missing")
        arrays.append(arrow_array(field.type, [c.default_value()] * n))
    return pa.Table.from_arrays(arrays, schema=schema)


def arrow_array(t: pa.DataType, values: Any) -> pa.Array:
    """An Arrow array of type ``t`` (the schema's: an integer, float, string or list type) from an
    Arrow array, a NumPy array or a Python sequence. ``pa.array`` of Python values or NumPy arrays
    imports pandas to check whether they are pandas' (~50 MB and ~0.2 s of a one-shot command), so
    the usual columns (ints, floats, str, lists of them) are built from buffers; anything else (None,
    mixed types, a value out of range) goes to ``pa.array``, which converts or raises as it always did."""
    import numpy as np
    import pyarrow as pa

    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        return values if values.type == t else values.cast(t)
    n = len(values)
    if pa.types.is_string(t):
        seq = values.tolist() if isinstance(values, np.ndarray) else values
        try:
            text = "".join(seq)
            data = text.encode()
        except (TypeError, UnicodeEncodeError):  # a value that is not a str, a lone surrogate
            return pa.array(values, type=t)
        if len(data) > 2**31 - 1:  # past a string array's 32-bit offsets
            return pa.array(values, type=t)
        if len(data) == len(text):  # ASCII: a character is a byte
            lengths = np.fromiter(map(len, seq), np.int64, count=n)
        else:
            lengths = np.fromiter((len(v.encode()) for v in seq), np.int64, count=n)
        offsets = np.zeros(n + 1, np.int32)
        np.cumsum(lengths, out=offsets[1:])
        return pa.Array.from_buffers(t, n, [None, pa.py_buffer(offsets), pa.py_buffer(data)])
    if pa.types.is_list(t):
        if not all(isinstance(v, (list, tuple)) for v in values):
            return pa.array(values, type=t)  # None, or a NumPy array of lists
        offsets = np.zeros(n + 1, np.int32)
        np.cumsum(np.fromiter(map(len, values), np.int64, count=n), out=offsets[1:])
        child = arrow_array(t.value_type, list(itertools.chain.from_iterable(values)))
        return pa.Array.from_buffers(t, n, [None, pa.py_buffer(offsets)], children=[child])
    if not (pa.types.is_integer(t) or pa.types.is_floating(t)) or pa.types.is_float16(t):
        return pa.array(values, type=t)  # bools (bit-packed), dates, times, decimals: not a NumPy buffer
    dtype = np.dtype(t.to_pandas_dtype())
    arr = values if isinstance(values, np.ndarray) else (np.array(values) if n else np.zeros(0, dtype))
    if arr.dtype != dtype:
        exact = arr.dtype.kind in "iu" and dtype.kind in "iu"
        if not (exact or (arr.dtype.kind in "iuf" and dtype.kind == "f")):
            return pa.array(values, type=t)  # floats or bools for an integer column, objects (None, mixed)
        cast = arr.astype(dtype)
        if exact and not np.array_equal(cast, arr):  # out of range for the column's type
            return pa.array(values, type=t)
        arr = cast
    return pa.Array.from_buffers(t, n, [None, pa.py_buffer(np.ascontiguousarray(arr))])


def numpy_array(values: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A NumPy array of an Arrow column, as ``to_numpy(zero_copy_only=False)`` gives it (numbers as
    their dtype, strings and lists as object arrays: a list an array), without importing pandas
    (pyarrow's ``to_numpy`` does: ~50 MB and ~0.4 s of a one-shot command). Null-free numbers are a
    read-only view of the Arrow buffer; anything else (nulls, bools, dates) goes to ``to_numpy``."""
    import numpy as np
    import pyarrow as pa

    chunks = values.chunks if isinstance(values, pa.ChunkedArray) else [values]
    parts = [_chunk_numpy(c) for c in chunks]
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return _chunk_numpy(arrow_array(values.type, []))
    if all(p.dtype != object for p in parts):
        return np.concatenate(parts)
    out = np.empty(sum(len(p) for p in parts), dtype=object)
    i = 0
    for p in parts:
        out[i : i + len(p)] = p
        i += len(p)
    return out


def _chunk_numpy(a: pa.Array) -> np.ndarray:
    import numpy as np
    import pyarrow as pa

    t = a.type
    if a.null_count == 0:
        if (pa.types.is_integer(t) or pa.types.is_floating(t)) and not pa.types.is_float16(t):
            dtype = np.dtype(t.to_pandas_dtype())
            if len(a) == 0:
                return np.zeros(0, dtype)
            return np.frombuffer(a.buffers()[1], dtype=dtype, count=a.offset + len(a))[a.offset :]
        if pa.types.is_string(t) or pa.types.is_large_string(t):
            out = np.empty(len(a), dtype=object)
            out[:] = a.to_pylist()
            return out
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            flat = a.flatten()  # the values of the slice's lists only
            offsets = numpy_array(a.offsets)
            inner = _chunk_numpy(flat)
            out = np.empty(len(a), dtype=object)
            base = int(offsets[0]) if len(offsets) else 0
            for i in range(len(a)):
                out[i] = inner[int(offsets[i]) - base : int(offsets[i + 1]) - base]
            return out
    out = a.to_numpy(zero_copy_only=False)
    return cast("np.ndarray", out)


def empty_arrow(table_name: str) -> pa.Table:
    """A table of ``table_name``'s schema with no rows (``Schema.empty_table`` imports pandas)."""
    import pyarrow as pa

    schema = arrow_schema(table_name)
    return pa.Table.from_arrays([arrow_array(f.type, []) for f in schema], schema=schema)


def to_arrow(table_name: str, rows: Iterable[Mapping[str, Any] | Any], *, validate: bool = True) -> pa.Table:
    """Turn rows (dicts or records) into an Arrow table of ``table_name``'s schema.

    Absent optional columns take their default; unknown keys are an error (a typo must not
    silently lose data). With ``validate`` each value is type- and range-checked first.

    Raises:
        ValueError: naming the row index and the column.
    """
    import pyarrow as pa

    t = table(table_name)
    cols: dict[str, list[Any]] = {c.name: [] for c in t.columns}
    for i, row in enumerate(rows):
        if dataclasses.is_dataclass(row) and not isinstance(row, type):
            row = row.to_row()  # type: ignore[attr-defined]
        assert isinstance(row, Mapping)
        extra = set(row) - cols.keys()
        if extra:
            raise ValueError(f"row {i}: unknown column(s) {sorted(extra)} for table {t.name}")
        for c in t.columns:
            if c.name in row:
                v = row[c.name]
                if validate:
                    try:
                        v = check_value(c, v)
                    except (TypeError, ValueError) as e:
                        raise ValueError(f"row {i}: column {c.name}: {e}") from None
            elif c.required:
                raise ValueError(f"row {i}: required column {c.name} is missing")
            else:
                v = c.default_value()
            cols[c.name].append(v)
    schema = arrow_schema(t.name)
    return pa.Table.from_arrays([arrow_array(arrow_type(c), cols[c.name]) for c in t.columns], schema=schema)


# --- strings that are not UTF-8 ----------------------------------------------------------------
# Ingest refuses them (the shipper quarantines such a segment), but a store may hold some already
# (written by an older ranklens, or by another client): readers decode them with U+FFFD rather than
# fail (issue 22 #5).


def decode_replacing(value: Any) -> Any:
    """``value`` with every ``bytes`` in it (lists included) decoded as UTF-8 with U+FFFD."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, (list, tuple)):
        return [decode_replacing(v) for v in value]
    return value


def _as_binary(t: pa.DataType) -> pa.DataType | None:
    """The type with its strings as binary (None: it holds no strings)."""
    import pyarrow as pa

    if pa.types.is_string(t):
        return pa.binary()
    if pa.types.is_large_string(t):
        return pa.large_binary()
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        inner = _as_binary(t.value_type)
        if inner is None:
            return None
        return pa.list_(inner) if pa.types.is_list(t) else pa.large_list(inner)
    return None


def repair_utf8(data: pa.Table) -> pa.Table:
    """``data`` with every string that is not valid UTF-8 decoded with U+FFFD (columns that are
    valid, the usual case, are checked in Arrow and passed through untouched)."""
    import pyarrow as pa

    columns = []
    changed = False
    for field, col in zip(data.schema, data.columns):
        binary = _as_binary(field.type)
        if binary is not None:
            try:
                col.validate(full=True)
            except pa.ArrowInvalid:
                values = decode_replacing(col.cast(binary).to_pylist())
                col = pa.chunked_array([arrow_array(field.type, values)], type=field.type)
                changed = True
        columns.append(col)
    return pa.Table.from_arrays(columns, schema=data.schema) if changed else data
