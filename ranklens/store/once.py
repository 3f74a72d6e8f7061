"""Writing a batch at most once: the ``ingest_id`` scheme of the shipper, for one-off ingests.

A batch is stamped with an ``ingest_id`` derived from what it is made of (a file's content, the
job it is filed under); before writing, the store is asked how many rows of that id it holds:
all of them -> nothing is written; none -> written; some (an ingest interrupted between two
blocks) -> those rows are discarded and the batch written again. So ingesting the same input
twice stores its rows once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ranklens.errors import IngestError
from ranklens.schema import INGEST_ID
from ranklens.store.api import Store, SupportsDiscardIngest, SupportsIngestRows

__all__ = ["key_ingest_id", "stamp", "stored_ingest_rows", "write_once"]


def key_ingest_id(parts: Iterable[bytes]) -> int:
    """63 bits of BLAKE2b over ``parts`` (never 0: 0 means "not stamped")."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(len(p).to_bytes(8, "little") + p)
    return (int.from_bytes(h.digest(), "little") & (2**63 - 1)) or 1


def stamp(data: Any, ingest_id: int) -> Any:
    """``data`` (Arrow rows of a schema table) with every row's ``ingest_id`` set (the column added
    if missing): the one stamp of ``ranklens ingest``, the write-once ingests and the shipper."""
    import numpy as np
    import pyarrow as pa

    from ranklens.records import arrow_array

    # from a buffer: pa.array of a Python list costs a conversion a row and imports pandas (issue 18)
    col = arrow_array(pa.uint64(), np.full(data.num_rows, ingest_id, dtype=np.uint64))
    if INGEST_ID in data.column_names:
        return data.set_column(data.column_names.index(INGEST_ID), INGEST_ID, col)
    return data.append_column(INGEST_ID, col)


def stored_ingest_rows(store: Store, table: str, ids: Sequence[int]) -> dict[int, int]:
    """Rows per ``ingest_id`` that the store already holds in ``table``."""
    if isinstance(store, SupportsIngestRows):
        return store.ingest_rows(table, ids)
    found: dict[int, int] = {}
    for i in range(0, len(ids), 1000):
        chunk = ", ".join(str(int(x)) for x in ids[i : i + 1000])
        res = store.query(
            f"SELECT {INGEST_ID} AS id, count() AS n FROM {table} WHERE {INGEST_ID} IN ({chunk}) GROUP BY id"
        )
        for id_, n in res.rows():
            found[int(id_)] = int(n)
    return found


def write_once(store: Store, batches: Mapping[str, Any], key: Sequence[bytes]) -> tuple[dict[str, int], dict[str, int]]:
    """Write ``batches`` (table -> Arrow table), each stamped with an id from ``key`` and its table
    name, unless the store holds them already. Returns (rows written, rows already there) per table.

    Raises:
        IngestError: the store holds part of a batch and cannot discard it.
    """
    fresh: dict[str, Any] = {}
    already: dict[str, int] = {}
    for table, data in batches.items():
        if data.num_rows == 0:
            continue
        iid = key_ingest_id([*key, table.encode()])
        n = stored_ingest_rows(store, table, [iid]).get(iid, 0)
        if n == data.num_rows:
            already[table] = n
            continue
        if n:  # a write interrupted half-way: drop what it left, write it whole
            if not isinstance(store, SupportsDiscardIngest):
                raise IngestError(table, "", "the store holds part of these rows and cannot discard them")
            store.discard_ingest(table, [iid])
        fresh[table] = stamp(data, iid)
    written = store.write_many(fresh) if fresh else {}
    return dict(written), already
