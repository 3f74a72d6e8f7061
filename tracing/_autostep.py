"""Steps and phases of an unmodified training script, inferred from what PyTorch exposes.

A script run under ``ranklens run`` marks no steps, yet every analysis is per step (issue 21 #1).
PyTorch tells us enough to infer them, with no user code:

- **step boundaries** from the global optimizer-step hooks
  (``torch.optim.optimizer.register_optimizer_step_pre_hook`` / ``_post_hook``): the step number is
  the count of completed optimizer steps, so it is the same on every rank of a data-parallel job.
  Step ``k`` closes when, after its optimizer step, the next step's work begins: a DataLoader wait,
  the model's forward, a backward, or a second ``step()`` of an optimizer that already stepped
  (several optimizers stepped back to back are one step; one whose ``step()`` runs the forward and
  backward in a closure, as Lightning does, is one step per call). A step spans from its first
  phase to the end of its last optimizer step. Collectives carry the tracer's current step, so
  those issued during step ``k`` carry ``k``.
- **forward**: the outermost module call. Global module hooks (every module pays a hook call)
  find the model: a DDP/FSDP wrapper at once; otherwise the outermost modules with trainable
  parameters seen before the first optimizer step (a loss module or a frozen teacher has none).
  Then the global hooks go and only the model's own two hooks stay. Calls under ``no_grad`` (evaluation)
  are not training forwards.
- **backward**: ``torch.autograd.backward`` (what ``Tensor.backward`` calls), wrapped; when a step
  has a forward and an optimizer step but no backward call (``torch.autograd.grad``, a custom
  engine), backward is the time from the end of the forward to the optimizer step.
- **optimizer**: from the optimizer step's pre hook (or the end of the forward/backward run inside
  it) to its post hook.
- **data**: DataLoader waits (``_dataloader``); a wait counts as the input of the training
  forward that follows it, so evaluation waits do not land in training steps.

Explicit markers win: the first ``rlt.step`` (or a trainer callback's) turns inference off for
good, and no inferred row of the step in progress is written; the first ``rlt.phase`` stops phase
inference (steps are still inferred). Every inferred step row carries ``source = 'inferred'``.
Step 0 opens at the first training forward once a torch.optim optimizer exists (their
construction is counted), else at the first optimizer step, so a loop without optimizer never
stamps its collectives with a made-up step. Where nothing can be inferred (no optimizer step: no
torch.optim optimizer, or a custom update loop) the tracer says so once, in one log line (rank 0),
after 20 training forwards with no optimizer or at exit, and collectives keep ``step = -1`` (the
analyzers then work from the arrival ledger alone).
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any

__all__ = ["NO_STEPS_MESSAGE", "AutoStep"]

log = logging.getLogger("ranklens.tracing")

GIVE_UP_AFTER_FORWARDS = 200  # training forwards without any optimizer step: not an optimizer loop
GIVE_UP_WITHOUT_OPTIMIZER = 20  # ... when no optimizer was even created
MAX_ROOTS = 8

NO_STEPS_MESSAGE = (
    "ranklens: no optimizer step seen in this job (no torch.optim optimizer, or a custom update loop): "
    "steps and phases cannot be inferred, collectives keep step -1 and analysis works from the arrival "
    "ledger alone; mark steps with ranklens.tracing.step(n) (and phases with ranklens.tracing.phase) "
    "for per-step analysis"
)
# an optimizer was created, so step 0 was opened at the first forward, but it never stepped
STAMPED_MESSAGE = (
    "ranklens: an optimizer was created but never stepped in {forwards} training forward passes (a custom "
    "update loop?): steps and phases cannot be inferred; collectives issued until now carry step 0, from now "
    "on step -1; mark steps with ranklens.tracing.step(n) (and phases with ranklens.tracing.phase) for "
    "per-step analysis"
)


def _remove_hooks(handles: list[Any]) -> None:
    """Remove every hook handle in ``handles``; one that fails to go does not keep the others."""
    for h in handles:
        try:
            h.remove()
        except Exception:
            pass


# the heartbeat phases of the gaps inside a step (see AutoStep._gap), and "" between steps
_GAPS = frozenset({"", "after_forward", "after_backward"})


class AutoStep:
    """Infers the steps and phases of one rank (see the module doc). Install with :meth:`install`;
    every hook is a no-op once the tracer is disabled, and none raises into the training code.

    Args:
        tracer: the rank's :class:`~ranklens.tracing.tracer.Tracer` (rows go through ``add``).
        give_up_after: training forwards without an optimizer step after which inference stops.
        give_up_without_optimizer: the same while no optimizer was even created. Step 0 opens at
            the first training forward only once an optimizer exists (else at its first
            ``step()``), so a loop without optimizer never stamps collectives with a step.
        say: where the one "nothing can be inferred" line goes (default: the tracing logger, on
            rank 0 only).
    """

    def __init__(
        self,
        tracer: Any,
        *,
        give_up_after: int = GIVE_UP_AFTER_FORWARDS,
        give_up_without_optimizer: int = GIVE_UP_WITHOUT_OPTIMIZER,
        say: Any = None,
    ) -> None:
        self.t = tracer
        self.clock = tracer.clock
        self.steps_on = True
        self.phases_on = True
        self.step = -1  # the open inferred step, -1 before the first
        self.optimizer_steps = 0  # completed (outermost) optimizer steps
        self.steps_written = 0
        self.said_none = False
        self.roots: list[Any] | None = None  # the model's outermost modules, None while discovering
        self._give_up_after = give_up_after
        self._give_up_without = give_up_without_optimizer
        self.optimizers_created = 0  # torch.optim optimizers constructed since install
        self._say = say
        self._start = 0  # earliest phase start of the open step (0 none yet)
        self._opened = 0
        self._opt_end = 0  # end of the open step's last optimizer step (0: none, not closable)
        self._stepped: set[int] = set()  # optimizers stepped in the open step
        self._opt_depth = 0
        self._opt_start = 0
        self._fwd_depth = 0
        self._gdepth = 0
        self._gmod: Any = None
        self._fwd_start = 0
        self._fwd_end = 0
        self._bwd_since_fwd = True
        self._bwd_depth = 0
        self._bwd_end = 0
        self._pending_data: tuple[int, int] | None = None
        self._forwards_without_opt = 0
        self._candidates: list[Any] = []
        self._stack: list[tuple[str, int] | None] = []
        self._span_phases: list[tuple[str, int, int]] = []
        self._handles: list[Any] = []
        self._global: list[Any] = []
        self._orig_backward: Any = None
        self._backward: Any = None
        self._optim_init: tuple[Any, Any, Any] | None = None

    # -- installation -----------------------------------------------------------------------
    def install(self) -> AutoStep:
        import torch
        from torch.nn.modules import module as nn_module
        from torch.optim import optimizer as optim

        self._torch = torch
        orig_init = optim.Optimizer.__init__

        @functools.wraps(orig_init)
        def __init__(opt: Any, *args: Any, **kwargs: Any) -> None:
            orig_init(opt, *args, **kwargs)
            self.optimizers_created += 1

        __init__.__ranklens_wrapped__ = orig_init  # type: ignore[attr-defined]
        self._optim_init = (optim.Optimizer, orig_init, __init__)
        optim.Optimizer.__init__ = __init__  # type: ignore[method-assign, assignment]  # restored by uninstall
        self._handles.append(optim.register_optimizer_step_pre_hook(self._opt_pre))
        self._handles.append(optim.register_optimizer_step_post_hook(self._opt_post))
        self._global.append(nn_module.register_module_forward_pre_hook(self._gpre))
        try:
            self._global.append(nn_module.register_module_forward_hook(self._gpost, always_call=True))
        except TypeError:  # torch without always_call: a forward that raises ends the job anyway
            self._global.append(nn_module.register_module_forward_hook(self._gpost))
        orig = torch.autograd.backward
        self._orig_backward = orig

        @functools.wraps(orig)
        def backward(*args: Any, **kwargs: Any) -> Any:
            if not self.steps_on or self._bwd_depth or self._fwd_depth or self._gdepth or not self.t.enabled:
                return orig(*args, **kwargs)
            start = self._begin_backward()
            try:
                return orig(*args, **kwargs)
            finally:
                self._end_backward(start)

        backward.__ranklens_wrapped__ = orig  # type: ignore[attr-defined]
        self._backward = backward
        torch.autograd.backward = backward
        return self

    def uninstall(self) -> None:
        """Remove every hook (idempotent). ``torch.autograd.backward`` is restored unless someone
        wrapped it after us (then ours stays, passing straight through)."""
        self._drop_global()
        _remove_hooks(self._handles)
        self._handles = []
        torch = getattr(self, "_torch", None)
        if torch is not None and self._backward is not None and torch.autograd.backward is self._backward:
            torch.autograd.backward = self._orig_backward
        self._backward = None
        if self._optim_init is not None:
            cls, orig_init, ours = self._optim_init
            if cls.__init__ is ours:
                cls.__init__ = orig_init
            self._optim_init = None

    def _drop_global(self) -> None:
        _remove_hooks(self._global)
        self._global = []
        self._gdepth = 0
        self._gmod = None

    # -- explicit markers, end ------------------------------------------------------------------
    def explicit(self, what: str) -> None:
        """The script (or a trainer callback) marks ``what`` ('step' or 'phase') itself: stop
        inferring it. Called by the tracer before it records an explicit step or phase."""
        try:
            if what == "step":
                if not self.steps_on:
                    return
                self._flush_pending_data()
                self.steps_on = self.phases_on = False
                self.uninstall()
                log.info("ranklens: the script marks its steps: step and phase inference is off")
            elif self.phases_on:
                self.phases_on = False  # DataLoader waits are still recorded, as without inference
                log.info("ranklens: the script marks its phases: phase inference is off")
        except Exception:
            self.t.count_drop("autostep:error")

    def close(self) -> None:
        """At shutdown: write the last step (when it had an optimizer step), say so when nothing
        could be inferred, remove the hooks."""
        try:
            if self.steps_on:
                if self.optimizer_steps == 0:
                    self._say_none()
                elif self._opt_end:
                    self._close_step()
            self.steps_on = self.phases_on = False
        except Exception:
            self.t.count_drop("autostep:error")
        finally:
            self.uninstall()

    def _say_none(self) -> None:
        if self.said_none:
            return
        self.said_none = True
        if self.step < 0:
            msg = NO_STEPS_MESSAGE
        else:
            msg = STAMPED_MESSAGE.format(forwards=self._forwards_without_opt)
        if self._say is not None:
            self._say(msg)
        elif self.t.rank == 0:
            log.warning(msg)

    def _give_up(self) -> None:
        self.steps_on = self.phases_on = False
        self.uninstall()
        if self.step >= 0 and self.t._step == self.step:
            self.t._step = -1
        self._say_none()

    # -- steps ------------------------------------------------------------------------------
    def _open(self, now: int) -> None:
        self.step += 1
        self.t._step = self.step
        self._opened = now
        self._start = 0
        self._opt_end = 0
        self._stepped = set()
        prof = self.t.profiler
        if prof is not None:
            prof.step_started(self.step)

    def _close_step(self) -> None:
        t = self.t
        n, end = self.step, self._opt_end
        start = self._start or self._opened
        prof = t.profiler
        if prof is not None:
            prof.step_ended(n)
        if t.spans is not None:
            phases, self._span_phases = self._span_phases, []
            try:
                t.spans.step(n, start, end, phases)
            except Exception:
                t.count_drop("spans:error")
        t.add("steps", {**t._ident, "step": n, "start_ns": start, "end_ns": end, "source": "inferred"})
        self.steps_written += 1
        self._opt_end = 0

    def _activity(self, now: int) -> None:
        """Training work (forward, backward, an optimizer step) begins at ``now``: after an
        optimizer step it is the next step's; before the first step it opens step 0."""
        if self._opt_depth:
            return  # inside an optimizer step (a closure): part of it
        if self._opt_end:
            self._close_step()
            self._open(now)
        elif self.step < 0 and self.optimizers_created:
            self._open(now)

    def _phase(self, name: str, start: int, end: int, *, always: bool = False) -> None:
        if not (self.phases_on or always) or self.step < 0:
            return  # before step 0 (no optimizer yet): nothing to attribute it to
        t = self.t
        if self._start == 0 or start < self._start:
            self._start = start
        if t.spans is not None:
            self._span_phases.append((name, start, end))
        t.add("phases", {**t._ident, "step": t._step, "phase": name, "start_ns": start, "end_ns": end})

    def _enter_phase(self, name: str, now: int) -> None:
        """What the heartbeats say this rank is doing (a stack: Lightning runs the forward and
        backward inside the optimizer step). Left alone while the script marks its phases."""
        t = self.t
        if len(self._stack) > 16:  # unbalanced by an exception somewhere: start over
            self._stack.clear()
        if self.phases_on:
            self._stack.append((t._phase, t._phase_start))
            t._phase, t._phase_start = name, now
        else:
            self._stack.append(None)

    def _leave_phase(self) -> None:
        if self._stack:
            prev = self._stack.pop()
            if prev is not None:
                self.t._phase, self.t._phase_start = prev

    def _gap(self, name: str, now: int) -> None:
        """Between a step's phases (the loss after the forward, clipping after the backward), what
        the heartbeats say is ``name``, not the empty phase between steps (where checkpoints and
        evaluation run): the live hang detector names a rank stuck inside a step sooner
        (``analyzers/live_hangs.py`` ``MID_STEP_PHASES``). ``""`` closes the step. No phase rows."""
        t = self.t
        if self.phases_on and t._phase in _GAPS:
            t._phase, t._phase_start = name, now

    # -- data -------------------------------------------------------------------------------
    def data_wait(self, orig: Any, it: Any) -> Any:
        """``next()`` on a DataLoader iterator, timed (called by ``_dataloader`` while steps are
        inferred). The wait is the input of the training forward that follows it; an epoch's
        closing ``StopIteration`` is nobody's input and is not recorded."""
        t = self.t
        now = self.clock()
        try:
            if self._opt_end and not self._opt_depth:
                self._close_step()
                self._open(now)
        except Exception:
            t.count_drop("autostep:error")
        self._enter_phase("data", now)
        try:
            out = orig(it)
        finally:
            self._leave_phase()
        self._pending_data = (now, self.clock())
        return out

    def _flush_pending_data(self) -> None:
        p, self._pending_data = self._pending_data, None
        if p is not None and self.t.enabled:
            t = self.t
            t.add("phases", {**t._ident, "step": t._step, "phase": "data", "start_ns": p[0], "end_ns": p[1]})

    # -- forward ----------------------------------------------------------------------------
    def _forward_begins(self, now: int) -> None:
        self._activity(now)
        if self.optimizer_steps == 0:
            self._forwards_without_opt += 1
            limit = self._give_up_after if self.optimizers_created else self._give_up_without
            if self._forwards_without_opt > limit:
                self._give_up()
                return
        p, self._pending_data = self._pending_data, None
        if p is not None:  # recorded even when the script marks phases: they always were
            self._phase("data", p[0], p[1], always=True)
        self._fwd_start = now
        self._enter_phase("forward", now)

    def _forward_ends(self) -> None:
        end = self.clock()
        self._phase("forward", self._fwd_start, end)
        self._leave_phase()
        self._gap("after_forward", end)
        self._fwd_start = 0
        self._fwd_end = end
        self._bwd_since_fwd = False

    def _root_pre(self, module: Any, args: Any) -> None:
        self._fwd_depth += 1
        if self._fwd_depth > 1 or not self.steps_on or not self.t.enabled:
            return
        try:
            if self._torch.is_grad_enabled():
                self._forward_begins(self.clock())
        except Exception:
            self.t.count_drop("autostep:error")

    def _root_post(self, module: Any, args: Any, output: Any) -> None:
        if self._fwd_depth:
            self._fwd_depth -= 1
        if self._fwd_depth or not self._fwd_start:
            return
        try:
            self._forward_ends()
        except Exception:
            self.t.count_drop("autostep:error")

    def _gpre(self, module: Any, args: Any) -> None:
        if self._gdepth:
            self._gdepth += 1
            return
        try:
            if not self.steps_on or not self.t.enabled or not self._torch.is_grad_enabled():
                self._gdepth += 1
                self._gmod = None
                return
            if _is_wrapper(module):
                # DDP/FSDP: the model. This call's own post hook is the one registered now.
                self._adopt([module])
                self._root_pre(module, args)
                return
            self._gdepth += 1
            self._gmod = None
            if not any(p.requires_grad for p in module.parameters()):
                return  # a loss function, an activation, a frozen teacher: not the model
            if all(m is not module for m in self._candidates) and len(self._candidates) < MAX_ROOTS:
                self._candidates.append(module)
            self._gmod = module
            self._forward_begins(self.clock())
        except Exception:
            self.t.count_drop("autostep:error")

    def _gpost(self, module: Any, args: Any, output: Any) -> None:
        if not self._gdepth:
            return
        self._gdepth -= 1
        if self._gdepth or self._gmod is not module:
            return
        self._gmod = None
        if self._fwd_start:
            try:
                self._forward_ends()
            except Exception:
                self.t.count_drop("autostep:error")

    def _adopt(self, roots: list[Any]) -> None:
        """The model is known: only its own hooks from now on."""
        self._drop_global()
        self._candidates = []
        self.roots = roots
        for m in roots:
            self._handles.append(m.register_forward_pre_hook(self._root_pre, prepend=True))
            try:
                self._handles.append(m.register_forward_hook(self._root_post, always_call=True))
            except TypeError:
                self._handles.append(m.register_forward_hook(self._root_post))
        log.info("ranklens: forward inferred from %s", ", ".join(type(m).__name__ for m in roots))

    # -- backward ---------------------------------------------------------------------------
    def _begin_backward(self) -> int:
        self._bwd_depth = 1
        try:
            now = self.clock()
            self._activity(now)
            self._enter_phase("backward", now)
            return now
        except Exception:
            self.t.count_drop("autostep:error")
            return 0

    def _end_backward(self, start: int) -> None:
        self._bwd_depth = 0
        if not start:
            return
        try:
            end = self.clock()
            self._leave_phase()
            self._gap("after_backward", end)
            self._bwd_end = end
            self._bwd_since_fwd = True
            self._phase("backward", start, end)
        except Exception:
            self.t.count_drop("autostep:error")

    # -- optimizer --------------------------------------------------------------------------
    def _opt_pre(self, opt: Any, args: Any, kwargs: Any) -> None:
        self._opt_depth += 1
        if self._opt_depth > 1 or not self.steps_on or not self.t.enabled:
            return
        try:
            now = self.clock()
            if self._opt_end and id(opt) in self._stepped:
                self._close_step()  # the same optimizer again, nothing seen between: a new step
                self._open(now)
            elif self.step < 0:
                self._open(now)
            if self.roots is None and self._candidates and not self._gdepth:
                self._adopt(list(self._candidates))
            if not self._bwd_since_fwd and self._fwd_end >= self._opened:
                # a forward and no backward call seen: the gradients came some other way
                self._phase("backward", self._fwd_end, now)
                self._bwd_since_fwd = True
            self._opt_start = now
            if self._start == 0:
                self._start = now
            self._enter_phase("optimizer", now)
        except Exception:
            self.t.count_drop("autostep:error")

    def _opt_post(self, opt: Any, args: Any, kwargs: Any) -> None:
        if not self._opt_depth:
            return  # installed while a step() was running
        self._opt_depth -= 1
        if self._opt_depth or not self.steps_on or not self.t.enabled or self.step < 0:
            return
        try:
            end = self.clock()
            self.optimizer_steps += 1
            self._stepped.add(id(opt))
            self._opt_end = end
            self.t._last_progress = end
            # with a closure (Lightning, LBFGS) the forward and backward ran inside step()
            start = max(self._opt_start, self._fwd_end, self._bwd_end)
            self._leave_phase()
            self._gap("", end)  # the step is over
            self._phase("optimizer", start, end)
        except Exception:
            self.t.count_drop("autostep:error")


def _is_wrapper(module: Any) -> bool:
    """DDP, FSDP (1) or an FSDP2 ``fully_shard``-ed module: the model of a data-parallel job."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        return True
    fsdp = sys.modules.get("torch.distributed.fsdp")  # only when the script uses FSDP
    if fsdp is not None:
        for name in ("FullyShardedDataParallel", "FSDPModule"):
            cls = getattr(fsdp, name, None)
            if cls is not None and isinstance(module, cls):
                return True
    return False
