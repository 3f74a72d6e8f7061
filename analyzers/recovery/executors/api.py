"""The executor interface: one decision in, one result out, never an exception.

A policy's ``[[executor]]`` table is an :class:`ExecutorSpec`::

    [[executor]]
    name = "elastic"
    kind = "torchrun"                    # restart the worker group through torch elastic
    levels = ["restart_rank", "restart_job"]
    kinds = ["hang", "desync"]           # finding kinds (default: any)
    signal = "SIGKILL"                   # kind-specific options
    stacks_wait_s = 10

:func:`build_executor` makes the implementation. The engine calls :meth:`Executor.execute` for
every live decision the spec accepts (a dry-run decision is recorded as ``skipped`` with what would
have been done) and writes the :class:`ExecResult` as an ``actions`` row (target
``executor:<name>``); an executor that raises is a ``failed`` row, never an error of the analysis.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ranklens.analyzers.recovery.api import Decision, Level
from ranklens.store.api import Store

__all__ = ["EXECUTOR_KINDS", "SIGNALS", "ExecContext", "ExecResult", "Executor", "ExecutorSpec", "build_executor"]

#: kinds an [[executor]] table may name, with the options each takes
EXECUTOR_KINDS: dict[str, set[str]] = {"torchrun": {"signal", "stacks_wait_s"}}
#: signals the torchrun executor may send
SIGNALS = ("SIGKILL", "SIGTERM", "SIGINT")
#: kinds asked for that are not built yet, and what to use meanwhile
NOT_YET = {
    "slurm": "the Slurm executor (drain, requeue) is not built yet: use a hook calling scontrol",
    "kubernetes": "the Kubernetes executor (cordon, delete pod) is not built yet: use a hook",
    "webhook": "webhooks are [[endpoint]] tables, not executors",
    "hook": "Python hooks are registered with @ranklens.analyzers.recovery.hook, not in [[executor]]",
}


@dataclass(frozen=True)
class ExecutorSpec:
    name: str
    kind: str
    levels: tuple[Level, ...] = (Level.RESTART_RANK, Level.RESTART_JOB)
    kinds: tuple[str, ...] = ("*",)
    options: Mapping[str, Any] = field(default_factory=dict)

    def accepts(self, level: Level, kind: str) -> bool:
        return level in self.levels and ("*" in self.kinds or kind in self.kinds)


@dataclass(frozen=True)
class ExecResult:
    """``outcome``: ``acknowledged`` (done), ``failed`` or ``skipped`` (not attempted: why in detail)."""

    outcome: str
    detail: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class ExecContext:
    """What executors may use: the store (heartbeats: which process is which rank), this node's name,
    the spool the job's ranks write (their stack dumps), a clock and a sleep (tests)."""

    store: Store | None = None
    host: str = ""
    spool_dir: str = ""
    clock_ns: Callable[[], int] = time.time_ns
    sleep: Callable[[float], None] = time.sleep


class Executor(Protocol):
    spec: ExecutorSpec

    def describe(self, decision: Decision) -> str:
        """What :meth:`execute` would do (for dry runs)."""

    def execute(self, decision: Decision, ctx: ExecContext) -> ExecResult:
        """Carry the decision out; never raises for conditions of the job or the node."""


def build_executor(spec: ExecutorSpec) -> Executor:
    if spec.kind == "torchrun":
        from ranklens.analyzers.recovery.executors.torchrun import TorchrunExecutor

        return TorchrunExecutor(spec)
    raise ValueError(f"unknown executor kind {spec.kind!r}")
