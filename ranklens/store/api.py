"""The store interface: write Arrow batches, run SQL, read results as Arrow or numpy.

Two backends implement it: :mod:`ranklens.store.embedded` (chDB over immutable Parquet parts,
safe for many processes at once) and :mod:`ranklens.store.server` (a ClickHouse server or
cluster over the native protocol). Analyzer SQL names tables plainly (``FROM collectives``) and
runs unchanged on both.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa

    from ranklens.schema import Table

__all__ = [
    "DEFAULT_BATCH_ROWS",
    "READ_STATEMENTS",
    "QueryResult",
    "Store",
    "SupportsCompact",
    "SupportsDiscardIngest",
    "SupportsIngestRows",
    "arrow_batch",
    "check_batch_rows",
    "read_only_statement",
    "rebatch",
    "sql_escape",
    "sql_string",
]

READ_STATEMENTS = ("SELECT", "WITH", "SHOW", "DESCRIBE", "DESC", "EXISTS")
DEFAULT_BATCH_ROWS = 65_536  # rows per batch of Store.iter_query


def sql_escape(s: str) -> str:
    """``s`` escaped for use inside a single-quoted ClickHouse string literal."""
    return str(s).replace("\\", "\\\\").replace("'", "\\'")


def sql_string(s: str) -> str:
    """``s`` as a single-quoted ClickHouse string literal."""
    return "'" + sql_escape(s) + "'"


def _code_tokens(sql: str) -> list[tuple[str, int]]:
    """``sql`` outside string literals, quoted identifiers and comments, as (kind, position) tokens:
    ``("word:X", i)`` for a bare word (upper-cased) and ``(";", i)`` for a statement separator."""
    out: list[tuple[str, int]] = []
    i, n = 0, len(sql)
    while i < n:
        c = sql[i]
        if c in "'\"`":
            j = i + 1
            while j < n and sql[j] != c:
                j += 2 if sql[j] == "\\" else 1
            i = j + 1
        elif sql.startswith("--", i) or c == "#":
            j = sql.find("\n", i)
            i = n if j < 0 else j + 1
        elif sql.startswith("/*", i):
            j = sql.find("*/", i + 2)
            i = n if j < 0 else j + 2
        elif c == ";":
            out.append((";", i))
            i += 1
        elif c.isalpha() or c == "_":
            j = i
            while j < n and (sql[j].isalnum() or sql[j] == "_"):
                j += 1
            out.append(("word:" + sql[i:j].upper(), i))
            i = j
        else:
            i += 1
    return out


def read_only_statement(sql: str) -> str:
    """``sql`` when it is exactly one read statement (``SELECT``, ``WITH``, ``SHOW``, ``DESCRIBE``,
    ``EXISTS``; a trailing ``;`` is allowed), without the trailing ``;``.

    Raises:
        ConfigError: several statements, a statement that is not a read (``DROP``, ``INSERT``,
            ``ALTER``, ``SET``, ...), ``INTO OUTFILE``, or no statement at all.
    """
    from ranklens.errors import ConfigError

    tokens = _code_tokens(sql)
    seps = [i for kind, i in tokens if kind == ";"]
    words = [kind[5:] for kind, _ in tokens if kind != ";"]
    if not words:
        raise ConfigError('no SQL statement given; e.g. `ranklens sql "SELECT count() FROM steps"`')
    if seps and any(kind != ";" for kind, i in tokens if i > seps[0]):
        raise ConfigError(
            f"{len(seps) + 1} statements given (separated by ';'); `ranklens sql` runs one read statement at a time"
        )
    if words[0] not in READ_STATEMENTS:
        raise ConfigError(
            f"`ranklens sql` runs read statements only ({', '.join(READ_STATEMENTS)}), not {words[0]}: the store is "
            "written by the collector and `ranklens ingest`; nothing was changed"
        )
    if any(a == "INTO" and b == "OUTFILE" for a, b in itertools.pairwise(words)):
        raise ConfigError("`ranklens sql` does not write files (INTO OUTFILE); use --json or the table output")
    return sql[: seps[0]] if seps else sql


class QueryResult:
    """Rows of a query, column-oriented (backed by a ``pyarrow.Table``)."""

    def __init__(self, table: pa.Table) -> None:
        self.arrow = table

    @property
    def columns(self) -> list[str]:
        return list(self.arrow.column_names)

    @property
    def num_rows(self) -> int:
        return int(self.arrow.num_rows)

    def __len__(self) -> int:
        return self.num_rows

    def column(self, name: str) -> np.ndarray:
        """One column as a numpy array (lists become object arrays; no pandas import: see
        :func:`ranklens.records.numpy_array`)."""
        from ranklens.records import numpy_array

        return numpy_array(self.arrow.column(name))

    def rows(self) -> list[tuple[Any, ...]]:
        cols = [self.arrow.column(i).to_pylist() for i in range(self.arrow.num_columns)]
        return list(zip(*cols)) if cols else []

    def to_pylist(self) -> list[dict[str, Any]]:
        return self.arrow.to_pylist()

    @classmethod
    def concat(cls, parts: Iterable[QueryResult]) -> QueryResult:
        """The rows of several results of one query shape, in order (a query run in parts)."""
        import pyarrow as pa

        tables = [p.arrow for p in parts]
        if len(tables) == 1:
            return cls(tables[0])
        return cls(pa.concat_tables(tables))

    def scalar(self) -> Any:
        """The single value of a one-row, one-column result."""
        if self.num_rows != 1 or self.arrow.num_columns != 1:
            raise ValueError(f"expected one value, got {self.num_rows} rows x {self.arrow.num_columns} columns")
        return self.arrow.column(0)[0].as_py()


@runtime_checkable
class Store(Protocol):
    """What every store backend offers.

    Writes are atomic per call: after a failure nothing of the call is visible (the embedded
    store commits all tables of a call at once; the server inserts each table's batch as one
    block).

    Optional capabilities are the small protocols below (:class:`SupportsDiscardIngest`,
    :class:`SupportsCompact`); test for them with ``isinstance(store, SupportsCompact)``.
    """

    url: str
    backend: str

    def write(self, table: str, data: pa.Table | Iterable[Mapping[str, Any] | Any]) -> int:
        """Append rows (Arrow table of the table's schema, or dicts/records); return the count.

        Raises:
            StoreUnavailable: the store cannot be reached (nothing of the call was written).
            StoreError: the store refused the rows.
        """
        ...

    def write_many(self, batches: Mapping[str, pa.Table]) -> dict[str, int]:
        """Append several tables' batches; the embedded store commits them together."""
        ...

    def query(self, sql: str) -> QueryResult:
        """Run one SQL statement and return all its rows.

        Raises:
            StoreError: bad SQL (or a query the store rejects).
            StoreUnavailable: the store cannot be reached or read.
        """
        ...

    def iter_query(self, sql: str, *, batch_rows: int = DEFAULT_BATCH_ROWS) -> Iterator[QueryResult]:
        """Run one SQL statement and yield its rows in batches of at most ``batch_rows`` rows,
        without holding the whole result in memory (every batch has the result's columns; an
        empty result yields nothing). Close the iterator (or read it to its end) to free the query.

        Raises:
            ValueError: ``batch_rows`` is not a positive integer.
            StoreError: bad SQL (raised on the first ``next()``).
            StoreUnavailable: the store cannot be reached or read.
        """
        ...

    def close(self) -> None: ...


@runtime_checkable
class SupportsDiscardIngest(Protocol):
    """A store that can remove the rows of given ``ingest_id`` batches: what lets a collector (or
    ``ranklens ingest``) re-send a batch the store holds in part without duplicating rows."""

    def discard_ingest(self, table: str, ingest_ids: Iterable[int]) -> int:
        """Remove every row of ``table`` whose ``ingest_id`` is in ``ingest_ids``; return how many
        rows went. On return the batches can be sent again: rows written after this call are never
        removed by it. The removed rows are gone for later queries on return, except on a
        ClickHouse cluster whose deletion waits for a replica that is down (the server store
        then warns, and the rows go when that replica is back)."""
        ...


@runtime_checkable
class SupportsIngestRows(Protocol):
    """A store that counts the rows of given ``ingest_id`` batches without a query (the embedded
    store reads its parts' Parquet footers: a one-shot ingest then never starts chDB)."""

    def ingest_rows(self, table: str, ingest_ids: Iterable[int]) -> dict[int, int]:
        """Rows per ``ingest_id`` of ``ingest_ids`` that ``table`` holds (ids it lacks are absent)."""
        ...


@runtime_checkable
class SupportsCompact(Protocol):
    """A store whose small parts a caller merges (the embedded store; a ClickHouse server merges
    its own parts and does not offer this)."""

    def compact(self) -> dict[str, int]:
        """Merge small parts; return how many parts each table lost."""
        ...


def arrow_batch(table_name: str, data: Any) -> tuple[Table, pa.Table]:
    """What :meth:`Store.write` takes for ``table_name`` (an Arrow table, records or dicts, or one of
    them) as the table's schema entry and an Arrow table of exactly its columns and types."""
    import pyarrow as pa

    from ranklens.records import arrow_schema, to_arrow
    from ranklens.schema import table

    t = table(table_name)
    if not isinstance(data, pa.Table):
        data = to_arrow(t.name, data if isinstance(data, Iterable) else [data])
    return t, data.select(t.column_names).cast(arrow_schema(t.name))


def check_batch_rows(batch_rows: int) -> int:
    """``batch_rows`` when it is a positive integer (for :meth:`Store.iter_query`), else ValueError."""
    if isinstance(batch_rows, bool) or not isinstance(batch_rows, int) or batch_rows < 1:
        raise ValueError(f"batch_rows must be a positive integer, not {batch_rows!r}")
    return batch_rows


def rebatch(chunks: Iterable[pa.Table | pa.RecordBatch], batch_rows: int) -> Iterator[QueryResult]:
    """``chunks`` (of one schema, any sizes) as results of exactly ``batch_rows`` rows each, but the
    last; empty chunks are skipped. Holds at most one batch plus one chunk at a time."""
    import pyarrow as pa

    pending: list[pa.Table] = []
    held = 0
    for chunk in chunks:
        t = chunk if isinstance(chunk, pa.Table) else pa.Table.from_batches([chunk])
        while t.num_rows:
            take = min(batch_rows - held, t.num_rows)
            pending.append(t.slice(0, take))
            held += take
            t = t.slice(take)
            if held == batch_rows:
                yield QueryResult(pa.concat_tables(pending).combine_chunks())
                pending, held = [], 0
    if held:
        yield QueryResult(pa.concat_tables(pending).combine_chunks())
