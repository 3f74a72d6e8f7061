"""Fault injection inside a training rank, installed by ranklens' bootstrap (``ranklens drill``).

``$RANKLENS_DRILL`` names the drill's plan (a JSON file: the faults and the folder the ground truth
goes to). The bootstrap calls :func:`before_init` before ``ranklens.tracing.init()`` and
:func:`after_init` after it, right after the script's ``init_process_group``; the script itself is
not changed. The hooks are PyTorch's own global ones, placed so that injected time lands in the
phase the tracer sees:

- **steps** are counted with a global optimizer-step post hook (step ``k`` runs after ``k``
  completed optimizer steps: the tracer's inferred step number);
- **forward** time: a global forward post hook on the outermost module call of a training step
  (global hooks run before the model's own, so it is inside the tracer's forward);
- **backward** time: a wrapper of ``torch.autograd.backward`` installed before the tracer's;
- **optimizer** time: a global optimizer-step pre hook registered after the tracer's;
- **data** time: a wrapper of the DataLoader iterator's ``__next__`` installed before the tracer's;
- **hang / crash / log lines / GPU event / desync** start at the first training forward of the
  onset step (before that step's collectives), or at the first forward after ``onset_s``;
- **nan**: the outermost module's output on the onset step is multiplied by NaN (a forward hook's
  return value), so the loss and the rank's gradients are NaN before DDP's all-reduce;
- **desync**: the rank's next ``torch.distributed.all_reduce`` becomes a ``broadcast`` from rank
  0 of the same group (what a rank that took another code path does).

A fault on a node (``hang:node1``) is every rank's of that node: torch elastic's node rank
(``GROUP_RANK``) says which node a rank is on. A ``slow_link`` is not the rank's to inject: the
node's ranks report ``due`` when its onset is reached and the drill throttles the link
(:mod:`ranklens.drill.network`), recording the onset itself.

Each rank appends its ground truth to ``<truth>/rank<R>.jsonl``: ``ready`` (pid, local rank, node,
host, world size), then ``onset`` with the exact time each fault started. Nothing here raises into the
training script except the faults themselves.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from typing import Any

from ranklens.config import ENV_ATTEMPT, ENV_DRILL, node_name
from ranklens.drill.faults import DrillFault, DrillKind

__all__ = ["ENV_DRILL", "after_init", "before_init", "log_lines"]

log = logging.getLogger("ranklens.drill")


def log_lines(klass: str, rank: int, local_rank: int, pid: int, now: float | None = None) -> list[str]:
    """The lines a real job writes for a failure of ``klass`` (torch's and the driver's wording),
    with torch's ``[rankN]:`` prefix."""
    t = time.localtime(now if now is not None else time.time())
    us = int(((now if now is not None else time.time()) % 1) * 1e6)
    stamp = f"{time.strftime('%m%d %H:%M:%S', t)}.{us:06d} {pid}"
    p = f"[rank{rank}]:"
    if klass == "nccl_error":
        return [
            f"{p}[E{stamp} ProcessGroupNCCL.cpp:1595] [PG ID 0 PG GUID 0(default_pg) Rank {rank}] Process group "
            "watchdog thread terminated with exception: NCCL error: unhandled system error (run with "
            "NCCL_DEBUG=INFO for details), NCCL version 2.21.5",
            f"{p}ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device error.",
            f"{p}Last error:",
            f"{p}socketProgress: Connection closed by remote peer",
        ]
    if klass == "nccl_timeout":
        return [
            f"{p}[E{stamp} ProcessGroupNCCL.cpp:616] [Rank {rank}] Watchdog caught collective operation timeout: "
            "WorkNCCL(SeqNum=5077, OpType=ALLREDUCE, NumelIn=26214400, NumelOut=26214400, Timeout(ms)=600000) ran "
            "for 600034 milliseconds before timing out."
        ]
    if klass == "cuda_oom":
        return [
            f"{p} Traceback (most recent call last):",
            f'{p}   File "train.py", line 88, in <module>',
            f"{p}     loss = model(batch).loss",
            f"{p} torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU {local_rank} has a "
            "total capacity of 79.15 GiB of which 1.05 GiB is free. Including non-PyTorch memory, this process has "
            "78.09 GiB memory in use.",
        ]
    if klass == "xid":
        return [
            f"{p}NVRM: Xid (PCI:0000:{0x18 + local_rank:02x}:00): 79, pid={pid}, name=python, "
            "GPU has fallen off the bus.",
            f"{p}RuntimeError: CUDA error: unspecified launch failure",
        ]
    raise ValueError(klass)


class _Injector:
    def __init__(self, plan: dict[str, Any]) -> None:
        import torch.distributed as dist

        self.rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        self.world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
        self.node = int(os.environ.get("GROUP_RANK", "0") or 0)  # torch elastic's node rank
        self.truth_dir = str(plan["truth_dir"])
        self.faults = [(i, DrillFault.from_json(d)) for i, d in enumerate(plan["faults"])]
        # faults break the first attempt only: a restarted worker group (torch elastic) runs clean
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get(ENV_ATTEMPT) or 0)
        self.mine = [(i, f) for i, f in self.faults if self._targets_me(f)] if self.attempt == 0 else []
        self.t0 = time.time()
        self.step = 0  # completed optimizer steps
        self.step_ends: list[float] = []
        self.started: dict[int, float] = {}  # fault -> onset (epoch s)
        self.baseline: dict[int, float] = {}  # slow_gpu factor: the step time before onset
        self._depth = 0
        self._fwd_step = -1
        self._applied_step: dict[tuple[int, str], int] = {}
        self._desync_armed = False
        self._armed: set[int] = set()
        self._reported: set[int] = set()  # slow_link faults reported due
        self._lock = threading.Lock()
        self._record(
            {
                "event": "ready",
                "rank": self.rank,
                "attempt": self.attempt,
                "world_size": self.world,
                "local_rank": self.local_rank,
                "node": self.node,
                "pid": os.getpid(),
                "host": node_name(),  # as the tracer records it (ranks.host)
            }
        )

    def _targets_me(self, f: DrillFault) -> bool:
        return f.node == self.node if f.node >= 0 else f.rank == self.rank

    # --- ground truth -------------------------------------------------------------------------

    def _record(self, rec: dict[str, Any]) -> None:
        rec.setdefault("ts_ns", time.time_ns())
        try:
            with open(os.path.join(self.truth_dir, f"rank{self.rank}.jsonl"), "a") as f:
                f.write(json.dumps(rec) + "\n")
                f.flush()
        except OSError as e:  # the drill then reports the fault as not applied
            log.warning("ranklens drill: cannot write the ground truth: %s", e)

    def _due(self, f: DrillFault) -> bool:
        if f.onset_s >= 0:
            return time.time() - self.t0 >= f.onset_s
        return self.step >= f.onset_step

    def _start(self, i: int, f: DrillFault, **extra: Any) -> bool:
        """True the first time fault ``i`` starts (its onset is recorded then)."""
        with self._lock:
            if i in self.started:
                return False
            self.started[i] = time.time()
        self._record({"event": "onset", "fault": i, "step": self.step, "spec": f.spec, **extra})
        return True

    # --- hooks ---------------------------------------------------------------------------------

    def _step_time(self) -> float | None:
        e = self.step_ends[-6:]
        d = [b - a for a, b in itertools.pairwise(e)]
        return sorted(d)[len(d) // 2] if len(d) >= 2 else None

    def _slow(self, phase: str) -> None:
        for i, f in self.mine:
            if f.kind is not DrillKind.SLOW_GPU or f.detail != phase or not self._due(f):
                continue
            if self._applied_step.get((i, phase)) == self.step:
                continue  # once per step
            if f.unit == "ms":
                extra = f.severity / 1000.0
            else:
                if i not in self.baseline:
                    base = self._step_time()
                    if base is None:
                        continue  # no pace yet: the onset moves to the first step with one
                    self.baseline[i] = base
                extra = (f.severity - 1.0) * self.baseline[i]
            self._applied_step[(i, phase)] = self.step
            self._start(i, f, added_s=round(extra, 6))
            time.sleep(extra)

    def _at_step_start(self) -> None:
        for i, f in self.mine:
            if f.kind in (DrillKind.SLOW_GPU, DrillKind.SLOW_DATA, DrillKind.NAN) or not self._due(f):
                continue
            if f.kind is DrillKind.SLOW_LINK:  # the drill throttles the link and records the onset
                if i not in self._reported:
                    self._reported.add(i)
                    self._record({"event": "due", "fault": i, "step": self.step, "spec": f.spec})
                continue
            if f.kind in (DrillKind.DESYNC, DrillKind.SIZE_MISMATCH):
                if not self._desync_armed and i not in self.started and i not in self._armed:
                    self._armed.add(i)
                    self._desync_armed = True
                continue
            if not self._start(i, f):
                continue
            if f.kind is DrillKind.LOG:
                lines = log_lines(f.detail, self.rank, self.local_rank, os.getpid())
                sys.stderr.write("\n".join(lines) + "\n")
                sys.stderr.flush()
            elif f.kind is DrillKind.CRASH:
                sys.stderr.flush()
                if f.unit == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                os._exit(int(f.severity))
            elif f.kind is DrillKind.HANG:
                time.sleep(f.severity if math.isfinite(f.severity) else 10**9)
            # GPU: the drill's fake NVML raises the event when it reads this onset

    def forward_pre(self, module: Any, args: Any) -> None:
        import torch

        if self._depth == 0 and torch.is_grad_enabled() and self._fwd_step != self.step:
            self._fwd_step = self.step
            self._at_step_start()
        self._depth += 1

    def forward_post(self, module: Any, args: Any, output: Any) -> Any:
        import torch

        self._depth = max(0, self._depth - 1)
        if self._depth == 0 and torch.is_grad_enabled():
            self._slow("forward")
            for i, f in self.mine:
                # one step's output: the loss, its gradients, then (after the all-reduce) every rank's
                if f.kind is DrillKind.NAN and self._due(f) and isinstance(output, torch.Tensor) and self._start(i, f):
                    return output * float("nan")
        return None

    def optimizer_pre(self, opt: Any, args: Any, kwargs: Any) -> None:
        self._slow("optimizer")

    def optimizer_post(self, opt: Any, args: Any, kwargs: Any) -> None:
        now = time.time()
        if not self.step_ends or now - self.step_ends[-1] > 1e-4:  # optimizers stepped back to back: one step
            self.step += 1
            self.step_ends.append(now)
            del self.step_ends[:-8]

    def data_delay(self) -> None:
        for i, f in self.mine:
            if f.kind is DrillKind.SLOW_DATA and self._due(f):
                self._start(i, f, added_s=f.severity)
                time.sleep(f.severity)


_injector: _Injector | None = None


def _plan() -> dict[str, Any] | None:
    path = os.environ.get(ENV_DRILL)
    if not path:
        return None
    with open(path) as f:
        plan: dict[str, Any] = json.load(f)
    return plan


def before_init() -> None:
    """Install what must sit inside the tracer's own wrappers (backward, data). Never raises."""
    global _injector
    try:
        plan = _plan()
        if plan is None or _injector is not None:
            return
        inj = _injector = _Injector(plan)
        import torch

        kinds = {(f.kind, f.detail) for _, f in inj.mine}
        if (DrillKind.SLOW_GPU, "backward") in kinds:
            orig_backward = torch.autograd.backward

            def backward(*args: Any, **kwargs: Any) -> Any:
                inj._slow("backward")
                return orig_backward(*args, **kwargs)

            torch.autograd.backward = backward
        if any(k is DrillKind.SLOW_DATA for k, _ in kinds):
            from torch.utils.data import dataloader

            orig_next = dataloader._BaseDataLoaderIter.__next__

            def __next__(self: Any) -> Any:
                inj.data_delay()
                return orig_next(self)

            dataloader._BaseDataLoaderIter.__next__ = __next__  # type: ignore[method-assign]
    except Exception:
        log.exception("ranklens drill: the fault injection could not be prepared")


def after_init() -> None:
    """Install the step counter and the forward/optimizer/collective faults. Never raises."""
    inj = _injector
    if inj is None:
        return
    try:
        import torch
        import torch.distributed as dist
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        register_optimizer_step_post_hook(inj.optimizer_post)
        if not inj.mine:
            return
        register_module_forward_pre_hook(inj.forward_pre)
        register_module_forward_hook(inj.forward_post)
        register_optimizer_step_pre_hook(inj.optimizer_pre)
        if any(f.kind in (DrillKind.DESYNC, DrillKind.SIZE_MISMATCH) for _, f in inj.mine):
            orig_all_reduce = dist.all_reduce

            def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                if inj._desync_armed:
                    inj._desync_armed = False
                    fired = [f for i, f in inj.mine if i in inj._armed and i not in inj.started and inj._start(i, f)]
                    group = kwargs.get("group") or (args[1] if len(args) > 1 else None)
                    if fired and fired[0].kind is DrillKind.SIZE_MISMATCH:
                        # the same collective with one element more than the peers pass
                        bigger = torch.cat([tensor.reshape(-1), tensor.new_zeros(1)])
                        return orig_all_reduce(bigger, *args, **kwargs)
                    src = dist.get_global_rank(group, 0) if group is not None else 0
                    return dist.broadcast(tensor, src=src, group=group, async_op=bool(kwargs.get("async_op")))
                return orig_all_reduce(tensor, *args, **kwargs)

            dist.all_reduce = all_reduce
    except Exception:
        log.exception("ranklens drill: the fault injection could not be installed")
