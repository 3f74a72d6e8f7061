"""Results the dashboards compute once per job *data version*, not once per page load.

The clock offsets that align the ranks' hosts (:func:`ranklens.analyzers.blame.blame_offsets`)
are the same for every blame, wait and culprit query of a job, and cost a scan of its
collectives each time (~1 s at 10,240 ranks). They are kept here per ``(store, job, attempt,
data version)``, where the version is what the job's rows are now (:func:`data_version`: the row
counts and newest times of its steps, phases and collectives): new rows change it and the next
query recomputes; a finished job's offsets are computed once.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

# _cell_values: the analyzer's own decoding of blame_sql's rows (overlapping waits counted once),
# called, not copied
from ranklens.analyzers.blame import BlameCells, _cell_values, blame_offsets, run_blame
from ranklens.dashboards.queries._sql import TTL_S, job_where
from ranklens.store.api import Store

__all__ = ["data_version", "job_blame_cells", "job_offsets"]

_MAX_ENTRIES = 64
_lock = threading.Lock()
_offsets: OrderedDict[tuple[Any, ...], dict[int, int] | None] = OrderedDict()
_versions: OrderedDict[tuple[Any, ...], tuple[float, tuple[int, ...]]] = OrderedDict()
_clock = time.monotonic  # a module attribute: tests move it on


def data_version(store: Store, job_id: str, attempt: int) -> tuple[int, ...]:
    """What a job attempt's timing rows are now: count and newest time of its steps, phases and
    collectives, and its ranks' count (one cheap aggregate each; any write to them changes it)."""
    w = job_where(job_id, attempt)
    parts = (("collectives", "enter_ns"), ("steps", "end_ns"), ("phases", "end_ns"), ("ranks", "toInt64(0)"))
    sql = " UNION ALL ".join(  # one round trip (UNION ALL: ClickHouse 18.16 has it)
        f"SELECT {i} AS part, count() AS n, toInt64(max({ts})) AS newest FROM {table} WHERE {w}"
        for i, (table, ts) in enumerate(parts)
    )
    rows = sorted(store.query(sql).rows())
    return tuple(int(v or 0) for _part, n, newest in rows for v in (n, newest))


def _recent_version(store: Store, job_id: str, attempt: int) -> tuple[int, ...]:
    """:func:`data_version`, read again once it is ``TTL_S`` old (the dashboards' freshness; the
    count over a 10,240-rank job's ledger is ~0.1-0.2 s, too much for every blame query)."""
    key = (store.url, job_id, int(attempt))
    now = _clock()
    with _lock:
        seen = _versions.get(key)
    if seen is not None and now - seen[0] < TTL_S:
        return seen[1]
    version = data_version(store, job_id, attempt)
    with _lock:
        _versions[key] = (now, version)
        _versions.move_to_end(key)
        while len(_versions) > _MAX_ENTRIES:
            _versions.popitem(last=False)
    return version


def job_offsets(store: Store, job_id: str, attempt: int) -> dict[int, int] | None:
    """:func:`~ranklens.analyzers.blame.blame_offsets` of the job, computed once per data version
    (the version read at most every ``TTL_S``)."""
    key = (store.url, job_id, int(attempt), _recent_version(store, job_id, attempt))
    with _lock:
        if key in _offsets:
            _offsets.move_to_end(key)
            return _offsets[key]
    value = blame_offsets(store, job_id, attempt)
    with _lock:
        _offsets[key] = value
        while len(_offsets) > _MAX_ENTRIES:
            _offsets.popitem(last=False)
    return value


def job_blame_cells(
    store: Store, job_id: str, attempt: int, step_from: int, step_to: int, t0_ns: int | None
) -> BlameCells:
    """:func:`~ranklens.analyzers.blame.blame_cells` (aligned clocks) with the job's offsets from
    :func:`job_offsets`: the analyzer's SQL (from the rollup where the store has one) and cell
    values, the offsets scan done once."""
    if not t0_ns:
        t0_ns = int(
            store.query(f"SELECT min(enter_ns) FROM collectives WHERE {job_where(job_id, attempt)}").scalar() or 0
        )
    offsets = job_offsets(store, job_id, attempt)
    result, sql = run_blame(store, job_id, attempt, int(t0_ns), offsets=offsets, step_from=step_from, step_to=step_to)
    last, step, n, d, w = _cell_values(result)
    return BlameCells(ranks=last, steps=step, collectives=n, delay_s=d, wait_s=w, sql=sql)
