"""Profiler windows into the store: ``<spool>/<job>/<attempt>/kineto/*.pt.trace.json`` →
``trace_events``, each row exactly once.

A trace is read once and validated in full before any of it is written (its batches kept in a
temporary lz4 Arrow file meanwhile; a trace that cannot be parsed is quarantined like a bad
segment, issue 22 #1; one that cannot be kept, for want of temporary disk, waits for the next
pass), then written batch by batch from that file, each batch stamped with
its own ``ingest_id`` (:func:`~ranklens.collector.settle.batch_id` of the trace's id), under the
same journal as the segments: a trace in doubt is settled batch by batch before it is sent again.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ranklens.collector.budget import TRACE_TABLE
from ranklens.collector.settle import batch_id, discarder, ingest_id_of, present, stamp
from ranklens.errors import IngestError, StoreError
from ranklens.store.api import Store

if TYPE_CHECKING:
    from ranklens.collector.shipper import Shipper, ShipResult

__all__ = ["settle_trace", "ship_traces"]

log = logging.getLogger("ranklens.collector")


def ship_traces(sh: Shipper, result: ShipResult) -> None:
    """Ship every profiler trace of ``sh``'s spool (under its spool lock, after its segments)."""
    if not sh.spool_dir.is_dir():
        return
    traces = sorted(sh.spool_dir.glob("*/*/kineto/*.pt.trace.json"))
    if not traces:
        return
    try:
        tmp = tempfile.TemporaryDirectory(prefix="ranklens-kineto-")
    except OSError as e:
        log.error(
            "ranklens collector: no temporary directory to read profiler traces in (%s); they stay for the next pass", e
        )
        return
    with tmp:
        for n, trace in enumerate(traces):
            if not _ship_trace(sh, result, trace, Path(tmp.name) / f"{n}.arrow"):
                return


def _ship_trace(sh: Shipper, result: ShipResult, trace: Path, spill: Path) -> bool:
    """One trace, read once: validated in full while its batches go to ``spill``, then written
    from there. False when the store failed (the pass stops)."""
    from ranklens.formats.kineto import SpillError, kineto_info, spill_kineto

    job, attempt = trace.parent.parent.parent.name, trace.parent.parent.name
    rel = sh._rel(trace)
    try:
        with open(trace, "rb") as f:
            base = ingest_id_of(rel, iter(lambda: f.read(1 << 20), b""))
        info = kineto_info(trace)
        # all of it, before writing any
        spilled = spill_kineto(trace, spill, job_id=job, attempt=int(attempt), info=info)
    except FileNotFoundError:
        sh._forget(rel)
        return True
    except (OSError, SpillError) as e:  # this node's disk, not the trace: it stays for the next pass
        log.error("ranklens collector: cannot read %s (%s); it stays for the next pass", trace, e)
        return True
    except Exception as e:  # any failure of this one trace: aside (issue 22 #1)
        if sh._quarantine(trace, str(e) if isinstance(e, IngestError) else f"{type(e).__name__}: {e}"):
            result.quarantined += 1
        return True
    try:
        skip: set[int] = set()
        if rel in sh.in_doubt:
            skip = settle_trace(sh.store, job, base, spilled.batch_rows)
        sh._journal.write(sh.in_doubt | {rel})
        sh.in_doubt.add(rel)
        for i, batch in enumerate(spilled):
            bid = batch_id(base, i)
            if bid in skip:
                continue
            sh._count(result, sh.store.write_many({TRACE_TABLE: stamp(batch, bid)}))
    except (StoreError, OSError) as e:
        result.error = str(e)
        sh._store_failed(e, 1)
        return False
    finally:
        spill.unlink(missing_ok=True)
    trace.unlink(missing_ok=True)
    sh._forget(rel)
    result.segments += 1
    return True


def settle_trace(store: Store, job: str, base: int, rows: Sequence[int]) -> set[int]:
    """The batch ids of a trace in doubt that the store holds in full (not to send again); the rows
    of batches it holds in part are discarded. ``rows``: the trace's batch sizes, as it was read."""
    sizes = {batch_id(base, i): n for i, n in enumerate(rows)}
    found = present(store, TRACE_TABLE, list(sizes), [job])
    partial = [i for i, n in found.items() if 0 < n < sizes.get(i, 0)]
    if partial:
        discarder(store, TRACE_TABLE, "a batch")(TRACE_TABLE, partial)
    return {i for i, n in found.items() if n >= sizes.get(i, 0)}
