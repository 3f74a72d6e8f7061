"""Exactly once: every spool row carries its segment's ``ingest_id``; a segment in doubt is
*settled* by asking the store how many rows of that id it holds before it is sent again.

All of them → the segment is deleted without sending; none → sent; some (a batch the server
applied partly) → those rows are discarded and the segment is sent again. Rows are sent in blocks
of at most :data:`MAX_BLOCK_ROWS` rows that never split a segment (:func:`blocks`), so a ClickHouse
server applies each segment's rows atomically. The look-up costs one query per table, and only
after a failure or a restart: a healthy pass sends without asking.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ranklens.errors import StoreError
from ranklens.schema import INGEST_ID, TABLES
from ranklens.store.api import Store, SupportsDiscardIngest, SupportsIngestRows
from ranklens.store.once import stamp  # the shipper stamps its segments as every ingest does

if TYPE_CHECKING:
    from ranklens.collector.shipper import ShipResult

__all__ = ["MAX_BLOCK_ROWS", "Segment", "batch_id", "blocks", "discarder", "ingest_id_of", "present", "settle", "stamp"]

log = logging.getLogger("ranklens.collector")

MAX_BLOCK_ROWS = 1_000_000  # at most this many rows of one table per insert (one atomic block on a server)


@dataclass(eq=False)
class Segment:
    """A spool segment read into memory: its file, its path in the spool, its table, its rows (an
    Arrow table) and its ``ingest_id``."""

    path: Path
    rel: str
    table: str
    data: Any  # pyarrow.Table
    ingest_id: int

    @property
    def rows(self) -> int:
        return int(self.data.num_rows)


def ingest_id_of(rel: str, content: bytes | Iterator[bytes]) -> int:
    """The ``ingest_id`` of a segment: 63 bits of BLAKE2b over its spool path and content (never 0)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(rel.encode("utf-8", "surrogateescape") + b"\0")
    if isinstance(content, bytes):
        h.update(content)
    else:
        for chunk in content:
            h.update(chunk)
    return (int.from_bytes(h.digest(), "little") & (2**63 - 1)) or 1


def batch_id(base: int, i: int) -> int:
    """The ``ingest_id`` of batch ``i`` of a file whose own id is ``base`` (a profiler trace)."""
    return ingest_id_of(str(base), i.to_bytes(8, "little"))


def blocks(segments: list[Segment]) -> Iterator[tuple[dict[str, Any], list[Segment]]]:
    """Batches for ``write_many`` and the segments in each: per table at most MAX_BLOCK_ROWS rows,
    never splitting a segment."""
    import pyarrow as pa

    by_table: dict[str, list[Segment]] = {}
    for s in segments:
        by_table.setdefault(s.table, []).append(s)
    rounds: list[dict[str, list[Segment]]] = []
    for name, segs in by_table.items():
        k, rows = 0, 0
        for seg in segs:
            if rows and rows + seg.rows > MAX_BLOCK_ROWS:
                k, rows = k + 1, 0
            while len(rounds) <= k:
                rounds.append({})
            rounds[k].setdefault(name, []).append(seg)
            rows += seg.rows
    for r in rounds:
        batch = {name: pa.concat_tables([stamp(s.data, s.ingest_id) for s in segs]) for name, segs in r.items()}
        yield batch, [s for segs in r.values() for s in segs]


def present(store: Store, table_name: str, ids: Sequence[int], job_ids: Sequence[str]) -> dict[int, int]:
    """Rows per ``ingest_id`` of ``ids`` that the store holds in ``table_name`` (narrowed to
    ``job_ids`` where the table is ordered by job)."""
    from ranklens.store.api import sql_string

    if isinstance(store, SupportsIngestRows):
        return store.ingest_rows(table_name, ids)
    found: dict[int, int] = {}
    t = TABLES[table_name]
    for i in range(0, len(ids), 1000):
        chunk = ids[i : i + 1000]
        where = f"{INGEST_ID} IN ({', '.join(str(int(x)) for x in chunk)})"
        if job_ids and t.order_by[0] == "job_id":  # narrows the scan to the job's rows
            where = f"job_id IN ({', '.join(sql_string(j) for j in job_ids)}) AND {where}"
        res = store.query(f"SELECT {INGEST_ID} AS id, count() AS n FROM {table_name} WHERE {where} GROUP BY id")
        for id_, n in res.rows():
            found[int(id_)] = int(n)
    return found


def discarder(store: Store, table_name: str, what: str) -> Callable[[str, list[int]], Any]:
    """The store's ``discard_ingest`` (removes the rows of batches it holds in part). Raises
    StoreError when the store has none."""
    if not isinstance(store, SupportsDiscardIngest):
        raise StoreError(f"{table_name}: the store holds part of {what} and cannot discard it")
    return store.discard_ingest


def settle(store: Store, doubtful: list[Segment], result: ShipResult) -> list[Segment]:
    """Ask the store which segments in doubt it already has. Returns those it has in full
    (to delete without sending); discards the rows of those it has in part (counted in
    ``result.already_stored`` and ``result.partial``)."""
    settled: list[Segment] = []
    by_table: dict[str, list[Segment]] = {}
    for s in doubtful:
        by_table.setdefault(s.table, []).append(s)
    for table_name, segs in by_table.items():
        found = present(store, table_name, [s.ingest_id for s in segs], _job_ids(segs))
        partial = []
        for s in segs:
            n = found.get(s.ingest_id, 0)
            if n >= s.rows:
                settled.append(s)
                result.already_stored += 1
            elif n:
                partial.append(s)
        if partial:
            discard = discarder(store, table_name, "a segment")
            log.warning(
                "ranklens collector: %s: the store holds part of %d segment(s); discarding and sending again",
                table_name,
                len(partial),
            )
            discard(table_name, [s.ingest_id for s in partial])
            result.partial += len(partial)
    if settled:
        log.info("ranklens collector: %d segment(s) in doubt were already stored; not sent again", len(settled))
    return settled


def _job_ids(segs: list[Segment]) -> list[str]:
    out: set[str] = set()
    for s in segs:
        if "job_id" in s.data.column_names:
            out.update(str(j) for j in s.data.column("job_id").unique().to_pylist())
    return sorted(out)
