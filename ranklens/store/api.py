"""The store interface: write Arrow batches, run SQL, read results as Arrow or numpy.

Two backends implement it: :mod:`ranklens.store.embedded` (chDB over immutable Parquet parts,
safe for many processes at once) and :mod:`ranklens.store.server` (a ClickHouse server or
cluster over the native protocol). Analyzer SQL names tables plainly (``FROM collectives``) and
runs unchanged on both.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa

__all__ = ["QueryResult", "Store", "sql_escape", "sql_string"]


def sql_escape(s: str) -> str:
    """``s`` escaped for use inside a single-quoted ClickHouse string literal."""
    return str(s).replace("\\", "\\\\").replace("'", "\\'")


def sql_string(s: str) -> str:
    """``s`` as a single-quoted ClickHouse string literal."""
    return "'" + sql_escape(s) + "'"


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
