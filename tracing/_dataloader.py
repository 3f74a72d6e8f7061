"""Automatic data-loader wait timing: every ``next()`` on a torch DataLoader iterator is recorded
as a ``data`` phase of the current step (unless the user already marks one), so a rank stuck
waiting for its input shows up as such without any code change. While steps are inferred
(``_autostep``), the wait goes there: it closes the previous step and counts as the input of the
next training forward."""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["patch_dataloader", "unpatch_dataloader"]

_saved: dict[str, Any] = {}


def patch_dataloader(tracer: Any) -> None:
    from torch.utils.data import dataloader

    if _saved:
        return
    base = dataloader._BaseDataLoaderIter
    orig = base.__next__
    _saved["__next__"] = orig

    @functools.wraps(orig)
    def __next__(self: Any) -> Any:
        if not tracer.enabled or tracer._phase == "data":
            return orig(self)
        auto = tracer.autostep
        if auto is not None and auto.steps_on:  # an unmarked script: the wait feeds step inference
            return auto.data_wait(orig, self)
        with tracer.phase("data"):
            return orig(self)

    base.__next__ = __next__  # type: ignore[method-assign]  # restored by unpatch_dataloader


def unpatch_dataloader() -> None:
    if not _saved:
        return
    from torch.utils.data import dataloader

    dataloader._BaseDataLoaderIter.__next__ = _saved.pop("__next__")  # type: ignore[method-assign]
