"""The store interface: write Arrow batches, run SQL, read results as Arrow or numpy.

Two backends implement it: :mod:`ranklens.store.embedded` (chDB over immutable Parquet parts,
safe for many processes at once) and :mod:`ranklens.store.server` (a ClickHouse server or
cluster over the native protocol). Analyzer SQL names tables plainly (``FROM collectives``) and
runs unchanged on both.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa

__all__ = ["READ_STATEMENTS", "QueryResult", "Store", "read_only_statement", "sql_escape", "sql_string"]

READ_STATEMENTS = ("SELECT", "WITH", "SHOW", "DESCRIBE", "DESC", "EXISTS")


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
        """One column as a numpy array (lists become object arrays)."""
        return self.arrow.column(name).to_numpy(zero_copy_only=False)

    def rows(self) -> list[tuple[Any, ...]]:
        cols = [self.arrow.column(i).to_pylist() for i in range(self.arrow.num_columns)]
        return list(zip(*cols)) if cols else []

    def to_pylist(self) -> list[dict[str, Any]]:
        return self.arrow.to_pylist()

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
    """

    url: str
    backend: str

    def write(self, table: str, data: pa.Table | Iterable[Mapping[str, Any] | Any]) -> int:
        """Append rows (Arrow table of the table's schema, or dicts/records); return the count."""
        ...

    def write_many(self, batches: Mapping[str, pa.Table]) -> dict[str, int]:
        """Append several tables' batches; the embedded store commits them together."""
        ...

    def query(self, sql: str) -> QueryResult:
        """Run one SQL statement and return its rows. Raises StoreError on bad SQL."""
        ...

    def close(self) -> None: ...
