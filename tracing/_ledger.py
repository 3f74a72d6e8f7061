"""The arrival ledger from torch's flight-recorder ring, joined with what the Python wrappers add.

The ring (``_fr_ring``) holds every c10d collective of this rank, whatever API issued it, with the
group's ``(pg, collective_seq_id)`` (the same on every member), op, sizes and CPU arrival time; it
is the ledger's source of *which* collectives there were. The ``torch.distributed`` wrappers
(``_patch``) add what the ring lacks on gloo: the completion time (the Work's future), and they
see the call on the hot path. Joining them without duplicates:

- a wrapped call on a group the ring covers does not take a seq of its own: it files a *claim*
  (its row, the time it was called, the time it returned) and waits;
- the reader (the tracer's background thread, never the caller's) takes the ring's new entries in
  order; an entry created inside a claim's call interval on the same group is that call: the claim's
  row gets the entry's seq and is written when complete (completion may come before or after);
- an entry no claim explains is written from the ring alone: its step is the one the rank was in
  when the entry was created, its end time is unknown on gloo (``end_ns = 0``; torch's NCCL ring
  gives it when timing is on);
- a claim whose call ended before the next entry of its group was created made no entry of its own
  (a call inside ``_coalescing_manager``: the group's one coalesced entry comes at its exit): it is
  dropped and counted, the ring's entry stands for it;
- rows reach the spool in the order their collectives finished: while a finished claim waits for
  its seq, a row that finishes after it (its seq known: numbered by an earlier read, or a group
  the ring does not cover) waits too, and the read that numbers the claim writes them all at once.
  A live analysis takes a rank's ledger as complete up to its newest arrival
  (``analyzers/compute.py``, ``settled``): a later collective stored before an earlier one that
  waited for the ring made a healthy rank's waits look like compute for a few steps (a CI run of
  the network drill named one a straggler).

p2p stays with the wrappers (gloo's ring does not record p2p; NCCL's has no peer), keyed per pair.
Groups on backends without a ring (MPI, UCC, custom) keep the wrappers' own seq counters.
"""

from __future__ import annotations

import bisect
import collections
import logging
import threading
from typing import Any

from ranklens.tracing._failures import FailureLog
from ranklens.tracing._fr_ring import RingReader, ring_capacity

__all__ = ["RING_BACKENDS", "Ledger"]

log = logging.getLogger("ranklens.tracing")

RING_BACKENDS = ("gloo", "nccl")  # c10d backends that record into the flight-recorder ring

# torch's ScalarType names (the ring) -> torch dtype names (what the wrappers write)
_DTYPES = {
    "Float": "float32",
    "Double": "float64",
    "Half": "float16",
    "BFloat16": "bfloat16",
    "Long": "int64",
    "Int": "int32",
    "Short": "int16",
    "Char": "int8",
    "Byte": "uint8",
    "Bool": "bool",
    "ComplexFloat": "complex64",
    "ComplexDouble": "complex128",
    "Float8_e4m3fn": "float8_e4m3fn",
    "Float8_e5m2": "float8_e5m2",
}
_ITEMSIZE = {
    "float32": 4,
    "float64": 8,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


class _Claim:
    __slots__ = ("done", "row", "t0", "t1")

    def __init__(self, row: dict[str, Any], t0: int) -> None:
        self.row = row
        self.t0 = t0
        self.t1 = 0  # when the call returned (0: not yet)
        self.done = False  # completed (or failed) before the ring gave its seq


class Ledger:
    """Joins the ring's entries with the wrappers' claims for one rank (see the module doc).

    Args:
        tracer: the rank's tracer (rows go through ``add``; ``_entered``/``_completed``/``_inflight``
            feed its heartbeats).
        reader: the ring reader.
        capacity: entries the ring holds; it is dumped before half of it is new.
        max_delay_s: at most this long between a new entry and its row (when nothing else triggers
            a read earlier).
        poll_s: how often the ledger's thread checks how much is new (a status read of a few
            microseconds); the ring is dumped when half of it is new, so it is not overwritten
            unread below ~``capacity / 2 / poll_s`` collectives a second (20,000/s by default).
        claim_wait_s: a collective in flight this long (a wrapped call, or one the ring's status
            shows) is read within ``poll_s``, so heartbeats and hang dumps name its ``(pg, seq)``.
    """

    def __init__(
        self,
        tracer: Any,
        reader: RingReader,
        *,
        capacity: int = 2000,
        max_delay_s: float = 2.0,
        claim_wait_s: float = 0.5,
        poll_s: float = 0.05,
    ) -> None:
        self.t = tracer
        self.reader = reader
        self.capacity = max(1, capacity)
        self.max_delay_ns = int(max_delay_s * 1e9)
        self.claim_wait_ns = int(claim_wait_s * 1e9)
        self._claims: dict[str, collections.deque[_Claim]] = {}
        self._by_row: dict[int, _Claim] = {}
        self._lock = threading.Lock()
        self._held = 0  # claims finished before the ring numbered them (under _lock)
        self._deferred: list[dict[str, Any]] = []  # rows finished after a held claim (under _lock)
        self._covered: dict[str, bool] = {}
        self._known_pgs: set[str] = set()
        self._open: dict[tuple[int, int], dict[str, Any]] = {}  # ring-only rows in flight, by (ring, id)
        self._last_read_ns = 0
        self._in_flight_since = 0  # when the ring's status first showed a collective in flight
        self._last_seq: dict[str, int] = {}  # the newest seq read per group
        self._enqueued_at_read = 0
        self.reads = 0
        self.entries = 0
        self.recovered = 0  # overwritten entries whose wrapped calls got their seqs back
        self.poll_s = poll_s
        self._poll_lock = threading.Lock()
        self._task: Any = None  # the tracer's worker task (ranklens._worker.Task)
        # a read that keeps failing says so once, then counts (issue 22, defect 8)
        self._read_failures = FailureLog(log, "ranklens: reading torch's flight-recorder ring failed")

    @classmethod
    def create(cls, tracer: Any) -> Ledger | None:
        reader = RingReader.create()
        if reader is None:
            return None
        ledger = cls(tracer, reader, capacity=ring_capacity())
        ledger._last_seq.update(reader.skipped_seqs)  # seqs a previous job of this process took
        ledger.start()
        return ledger

    def start(self) -> None:
        """Poll every ``poll_s`` as a task on the tracer's background worker (the tracer's flush
        interval is too slow for a busy ring); it stops with the tracer."""
        if self._task is None:
            self._task = self.t.worker.every(self.poll_s, self._tick, name="ring")

    def stop(self) -> None:
        """No more periodic reads (the tracer's final flush still does a forced one)."""
        if self._task is not None:
            self._task.cancel()

    def _tick(self) -> None:
        if self.t.enabled and not self.t._stop.is_set():
            self.poll(self.t.clock())

    # -- the hot path (the caller's thread) ------------------------------------------------
    def covers(self, pg: str, group: Any, c10d: Any) -> bool:
        """Whether the ring records this group's collectives (its backend is gloo or NCCL)."""
        got = self._covered.get(pg)
        if got is None:
            try:
                backend = str(c10d.get_backend(group)).lower()
            except Exception:
                backend = ""
            got = self._covered[pg] = any(b in backend for b in RING_BACKENDS)
            self._known_pgs.add(pg)
        return got

    def entered(self, pg: str, op: str, nbytes: int, dtype: str, async_op: bool) -> _Claim:
        """A wrapped collective is being called on a covered group: its row, claimed."""
        t = self.t
        row = {
            **t._ident,
            "pg": pg,
            "seq": 0,
            "op": op,
            "nbytes": nbytes,
            "dtype": dtype,
            "peer": -1,
            "step": t._step,
            "enter_ns": t.clock(),
            "async_op": int(async_op),
        }
        return self.claim(row)

    def claim(self, row: dict[str, Any]) -> _Claim:
        """File a wrapped call's row (``seq`` 0 until the ring gives it), before torch's call; the
        caller sets the claim's ``t1`` when torch's call returns."""
        c = _Claim(row, row["enter_ns"])
        q = self._claims.get(row["pg"])
        if q is None:
            q = self._claims.setdefault(row["pg"], collections.deque())
        self._by_row[id(row)] = c
        q.append(c)
        return c

    def hold(self, row: dict[str, Any]) -> bool:
        """A claimed row completed (or failed) before its seq is known: keep it until the reader
        gives it one. False when the seq came meanwhile (the caller writes the row then)."""
        with self._lock:
            if row["seq"] > 0:
                return False
            c = self._by_row.get(id(row))
            if c is None:
                return False
            if not c.done:
                c.done = True
                self._held += 1
            if not c.t1:
                c.t1 = row.get("end_ns") or self.t.clock()
            return True

    def defer(self, row: dict[str, Any]) -> bool:
        """A finished row (its seq known, the tracer's progress already marked) is about to be
        buffered: True when a held claim finished before it, so the ledger buffers it after the
        read that numbers the claim (see the module doc)."""
        with self._lock:
            if not self._held:
                return False
            self._deferred.append(row)
            return True

    def _release(self) -> None:
        """Buffer the rows that waited behind held claims (after a read, in finishing order)."""
        with self._lock:
            rows, self._deferred = self._deferred, []
        for row in rows:
            self.t.add("collectives", row)

    # -- the reader (the tracer's background thread) ----------------------------------------
    def poll(self, now: int, force: bool = False) -> None:
        """Read the ring when due (see the class doc); never raises. The final (forced) poll waits
        for one in progress on the other thread."""
        if not self._poll_lock.acquire(blocking=force):
            return
        try:
            self._poll(now, force)
        finally:
            self._poll_lock.release()

    def _poll(self, now: int, force: bool) -> None:
        try:
            status = self.reader.status()
            n = status[0] if status is not None else None
            if not force and not self._due(now, status):
                return
            entries, lost = self.reader.read()
            self._last_read_ns = now
            if n is not None:
                self._enqueued_at_read = n
            self.reads += 1
            before = self.recovered
            # the read's rows and the rows that waited for it go into the tracer's buffer at once:
            # a flush between them would ship later collectives before earlier ones
            with self.t._buf_lock:
                if entries or self._open:
                    self._take(entries)
                self._release()
            # overwritten entries no wrapped call stood for are lost (the others were recovered)
            unrecovered = lost - (self.recovered - before)
            if unrecovered > 0:
                self.t.count_drop("collectives:fr_ring_overwritten", unrecovered)
            self._read_failures.ok()
            if force:
                self._close_claims()
                self._read_failures.close()
        except Exception as e:
            self._release()  # a failing read keeps no finished row back
            self.t.count_drop("collectives:fr_read_error")
            self._read_failures.failed(e, traceback=True)
            if force:
                self._read_failures.close()

    def _due(self, now: int, status: tuple[int, bool] | None) -> bool:
        # a collective in flight for a while: read it, so heartbeats and hang dumps name its seq
        in_flight = status is not None and status[1]
        if in_flight and not self._in_flight_since:
            self._in_flight_since = now
        elif not in_flight:
            self._in_flight_since = 0
        if now - self._last_read_ns >= self.claim_wait_ns:
            if in_flight and now - self._in_flight_since >= self.claim_wait_ns:
                return True
            for q in list(self._claims.values()):
                if q and not q[0].done and now - q[0].t0 >= self.claim_wait_ns:
                    return True
        late = now - self._last_read_ns >= self.max_delay_ns
        if status is None:
            return late
        new = status[0] - self._enqueued_at_read
        return (new > 0 or bool(self._open) or bool(self._deferred)) and (new >= self.capacity // 2 or late)

    def _take(self, entries: list[dict[str, Any]]) -> None:
        t = self.t
        marks = list(t._step_marks)
        times = [m[0] for m in marks]
        for e in entries:
            self.entries += 1
            if e.get("is_p2p"):
                continue  # p2p: the wrappers' pair-keyed rows
            pg = str((e.get("process_group") or [""])[0])
            seq = int(e.get("collective_seq_id") or 0)
            if not pg or seq <= 0:
                continue
            if pg not in self._known_pgs:
                self._register(pg)
            created = int(e.get("time_created_ns") or 0)
            c, orphans = self._match(pg, created)
            gap = seq - self._last_seq.get(pg, 0) - 1  # seqs of this group never seen
            if seq > self._last_seq.get(pg, 0):
                self._last_seq[pg] = seq
            if orphans:
                if gap == len(orphans):  # their entries were overwritten unread: one seq each, in order
                    for i, o in enumerate(orphans):
                        self._settle(o, seq - gap + i)
                    self.recovered += gap
                else:  # coalesced calls (gap 0), or lost among other entries: counted, not guessed
                    for o in orphans:
                        self._drop_claim(o)
            if c is not None:
                self._settle(c, seq)
                continue
            op = str(e.get("profiling_name") or "")
            op = op.split(":", 1)[1] if ":" in op else op
            dtypes = [_DTYPES.get(str(d), str(d).lower()) for d in e.get("input_dtypes") or []]
            nbytes = 0
            for dims, dt in zip(e.get("input_sizes") or [], dtypes):
                n = 1
                for d in dims:
                    n *= int(d)
                nbytes += n * _ITEMSIZE.get(dt, 0)
            i = bisect.bisect_right(times, created) - 1
            row = {
                **t._ident,
                "pg": pg,
                "seq": seq,
                "op": op,
                "nbytes": nbytes,
                "dtype": dtypes[0] if dtypes else "",
                "peer": -1,
                "step": marks[i][1] if i >= 0 else -1,
                "enter_ns": created,
                "async_op": 0,
            }
            if seq > t._entered.get(pg, -1):
                t._entered[pg] = seq
            end = int(e.get("time_discovered_completed_ns") or 0)
            if e.get("retired", True) or end > 0:
                self._write_ring_row(row, end)
            else:  # still in flight: heartbeats and hang dumps see it; written when it retires
                self._open[(e["_ring"], int(e["record_id"]))] = row
                t._inflight[(pg, seq)] = row
        if self._open:
            self._recheck_open(entries)

    def _write_ring_row(self, row: dict[str, Any], end: int) -> None:
        t = self.t
        row["end_ns"] = end if end > 0 else 0  # gloo's ring has no completion time
        pg, seq = row["pg"], row["seq"]
        t._inflight.pop((pg, seq), None)
        if seq > t._completed.get(pg, -1):
            t._completed[pg] = seq
        t.add("collectives", row)

    def _recheck_open(self, entries: list[dict[str, Any]]) -> None:
        """Ring-only rows seen in flight: written once their entry is retired (or overwritten)."""
        fresh = {(e["_ring"], int(e["record_id"])): e for e in entries}
        for key in list(self._open):
            e = fresh.get(key)
            if e is None:
                data = self.reader.last_data[key[0]]
                e = _entry(data, key[1]) if data else None
            end = int((e or {}).get("time_discovered_completed_ns") or 0)
            if e is None or e.get("retired", True) or end > 0:
                self._write_ring_row(self._open.pop(key), end)

    def _match(self, pg: str, created: int) -> tuple[_Claim | None, list[_Claim]]:
        """The claim whose call made the entry created at ``created`` (None: a call the wrappers did
        not see, e.g. DDP's reducer, FSDP2's, DTensor's), and the claims before it whose calls
        ended with no entry read for them (coalesced, or their entries were overwritten)."""
        q = self._claims.get(pg)
        orphans: list[_Claim] = []
        while q:
            c = q[0]
            if created < c.t0:
                return None, orphans
            q.popleft()
            if c.t1 and created > c.t1:
                orphans.append(c)
                continue
            return c, orphans
        return None, orphans

    def _drop_claim(self, c: _Claim) -> None:
        with self._lock:
            self._by_row.pop(id(c.row), None)
            if c.done:
                self._held -= 1
        self.t.count_drop("collectives:wrapped_call_without_own_entry")

    def _settle(self, c: _Claim, seq: int) -> None:
        t = self.t
        row = c.row
        with self._lock:
            self._by_row.pop(id(row), None)
            row["seq"] = seq
            done = c.done
            if done:
                self._held -= 1
            if seq > t._entered.get(row["pg"], -1):
                t._entered[row["pg"]] = seq
            if not done:
                t._inflight[(row["pg"], seq)] = row
        if done:
            if row.get("end_ns", 0) == -1:
                t.write_failed(row)
            else:
                t.write_completed(row)

    def _close_claims(self) -> None:
        """Final read: claims the ring never explained (it lost them) are counted, not guessed."""
        for q in self._claims.values():
            while q:
                c = q.popleft()
                self._drop_claim(c)
        for key in list(self._open):  # never retired: written as not completed
            row = self._open.pop(key)
            self.t._inflight.pop((row["pg"], row["seq"]), None)
            row["end_ns"] = 0
            self.t.add("collectives", row)

    def _register(self, pg: str) -> None:
        """A group first seen in the ring (made by DeviceMesh's split, a library, ...): record it."""
        self._known_pgs.add(pg)
        if pg in {v[0] for v in list(self.t._pg_names.values())}:
            return
        try:
            import torch.distributed.distributed_c10d as c10d

            from ranklens.tracing._patch import _register_group

            g = c10d._resolve_process_group(c10d.GroupName(pg))
            self.t._pg_names[id(g)] = (pg, g)
            _register_group(self.t, c10d, g, pg)
        except Exception:
            self.t.count_drop("process_groups:unresolved")


def _entry(data: bytes, record_id: int) -> dict[str, Any] | None:
    import json

    pos = data.find(b'"record_id":%d,' % record_id)
    if pos < 0:
        return None
    start = data.rfind(b'{"collective_seq_id":', 0, pos)
    end = data.find(b"}", pos)
    if start < 0 or end < 0:
        return None
    try:
        return json.loads(data[start : end + 1])
    except ValueError:
        return None
