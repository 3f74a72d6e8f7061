"""Python remediation hooks: ``@hook("straggler")`` functions called with a :class:`Decision`.

Register with the decorator on a :class:`HookRegistry` (the module-level :func:`hook` uses
:data:`default_registry`) or from installed packages through the entry-point group
``ranklens.hooks``::

    [project.entry-points."ranklens.hooks"]
    cordon = "mypkg.remediation:cordon_node"   # a @hook-decorated function, or any callable

A hook gets the decision (finding, level, target, dry-run flag). Returning None or True means
done, False means it failed, a string is kept as the detail. Each call runs as a job on the
process's background worker (:mod:`ranklens._worker`), on a lane of that hook's own (one daemon
thread per hook name, started at its first call; a hung hook never holds up another one nor the
interpreter's exit), and is waited for at most ``timeout_s``: a hook that raises is recorded as
``failed``, one that hangs as ``timeout`` and the caller goes on (the call is left to finish;
while it runs, further calls of the same hook are ``skipped`` rather than piling up). Hooks are
called at most once per decision; they are not retried.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from ranklens._worker import Worker
from ranklens.analyzers.recovery.api import Decision, Level, RecoveryError

__all__ = [
    "ENTRY_POINT_GROUP",
    "HookRegistry",
    "HookResult",
    "HookSpec",
    "default_registry",
    "hook",
    "run_hook",
]

logger = logging.getLogger("ranklens.recovery")

ENTRY_POINT_GROUP = "ranklens.hooks"
DEFAULT_TIMEOUT_S = 30.0
HookFn = Callable[[Decision], Any]


@dataclass(frozen=True)
class HookSpec:
    """A registered hook: called for decisions whose finding kind is in ``kinds`` (``"*"``: any)
    and whose delivered level is in ``levels``."""

    name: str
    fn: HookFn
    kinds: tuple[str, ...] = ("*",)
    levels: tuple[Level, ...] = tuple(Level)
    timeout_s: float = DEFAULT_TIMEOUT_S

    def wants(self, kind: str, level: Level) -> bool:
        return level in self.levels and ("*" in self.kinds or kind in self.kinds)


@dataclass(frozen=True)
class HookResult:
    """How a hook call ended: ``outcome`` is acknowledged, failed, timeout or skipped."""

    outcome: str
    detail: str
    duration_s: float


class HookRegistry:
    """Hooks by name. Registering a name twice replaces the first (re-imports are harmless).

    Args:
        worker: runs the calls (default: the process's hook worker, shared by every registry).
    """

    def __init__(self, worker: Worker | None = None) -> None:
        self._hooks: dict[str, HookSpec] = {}
        self._lock = threading.Lock()
        self._running: set[str] = set()  # hooks whose call has not returned yet
        self._worker = worker

    def hook(
        self,
        *kinds: str,
        name: str | None = None,
        levels: Iterable[Level | str] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> Callable[[HookFn], HookFn]:
        """Decorator: register ``fn`` for findings of ``kinds`` (none given: every kind).

        Args:
            kinds: finding kinds, e.g. ``"straggler"``, ``"hang"``.
            name: the hook's name in ``actions`` rows (``hook:<name>``); default module.qualname.
            levels: delivered levels it wants (default all; in dry-run every decision is delivered as notify).
            timeout_s: how long a call may run before the caller goes on.
        """

        def deco(fn: HookFn) -> HookFn:
            spec = self.register(fn, kinds=kinds or ("*",), name=name, levels=levels, timeout_s=timeout_s)
            fn.__ranklens_hook__ = spec  # type: ignore[attr-defined]
            return fn

        return deco

    def register(
        self,
        fn: HookFn,
        *,
        kinds: Iterable[str] = ("*",),
        name: str | None = None,
        levels: Iterable[Level | str] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> HookSpec:
        """Register ``fn`` (see :meth:`hook`); returns its spec."""
        if not callable(fn):
            raise RecoveryError(f"hook {name or fn!r} is not callable")
        if not timeout_s > 0:
            raise RecoveryError(f"hook {name or fn!r}: timeout_s must be > 0, got {timeout_s!r}")
        try:
            lv = tuple(Level(x) for x in (levels if levels is not None else tuple(Level)))
        except ValueError as e:
            raise RecoveryError(f"hook {name or fn!r}: {e}; levels are {[x.value for x in Level]}") from None
        spec = HookSpec(
            name=name or f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}",
            fn=fn,
            kinds=tuple(kinds),
            levels=lv,
            timeout_s=float(timeout_s),
        )
        with self._lock:
            self._hooks[spec.name] = spec
        return spec

    def add(self, spec: HookSpec) -> None:
        with self._lock:
            self._hooks[spec.name] = spec

    def unregister(self, name: str) -> None:
        with self._lock:
            self._hooks.pop(name, None)

    def specs(self) -> list[HookSpec]:
        with self._lock:
            return sorted(self._hooks.values(), key=lambda s: s.name)

    def for_decision(self, kind: str, level: Level) -> list[HookSpec]:
        """The hooks that want a decision on a finding of ``kind`` delivered at ``level``."""
        return [s for s in self.specs() if s.wants(kind, level)]

    def load_entry_points(self, group: str = ENTRY_POINT_GROUP) -> list[str]:
        """Register the hooks installed packages declare in ``group``; returns their names.

        An entry point that fails to load is logged and skipped (one broken plugin must not stop
        the others nor the analysis).
        """
        names = []
        for ep in entry_points(group=group):
            try:
                obj = ep.load()
            except Exception:
                logger.exception("recovery: cannot load hook entry point %s = %s", ep.name, ep.value)
                continue
            spec = getattr(obj, "__ranklens_hook__", None)
            if isinstance(spec, HookSpec):
                self.add(spec)
            elif callable(obj):
                spec = self.register(obj, name=ep.name)
            else:
                logger.error("recovery: hook entry point %s = %s is not callable", ep.name, ep.value)
                continue
            names.append(spec.name)
        return names

    def run(self, spec: HookSpec, decision: Decision) -> HookResult:
        """Call one hook with ``decision`` on its lane of the worker, waiting at most ``spec.timeout_s``."""
        with self._lock:
            if spec.name in self._running:
                return HookResult("skipped", "the previous call of this hook is still running", 0.0)
            self._running.add(spec.name)

        def finished() -> None:
            with self._lock:
                self._running.discard(spec.name)

        return run_hook(spec, decision, worker=self._worker, _finished=finished)


_hook_worker: Worker | None = None
_hook_worker_lock = threading.Lock()


def hook_worker() -> Worker:
    """The process's worker for hook calls (made at the first call; reset in a forked child)."""
    global _hook_worker
    with _hook_worker_lock:
        if _hook_worker is None:
            _hook_worker = Worker("ranklens-hooks", max_queue=1)
        return _hook_worker


def run_hook(
    spec: HookSpec,
    decision: Decision,
    *,
    worker: Worker | None = None,
    _finished: Callable[[], None] | None = None,
) -> HookResult:
    """Run ``spec.fn(decision)`` with a timeout (on ``worker``, default :func:`hook_worker`, in
    the lane ``hook:<name>``); never raises."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def call() -> None:
        try:
            box["value"] = spec.fn(decision)
        except BaseException as e:
            box["error"] = e
        finally:
            done.set()
            if _finished is not None:
                _finished()

    # A daemon lane of the worker, not a ThreadPoolExecutor: the executor's workers are joined at
    # interpreter exit, so one hung hook would keep the analyzer from ever exiting.
    start = time.monotonic()
    w = worker if worker is not None else hook_worker()
    if not w.submit(call, name=spec.name, lane=f"hook:{spec.name}"):
        if _finished is not None:
            _finished()
        return HookResult("skipped", "the hook's previous call is still queued (or the worker is closed)", 0.0)
    done.wait(spec.timeout_s)
    took = time.monotonic() - start
    if not done.is_set():
        logger.error("recovery: hook %s still running after %.1f s; going on without it", spec.name, spec.timeout_s)
        return HookResult("timeout", f"still running after {spec.timeout_s:g} s", took)
    if "error" in box:
        e = box["error"]
        logger.error("recovery: hook %s raised %s: %s", spec.name, type(e).__name__, e)
        return HookResult("failed", f"{type(e).__name__}: {e}"[:500], took)
    value = box.get("value")
    if value is False:
        return HookResult("failed", "the hook returned False", took)
    return HookResult("acknowledged", value[:500] if isinstance(value, str) else "", took)


default_registry = HookRegistry()


def hook(
    *kinds: str,
    name: str | None = None,
    levels: Iterable[Level | str] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Callable[[HookFn], HookFn]:
    """``@hook("straggler")``: register on :data:`default_registry` (see :meth:`HookRegistry.hook`)."""
    return default_registry.hook(*kinds, name=name, levels=levels, timeout_s=timeout_s)
