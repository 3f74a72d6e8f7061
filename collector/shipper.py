"""Ships rank spools (ranklens/formats/spool.py) into the store: every row exactly once.

**Nothing lost.** A segment is deleted only after the store acknowledged its rows. A store that is
down leaves the segments in place for the next pass. A segment that cannot be read (not JSON, not
UTF-8, a lone surrogate, a value out of range: any failure of that one segment) is moved to
``<spool>/quarantine/`` with a ``.reason`` file beside it and counted in ``drops``: never deleted,
and never in the way of the other segments (issue 22 #1). A segment that fails on its own while the
store takes its neighbours (a Python error converting it, a server refusing its block) goes the
same way.

**Nothing twice.** Every row is stamped with its segment's ``ingest_id`` (a hash of the segment's
path and content). Before a pass sends anything, the segments it is about to send are written to
a small journal (``<spool>/_collector/state/shipping.json``, fsynced). A segment in the journal is
*in doubt*: the collector
may have died (kill -9, OOM, power) or the store may have failed after the rows reached it but
before the segment was deleted. The next pass that sees a segment in doubt asks the store how many
rows carry its id: all of them → the segment is deleted without sending; none → sent; some (a
batch the server applied partly) → those rows are discarded and the segment is sent again. Rows are
sent in blocks of at most :data:`MAX_BLOCK_ROWS` rows that never split a segment, so a ClickHouse
server applies each segment's rows atomically. The lookup costs one query per table, and only
after a failure or a restart: a healthy pass sends without asking.

**One journal per spool.** Every shipper of a spool (the node agent, a one-off ``ranklens collect``,
the shipper of ``ranklens run``) works under one ``flock`` (``<spool>/.ranklens-ship.lock``) and
re-reads the one journal under it at every pass, so a segment another process sent and did not get
to delete (it was killed after the store's acknowledgement) is asked about, never sent twice
(issue 22 #3). The node agent also holds ``<spool>/.collector.lock`` (:func:`hold_collector_lock`)
so ``ranklens run`` does not start a second shipper next to it.

**Bounded disk.** While the store cannot take the rows (a pass failed) and the spool outgrows its
budget (:class:`SpoolBudget`: a size limit and a free-space floor), the oldest segments of the
least valuable tables go first (profiler traces, GPU samples, heartbeats; then steps, phases and
collectives; log events, GPU events and the job's metadata last), and every row lost that way is
counted in ``drops``. A store that takes the rows is always given them first: nothing is evicted
while it is healthy (issue 22 #2). The budget is checked as data arrives
(:meth:`Shipper.check_budget`, every tick of the agent's loop, however long the shipping passes
back off), not only at passes (issue 22 #6).
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
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ranklens.config import node_name
from ranklens.errors import ConfigError, IngestError, StoreError, StoreUnavailable
from ranklens.ingest import read_jsonl
from ranklens.schema import INGEST_ID, TABLES
from ranklens.store.api import Store

__all__ = [
    "COLLECTOR_LOCK",
    "MAX_BLOCK_ROWS",
    "ShipResult",
    "Shipper",
    "SpoolBudget",
    "hold_collector_lock",
    "parse_bytes",
]

log = logging.getLogger("ranklens.collector")

QUARANTINE = "quarantine"
LOCK_FILE = ".ranklens-ship.lock"
COLLECTOR_LOCK = ".collector.lock"  # held by the node agent; ranklens run ships only when it can take it
JOURNAL = "_collector/state/shipping.json"  # one per spool, beside the collector's state
COMPACT_EVERY = 20
MAX_BLOCK_ROWS = 1_000_000  # at most this many rows of one table per insert (one atomic block on a server)
JOURNAL_VERSION = 1
PROBE_SEGMENTS = 16  # while the store fails, a pass tries this many segments before reading them all
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

    Both limits apply only while the store cannot take the rows: a healthy store ships first.
    """

    max_bytes: int = 20 * 1024**3
    min_free_bytes: int = 1024**3
    check_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_bytes < 0 or self.min_free_bytes < 0:
            raise ConfigError("spool budget sizes must not be negative")
        if not 0 <= self.check_interval_s <= 3600:
            raise ConfigError(f"spool check_interval_s={self.check_interval_s!r}: allowed 0..3600 seconds")


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
        journal: the delivery journal's path (default ``<spool>/_collector/state/shipping.json``;
            every shipper of one spool must use the same one).
        budget: disk budget of the spool (default :class:`SpoolBudget`; None: unbounded).
        free_bytes: the free-space probe of the spool's filesystem (default: ``shutil.disk_usage``).
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
        free_bytes: Callable[[Path], int] | None = None,
    ) -> None:
        from ranklens.collector.outbox import COLLECTOR_DIR, _safe

        self.spool_dir = Path(spool_dir)
        self.store = store
        self.max_segments = max_segments
        self.host = host or node_name()
        self.journal_path = Path(journal) if journal else self.spool_dir / JOURNAL
        # journals of older releases (one per host): folded into the spool's journal
        self._legacy_journals = [self.spool_dir / COLLECTOR_DIR / "state" / _safe(self.host) / "shipping.json"]
        self.budget = budget
        self._free_bytes = free_bytes or _free_bytes
        self._outbox = outbox
        self.on_segment = on_segment
        self.tracer = tracer  # OpenTelemetry tracer of the shipping loop (None: not traced)
        self.totals: dict[str, int] = {}
        self._observed: set[str] = set()  # segments already shown to on_segment
        self._journaled: set[str] | None = set()  # what the journal on disk says (None: rewrite it)
        self.in_doubt: set[str] = self._load_journal()
        self._last_budget_check = -1e18
        # the budget may be held from another thread while a pass runs (Agent's budget loop):
        # it never evicts what the pass holds in memory
        self._budget_lock = threading.RLock()
        self._inflight: set[str] = set()
        self._in_pass = False
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

    def _quarantine(self, path: Path, reason: str) -> bool:
        """Move a segment that cannot be shipped aside, with its reason. False if it could not be moved."""
        qdir = self.spool_dir / QUARANTINE
        rel = path.relative_to(self.spool_dir)
        target = qdir / "__".join(rel.parts)
        reason = reason.encode("utf-8", "backslashreplace").decode("utf-8")
        try:
            qdir.mkdir(parents=True, exist_ok=True)
            os.replace(path, target)
        except FileNotFoundError:
            self._forget(self._rel(path))
            return False
        except OSError as e:
            log.error("ranklens collector: cannot quarantine %s (%s): %s", path, e, reason)
            return False
        try:
            target.with_suffix(".reason").write_text(reason + "\n", encoding="utf-8")
        except OSError as e:
            log.error("ranklens collector: cannot write the reason beside %s: %s", target, e)
        self._forget(self._rel(path))
        log.error("ranklens collector: quarantined %s: %s", path, reason)
        # counted at once, not at the end of the pass: a collector killed meanwhile still counts it
        self._record_drops([self._drop_row("spool_segment_quarantined", 1)])
        return True

    # --- the journal ----------------------------------------------------------------------

    def _load_journal(self, *, quiet: bool = False) -> set[str]:
        """What the spool's journal says is in doubt (and what journals of older releases say)."""
        doubt: set[str] = set()
        readable = True
        for path in (self.journal_path, *self._legacy_journals):
            got = self._read_journal(path)
            readable &= got is not None
            doubt |= got if got is not None else {self._rel(p) for p in self._walk()}
        # the journal lists each pass's segments; those since shipped and deleted are not in doubt
        doubt = {s for s in doubt if (self.spool_dir / s).exists()}
        self._journaled = set(doubt) if readable and not self._legacy_present() else None
        if doubt and not quiet:
            log.info(
                "ranklens collector: %d segment(s) in doubt from the last run; the store is asked first", len(doubt)
            )
        return doubt

    def _legacy_present(self) -> bool:
        return any(p.exists() for p in self._legacy_journals if p != self.journal_path)

    def _read_journal(self, path: Path) -> set[str] | None:
        """The segments a journal names; None when it is unreadable (then everything pending is in
        doubt: we cannot tell what is)."""
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            return set()
        except (OSError, ValueError) as e:
            log.error("ranklens collector: delivery journal %s unreadable (%s); checking every segment", path, e)
            return None
        if not isinstance(raw, dict) or raw.get("version") != JOURNAL_VERSION:
            log.error("ranklens collector: delivery journal %s has an unknown format; checking every segment", path)
            return None
        return {str(s) for s in raw.get("in_doubt", [])}

    def _reload_journal(self) -> None:
        """Under the spool's lock, at every pass: the journal on disk is the truth. Another shipper
        (a one-off ``ranklens collect``, ``ranklens run``) may have sent segments since our last
        pass and died before deleting them; they are in doubt for us too."""
        ours = self.in_doubt
        on_disk = self._load_journal(quiet=True)
        # what we hold in doubt stays so until we deleted it (asking once too often costs a query)
        self.in_doubt = on_disk | {s for s in ours if (self.spool_dir / s).exists()}
        if self._journaled is None:  # unreadable, or an old release's: write the spool's journal now
            try:
                self._write_journal(self.in_doubt)
            except OSError as e:
                log.error("ranklens collector: cannot write the delivery journal %s: %s", self.journal_path, e)
        new = on_disk - ours
        if new:
            log.warning(
                "ranklens collector: %d segment(s) another shipper of this spool sent without deleting "
                "(killed?); the store is asked before sending them",
                len(new),
            )

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
        for old in self._legacy_journals:  # folded in: the spool's journal is the only one now
            if old != self.journal_path:
                with contextlib.suppress(OSError):
                    old.unlink()

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
            self._in_pass = True
            try:
                return self._traced_pass()
            finally:
                self._in_pass = False
                with self._budget_lock:
                    self._inflight.clear()

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
        self._reload_journal()
        segments: list[_Segment] = []
        pending = self.pending()
        probing = bool(self.failures) and len(pending) > PROBE_SEGMENTS
        if self.failures:
            # the store failed last time: hold the budget now, and let a few segments find out
            # whether it is back before reading thousands (a failing pass stays short and cheap)
            self._enforce_budget(result, evict=True, force=True)
            pending = [p for p in pending[:PROBE_SEGMENTS] if p.exists()]
        for seg in pending:
            rel = self._rel(seg)
            try:
                content = seg.read_bytes()
                name, data = read_jsonl(seg, content=content)
            except FileNotFoundError:
                self._forget(rel)
                continue  # another collector took it
            except OSError as e:
                log.error("ranklens collector: cannot read %s (%s); it stays for the next pass", seg, e)
                continue
            except Exception as e:  # any failure of this one segment: aside, and the others ship (issue 22 #1)
                reason = str(e) if isinstance(e, IngestError) else f"{seg}: cannot be read: {type(e).__name__}: {e}"
                if self._quarantine(seg, reason):
                    result.quarantined += 1
                continue
            segments.append(_Segment(seg, rel, name, data, ingest_id_of(rel, content)))
            with self._budget_lock:
                self._inflight.add(rel)
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
        # the budget after the pass: a store that took the rows has emptied the spool; eviction is
        # only for a pass that could not ship (issue 22 #2)
        with self._budget_lock:
            self._inflight.clear()  # this pass is done with them
        self._enforce_budget(result, evict=not result.ok)
        self._record_result_drops(result)
        if result.ok and not probing and len(pending) < self.max_segments:
            self.spool_bytes, self.spool_segments, self.spool_oldest = 0, 0, None  # drained
        return result

    def _record_result_drops(self, result: ShipResult) -> None:
        self._record_drops([self._drop_row(f"spool_budget:{t}", n) for t, n in sorted(result.evicted.items())])

    def check_budget(self) -> ShipResult:
        """Measure the spool and, while the store is failing (the last pass could not ship), hold it
        to its budget: between passes, however long they back off, so the budget holds as data
        arrives (issue 22 #6). Thread-safe: while this shipper's own pass runs (it holds the spool),
        the segments that pass holds are left alone. Skipped (``busy``) while another process
        ships the spool."""
        if self._in_pass:
            result = ShipResult()
            self._enforce_budget(result, evict=self.failures > 0, concurrent=True)
            self._record_result_drops(result)
            return result
        with self._spool_lock(0.0) as held:
            if not held:
                return ShipResult(busy=True)
            result = ShipResult()
            self._enforce_budget(result, evict=self.failures > 0)
            self._record_result_drops(result)
            return result

    def _ship_segments(self, segments: list[_Segment], result: ShipResult) -> None:
        try:
            self._write_journal(self.in_doubt | {s.rel for s in segments})
        except OSError as e:
            result.error = f"cannot write the delivery journal {self.journal_path}: {e}"
            log.error("ranklens collector: %s; nothing sent", result.error)
            return
        doubtful = [s for s in segments if s.rel in self.in_doubt]
        self.in_doubt |= {s.rel for s in segments}
        done: list[_Segment] = []
        todo = segments
        try:
            if doubtful:
                with self._span("ranklens.settle", segments=len(doubtful)):
                    settled = self._settle(doubtful, result)
                done.extend(settled)
                todo = [s for s in segments if s not in settled]
            for batch, segs in _blocks(todo):
                with self._span(
                    "ranklens.store_write", tables=sorted(batch), rows=sum(t.num_rows for t in batch.values())
                ):
                    written = self.store.write_many(batch)
                self._count(result, written)
                done.extend(segs)
        except StoreUnavailable as e:
            result.error = str(e)
            self._store_failed(e, len(segments) - len(done))
        except Exception as e:  # refused, or failed converting: find the segment(s) at fault
            done.extend(self._isolate([s for s in todo if s not in done], e, result))
        if result.ok:
            self._store_ok()
        for s in done:
            try:
                s.path.unlink()
            except FileNotFoundError:
                pass
            self._forget(s.rel)
        result.segments += len(done)

    def _isolate(self, segments: list[_Segment], first: Exception, result: ShipResult) -> list[_Segment]:
        """A block failed for a reason other than the store being down: send its segments one by
        one (each in doubt: asked about first, so nothing is sent twice). A segment that fails on
        its own with a Python error (converting its rows), or that the store refuses while it
        takes other segments of the same table, is quarantined; a refusal of a whole table (a
        table the store cannot write, a query it cannot run) is the store's problem: those stay.
        Returns the segments now stored."""
        log.warning(
            "ranklens collector: a block of %d segment(s) failed (%s: %s); sending them one by one",
            len(segments),
            type(first).__name__,
            first,
        )
        stored: list[_Segment] = []
        written: set[str] = set()  # tables the store took a segment of, alone
        refused: list[tuple[_Segment, Exception]] = []
        for s in segments:
            try:
                if self._settle([s], result):
                    stored.append(s)
                    continue
                ((batch, _),) = list(_blocks([s]))
                self._count(result, self.store.write_many(batch))
                stored.append(s)
                written.add(s.table)
            except StoreUnavailable as e:
                result.error = str(e)
                self._store_failed(e, len(segments) - len(stored))
                return stored
            except Exception as e:
                refused.append((s, e))
                if not stored and len(refused) >= 3 and all(isinstance(x, StoreError) for _, x in refused):
                    break  # the store refuses everything: its problem, not these segments'
        poison = [(s, err) for s, err in refused if s.table in written or not isinstance(err, StoreError)]
        for s, err in poison:
            if self._quarantine(s.path, f"{s.path}: the store cannot take it: {type(err).__name__}: {err}"):
                result.quarantined += 1
        kept = [err for s, err in refused if (s, err) not in poison]
        if kept:
            result.error = str(kept[0])
            self._store_failed(kept[0], len(kept))
        return stored

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
        from ranklens.formats.kineto import iter_kineto_batches

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
            except FileNotFoundError:
                self._forget(rel)
                continue
            except OSError as e:
                log.error("ranklens collector: cannot read %s (%s); it stays for the next pass", trace, e)
                continue
            except Exception as e:  # any failure of this one trace: aside (issue 22 #1)
                if self._quarantine(trace, str(e) if isinstance(e, IngestError) else f"{type(e).__name__}: {e}"):
                    result.quarantined += 1
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
        from ranklens.formats.kineto import iter_kineto_batches

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

    def _enforce_budget(
        self, result: ShipResult, *, evict: bool, force: bool = False, concurrent: bool = False
    ) -> None:
        """Measure the spool (at most every ``check_interval_s``, unless ``force``); with ``evict``
        (the store cannot take the rows) remove the least valuable data until it is back within
        its budget. ``concurrent``: called while this shipper's pass runs in another thread."""
        with self._budget_lock:
            self._enforce_budget_locked(result, evict=evict, force=force, concurrent=concurrent)

    def _enforce_budget_locked(self, result: ShipResult, *, evict: bool, force: bool, concurrent: bool) -> None:
        b = self.budget
        if b is None or (not force and time.monotonic() - self._last_budget_check < b.check_interval_s):
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
        free = self._free_bytes(self.spool_dir)
        over = max(total - b.max_bytes if b.max_bytes else 0, b.min_free_bytes - free if b.min_free_bytes else 0)
        if over <= 0 or not evict:
            return
        target = over + (b.max_bytes // 10 if b.max_bytes else 0)  # hysteresis: a tenth below the limit
        freed = 0
        for _cls, _mtime, size, p in sorted(files, key=lambda f: (f[0], f[1], f[3].name)):
            if freed >= target:
                break
            rel = self._rel(p)
            if rel in self._inflight:
                continue  # the running pass holds it
            table_name, rows = _table_and_rows(p)
            try:
                p.unlink()
            except FileNotFoundError:
                continue
            if not concurrent:  # (the pass's own bookkeeping drops names of files that are gone)
                self._forget(rel)
            freed += size
            result.evicted[table_name] = result.evicted.get(table_name, 0) + rows
        self.spool_bytes -= freed
        log.error(
            "ranklens collector: store unavailable and the spool over its budget (%s, limit %s, %s free): "
            "removed %s, oldest low-value data first: %s",
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
            try:
                r = self.ship_once()
            except Exception as e:  # never let the shipping thread die (issue 22 #1): next pass
                log.exception("ranklens collector: shipping pass failed; segments stay for the next one")
                r = ShipResult(error=f"{type(e).__name__}: {e}")
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


def _blocks(segments: list[_Segment]) -> Iterator[tuple[dict[str, Any], list[_Segment]]]:
    """Batches for ``write_many`` and the segments in each: per table at most MAX_BLOCK_ROWS rows,
    never splitting a segment."""
    import pyarrow as pa

    by_table: dict[str, list[_Segment]] = {}
    for s in segments:
        by_table.setdefault(s.table, []).append(s)
    rounds: list[dict[str, list[_Segment]]] = []
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
        batch = {name: pa.concat_tables([_stamp(s.data, s.ingest_id) for s in segs]) for name, segs in r.items()}
        yield batch, [s for segs in r.values() for s in segs]


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


@contextlib.contextmanager
def hold_collector_lock(spool_dir: str | os.PathLike[str]) -> Iterator[bool]:
    """Hold ``<spool>/.collector.lock`` (the node agent, for as long as it runs): ``ranklens run``
    starts its own shipper only when it can take this lock, so it does not ship next to a running
    collector. Yields False when another process holds it (the agent runs anyway: the spool's
    ship lock and journal keep two shippers from sending anything twice)."""
    import fcntl

    try:
        Path(spool_dir).mkdir(parents=True, exist_ok=True)
        fd = os.open(Path(spool_dir) / COLLECTOR_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        log.warning("ranklens collector: cannot open %s (%s)", Path(spool_dir) / COLLECTOR_LOCK, e)
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
