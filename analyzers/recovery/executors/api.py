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

import importlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from ranklens.analyzers.recovery.api import Decision, Level
from ranklens.store.api import Store

__all__ = [
    "EXECUTOR_KINDS",
    "SIGNALS",
    "ExecContext",
    "ExecResult",
    "Executor",
    "ExecutorSpec",
    "Option",
    "build_executor",
    "executor_class",
]

#: kinds an [[executor]] table may name -> the class that implements it (imported when a policy
#: names the kind; its ``OPTIONS`` are the keys the table may have besides the common ones)
EXECUTOR_KINDS: dict[str, str] = {
    "torchrun": "ranklens.analyzers.recovery.executors.torchrun:TorchrunExecutor",
    "slurm": "ranklens.analyzers.recovery.executors.slurm:SlurmExecutor",
    "kubernetes": "ranklens.analyzers.recovery.executors.kubernetes:KubernetesExecutor",
}
#: signals the torchrun executor may send
SIGNALS = ("SIGKILL", "SIGTERM", "SIGINT")
#: kinds people ask for that are configured elsewhere, and where
NOT_YET = {
    "webhook": "webhooks are [[endpoint]] tables, not executors",
    "hook": "Python hooks are registered with @ranklens.analyzers.recovery.hook, not in [[executor]]",
}


@dataclass(frozen=True)
class Option:
    """One kind-specific key of an ``[[executor]]`` table: its type (``string``, ``number``,
    ``integer``, ``boolean``, ``strings``), default, bounds (numbers), allowed values or template
    placeholders (strings)."""

    type: str
    default: Any
    lo: float | None = None
    hi: float | None = None
    choices: tuple[str, ...] = ()
    placeholders: tuple[str, ...] = ()  # a str.format template: the ``{names}`` it may use
    help: str = ""


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
    #: the kind-specific keys its ``[[executor]]`` table takes (checked by the policy loader)
    OPTIONS: ClassVar[Mapping[str, Option]]
    spec: ExecutorSpec

    def describe(self, decision: Decision) -> str:
        """What :meth:`execute` would do, as a verb phrase ("send SIGKILL to rank 2 ...", "do nothing:
        why"): a dry run's ``actions`` row says "dry run: would <this>"."""

    def execute(self, decision: Decision, ctx: ExecContext) -> ExecResult:
        """Carry the decision out; never raises for conditions of the job or the node."""


def executor_class(kind: str) -> type[Executor]:
    """The class implementing executor ``kind`` (one of :data:`EXECUTOR_KINDS`)."""
    if kind not in EXECUTOR_KINDS:
        raise ValueError(f"unknown executor kind {kind!r}; one of {sorted(EXECUTOR_KINDS)}")
    module, _, name = EXECUTOR_KINDS[kind].partition(":")
    cls: type[Executor] = getattr(importlib.import_module(module), name)
    return cls


def build_executor(spec: ExecutorSpec) -> Executor:
    return executor_class(spec.kind)(spec)  # type: ignore[call-arg]
