"""The per-rank tracer: steps, phases and the collective arrival ledger, buffered and spooled.

Rules (DESIGN.md §1): never raise into user code, never block on I/O on the caller's thread,
bounded buffers (drop and count), survives fork (children are not traced), one env var turns it off.

Heartbeats have a lane of their own (issue 18): the live hang detector reads a late heartbeat as a
rank that stopped answering, so they are written by their own job thread and spool writer, and a
data flush stuck on a slow or full disk (a big segment behind dirty-page throttling) never holds
them back.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Iterator
from typing import Any

from ranklens._worker import IDLE, Task, Worker
from ranklens.config import node_name
from ranklens.formats.process import pid_namespace
from ranklens.formats.spool import SpoolWriter
from ranklens.tracing._cpu import make_sampler as make_cpu_sampler
from ranklens.tracing._failures import FailureLog
from ranklens.tracing._nonfinite import NonFiniteCheck

__all__ = ["Tracer"]

log = logging.getLogger("ranklens.tracing")

FR_SIGNAL_KEY = "ranklens/fr_dump_signal"
HEARTBEAT_LANE = "heartbeat"  # the worker lane (thread <worker>-heartbeat) that writes heartbeats only
TABLES = ("collectives", "steps", "phases", "process_groups", "ranks", "heartbeats", "cpu", "drops")


class Tracer:
    """Collects records of one rank and spools them from a background thread.

    Args:
        job_id, attempt, rank, world_size: identity of this rank.
        spool_dir: root of the local spool (the collector reads it).
        flush_interval_s: how often the background thread writes segments, and how often a
            heartbeat is written (on its own lane: a stuck data write does not delay it).
        max_buffered: rows held in memory at most; beyond it rows are dropped and counted.
        clock: returns epoch nanoseconds (injectable for tests).
        worker: the background worker that runs the flush, the completion watcher, the ring reader
            and the CUDA timer (default: one of the tracer's own, closed by :meth:`shutdown`).
    """

    def __init__(
        self,
        *,
        job_id: str,
        attempt: int,
        rank: int,
        world_size: int,
        spool_dir: str,
        local_rank: int = -1,
        coords: dict[str, int | None] | None = None,  # None: not known
        flush_interval_s: float = 0.5,
        max_buffered: int = 500_000,
        clock: Callable[[], int] = time.time_ns,
        fr_stuck_s: float = 30.0,
        fr_interval_s: float = 0.0,
        store: Any = None,
        fr_signal_poll_s: float = 2.0,
        worker: Worker | None = None,
    ) -> None:
        self.job_id = job_id
        self.attempt = attempt
        self.rank = rank
        self.world_size = world_size
        self.spool_dir = spool_dir
        self.clock = clock
        self.enabled = True
        self._ident = {"job_id": job_id, "attempt": attempt, "rank": rank}
        self._writer = SpoolWriter.for_rank(spool_dir, job_id, attempt, rank)
        # the heartbeat lane's own writer: nothing it does waits on the data writer's segments
        self._hb_writer = SpoolWriter.for_rank(spool_dir, job_id, attempt, rank)
        # a failure that repeats every flush: one warning, then a count at most once a minute
        # (issue 22, defect 8: a traceback per flush buried the job's own stderr)
        self._spool_failures = FailureLog(log, f"ranklens: rank {rank} cannot write the spool under {spool_dir}")
        self._flush_failures = FailureLog(log, f"ranklens: rank {rank}: a spool flush failed")
        self._hb_failures = FailureLog(log, f"ranklens: rank {rank} cannot write heartbeats under {spool_dir}")
        self._fr_failures = FailureLog(log, f"ranklens: rank {rank}: a flight-recorder dump failed")
        self._buf: list[tuple[str, dict[str, Any]]] = []
        self._buf_lock = threading.Lock()
        self._max = max_buffered
        self._drops: Counter[str] = Counter()
        self._drops_reported: Counter[str] = Counter()
        self.ledger: Any = None  # ranklens.tracing._ledger.Ledger (set by _patch.patch): the ring's collectives
        self._step_marks: deque[tuple[int, int]] = deque(maxlen=8192)  # (ns, step) at every step change
        self._step = -1
        self._phase = ""
        self._seq: dict[str, int] = {}
        self._entered: dict[str, int] = {}
        self._completed: dict[str, int] = {}
        self._inflight: dict[tuple[str, int], dict[str, Any]] = {}
        self._phase_start = 0
        self._last_progress = 0
        self._host = node_name()
        self._pid_ns = pid_namespace()
        self._pg_names: dict[int, tuple[str, Any]] = {}
        self._interval = flush_interval_s
        self._fr_stuck_ns = int(fr_stuck_s * 1e9) if fr_stuck_s > 0 else 0
        self._fr_interval_ns = int(fr_interval_s * 1e9) if fr_interval_s > 0 else 0
        self._fr_last_ns = 0
        self._fr_dumped_for: set[tuple[str, int]] = set()
        # torch.distributed's key-value store (TCPStore): a rank that dumps raises a signal there
        # and every other rank dumps too, so the post-mortem has every live rank's buffer.
        self._store = store
        self._fr_signal_poll_ns = int(fr_signal_poll_s * 1e9)
        self._fr_signal_seen = 0
        self._fr_signal_polled = 0
        self._stop = threading.Event()
        self._flush_lock = threading.Lock()
        self._beat_lock = threading.Lock()
        self._pid = os.getpid()
        self._rank_row: dict[str, Any] = {
            **self._ident,
            "world_size": world_size,
            "host": self._host,
            "local_rank": local_rank,
            "pid": os.getpid(),
            "started_ns": clock(),
            **{k: int(v) for k, v in (coords or {}).items() if k in ("pp", "tp", "dp") and v is not None},
        }
        self.add("ranks", dict(self._rank_row))
        # the training thread's scheduler counters (host CPU contention vs a straggler: tracing/_cpu.py)
        self._cpu = make_cpu_sampler(self._ident, self._host, self.count_drop)
        self.profiler: Any = None  # ranklens.tracing.profiler.ProfilerWindows, set by init()
        self._cuda_timer: Any = None
        self.clock_error_ns = 0  # worst host/device clock mapping error seen (CUDA timing)
        self.spans: Any = None  # ranklens.tracing.otel.StepSpans, set by init() when asked for
        self.autostep: Any = None  # ranklens.tracing._autostep.AutoStep, set by init(): inferred steps
        self._step_phases: list[tuple[str, int, int]] = []
        self._pending: list[tuple[Any, dict[str, Any]]] = []
        self._pending_lock = threading.Lock()
        self._final_rows: set[int] = set()  # in-flight rows the final flush wrote as not completed
        # ONE background worker (ranklens/_worker.py) for the flush, the heartbeat, the 1 ms
        # completion watcher, the ring reader and the CUDA timer. The flush and the heartbeat are
        # blocking tasks (queued jobs) on two lanes: a slow disk delays the next flush, never the
        # watcher's cadence nor the next heartbeat.
        self._owns_worker = worker is None
        self.worker = worker if worker is not None else Worker("ranklens-trace", max_queue=64)
        period = max(flush_interval_s, 0.001)
        self.nonfinite = NonFiniteCheck(self)  # gradients checked before DDP's all-reduce (tracing/_nonfinite.py)
        self._flush_task = self.worker.every(period, self._run, name="flush", blocking=True)
        self._beat_task = self.worker.every(
            period, self._run_beat, name="heartbeat", blocking=True, lane=HEARTBEAT_LANE
        )
        self._watch_task: Task | None = None
        _TRACERS.add(self)

    # -- buffering ------------------------------------------------------------------------
    def add(self, table: str, row: dict[str, Any]) -> None:
        """Buffer one row (never blocks on I/O; drops and counts when the buffer is full)."""
        if not self.enabled:
            return
        buf = self._buf
        if len(buf) >= self._max:
            self._drops[f"{table}:buffer_full"] += 1
            return
        buf.append((table, row))

    def _take(self) -> list[tuple[str, dict[str, Any]]]:
        with self._buf_lock:
            buf, self._buf = self._buf, []
        return buf

    def flush(self) -> None:
        """Write everything buffered to the spool now (called by the background thread). Heartbeats
        are not among it: :meth:`beat` writes them, on a lane of their own."""
        with self._flush_lock:
            if os.getpid() != self._pid:
                return
            if self.ledger is not None:  # the flight-recorder ring's new collectives (tracing/_ledger.py)
                self.ledger.poll(self.clock(), force=self._stop.is_set())
            nonfinite = self.nonfinite.rows()  # never raises (a failing device turns the check off)
            rows = self._take()
            rows += [("log_events", r) for r in nonfinite]
            if self.spans is not None:  # OpenTelemetry spans and metrics, made here and not on the training thread
                self.spans.flushed(rows, self.count_drop)
            now = self.clock()
            if self._cpu is not None and (cpu := self._cpu.sample(now)) is not None:
                rows.append(("cpu", cpu))
            self._maybe_dump_fr(now)
            # the background worker's own losses and skipped flushes, counted like ours (a late 1 ms
            # watcher tick is latency, not a loss: not counted here)
            ws = self.worker.stats()
            for what, n in (
                ("worker:jobs_dropped", ws.jobs_dropped),
                ("worker:task_errors", ws.task_errors),
                ("worker:flush_overruns", ws.overruns_by_name.get("flush", 0)),
                ("worker:heartbeat_overruns", ws.overruns_by_name.get("heartbeat", 0)),
            ):
                if n:
                    self._drops[what] = n
            # a snapshot (one C-level copy): other threads (the heartbeat lane, the watcher) count
            # drops meanwhile, and iterating the live Counter could fail or miss them
            counted = Counter(self._drops)
            for what, n in (counted - self._drops_reported).items():
                rows.append(
                    (
                        "drops",
                        {
                            "ts_ns": now,
                            "host": self._host,
                            "job_id": self.job_id,
                            "rank": self.rank,
                            "component": "tracer",
                            "what": what,
                            "count": n,
                        },
                    )
                )
            self._drops_reported = counted
            by_table: dict[str, list[dict[str, Any]]] = {}
            for table, row in rows:
                by_table.setdefault(table, []).append(row)
            for row in by_table.get("collectives", ()):  # the node, here and not on the hot path (schema 11)
                row["host"] = self._host
            error: OSError | None = None
            lost = 0
            for table, trows in by_table.items():
                try:
                    self._writer.write(table, trows)
                except OSError as e:
                    self._drops[f"{table}:spool_write_failed"] += len(trows)
                    error, lost = e, lost + len(trows)
            if error is not None:
                self._spool_failures.failed(error, lost)
            else:
                self._spool_failures.ok()

    # -- PyTorch's flight recorder ----------------------------------------------------------
    @property
    def kineto_dir(self) -> str:
        """Where profiler windows of this job attempt go (the collector ingests them)."""
        return os.path.join(str(self._writer.dir.parent), "kineto")

    @property
    def fr_dir(self) -> str:
        """Where this job attempt's flight-recorder dumps go (one file per rank, all ranks in one
        folder, so `ranklens analyze --flight-recorder` takes it as it is)."""
        return os.path.join(str(self._writer.dir.parent), "fr")

    @property
    def stacks_dir(self) -> str:
        """Where this job attempt's Python stack dumps go (``stacks/stacks_rank_<r>.json``)."""
        return os.path.join(str(self._writer.dir.parent), "stacks")

    def dump_stacks(self, reason: str) -> str | None:
        """Write every thread's Python stack (tracing/_stacks.py); the path, or None. Never raises."""
        try:
            from ranklens.tracing._stacks import write_stacks

            return write_stacks(self.stacks_dir, self.rank, reason, self.clock())
        except Exception:
            self._drops["stacks:dump_failed"] += 1
            return None

    def dump_flight_recorder(self, reason: str) -> str | None:
        """Write torch's flight-recorder buffer (JSON) as ``fr/fr_trace_rank_<r>.json`` next to the
        spool, replacing the previous dump of this rank, and this rank's Python stacks beside it
        (``stacks/``). Returns the dump's path, or None when torch has no flight recorder here.
        Never raises."""
        self.dump_stacks(reason)
        try:
            from torch._C._distributed_c10d import _dump_fr_trace_json  # type: ignore[attr-defined]  # private
        except Exception:
            return None
        try:
            data = _dump_fr_trace_json()
            os.makedirs(self.fr_dir, exist_ok=True)
            path = os.path.join(self.fr_dir, f"fr_trace_rank_{self.rank}.json")
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(data if isinstance(data, bytes) else str(data).encode())
            os.replace(tmp, path)
            self._fr_last_ns = self.clock()
            log.warning("ranklens: flight-recorder dump of rank %d (%s): %s", self.rank, reason, path)
            return path
        except Exception as e:
            self._drops["flight_recorder:dump_failed"] += 1
            self._fr_failures.failed(e, traceback=not isinstance(e, OSError))
            return None

    def _maybe_dump_fr(self, now: int) -> None:
        """Dump when a collective has been in flight for ``fr_stuck_s`` (before a watchdog kills
        the process), and every ``fr_interval_s`` when asked."""
        if self._fr_stuck_ns:
            for key, row in list(self._inflight.items()):
                if now - row["enter_ns"] >= self._fr_stuck_ns and key not in self._fr_dumped_for:
                    self._fr_dumped_for.add(key)
                    self.dump_flight_recorder(
                        f"{row['op']} #{key[1]} of pg {key[0]} in flight for {(now - row['enter_ns']) / 1e9:.0f} s"
                    )
                    self._raise_fr_signal()
                    return
        if self._store is not None and self._fr_stuck_ns and now - self._fr_signal_polled >= self._fr_signal_poll_ns:
            self._fr_signal_polled = now
            try:
                value = int(self._store.add(FR_SIGNAL_KEY, 0))
            except Exception:
                self._store = None  # the store is gone (job ending): stop polling it
                return
            if value > self._fr_signal_seen:
                self._fr_signal_seen = value
                self.dump_flight_recorder("dump signal from another rank")
                return
        if self._fr_interval_ns and now - self._fr_last_ns >= self._fr_interval_ns:
            self.dump_flight_recorder("periodic")

    def _raise_fr_signal(self) -> None:
        if self._store is None:
            return
        try:
            self._fr_signal_seen = int(self._store.add(FR_SIGNAL_KEY, 1))
        except Exception:
            self._drops["flight_recorder:signal_failed"] += 1

    def _heartbeat(self, now: int) -> dict[str, Any]:
        """Where this rank is now: step, phase, per-group progress and what is in flight."""
        pgs = list(self._entered)
        inflight = list(self._inflight.values())  # copied: completions run on other threads
        return {
            **self._ident,
            "ts_ns": now,
            "pid": self._pid,
            "host": self._host,
            "pid_ns": self._pid_ns,
            "step": self._step,
            "phase": self._phase,
            "phase_start_ns": self._phase_start,
            "last_progress_ns": self._last_progress,
            "pgs": pgs,
            "pg_entered": [self._entered.get(p, -1) for p in pgs],
            "pg_completed": [self._completed.get(p, -1) for p in pgs],
            "pending_pgs": [r["pg"] for r in inflight],
            "pending_seqs": [r["seq"] for r in inflight],
            "pending_ops": [r["op"] for r in inflight],
            "pending_nbytes": [r["nbytes"] for r in inflight],
            "pending_enter_ns": [r["enter_ns"] for r in inflight],
            "exited": int(self._stop.is_set()),
        }

    def beat(self) -> None:
        """Write one heartbeat now, with its own writer (called by the heartbeat lane's thread).
        A failed write is counted (``heartbeats:spool_write_failed``, reported by the next flush)
        and logged at a bounded rate; the next beat says where the rank is then, so nothing is
        retried."""
        with self._beat_lock:
            if os.getpid() != self._pid:
                return
            try:
                self._hb_writer.write("heartbeats", [self._heartbeat(self.clock())])
            except OSError as e:
                self._drops["heartbeats:spool_write_failed"] += 1
                self._hb_failures.failed(e, 1)
            else:
                self._hb_failures.ok()

    def _run(self) -> None:
        """One periodic flush (a job on the worker's job thread)."""
        try:
            self.flush()
        except Exception as e:  # never let the flusher fail silently (nor flood: see FailureLog)
            self._flush_failures.failed(e, traceback=True)

    def _run_beat(self) -> None:
        """One periodic heartbeat (a job on the heartbeat lane's thread)."""
        try:
            self.beat()
        except Exception as e:
            self._flush_failures.failed(e, traceback=True)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the background thread and write what is left (bounded by ``timeout_s``)."""
        if not self.enabled:
            return
        self._stop.set()
        if self.spans is not None:
            self.spans.shutdown()
        if self._cuda_timer is not None:
            self._cuda_timer.close(timeout_s)
        if self.profiler is not None:
            try:
                self.profiler.close()
            except Exception:
                log.exception("ranklens: closing the profiler failed")
        self._flush_task.cancel()
        self._beat_task.cancel()
        if self._watch_task is not None:
            self._watch_task.cancel()
        if self.ledger is not None:
            self.ledger.stop()

        def final() -> None:
            self._run()  # the ledger's forced read first: claims get their seqs, retired entries are written
            with self._pending_lock:
                pending, self._pending = self._pending, []
            # still in flight (a victim stopped inside its collective, a watched p2p): the arrival
            # is the ledger's most telling row, written as not completed (end_ns 0)
            left = {id(r): r for _, r in pending}
            for key in list(self._inflight):
                row = self._inflight.pop(key, None)
                if row is not None:
                    left[id(row)] = row
            for row in left.values():
                if int(row.get("seq", 0)) > 0 and id(row) not in self._final_rows:
                    self._final_rows.add(id(row))
                    row.setdefault("end_ns", 0)
                    self.add("collectives", row)
            self._run()
            # and the exited heartbeat once more, now that the final flush has read the ring's last
            # completions (the first one, below, is not held back by a stuck disk; the newest wins)
            self._run_beat()

        # The last heartbeat (``exited``: tracing shut down cleanly, the rank did not die) goes on
        # the heartbeat lane, so a data flush stuck on the disk does not keep it back; the final
        # flush runs on the job thread, after a flush in progress. Both are bounded by timeout_s
        # even when the disk is stuck (the worker logs what did not finish).
        beat_done = threading.Event()

        def last_beat() -> None:
            try:
                self._run_beat()
            finally:
                beat_done.set()

        deadline = time.monotonic() + max(0.0, timeout_s)
        queued_beat = self.worker.submit(last_beat, name="tracer-last-heartbeat", lane=HEARTBEAT_LANE)
        if self._owns_worker:
            self.worker.close(timeout_s, final=final)  # drains the heartbeat lane, then runs final
        else:
            done = threading.Event()

            def final_then_done() -> None:
                final()
                done.set()

            if self.worker.submit(final_then_done, name="tracer-final-flush"):
                done.wait(timeout_s)
            if queued_beat:
                beat_done.wait(max(0.0, deadline - time.monotonic()))
        for failures in (self._spool_failures, self._hb_failures, self._flush_failures, self._fr_failures):
            failures.close()  # what the rate limit held back
        self.enabled = False

    def _after_fork_in_child(self) -> None:
        # A forked child (e.g. a DataLoader worker) is not this rank: trace nothing there (the
        # worker itself is reset in the child by ranklens._worker's own at-fork hook).
        self.enabled = False
        self._cuda_timer = None
        self._buf = []
        self._buf_lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._beat_lock = threading.Lock()
        self._pending = []
        self._pending_lock = threading.Lock()

    # -- steps and phases -------------------------------------------------------------------
    @property
    def _step(self) -> int:
        """The step this rank is in (-1 none). Every change is marked with its time, so that rows
        read later (the flight-recorder ring's collectives) get the step they were issued in."""
        return self._step_now

    @_step.setter
    def _step(self, n: int) -> None:
        self._step_now = n
        self._step_marks.append((self.clock(), n))

    @contextlib.contextmanager
    def step(self, n: int, **info: Any) -> Iterator[None]:
        """Time training step ``n``; ``info`` may carry samples, tokens, loss, grad_norm."""
        if self.autostep is not None:  # explicit steps win: inference stops
            self.autostep.explicit("step")
        start = self.clock()
        self._step = n
        prof = self.profiler
        if prof is not None:
            prof.step_started(n)
        try:
            yield
        finally:
            if prof is not None:
                prof.step_ended(n)
            try:
                row: dict[str, Any] = {**self._ident, "step": n, "start_ns": start, "end_ns": self.clock()}
                self._last_progress = row["end_ns"]
                if self.spans is not None:
                    phases, self._step_phases = self._step_phases, []
                    try:
                        self.spans.step(n, start, row["end_ns"], phases)
                    except Exception:
                        self._drops["spans:error"] += 1
                for k in ("samples", "tokens", "loss", "grad_norm"):
                    if info.get(k) is not None:
                        row[k] = float(info[k]) if k in ("loss", "grad_norm") else int(info[k])
                self.add("steps", row)
            except Exception:
                self._drops["steps:error"] += 1

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a phase (data, forward, backward, optimizer, or any name) of the current step."""
        if self.autostep is not None:  # explicit phases win: phase inference stops
            self.autostep.explicit("phase")
        start = self.clock()
        outer, outer_start = self._phase, self._phase_start
        self._phase, self._phase_start = name, start
        try:
            yield
        finally:
            self._phase, self._phase_start = outer, outer_start
            if self.spans is not None:
                self._step_phases.append((name, start, self.clock()))
            try:
                self.add(
                    "phases",
                    {
                        **self._ident,
                        "step": self._step,
                        "phase": name,
                        "start_ns": start,
                        "end_ns": self.clock(),
                    },
                )
            except Exception:
                self._drops["phases:error"] += 1

    # -- collectives ------------------------------------------------------------------------
    def next_seq(self, key: str) -> int:
        n = self._seq.get(key, 0) + 1
        self._seq[key] = n
        return n

    def set_coords(self, coords: dict[str, int]) -> None:
        """This rank's parallelism coordinates (``pp``, ``tp``, ``dp``) learnt after start (from a
        DeviceMesh): one more ``ranks`` row; readers take the largest known value per rank."""
        new = {k: int(v) for k, v in coords.items() if k in ("pp", "tp", "dp") and v is not None and v >= 0}
        if not new or all(self._rank_row.get(k) == v for k, v in new.items()):
            return
        self._rank_row.update(new)
        self.add("ranks", dict(self._rank_row))

    def collective_entered(
        self, pg: str, seq: int, op: str, nbytes: int, dtype: str, peer: int, async_op: bool
    ) -> dict[str, Any]:
        row = {
            **self._ident,
            "pg": pg,
            "seq": seq,
            "op": op,
            "nbytes": nbytes,
            "dtype": dtype,
            "peer": peer,
            "step": self._step,
            "enter_ns": self.clock(),
            "async_op": int(async_op),
        }
        self._entered[pg] = seq
        self._inflight[(pg, seq)] = row
        return row

    def collective_completed(self, row: dict[str, Any], end_ns: int | None = None) -> None:
        if id(row) in self._final_rows:
            return  # completed after the final flush wrote it as not completed
        row["end_ns"] = self.clock() if end_ns is None else end_ns
        if row["seq"] <= 0 and self.ledger is not None and self.ledger.hold(row):
            return  # its seq comes from the flight-recorder ring: the ledger writes it then
        self.write_completed(row)

    def write_completed(self, row: dict[str, Any]) -> None:
        """Write a completed collective's row (its seq known) and mark its group's progress."""
        pg, seq = row["pg"], row["seq"]
        self._inflight.pop((pg, seq), None)
        if seq > self._completed.get(pg, -1):
            self._completed[pg] = seq
        self._last_progress = row["end_ns"]
        self._add_collective(row)

    def _add_collective(self, row: dict[str, Any]) -> None:
        """Buffer a finished collective's row, unless the ledger keeps it behind an earlier one that
        waits for its seq (``Ledger.defer``: rows reach the store in finishing order)."""
        if self.ledger is None or not self.ledger.defer(row):
            self.add("collectives", row)

    def cuda_timer(self) -> Any:
        """The CUDA event timer (made at the first collective on a CUDA tensor)."""
        timer = self._cuda_timer
        if timer is None:
            import torch

            from ranklens.tracing.timing import CudaEventTimer

            def done(row: dict[str, Any], enter_ns: int, end_ns: int, error_ns: int) -> None:
                row["enter_ns"] = enter_ns
                row["clock"] = "cuda"
                self.clock_error_ns = max(self.clock_error_ns, error_ns)
                self.collective_completed(row, end_ns)

            timer = self._cuda_timer = CudaEventTimer(torch.cuda, done, worker=self.worker, clock=self.clock)
        return timer

    def collective_failed(self, row: dict[str, Any]) -> None:
        """The call raised (timeout, peer gone): it is no longer in flight; keep its arrival."""
        if id(row) in self._final_rows:
            return
        row["end_ns"] = -1
        if row["seq"] <= 0 and self.ledger is not None and self.ledger.hold(row):
            return  # its seq comes from the flight-recorder ring: the ledger writes it then
        self.write_failed(row)

    def write_failed(self, row: dict[str, Any]) -> None:
        """Write a failed collective's row (its seq known); dump the flight recorder once per burst."""
        self._inflight.pop((row["pg"], row["seq"]), None)
        self._add_collective(row)
        if self.clock() - self._fr_last_ns > 5_000_000_000:  # once per failure burst
            self.dump_flight_recorder(f"{row['op']} #{row['seq']} of pg {row['pg']} failed")
            self._raise_fr_signal()

    def watch(self, work: Any, row: dict[str, Any], max_pending: int = 10_000) -> None:
        """Complete ``row`` when ``work.is_completed()`` turns true (for Work objects without a
        future, e.g. gloo isend/irecv). A 1 ms task on the worker polls while anything
        is pending and is idle otherwise; the caller never waits."""
        if not self.enabled:
            return
        with self._pending_lock:
            if len(self._pending) >= max_pending:
                self._drops["collectives:pending_full"] += 1
                return
            self._pending.append((work, row))
            task = self._watch_task
            if task is None:
                task = self._watch_task = self.worker.every(0.001, self._watch_tick, name="watch")
        task.wake()

    def _watch_tick(self) -> object:
        """The watcher's tick: complete the works that finished; idle when nothing is pending."""
        with self._pending_lock:
            # take the list: watch() appends to a new one meanwhile (appending to the list being
            # checked lost a row registered between the check and the merge below)
            pending, self._pending = self._pending, []
        if not pending:
            return IDLE
        still = []
        for work, row in pending:
            try:
                if work.is_completed():
                    self.collective_completed(row)
                else:
                    still.append((work, row))
            except Exception:
                self._drops["collectives:watch_error"] += 1
        with self._pending_lock:
            self._pending = still + self._pending
            return None if self._pending else IDLE

    def count_drop(self, what: str, n: int = 1) -> None:
        self._drops[what] += n


# A forked child is not the rank: one hook per process (registered at import, not at every init()),
# holding the tracers by weak reference (issue 13: a strong reference per init() kept every tracer alive)
_TRACERS: weakref.WeakSet[Tracer] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for tracer in list(_TRACERS):
        tracer._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
