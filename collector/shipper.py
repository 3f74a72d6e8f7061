"""Ships rank spools (ranklens/formats/spool.py) into the store: every row exactly once.

**Nothing lost.** A segment is deleted only after the store acknowledged its rows. A store that is
down leaves the segments in place for the next pass. A segment that cannot be read (not JSON, not
UTF-8, a lone surrogate, a value out of range: any failure of that one segment) is moved to
``<spool>/quarantine/`` with a ``.reason`` file beside it and counted in ``drops``: never deleted,
and never in the way of the other segments (issue 22 #1). A segment that fails on its own while the
store takes its neighbours (a Python error converting it, a server refusing its block) goes the
same way.

**Nothing twice.** Every row is stamped with its segment's ``ingest_id``; the segments a pass is
about to send are first written to the spool's delivery journal (:mod:`ranklens.collector.journal`),
and a segment in doubt is settled with the store before it is sent again
(:mod:`ranklens.collector.settle`). Profiler traces go the same way (:mod:`ranklens.collector.ship_kineto`).

**One journal per spool.** Every shipper of a spool (the node agent, a one-off ``ranklens collect``,
the shipper of ``ranklens run``) works under one ``flock`` (``<spool>/.ranklens-ship.lock``) and
re-reads the one journal under it at every pass, so a segment another process sent and did not get
to delete (it was killed after the store's acknowledgement) is asked about, never sent twice
(issue 22 #3). The node agent also holds ``<spool>/.collector.lock`` (:func:`hold_collector_lock`)
so ``ranklens run`` does not start a second shipper next to it (:mod:`ranklens.collector.locks`).

**Bounded disk.** While the store cannot take the rows (a pass failed) and the spool outgrows its
budget (:class:`SpoolBudget`, :mod:`ranklens.collector.budget`), the oldest segments of the least
valuable tables go first, and every row lost that way is counted in ``drops``. A store that takes
the rows is always given them first: nothing is evicted while it is healthy (issue 22 #2). The
budget is checked as data arrives (:meth:`Shipper.check_budget`, every tick of the agent's loop,
however long the shipping passes back off), not only at passes (issue 22 #6).

This module keeps the :class:`Shipper` itself: the pass (read, settle, write, delete), the
quarantine and the drop counts; and :class:`ShipLoop`, its passes on a background worker.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ranklens._worker import Worker
from ranklens.collector import budget as _budget
from ranklens.collector.budget import TRACE_TABLE, SpoolBudget, parse_bytes
from ranklens.collector.fault_drill import FaultDrill
from ranklens.collector.journal import JOURNAL, JOURNAL_VERSION, Journal
from ranklens.collector.locks import COLLECTOR_LOCK, LOCK_FILE, hold_collector_lock, spool_lock
from ranklens.collector.settle import MAX_BLOCK_ROWS, Segment, blocks, ingest_id_of, settle
from ranklens.collector.ship_kineto import ship_traces
from ranklens.config import node_name
from ranklens.errors import IngestError, StoreError, StoreUnavailable
from ranklens.formats.rows import read_jsonl
from ranklens.formats.spool import COLLECTOR_DIR, safe_part
from ranklens.store.api import Store, SupportsCompact

__all__ = [
    "COLLECTOR_LOCK",
    "COMPACT_EVERY",
    "JOURNAL",
    "JOURNAL_VERSION",
    "LOCK_FILE",
    "MAX_BLOCK_ROWS",
    "TRACE_TABLE",
    "ShipLoop",
    "ShipResult",
    "Shipper",
    "SpoolBudget",
    "hold_collector_lock",
    "ingest_id_of",
    "parse_bytes",
]

log = logging.getLogger("ranklens.collector")

QUARANTINE = "quarantine"
TO_COUNT = ".tocount"  # beside a quarantined segment whose drop row is not recorded yet
COMPACT_EVERY = 20
PROBE_SEGMENTS = 16  # while the store fails, a pass tries this many segments before reading them all
# An empty segment younger than this stays for a later pass: a writer that creates its segment in
# place (not under a hidden name, then a rename, as ranklens' own writers do) may not have written
# it yet. Older, it is an empty table: removed, nothing shipped.
EMPTY_SEGMENT_GRACE_S = 30.0
_DEFAULT_BUDGET = SpoolBudget()  # frozen: one default shared by every shipper


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
    more: bool = False  # the spool held more segments than one pass takes (``max_segments``)
    removed: int = 0  # segments gone from the spool: stored and deleted (or gone already)
    passes: int = 1
    waiting: int = 0  # empty segments left for a later pass (younger than EMPTY_SEGMENT_GRACE_S)

    @property
    def ok(self) -> bool:
        return self.error is None

    def add(self, other: ShipResult) -> None:
        """Fold a later pass into this one (:meth:`Shipper.ship_all`)."""
        self.segments += other.segments
        for table, n in other.rows.items():
            self.rows[table] = self.rows.get(table, 0) + n
        for table, n in other.evicted.items():
            self.evicted[table] = self.evicted.get(table, 0) + n
        self.quarantined += other.quarantined
        self.removed += other.removed
        self.already_stored += other.already_stored
        self.partial += other.partial
        self.error, self.busy, self.more = other.error, other.busy, other.more
        self.waiting = other.waiting  # the spool as the last pass left it
        self.passes += other.passes


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
        legacy_journals: journals older releases kept elsewhere (besides the per-host one under
            ``<spool>/_collector/state/``): read, folded into the spool's journal, then removed.
    """

    def __init__(
        self,
        spool_dir: str | os.PathLike[str],
        store: Store,
        *,
        max_segments: int = 2000,
        host: str | None = None,
        journal: str | os.PathLike[str] | None = None,
        budget: SpoolBudget | None = _DEFAULT_BUDGET,
        outbox: Any = None,
        on_segment: Callable[[str, Any], None] | None = None,
        tracer: Any = None,
        free_bytes: Callable[[Path], int] | None = None,
        legacy_journals: Sequence[str | os.PathLike[str]] = (),
    ) -> None:
        self.spool_dir = Path(spool_dir)
        self.store = store
        self.max_segments = max_segments
        self.host = host or node_name()
        journal_path = Path(journal) if journal else self.spool_dir / JOURNAL
        # journals of older releases (one per host): folded into the spool's journal
        legacy = [self.spool_dir / COLLECTOR_DIR / "state" / safe_part(self.host) / "shipping.json"]
        legacy += [Path(p) for p in legacy_journals if Path(p) not in legacy and Path(p) != journal_path]
        self._journal = Journal(journal_path, self.spool_dir, host=self.host, legacy=legacy)
        self.budget = budget
        self._free_bytes = free_bytes or _budget.free_bytes
        self._outbox = outbox
        self.on_segment = on_segment
        self.tracer = tracer  # OpenTelemetry tracer of the shipping loop (None: not traced)
        self.totals: dict[str, int] = {}
        self._observed: set[str] = set()  # segments already shown to on_segment
        self.in_doubt: set[str] = self._journal.load(self._all_segments)
        # stored (the store acknowledged them) but not deletable, warned about once: each pass
        # retries the delete only, and leaves them out of what it reads, so they never hold back
        # newer segments
        self._stuck: set[str] = set()
        self._last_budget_check = -1e18
        # the budget may be held from another thread while a pass runs (Agent's budget loop):
        # it never evicts what the pass holds in memory
        self._budget_lock = threading.RLock()
        self._inflight: set[str] = set()
        self._in_pass = False
        self.spool_bytes = 0  # measured by the last budget check (and zeroed when a pass drains the spool)
        self.spool_segments = 0
        self.spool_oldest: float | None = None  # mtime of the oldest file waiting
        self.failures = 0  # consecutive passes the store failed (the agent backs off on it)
        self._failing_since: float | None = None
        self._last_warn = -1e18
        self._fault = FaultDrill.from_env()  # RANKLENS_COLLECTOR_FAULT, read once, here

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

    def pending(self, skip: set[str] | frozenset[str] = frozenset()) -> list[Path]:
        """Segments waiting to be shipped, oldest first (at most ``max_segments``), without the
        spool-relative paths in ``skip``."""
        out = [p for p in self._walk() if p.name.endswith(".jsonl")]
        if skip:
            out = [p for p in out if self._rel(p) not in skip]
        return sorted(out, key=lambda p: p.name.rsplit(".", 2)[-2])[: self.max_segments]

    def _all_segments(self) -> set[str]:
        return {self._rel(p) for p in self._walk()}

    @property
    def journal_path(self) -> Path:
        """The spool's delivery journal."""
        return self._journal.path

    def _rel(self, path: Path) -> str:
        return path.relative_to(self.spool_dir).as_posix()

    def _quarantine(self, path: Path, reason: str) -> bool:
        """Move a segment that cannot be shipped aside, with its reason, and count it in ``drops``.
        False if it could not be moved.

        The count survives a collector killed at any moment: a ``.tocount`` marker is made before
        the move and removed once the drop row is in the outbox; a pass that finds a marker beside a
        quarantined segment counts it then (:meth:`_count_quarantined`). A kill between the drop
        row's write and the marker's removal (one unlink) would count it twice; nothing loses it."""
        qdir = self.spool_dir / QUARANTINE
        rel = path.relative_to(self.spool_dir)
        target = qdir / "__".join(rel.parts)
        marker = target.with_name(target.name + TO_COUNT)
        reason = reason.encode("utf-8", "backslashreplace").decode("utf-8")
        try:
            qdir.mkdir(parents=True, exist_ok=True)
            marker.touch()
            os.replace(path, target)
        except FileNotFoundError:
            _unlink_quietly(marker)
            self._forget(self._rel(path))
            return False
        except OSError as e:
            _unlink_quietly(marker)
            log.error("ranklens collector: cannot quarantine %s (%s): %s", path, e, reason)
            return False
        try:
            target.with_suffix(".reason").write_text(reason + "\n", encoding="utf-8")
        except OSError as e:
            log.error("ranklens collector: cannot write the reason beside %s: %s", target, e)
        self._forget(self._rel(path))
        log.error("ranklens collector: quarantined %s: %s", path, reason)
        # counted at once, not at the end of the pass: a collector killed meanwhile still counts it
        self._count_quarantined([marker])
        return True

    def _count_quarantined(self, markers: list[Path] | None = None) -> None:
        """Record the drop row of each quarantined segment whose ``.tocount`` marker is still there
        (all of the spool's, when ``markers`` is None: a collector was killed between a move and its
        count), then remove the marker. A marker without its segment (killed before the move) is
        removed: the segment is still in the spool."""
        if markers is None:
            qdir = self.spool_dir / QUARANTINE
            try:
                markers = [qdir / n for n in os.listdir(qdir) if n.endswith(TO_COUNT)]
            except OSError:
                return
        for marker in markers:
            if not marker.with_name(marker.name[: -len(TO_COUNT)]).exists():
                _unlink_quietly(marker)
                continue
            if self._record_drops([self._drop_row("spool_segment_quarantined", 1)]):
                _unlink_quietly(marker)

    # --- the journal ----------------------------------------------------------------------

    def _reload_journal(self) -> None:
        """Under the spool's lock, at every pass: the journal on disk is the truth. Another shipper
        (a one-off ``ranklens collect``, ``ranklens run``) may have sent segments since our last
        pass and died before deleting them; they are in doubt for us too."""
        ours = self.in_doubt
        on_disk = self._journal.load(self._all_segments, quiet=True)
        # what we hold in doubt stays so until we deleted it (asking once too often costs a query)
        self.in_doubt = on_disk | {s for s in ours if (self.spool_dir / s).exists()}
        if self._journal.stale:  # unreadable, or an old release's: write the spool's journal now
            try:
                self._journal.write(self.in_doubt)
            except OSError as e:
                log.error("ranklens collector: cannot write the delivery journal %s: %s", self._journal.path, e)
        new = on_disk - ours
        if new:
            log.warning(
                "ranklens collector: %d segment(s) another shipper of this spool sent without deleting "
                "(killed?); the store is asked before sending them",
                len(new),
            )

    def _undeletable(self, rel: str, e: OSError) -> None:
        if rel not in self._stuck:
            self._stuck.add(rel)
            log.warning(
                "ranklens collector: %s is stored but cannot be deleted (%s); it stays in the spool, "
                "never sent again (its delete is retried each pass): check the spool's permissions",
                self.spool_dir / rel,
                e,
            )

    @property
    def undeletable(self) -> int:
        """Segments this shipper stored but could not delete (they wait in the spool)."""
        return len(self._stuck)

    def _retry_stuck(self, result: ShipResult) -> None:
        """Segments this shipper stored but could not delete: the delete is retried, nothing is
        read or asked (the store acknowledged their rows)."""
        for rel in sorted(self._stuck):
            try:
                (self.spool_dir / rel).unlink()
            except FileNotFoundError:
                pass
            except OSError:
                continue
            self._stuck.discard(rel)
            self._forget(rel)
            result.removed += 1

    def _forget(self, rel: str) -> None:
        self.in_doubt.discard(rel)
        self._observed.discard(rel)

    # --- one pass -------------------------------------------------------------------------

    def ship_once(self, *, wait_s: float = 0.0) -> ShipResult:
        """One pass over the spool: read, ask the store about segments in doubt, write, delete.

        One shipper at a time per spool (an flock on ``<spool>/.ranklens-ship.lock``): two would
        send the same segments. When another process holds it, this pass waits up to ``wait_s``
        seconds, then does nothing (``ShipResult.busy``)."""
        with spool_lock(self.spool_dir, wait_s) as held:
            if not held:
                return ShipResult(busy=True)
            self._in_pass = True
            try:
                return self._traced_pass()
            finally:
                self._in_pass = False
                with self._budget_lock:
                    self._inflight.clear()

    def ship_all(self, *, wait_s: float = 0.0, deadline_s: float | None = None) -> ShipResult:
        """Passes until the spool is drained: one pass takes at most ``max_segments`` segments (a
        spool of a long job, or of a store that was down, holds more). Stops at a failing pass (the
        rest stays for the next), when another shipper holds the spool, when a pass shipped
        nothing, after as many passes as the spool held segments when it started (a spool that
        ranks still write is not chased forever), or after ``deadline_s`` seconds. ``more`` is then
        still set. Segments stored but not deletable stay in the spool, left out of later passes.
        The passes' results, summed."""
        t_end = None if deadline_s is None else time.monotonic() + deadline_s
        total = self.ship_once(wait_s=wait_s)
        if not total.more:
            return total
        cap = 1 + sum(1 for _ in self._walk()) // max(1, self.max_segments)
        while total.more and total.ok and not total.busy and total.passes <= cap:
            if t_end is not None and time.monotonic() >= t_end:
                break
            r = self.ship_once(wait_s=wait_s)
            total.add(r)
            if not (r.segments or r.removed or r.quarantined):
                break
        return total

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
        self._count_quarantined()
        self._retry_stuck(result)
        segments: list[Segment] = []
        pending = self.pending(skip=self._stuck)
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
            if not content and _young(seg):
                result.waiting += 1  # perhaps still being written in place: the next pass looks again
                continue
            segments.append(Segment(seg, rel, name, data, ingest_id_of(rel, content)))
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
            ship_traces(self, result)
        # the budget after the pass: a store that took the rows has emptied the spool; eviction is
        # only for a pass that could not ship (issue 22 #2)
        with self._budget_lock:
            self._inflight.clear()  # this pass is done with them
        self._enforce_budget(result, evict=not result.ok)
        self._record_result_drops(result)
        result.more = probing or len(pending) >= self.max_segments  # a probe that got through: the rest next
        if result.ok and not probing and len(pending) < self.max_segments:
            self.spool_bytes, self.spool_segments, self.spool_oldest = 0, result.waiting, None  # drained
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
        with spool_lock(self.spool_dir, 0.0) as held:
            if not held:
                return ShipResult(busy=True)
            result = ShipResult()
            self._enforce_budget(result, evict=self.failures > 0)
            self._record_result_drops(result)
            return result

    def _ship_segments(self, segments: list[Segment], result: ShipResult) -> None:
        try:
            self._journal.write(self.in_doubt | {s.rel for s in segments})
        except OSError as e:
            result.error = f"cannot write the delivery journal {self.journal_path}: {e}"
            log.error("ranklens collector: %s; nothing sent", result.error)
            return
        doubtful = [s for s in segments if s.rel in self.in_doubt]
        self.in_doubt |= {s.rel for s in segments}
        done: list[Segment] = []
        todo = segments
        try:
            if doubtful:
                with self._span("ranklens.settle", segments=len(doubtful)):
                    settled = settle(self.store, doubtful, result)
                done.extend(settled)
                todo = [s for s in segments if s not in settled]
            for batch, segs in blocks(todo):
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
                result.removed += 1
            except FileNotFoundError:
                result.removed += 1
            except OSError as e:
                # stored, but this user may not delete it (a spool whose permissions keep the
                # collector out): it stays in doubt, so a later pass looks it up (never sends it
                # again) and retries the delete
                self._undeletable(s.rel, e)
                continue
            self._forget(s.rel)
        result.segments += len(done)

    def _isolate(self, segments: list[Segment], first: Exception, result: ShipResult) -> list[Segment]:
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
        stored: list[Segment] = []
        written: set[str] = set()  # tables the store took a segment of, alone
        refused: list[tuple[Segment, Exception]] = []
        for s in segments:
            try:
                if settle(self.store, [s], result):
                    stored.append(s)
                    continue
                ((batch, _),) = list(blocks([s]))
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

    def _count(self, result: ShipResult, written: dict[str, int]) -> None:
        """A store write succeeded: count its rows (then the fault drill may strike)."""
        for k, v in written.items():
            result.rows[k] = result.rows.get(k, 0) + v
            self.totals[k] = self.totals.get(k, 0) + v
        self._fault.wrote()

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

    def _drop_row(self, what: str, n: int) -> dict[str, Any]:
        return {"ts_ns": time.time_ns(), "host": self.host, "component": "collector", "what": what, "count": n}

    def _record_drops(self, rows: list[dict[str, Any]]) -> bool:
        """Drop counts go through the spool like every other row (shipped once, even if the store is
        down). False: they could not be written (said in the log)."""
        if not rows:
            return True
        if self._outbox is None:
            from ranklens.collector.outbox import Outbox

            self._outbox = Outbox(self.spool_dir, host=self.host)
        try:
            self._outbox.write("drops", rows)
        except OSError as e:
            log.error("ranklens collector: cannot record drop counts %s: %s", rows, e)
            return False
        return True

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
        usage = _budget.measure(self._walk(), self._free_bytes(self.spool_dir))
        self.spool_bytes, self.spool_segments = usage.total_bytes, len(usage.files)
        self.spool_oldest = usage.oldest
        if not evict:
            return

        def removed(p: Path) -> None:
            if not concurrent:  # (the pass's own bookkeeping drops names of files that are gone)
                self._forget(self._rel(p))

        freed, evicted = _budget.evict(b, usage, skip=lambda p: self._rel(p) in self._inflight, removed=removed)
        for table_name, rows in evicted.items():
            result.evicted[table_name] = result.evicted.get(table_name, 0) + rows
        self.spool_bytes -= freed

    # --- the loop -------------------------------------------------------------------------

    def start(self, *, interval_s: float = 1.0, on_pass: Callable[[ShipResult], None] | None = None) -> ShipLoop:
        """Ship in the background (a pass at once, then every ``interval_s``) until
        :meth:`ShipLoop.close`, which makes one last pass. See :class:`ShipLoop`."""
        return ShipLoop(self, interval_s=interval_s, on_pass=on_pass)


def _young(path: Path) -> bool:
    """Whether ``path`` changed within the last ``EMPTY_SEGMENT_GRACE_S`` seconds (gone: no)."""
    try:
        return time.time() - path.stat().st_mtime < EMPTY_SEGMENT_GRACE_S
    except OSError:
        return False


class ShipLoop:
    """A :class:`Shipper` shipping in the background, on a :class:`ranklens._worker.Worker` of its
    own: a pass at once, then one every ``interval_s`` on the worker's job thread (a pass still
    running when the next is due is skipped and counted, never piled up); a pass that fails is
    logged and the next one comes (issue 22 #1). :meth:`close` stops within its timeout, the last
    pass included.

    Every ``COMPACT_EVERY`` passes, and at the last one, a store that can (the embedded one) merges
    small parts, so a collector that runs for weeks keeps readers fast.
    """

    def __init__(
        self, shipper: Shipper, *, interval_s: float = 1.0, on_pass: Callable[[ShipResult], None] | None = None
    ) -> None:
        self.shipper = shipper
        self.on_pass = on_pass
        self.passes = 0
        self._worker = Worker("ranklens-shipper", max_queue=2)
        self._worker.submit(self._pass, name="ship")  # the first pass at once
        self._worker.every(interval_s, self._pass, name="ship", blocking=True)

    def _pass(self, *, last: bool = False, deadline_s: float | None = None) -> None:
        sh = self.shipper
        try:
            r = sh.ship_all(deadline_s=deadline_s) if last else sh.ship_once()
        except Exception as e:  # never let the shipping stop (issue 22 #1): next pass
            log.exception("ranklens collector: shipping pass failed; segments stay for the next one")
            r = ShipResult(error=f"{type(e).__name__}: {e}")
        self.passes += 1
        if self.on_pass:
            self.on_pass(r)
        if isinstance(sh.store, SupportsCompact) and (self.passes % COMPACT_EVERY == 0 or last):
            try:
                sh.store.compact()
            except Exception:
                log.exception("ranklens collector: compaction failed (data is safe, parts stay)")

    def close(self, timeout_s: float = 300.0) -> bool:
        """Stop: the pass in progress finishes, then one last pass ships what the ranks wrote last,
        all within ``timeout_s`` (what is not shipped by then stays in the spool). Never raises.
        Returns whether the last pass ran to its end."""
        end = time.monotonic() + timeout_s

        def last() -> None:  # drains the spool within what is left of the timeout (at least one pass)
            self._pass(last=True, deadline_s=max(0.0, end - time.monotonic()))

        return self._worker.close(timeout_s, final=last).final_ran


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
