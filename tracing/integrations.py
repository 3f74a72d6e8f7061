"""Callbacks for the trainers users already have: PyTorch Lightning and Hugging Face Transformers.

Both only mark steps and phases on the active tracer (:func:`ranklens.tracing.init` must have run;
collectives are traced by init itself). Their steps are the trainer's own (``global_step``), stored
with ``source = 'explicit'``, and the first one turns the tracer's step inference off. Without a
callback, steps and phases of both trainers are inferred from their optimizer steps (``source =
'inferred'``, counted from 0). They are built lazily, so importing ranklens.tracing never
imports Lightning or Transformers::

    trainer = lightning.Trainer(callbacks=[ranklens.tracing.integrations.lightning_callback()])
    trainer = transformers.Trainer(..., callbacks=[ranklens.tracing.integrations.hf_callback()])
"""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = ["hf_callback", "lightning_callback"]


class _Marks:
    """Open/close step and phase contexts from callback pairs (never raises)."""

    def __init__(self) -> None:
        self._step: contextlib.AbstractContextManager[None] | None = None
        self._phase: contextlib.AbstractContextManager[None] | None = None

    def step_start(self, n: int) -> None:
        from ranklens.tracing import step

        self.step_end()
        try:
            self._step = step(int(n))
            self._step.__enter__()
        except Exception:
            self._step = None

    def phase_start(self, name: str) -> None:
        from ranklens.tracing import phase

        self.phase_end()
        try:
            self._phase = phase(name)
            self._phase.__enter__()
        except Exception:
            self._phase = None

    def phase_end(self) -> None:
        cm, self._phase = self._phase, None
        if cm is not None:
            with contextlib.suppress(Exception):
                cm.__exit__(None, None, None)

    def step_end(self) -> None:
        self.phase_end()
        cm, self._step = self._step, None
        if cm is not None:
            with contextlib.suppress(Exception):
                cm.__exit__(None, None, None)


def lightning_callback() -> Any:
    """A ``lightning.pytorch.Callback`` marking steps and forward/backward/optimizer phases."""
    try:
        from lightning.pytorch import Callback
    except ImportError:
        from pytorch_lightning import Callback  # the older package's own class

    class RanklensLightningCallback(Callback):
        def __init__(self) -> None:
            super().__init__()
            self._marks = _Marks()

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self._marks.step_start(trainer.global_step)
            self._marks.phase_start("forward")

        def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
            self._marks.phase_start("backward")

        def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
            self._marks.phase_end()

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            self._marks.phase_start("optimizer")

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self._marks.step_end()

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self._marks.step_end()

    return RanklensLightningCallback()


def hf_callback() -> Any:
    """A ``transformers.TrainerCallback`` marking steps and the optimizer phase."""
    from transformers import TrainerCallback

    class RanklensTrainerCallback(TrainerCallback):
        def __init__(self) -> None:
            self._marks = _Marks()

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._marks.step_start(state.global_step)
            self._marks.phase_start("forward_backward")

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._marks.phase_start("optimizer")

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._marks.phase_end()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._marks.step_end()

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._marks.step_end()

    return RanklensTrainerCallback()
