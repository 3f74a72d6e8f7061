"""Ships rank spools (tracing/spool.py) into the store: every row exactly once.

**Nothing lost.** A segment is deleted only after the store acknowledged its rows. A store that is
down leaves the segments in place for the next pass. A segment that cannot be parsed is moved to
``<spool>/quarantine/`` with a ``.reason`` file beside it and counted in ``drops``: never deleted.

**Nothing twice.** Every row is stamped with its segment's ``ingest_id`` (a hash of the segment's
path and content). Before a pass sends anything, the segments it is about to send are written to
a small journal (``shipping.json``, fsynced). A segment in the journal is *in doubt*: the collector
may have died (kill -9, OOM, power) or the store may have failed after the rows reached it but
before the segment was deleted. The next pass that sees a segment in doubt asks the store how many
rows carry its id: all of them → the segment is deleted without sending; none → sent; some (a
batch the server applied partly) → those rows are discarded and the segment is sent again. Rows are
sent in blocks of at most :data:`MAX_BLOCK_ROWS` rows that never split a segment, so a ClickHouse
server applies each segment's rows atomically. The lookup costs one query per table, and only
after a failure or a restart: a healthy pass sends without asking.

**Bounded disk.** When the spool outgrows its budget (:class:`SpoolBudget`; the store has been
down for long), the oldest segments of the least valuable tables go first (profiler traces, GPU
samples, heartbeats; then steps, phases and collectives; log events, GPU events and the job's
metadata last), and every row lost that way is counted in ``drops``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ranklens.config import node_name
from ranklens.errors import ConfigError, IngestError, StoreError
from ranklens.ingest import read_jsonl
from ranklens.schema import INGEST_ID, TABLES
from ranklens.store.api import Store

__all__ = ["MAX_BLOCK_ROWS", "ShipResult", "Shipper", "SpoolBudget", "parse_bytes"]

log = logging.getLogger("ranklens.collector")

QUARANTINE = "quarantine"
LOCK_FILE = ".ranklens-ship.lock"
COMPACT_EVERY = 20
MAX_BLOCK_ROWS = 1_000_000  # at most this many rows of one table per insert (one atomic block on a server)
JOURNAL_VERSION = 1
FAULT_ENV = "RANKLENS_COLLECTOR_FAULT"
TRACE_TABLE = "trace_events"

# Which data goes first when the spool is over budget (lowest value first).
EVICTION_ORDER: tuple[tuple[str, ...], ...] = (
    (TRACE_TABLE, "gpu_samples", "heartbeats"),
    ("steps", "phases", "collectives"),
)


@dataclass
class ShipResult:
    """What one pass did."""

    segments: int = 0
    rows: dict[str, int] = field(default_factory=dict)
    quarantined: int = 0
    already_stored: int = 0  # segments in doubt that the store already had in full (deleted, not sent)
    partial: int = 0  # segments in doubt the store had in part (those rows discarded, segment sent again)
    evicted: dict[str, int] = field(default_factory=dict)  # rows removed by the disk budget, per table
    error: str | None = None  # the store failed: segments stay for the next pass
    busy: bool = False  # another shipper holds this spool: nothing was done

    @property
    def ok(self) -> bool:
        return self.error is None


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_bytes(value: int | float | str, what: str = "size") -> int:
    """``20GiB``, ``500MB``, ``1e9`` or a plain number of bytes → bytes. Raises ConfigError."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}={value!r}: expected a size such as 20GiB or 500MB")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ConfigError(f"{what}={value!r}: must not be negative")
        return int(value)
    m = _SIZE.match(str(value))
    if not m:
        raise ConfigError(f"{what}={value!r}: expected a size such as 20GiB, 500MB or a number of bytes")
    unit = (m.group(2) or "").lower()
    base = 1024 if "i" in unit else 1000
    mult = 1 if unit in ("", "b") else base ** ("kmgt".index(unit[0]) + 1)
    return int(float(m.group(1)) * mult)


@dataclass(frozen=True)
class SpoolBudget:
    """How much disk the spool may use while the store cannot take its rows.

    Args:
        max_bytes: the spool's size limit (pending segments and profiler traces); 0: no limit.
        min_free_bytes: keep at least this much free on the spool's filesystem; 0: no floor.
        check_interval_s: how often the spool is measured (a full directory walk).
    """

    max_bytes: int = 20 * 1024**3
    min_free_bytes: int = 1024**3
    check_interval_s: float = 5.0

    def __post_init__(self) -> None:
        if self.max_bytes < 0 or self.min_free_bytes < 0:
            raise ConfigError("spool budget sizes must not be negative")


@dataclass(eq=False)
class _Segment:
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


class Shipper:
    """Moves complete spool segments under ``spool_dir`` into ``store``, each row exactly once.

    Args:
        spool_dir: root of the spools (the tracer's ``RANKLENS_SPOOL``).
        store: where rows go.
        max_segments: at most this many segments per pass (bounded memory).
        host: this node's name (journal and drop records; default: the host name).
        journal: the delivery journal's path (default ``<spool>/_collector/state/<host>/shipping.json``).
        budget: disk budget of the spool (default :class:`SpoolBudget`; None: unbounded).
        outbox: where drop records are written (default: the collector's outbox for ``host``).
        on_segment: called with (table, Arrow rows) once per segment read (metrics, liveness).
        tracer: an OpenTelemetry tracer: a span per pass, a child span per store call (off: None).
    """

    def __init__(
        self,
        spool_dir: str | os.PathLike[str],
        store: Store,
        *,
        max_segments: int = 2000,
        host: str | None = None,
        journal: str | os.PathLike[str] | None = None,
        budget: SpoolBudget | None = SpoolBudget(),
        outbox: Any = None,
        on_segment: Callable[[str, Any], None] | None = None,
        tracer: Any = None,
    ) -> None:
        from ranklens.collector.outbox import COLLECTOR_DIR, _safe

        self.spool_dir = Path(spool_dir)
        self.store = store
        self.max_segments = max_segments
        self.host = host or node_name()
        self.journal_path = (
            Path(journal) if journal else self.spool_dir / COLLECTOR_DIR / "state" / _safe(self.host) / "shipping.json"
        )
        self.budget = budget
        self._outbox = outbox
        self.on_segment = on_segment
        self.tracer = tracer  # OpenTelemetry tracer of the shipping loop (None: not traced)
        self.totals: dict[str, int] = {}
        self._observed: set[str] = set()  # segments already shown to on_segment
        self.in_doubt: set[str] = self._load_journal()
        self._journaled: set[str] = set(self.in_doubt)
        self._last_budget_check = -1e18
        self.spool_bytes = 0  # measured by the last budget check (and zeroed when a pass drains the spool)
        self.spool_segments = 0
        self.spool_oldest: float | None = None  # mtime of the oldest file waiting
        self._writes = 0
        self.failures = 0  # consecutive passes the store failed (the agent backs off on it)
        self._failing_since: float | None = None
        self._last_warn = -1e18
        self._fault = _parse_fault(os.environ.get(FAULT_ENV, ""))

    # --- the spool ----------------------------------------------------------------------

    def _walk(self) -> Iterator[Path]:
        if not self.spool_dir.is_dir():
            return
        for dirpath, dirnames, filenames in os.walk(self.spool_dir):
            if QUARANTINE in dirnames:
                dirnames.remove(QUARANTINE)
            for f in filenames:
                if not f.startswith(".") and (f.endswith(".jsonl") or f.endswith(".pt.trace.json")):
                    yield Path(dirpath) / f

    def pending(self) -> list[Path]:
        """Segments waiting to be shipped, oldest first (at most ``max_segments``)."""
        out = [p for p in self._walk() if p.name.endswith(".jsonl")]
        return sorted(out, key=lambda p: p.name.rsplit(".", 2)[-2])[: self.max_segments]

    def _rel(self, path: Path) -> str:
        return path.relative_to(self.spool_dir).as_posix()

    def _quarantine(self, path: Path, reason: str) -> None:
        qdir = self.spool_dir / QUARANTINE
        qdir.mkdir(parents=True, exist_ok=True)
        rel = path.relative_to(self.spool_dir)
        target = qdir / "__".join(rel.parts)
        os.replace(path, target)
        target.with_suffix(".reason").write_text(reason + "\n")
        self._forget(self._rel(path))
        log.error("ranklens collector: quarantined %s: %s", path, reason)

    # --- the journal ----------------------------------------------------------------------

    def _load_journal(self) -> set[str]:
        try:
            raw = json.loads(self.journal_path.read_text())
        except FileNotFoundError:
            return set()
        except (OSError, ValueError) as e:
            # Unreadable: we cannot tell what is in doubt, so everything pending is.
            log.error(
                "ranklens collector: delivery journal %s unreadable (%s); checking every segment", self.journal_path, e
            )
            return {self._rel(p) for p in self._walk()}
        if not isinstance(raw, dict) or raw.get("version") != JOURNAL_VERSION:
            log.error(
                "ranklens collector: delivery journal %s has an unknown format; checking every segment",
                self.journal_path,
            )
            return {self._rel(p) for p in self._walk()}
        # the journal lists each pass's segments; those since shipped and deleted are not in doubt
        doubt = {str(s) for s in raw.get("in_doubt", []) if (self.spool_dir / str(s)).exists()}
        if doubt:
            log.info(
                "ranklens collector: %d segment(s) in doubt from the last run; the store is asked first", len(doubt)
            )
        return doubt

    def _write_journal(self, doubt: set[str]) -> None:
        """Durably record ``doubt`` before anything of it is sent."""
        if doubt == self._journaled:
            return
        self.journal_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.journal_path.with_name(self.journal_path.name + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"version": JOURNAL_VERSION, "host": self.host, "in_doubt": sorted(doubt)}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.journal_path)
        self._journaled = set(doubt)

    def _forget(self, rel: str) -> None:
        self.in_doubt.discard(rel)
        self._observed.discard(rel)

    # --- one pass -------------------------------------------------------------------------

    def ship_once(self, *, wait_s: float = 0.0) -> ShipResult:
        """One pass over the spool: read, ask the store about segments in doubt, write, delete.

        One shipper at a time per spool (an flock on ``<spool>/.ranklens-ship.lock``): two would
        send the same segments. When another process holds it, this pass waits up to ``wait_s``
        seconds, then does nothing (``ShipResult.busy``)."""
        with self._spool_lock(wait_s) as held:
            if not held:
                return ShipResult(busy=True)
            return self._traced_pass()

    @contextlib.contextmanager
    def _spool_lock(self, wait_s: float) -> Iterator[bool]:
        import fcntl

        if not self.spool_dir.is_dir():
            yield True  # nothing to ship, nothing to guard
            return
        try:
            fd = os.open(self.spool_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            log.warning("ranklens collector: cannot open the spool lock (%s); shipping without it", e)
            yield True
            return
        deadline = time.monotonic() + wait_s
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        yield False
                        return
                    time.sleep(0.05)
            try:
                yield True
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _traced_pass(self) -> ShipResult:
        if self.tracer is None:
            return self._ship_once()
        with self.tracer.start_as_current_span("ranklens.ship_pass") as span:
            r = self._ship_once()
            span.set_attribute("ranklens.segments", r.segments)
            span.set_attribute("ranklens.rows", sum(r.rows.values()))
            span.set_attribute("ranklens.already_stored", r.already_stored)
            span.set_attribute("ranklens.quarantined", r.quarantined)
            span.set_attribute("ranklens.in_doubt", len(self.in_doubt))
            if r.error:
                from opentelemetry.trace import Status, StatusCode

                span.set_status(Status(StatusCode.ERROR, r.error[:200]))
            return r

    def _span(self, name: str, **attrs: Any) -> Any:
        if self.tracer is None:
            return contextlib.nullcontext()
        return self.tracer.start_as_current_span(name, attributes={f"ranklens.{k}": v for k, v in attrs.items()})

    def _ship_once(self) -> ShipResult:
        result = ShipResult()
        self._enforce_budget(result)
        segments: list[_Segment] = []
        pending = self.pending()
        for seg in pending:
            rel = self._rel(seg)
            try:
                content = seg.read_bytes()
                name, data = read_jsonl(seg, content=content)
            except IngestError as e:
                self._quarantine(seg, str(e))
                result.quarantined += 1
                continue
            except FileNotFoundError:
                self._forget(rel)
                continue  # another collector took it
            segments.append(_Segment(seg, rel, name, data, ingest_id_of(rel, content)))
            if self.on_segment is not None and rel not in self._observed:  # once, not per retry
                self._observed.add(rel)
                try:
                    self.on_segment(name, data)
                except Exception:
                    log.exception("ranklens collector: segment observer failed (shipping goes on)")
        if segments:
            self._ship_segments(segments, result)
        if result.ok:
            self._ship_traces(result)
        drops = [self._drop_row(f"spool_budget:{t}", n) for t, n in sorted(result.evicted.items())]
        if result.quarantined:
            drops.append(self._drop_row("spool_segment_quarantined", result.quarantined))
        self._record_drops(drops)
        if result.ok and len(pending) < self.max_segments:
            self.spool_bytes, self.spool_segments, self.spool_oldest = 0, 0, None  # drained
        return result

    def _ship_segments(self, segments: list[_Segment], result: ShipResult) -> None:
        doubtful = [s for s in segments if s.rel in self.in_doubt]
        done: list[_Segment] = []
        if doubtful:
            try:
                with self._span("ranklens.settle", segments=len(doubtful)):
                    settled = self._settle(doubtful, result)
            except StoreError as e:
                result.error = str(e)
                self._store_failed(e, len(segments))
                return
            done.extend(settled)
            settled_ids = {id(s) for s in settled}
            segments = [s for s in segments if id(s) not in settled_ids]
        try:
            self._write_journal(self.in_doubt | {s.rel for s in segments})
        except OSError as e:
            result.error = f"cannot write the delivery journal {self.journal_path}: {e}"
            log.error("ranklens collector: %s; nothing sent", result.error)
            return
        self.in_doubt |= {s.rel for s in segments}
        try:
            for batch in _blocks(segments):
                with self._span(
                    "ranklens.store_write", tables=sorted(batch), rows=sum(t.num_rows for t in batch.values())
                ):
                    written = self.store.write_many(batch)
                self._count(result, written)
        except StoreError as e:
            result.error = str(e)
            self._store_failed(e, len(segments))
            return
        self._store_ok()
        done.extend(segments)
        for s in done:
            try:
                s.path.unlink()
            except FileNotFoundError:
                pass
            self._forget(s.rel)
        result.segments += len(done)

    def _settle(self, doubtful: list[_Segment], result: ShipResult) -> list[_Segment]:
        """Ask the store which segments in doubt it already has. Returns those it has in full
        (to delete without sending); discards the rows of those it has in part."""
        settled: list[_Segment] = []
        by_table: dict[str, list[_Segment]] = {}
        for s in doubtful:
            by_table.setdefault(s.table, []).append(s)
        for table_name, segs in by_table.items():
            present = self._present(table_name, [s.ingest_id for s in segs], _job_ids(segs))
            partial = []
            for s in segs:
                n = present.get(s.ingest_id, 0)
                if n >= s.rows:
                    settled.append(s)
                    result.already_stored += 1
                elif n:
                    partial.append(s)
            if partial:
                discard = getattr(self.store, "discard_ingest", None)
                if discard is None:
                    raise StoreError(f"{table_name}: the store holds part of a segment and cannot discard it")
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

    def _present(self, table_name: str, ids: Sequence[int], job_ids: Sequence[str]) -> dict[int, int]:
        from ranklens.store.api import sql_string

        found: dict[int, int] = {}
        t = TABLES[table_name]
        for i in range(0, len(ids), 1000):
            chunk = ids[i : i + 1000]
            where = f"{INGEST_ID} IN ({', '.join(str(int(x)) for x in chunk)})"
            if job_ids and t.order_by[0] == "job_id":  # narrows the scan to the job's rows
                where = f"job_id IN ({', '.join(sql_string(j) for j in job_ids)}) AND {where}"
            res = self.store.query(
                f"SELECT {INGEST_ID} AS id, count() AS n FROM {table_name} WHERE {where} GROUP BY id"
            )
            for id_, n in res.rows():
                found[int(id_)] = int(n)
        return found

    def _count(self, result: ShipResult, written: dict[str, int]) -> None:
        """A store write succeeded: count its rows (then the fault drill may strike)."""
        for k, v in written.items():
            result.rows[k] = result.rows.get(k, 0) + v
            self.totals[k] = self.totals.get(k, 0) + v
        self._writes += 1
        self._maybe_fault()

    def _store_failed(self, e: Exception, kept: int) -> None:
        """Log a store failure: at once, then at most once a minute while it lasts."""
        now = time.monotonic()
        self.failures += 1
        if self._failing_since is None:
            self._failing_since = now
        if now - self._last_warn >= 60.0 or self.failures == 1:
            self._last_warn = now
            log.warning(
                "ranklens collector: store unavailable (%d failed pass(es) in %.0f s), %d segment(s) kept: %s",
                self.failures,
                now - self._failing_since,
                kept,
                e,
            )

    def _store_ok(self) -> None:
        if self._failing_since is not None:
            log.warning(
                "ranklens collector: store available again after %.0f s (%d failed pass(es)); catching up",
                time.monotonic() - self._failing_since,
                self.failures,
            )
        self._failing_since, self.failures, self._last_warn = None, 0, -1e18

    def _maybe_fault(self) -> None:
        if self._fault and self._writes >= self._fault:
            log.error("ranklens collector: %s: killing this process after store write %d", FAULT_ENV, self._writes)
            os.kill(os.getpid(), signal.SIGKILL)

    def _drop_row(self, what: str, n: int) -> dict[str, Any]:
        return {"ts_ns": time.time_ns(), "host": self.host, "component": "collector", "what": what, "count": n}

    def _record_drops(self, rows: list[dict[str, Any]]) -> None:
        """Drop counts go through the spool like every other row (shipped once, even if the store is down)."""
        if not rows:
            return
        if self._outbox is None:
            from ranklens.collector.outbox import Outbox

            self._outbox = Outbox(self.spool_dir, host=self.host)
        try:
            self._outbox.write("drops", rows)
        except OSError as e:
            log.error("ranklens collector: cannot record drop counts %s: %s", rows, e)

    # --- profiler traces ---------------------------------------------------------------------

    def _ship_traces(self, result: ShipResult) -> None:
        """Profiler windows (``<spool>/<job>/<attempt>/kineto/*.pt.trace.json``) into ``trace_events``,
        one ``ingest_id`` per batch of a trace, with the same journal as the segments."""
        from ranklens.collector.kineto import iter_kineto_batches

        if not self.spool_dir.is_dir():
            return
        for trace in sorted(self.spool_dir.glob("*/*/kineto/*.pt.trace.json")):
            job, attempt = trace.parent.parent.parent.name, trace.parent.parent.name
            rel = self._rel(trace)
            try:
                with open(trace, "rb") as f:
                    base = ingest_id_of(rel, iter(lambda: f.read(1 << 20), b""))
                for _ in iter_kineto_batches(trace, job_id=job, attempt=int(attempt)):
                    pass  # validate all of it before writing any of it
            except (IngestError, ValueError) as e:
                self._quarantine(trace, str(e))
                result.quarantined += 1
                continue
            except FileNotFoundError:
                self._forget(rel)
                continue
            try:
                skip: set[int] = set()
                if rel in self.in_doubt:
                    skip = self._settle_trace(trace, job, int(attempt), base)
                self._write_journal(self.in_doubt | {rel})
                self.in_doubt.add(rel)
                for i, batch in enumerate(iter_kineto_batches(trace, job_id=job, attempt=int(attempt))):
                    bid = _batch_id(base, i)
                    if bid in skip:
                        continue
                    self._count(result, self.store.write_many({TRACE_TABLE: _stamp(batch, bid)}))
            except (StoreError, OSError) as e:
                result.error = str(e)
                self._store_failed(e, 1)
                return
            trace.unlink(missing_ok=True)
            self._forget(rel)
            result.segments += 1

    def _settle_trace(self, trace: Path, job: str, attempt: int, base: int) -> set[int]:
        from ranklens.collector.kineto import iter_kineto_batches

        sizes = {
            _batch_id(base, i): b.num_rows
            for i, b in enumerate(iter_kineto_batches(trace, job_id=job, attempt=attempt))
        }
        present = self._present(TRACE_TABLE, list(sizes), [job])
        partial = [i for i, n in present.items() if 0 < n < sizes.get(i, 0)]
        if partial:
            discard = getattr(self.store, "discard_ingest", None)
            if discard is None:
                raise StoreError(f"{TRACE_TABLE}: the store holds part of a batch and cannot discard it")
            discard(TRACE_TABLE, partial)
        return {i for i, n in present.items() if n >= sizes.get(i, 0)}

    # --- the disk budget -----------------------------------------------------------------------

    def _enforce_budget(self, result: ShipResult) -> None:
        b = self.budget
        if b is None or time.monotonic() - self._last_budget_check < b.check_interval_s:
            return
        self._last_budget_check = time.monotonic()
        files: list[tuple[int, float, int, Path]] = []  # (value class, mtime, size, path)
        total = 0
        for p in self._walk():
            try:
                st = p.stat()
            except OSError:
                continue
            files.append((_value_class(p.name), st.st_mtime, st.st_size, p))
            total += st.st_size
        self.spool_bytes, self.spool_segments = total, len(files)
        self.spool_oldest = min((f[1] for f in files), default=None)
        free = _free_bytes(self.spool_dir)
        over = max(total - b.max_bytes if b.max_bytes else 0, b.min_free_bytes - free if b.min_free_bytes else 0)
        if over <= 0:
            return
        target = over + (b.max_bytes // 10 if b.max_bytes else 0)  # hysteresis: a tenth below the limit
        freed = 0
        for _cls, _mtime, size, p in sorted(files, key=lambda f: (f[0], f[1], f[3].name)):
            if freed >= target:
                break
            table_name, rows = _table_and_rows(p)
            try:
                p.unlink()
            except FileNotFoundError:
                continue
            self._forget(self._rel(p))
            freed += size
            result.evicted[table_name] = result.evicted.get(table_name, 0) + rows
        self.spool_bytes -= freed
        log.error(
            "ranklens collector: spool over its budget (%s, limit %s, %s free): removed %s, "
            "oldest low-value data first: %s",
            _human(total),
            _human(b.max_bytes) if b.max_bytes else "none",
            _human(free),
            _human(freed),
            ", ".join(f"{n} {t} rows" for t, n in sorted(result.evicted.items())),
        )

    # --- the loop -------------------------------------------------------------------------

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


def _parse_fault(spec: str) -> int:
    """``RANKLENS_COLLECTOR_FAULT=kill_after_write:N``: SIGKILL this process right after the N-th
    store write, before the segments are deleted (fault drills and the exactly-once tests)."""
    if not spec:
        return 0
    m = re.fullmatch(r"kill_after_write(?::(\d+))?", spec.strip())
    if not m:
        raise ConfigError(f"{FAULT_ENV}={spec!r}: allowed kill_after_write[:N]")
    return int(m.group(1) or 1)


def _blocks(segments: list[_Segment]) -> Iterator[dict[str, Any]]:
    """Batches for ``write_many``: per table at most MAX_BLOCK_ROWS rows, never splitting a segment."""
    import pyarrow as pa

    by_table: dict[str, list[Any]] = {}
    for s in segments:
        by_table.setdefault(s.table, []).append(_stamp(s.data, s.ingest_id))
    rounds: list[dict[str, list[Any]]] = []
    for name, parts in by_table.items():
        k, rows = 0, 0
        for part in parts:
            if rows and rows + part.num_rows > MAX_BLOCK_ROWS:
                k, rows = k + 1, 0
            while len(rounds) <= k:
                rounds.append({})
            rounds[k].setdefault(name, []).append(part)
            rows += part.num_rows
    for r in rounds:
        yield {name: pa.concat_tables(parts) for name, parts in r.items()}


def _stamp(data: Any, ingest_id: int) -> Any:
    import pyarrow as pa

    col = pa.array([ingest_id] * data.num_rows, type=pa.uint64())
    if INGEST_ID in data.column_names:
        return data.set_column(data.column_names.index(INGEST_ID), INGEST_ID, col)
    return data.append_column(INGEST_ID, col)


def _batch_id(base: int, i: int) -> int:
    return ingest_id_of(str(base), i.to_bytes(8, "little"))


def _job_ids(segs: list[_Segment]) -> list[str]:
    out: set[str] = set()
    for s in segs:
        if "job_id" in s.data.column_names:
            out.update(str(j) for j in s.data.column("job_id").unique().to_pylist())
    return sorted(out)


def _value_class(name: str) -> int:
    table_name = TRACE_TABLE if name.endswith(".pt.trace.json") else name.split(".", 1)[0]
    for i, tables in enumerate(EVICTION_ORDER):
        if table_name in tables:
            return i
    return len(EVICTION_ORDER)


def _table_and_rows(p: Path) -> tuple[str, int]:
    """The table of a spool file and how many rows it holds (a profiler trace counts as one)."""
    if p.name.endswith(".pt.trace.json"):
        return TRACE_TABLE + "_traces", 1
    try:
        with open(p, "rb") as f:
            lines = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except OSError:
        lines = 0
    return p.name.split(".", 1)[0], max(0, lines - 1)  # the header line is not a row


def _free_bytes(path: Path) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 1 << 62


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n:.1f} TiB"
