"""Automatic DDP instrumentation: DDP's gradient-bucket all-reduces run in C++ and bypass the
Python collectives, so at a model's first forward, when the user registered no communication
hook of their own, ranklens registers its averaging all-reduce hook (which goes through the traced
``all_reduce``). A user hook registered before that is respected; if it calls torch.distributed
functions, those are traced anyway.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

__all__ = ["patch_ddp", "unpatch_ddp"]

log = logging.getLogger("ranklens.tracing")
_saved: dict[str, Any] = {}


def patch_ddp(tracer: Any) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    if _saved:
        return
    _saved.update(
        forward=DDP.forward,
        register_comm_hook=DDP.register_comm_hook,
        _register_builtin_comm_hook=DDP._register_builtin_comm_hook,
    )
    orig_forward = _saved["forward"]
    orig_register = _saved["register_comm_hook"]
    orig_builtin = _saved["_register_builtin_comm_hook"]

    @functools.wraps(orig_register)
    def register_comm_hook(self: Any, state: Any, hook: Any) -> Any:
        self._ranklens_user_hook = True
        return orig_register(self, state, hook)

    @functools.wraps(orig_builtin)
    def register_builtin_comm_hook(self: Any, comm_hook_type: Any) -> Any:
        self._ranklens_user_hook = True
        return orig_builtin(self, comm_hook_type)

    @functools.wraps(orig_forward)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(self, "_ranklens_checked", False):
            self._ranklens_checked = True
            if tracer.enabled and not getattr(self, "_ranklens_user_hook", False):
                try:
                    from ranklens.tracing import allreduce_hook

                    orig_register(self, self.process_group, allreduce_hook)
                    self._ranklens_user_hook = True
                except Exception:
                    tracer.count_drop("ddp:hook_registration_failed")
                    log.exception("ranklens: could not instrument DDP; its all-reduces go untraced")
        return orig_forward(self, *args, **kwargs)

    # monkeypatching the class is the point (unpatch_ddp restores it)
    DDP.forward = forward  # type: ignore[method-assign]
    DDP.register_comm_hook = register_comm_hook  # type: ignore[method-assign]
    DDP._register_builtin_comm_hook = register_builtin_comm_hook  # type: ignore[method-assign]


def unpatch_ddp() -> None:
    if not _saved:
        return
    from torch.nn.parallel import DistributedDataParallel as DDP

    DDP.forward = _saved["forward"]  # type: ignore[method-assign]
    DDP.register_comm_hook = _saved["register_comm_hook"]  # type: ignore[method-assign]
    DDP._register_builtin_comm_hook = _saved["_register_builtin_comm_hook"]  # type: ignore[method-assign]
    _saved.clear()
