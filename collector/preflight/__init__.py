"""``ranklens preflight``'s per-node checks: GPUs through NVML, host, storage, environment and
software, each a small registered function (:mod:`.api`), run on a node by :func:`run_node`.

The modules beside this one hold the checks by group (``gpu``, ``host``, ``storage``, ``env``,
``software``); the cross-node checks (all-reduce, pairwise bandwidth, clock offset, version
consistency, compute against the fleet's median) run in the coordinator, ``ranklens.preflight``.
A node is checked in-process (this machine) or as ``python -m ranklens.collector.preflight`` through
a launcher (ssh, srun, ``ip netns exec``), which prints its report as one JSON line.
"""

from __future__ import annotations

from ranklens.collector.preflight.api import (
    CHECKS,
    Check,
    CheckResult,
    Context,
    NodeReport,
    Status,
    resolve_checks,
    worst,
)
from ranklens.collector.preflight.runner import RESULT_TAG, run_node

__all__ = [
    "CHECKS",
    "RESULT_TAG",
    "Check",
    "CheckResult",
    "Context",
    "NodeReport",
    "Status",
    "resolve_checks",
    "run_node",
    "worst",
]

_MODULES = ("host", "storage", "env", "software", "gpu", "fleet")


def _load_all() -> None:
    """Import every check module (each registers its checks once)."""
    import importlib

    for name in _MODULES:
        importlib.import_module(f"ranklens.collector.preflight.{name}")
