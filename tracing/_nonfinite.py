"""Non-finite gradients, seen on the rank that made them: before DDP's all-reduce.

A NaN or Inf loss on one rank poisons its gradients; DDP's all-reduce then hands them to every rank,
and from the next step every rank's loss is NaN: after the fact the culprit cannot be told from
its victims. Before the all-reduce it can. :class:`NonFiniteCheck` looks at each gradient bucket as
the tracer's DDP hook receives it, on a sample of ``SAMPLE`` elements: ``BLOCKS`` runs of
``SAMPLE // BLOCKS`` contiguous elements spread evenly over the bucket, from its start to its end. A
NaN loss or a backward that blew up makes every gradient non-finite, and a bad region of ~1/(``BLOCKS``
- 1) of a bucket or more is always seen; a lone bad element in a large bucket can be missed: this
is a check for the NaN-loss family, not a full scan. Runs, not single elements ``n // SAMPLE``
apart: 4,096 elements each on its own cache line cost ~156 us per 4 MB bucket on a CPU (every load a
miss, through TensorIterator's element-wise strided path), 256 runs of 16 ~30 us; on the 2-rank CPU
DDP bench (several buckets a step) the old sample was ~1 ms of a ~52 ms step.

The hot path never waits: ``torch.isfinite(sample).all()`` is queued on the bucket's device (a CUDA
event is recorded behind it); the tracer's background flush reads the flags whose work completed.
The first non-finite bucket of a step becomes one ``log_events`` row (class ``nonfinite_grad``)
with the step; at most ``MAX_REPORTS`` steps are reported per rank, then only counted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

__all__ = ["CLASS", "NonFiniteCheck"]

CLASS = "nonfinite_grad"
SAMPLE = 4096  # elements looked at per bucket
BLOCKS = 256  # ...in this many contiguous runs (of 16 elements: one 64-byte line of float32)
MAX_REPORTS = 3  # steps reported per rank; later ones only counted
MAX_PENDING = 256  # flags not read yet; more are dropped (counted)

log = logging.getLogger("ranklens.tracing")


class NonFiniteCheck:
    def __init__(self, tracer: Any) -> None:
        self.tracer = tracer
        self._pending: deque[tuple[int, int, int, Any, Any]] = deque()
        self._lock = threading.Lock()
        self._reported_step: int | None = None  # buckets are checked in step order: one report per step
        self.reports = 0
        self.off = False

    def bucket(self, tensor: Any, index: int) -> None:
        """Queue the check of one gradient bucket (the training thread: no sync, never raises)."""
        if self.off:
            return
        try:
            import torch

            flat = tensor.reshape(-1)
            n = flat.numel()
            if n == 0:
                return
            # a contiguous tensor (a bucket's flat buffer; reshape copies anything else): BLOCKS runs
            # of SAMPLE // BLOCKS elements from the view's own offset, the first at its start, the last
            # fewer than BLOCKS elements before its end
            w = SAMPLE // BLOCKS
            sample = flat if n <= SAMPLE else flat.as_strided((BLOCKS, w), ((n - w) // (BLOCKS - 1), 1))
            flag = torch.isfinite(sample).all()
            event = None
            if flag.is_cuda:  # copied to pinned host memory behind the check; read once the event completed
                host = torch.empty((), dtype=torch.bool, pin_memory=True)
                host.copy_(flag, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                flag = host
            with self._lock:
                if len(self._pending) >= MAX_PENDING:
                    self.tracer.count_drop("nonfinite:pending_full")
                    return
                self._pending.append((self.tracer._step, index, time.time_ns(), flag, event))
        except Exception:  # a tensor this check cannot read: stop checking, never break training
            self.off = True
            log.debug("ranklens: the non-finite gradient check is off", exc_info=True)

    def rows(self) -> list[dict[str, Any]]:
        """``log_events`` rows for the completed checks that found non-finite values (the flush thread).
        Never raises: a device that fails (a sticky CUDA error) turns the check off."""
        try:
            return self._rows()
        except Exception:
            self.off = True
            with self._lock:
                self._pending.clear()
            self.tracer.count_drop("nonfinite:check_failed")
            log.debug("ranklens: the non-finite gradient check failed and is off", exc_info=True)
            return []

    def _rows(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while True:
            with self._lock:
                if not self._pending:
                    break
                step, index, ts, flag, event = self._pending[0]
                if event is not None and not event.query():
                    break  # in order: later checks were queued behind this one
                self._pending.popleft()
            try:
                finite = bool(flag.item())
            except Exception:
                continue
            if finite or step == self._reported_step:
                continue
            self._reported_step = step
            if self.reports >= MAX_REPORTS:
                self.tracer.count_drop("nonfinite:steps_not_reported")
                continue
            self.reports += 1
            t = self.tracer
            out.append(
                {
                    "job_id": t.job_id,
                    "attempt": t.attempt,
                    "host": t._host,
                    "rank": t.rank,
                    "ts_ns": ts,
                    "stream": "tracer",
                    "source": "ranklens.tracing",
                    "rule": CLASS,
                    "klass": CLASS,
                    "severity": "error",
                    "message": (
                        f"rank {t.rank}: non-finite gradients (NaN/Inf) in DDP bucket {index} before the all-reduce "
                        f"at step {step}: this rank's loss or backward produced them"
                    ),
                    "repeat_count": 1,
                    "context": [f"step {step}"],
                }
            )
        return out
