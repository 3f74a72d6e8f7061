"""Executors: what carries a recovery decision out on the launcher or scheduler the job runs under.

:mod:`.api` is the interface (an :class:`~.api.Executor` gets a decision and returns an
:class:`~.api.ExecResult`, which becomes an ``actions`` row); :mod:`.torchrun` restarts the worker
group of a torchrun / torch elastic job in place. Webhooks and Python hooks stay the generic
executors (``[[endpoint]]`` tables and ``@hook`` functions).
"""

from ranklens.analyzers.recovery.executors.api import (
    EXECUTOR_KINDS,
    ExecContext,
    ExecResult,
    Executor,
    ExecutorSpec,
    build_executor,
)

__all__ = ["EXECUTOR_KINDS", "ExecContext", "ExecResult", "Executor", "ExecutorSpec", "build_executor"]
