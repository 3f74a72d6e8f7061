"""Ships rank spools (tracing/spool.py) into the store, losing nothing.

A segment is deleted only after the store acknowledged its rows. A store that is down leaves the
segments in place for the next pass. A segment that cannot be parsed is moved to
``<spool>/quarantine/`` with a ``.reason`` file beside it and counted in ``drops``: never deleted.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ranklens.errors import IngestError, StoreError
from ranklens.ingest import read_jsonl
from ranklens.store.api import Store

__all__ = ["ShipResult", "Shipper"]

log = logging.getLogger("ranklens.collector")

QUARANTINE = "quarantine"
COMPACT_EVERY = 20


@dataclass
class ShipResult:
    """What one pass did."""

    segments: int = 0
    rows: dict[str, int] = field(default_factory=dict)
    quarantined: int = 0
    error: str | None = None  # the store failed: segments stay for the next pass

    @property
    def ok(self) -> bool:
        return self.error is None


class Shipper:
    """Moves complete spool segments under ``spool_dir`` into ``store``.

    Args:
        spool_dir: root of the spools (the tracer's ``RANKLENS_SPOOL``).
        store: where rows go.
        max_segments: at most this many segments per pass (bounded memory).
    """

    def __init__(self, spool_dir: str | os.PathLike[str], store: Store, *, max_segments: int = 2000) -> None:
        self.spool_dir = Path(spool_dir)
        self.store = store
        self.max_segments = max_segments
        self.totals: dict[str, int] = {}

    def pending(self) -> list[Path]:
        if not self.spool_dir.is_dir():
            return []
        out: list[Path] = []
        for dirpath, dirnames, filenames in os.walk(self.spool_dir):
            if QUARANTINE in dirnames:
                dirnames.remove(QUARANTINE)
            out.extend(Path(dirpath) / f for f in filenames if f.endswith(".jsonl") and not f.startswith("."))
        return sorted(out, key=lambda p: p.name.rsplit(".", 2)[-2])[: self.max_segments]

    def _quarantine(self, path: Path, reason: str) -> None:
        qdir = self.spool_dir / QUARANTINE
        qdir.mkdir(parents=True, exist_ok=True)
        rel = path.relative_to(self.spool_dir)
        target = qdir / "__".join(rel.parts)
        os.replace(path, target)
        target.with_suffix(".reason").write_text(reason + "\n")
        log.error("ranklens collector: quarantined %s: %s", path, reason)

    def ship_once(self) -> ShipResult:
        """One pass over the spool: read, write to the store, then delete what was written."""
        import pyarrow as pa

        result = ShipResult()
        batches: dict[str, list[Any]] = {}
        done: list[Path] = []
        for seg in self.pending():
            try:
                name, data = read_jsonl(seg)
            except IngestError as e:
                self._quarantine(seg, str(e))
                result.quarantined += 1
                continue
            except FileNotFoundError:
                continue  # another collector took it
            batches.setdefault(name, []).append(data)
            done.append(seg)
        if result.quarantined:
            batches.setdefault("drops", []).append(_drops_row(result.quarantined))
        self._ship_traces(result)
        if not batches:
            return result
        merged = {name: pa.concat_tables(parts) for name, parts in batches.items()}
        try:
            written = self.store.write_many(merged)
        except StoreError as e:
            result.error = str(e)
            log.warning("ranklens collector: store unavailable, %d segment(s) kept for retry: %s", len(done), e)
            return result
        for seg in done:
            try:
                seg.unlink()
            except FileNotFoundError:
                pass
        result.segments += len(done)
        for k, v in written.items():
            result.rows[k] = result.rows.get(k, 0) + v
        for k, v in written.items():
            self.totals[k] = self.totals.get(k, 0) + v
        return result

    def _ship_traces(self, result: ShipResult) -> None:
        """Profiler windows (``<spool>/<job>/<attempt>/kineto/*.pt.trace.json``) into ``trace_events``."""
        from ranklens.collector.kineto import ingest_kineto

        if not self.spool_dir.is_dir():
            return
        for trace in sorted(self.spool_dir.glob("*/*/kineto/*.pt.trace.json")):
            job, attempt = trace.parent.parent.parent.name, trace.parent.parent.name
            try:
                written = ingest_kineto(self.store, [trace], job_id=job, attempt=int(attempt))
            except IngestError as e:
                self._quarantine(trace, str(e))
                result.quarantined += 1
                continue
            except (StoreError, ValueError) as e:
                result.error = str(e)
                return
            trace.unlink(missing_ok=True)
            result.segments += 1
            for k, v in written.items():
                result.rows[k] = result.rows.get(k, 0) + v
                self.totals[k] = self.totals.get(k, 0) + v

    def run(
        self,
        *,
        interval_s: float = 1.0,
        stop: Callable[[], bool] = lambda: False,
        on_pass: Callable[[ShipResult], None] | None = None,
    ) -> None:
        """Ship until ``stop()`` is true (checked every ``interval_s``), then one last pass.

        Every ``COMPACT_EVERY`` passes, a store that can (the embedded one) merges small parts, so
        a collector that runs for weeks keeps readers fast."""
        passes = 0
        while True:
            stopping = stop()
            r = self.ship_once()
            passes += 1
            if on_pass:
                on_pass(r)
            compact = getattr(self.store, "compact", None)
            if compact is not None and (passes % COMPACT_EVERY == 0 or stopping):
                try:
                    compact()
                except Exception:
                    log.exception("ranklens collector: compaction failed (data is safe, parts stay)")
            if stopping:
                return
            time.sleep(interval_s)


def _drops_row(n: int) -> Any:
    from ranklens.records import to_arrow

    return to_arrow(
        "drops",
        [
            {
                "ts_ns": time.time_ns(),
                "host": socket.gethostname(),
                "component": "collector",
                "what": "spool_segment_quarantined",
                "count": n,
            }
        ],
    )
