"""Every ``RANKLENS_*`` environment variable, named once, and the helpers that read them.

Components take keyword arguments first; a variable is read (through these names) when the
component is built, never at import time: torchrun forks, and a value read at import would be
the parent's. ``tests/ground/test_config_env.py`` checks that no other module spells a variable's name.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from typing import TypeVar

from ranklens.errors import ConfigError

__all__ = [
    "DEFAULT_SPOOL_DIR",
    "DEFAULT_STORE_DIR",
    "ENV_ALERTS_TOKEN",
    "ENV_ATTEMPT",
    "ENV_AUTOSTEP",
    "ENV_CHECKPOINT_PATH",
    "ENV_COLLECTOR_FAULT",
    "ENV_COLLECTOR_PREFIX",
    "ENV_DDP",
    "ENV_DISABLE",
    "ENV_DRILL",
    "ENV_ELASTIC_STORE",
    "ENV_FAKE_NVML",
    "ENV_FR_INTERVAL_S",
    "ENV_FR_LEDGER",
    "ENV_FR_STUCK_S",
    "ENV_HOST",
    "ENV_JOB_ID",
    "ENV_LOG_FORMAT",
    "ENV_LOG_LEVEL",
    "ENV_OUTBOX",
    "ENV_POLICY",
    "ENV_PROFILE_EVERY",
    "ENV_ROLLUPS",
    "ENV_SIGTERM_FLUSH",
    "ENV_SPOOL",
    "ENV_STORE",
    "ENV_STORE_PASSWORD",
    "ENV_WEBHOOK_SECRET",
    "SLURM_JOB_ID_VAR",
    "SLURM_RESTART_COUNT_VAR",
    "env_float",
    "env_int",
    "node_name",
    "slurm_job_name",
    "slurm_job_of",
    "slurm_run_of",
]

# the store (every command, the dashboard)
ENV_STORE = "RANKLENS_STORE"  # store URL; default ./ranklens-store (embedded)
ENV_STORE_PASSWORD = "RANKLENS_STORE_PASSWORD"  # the server store's password, never in a URL
ENV_ROLLUPS = "RANKLENS_ROLLUPS"  # 1: blame reads a server's rollup wherever it can, 0: never (default: expired jobs)

# tracing, inside each rank
ENV_SPOOL = "RANKLENS_SPOOL"  # spool root the ranks write and the collector ships
ENV_JOB_ID = "RANKLENS_JOB_ID"
ENV_ATTEMPT = "RANKLENS_ATTEMPT"
ENV_DISABLE = "RANKLENS_DISABLE"  # 1: tracing off (also spelled in ranklens/_bootstrap/sitecustomize.py)
ENV_HOST = "RANKLENS_HOST"  # this node's name (see node_name)
ENV_CHECKPOINT_PATH = "RANKLENS_CHECKPOINT_PATH"  # the job's checkpoint directory (pre-flight storage checks)
ENV_FAKE_NVML = "RANKLENS_FAKE_NVML"  # a JSON spec of fake GPUs the pre-flight checks read instead of NVML
ENV_FR_LEDGER = "RANKLENS_FR_LEDGER"  # 0: no flight-recorder ring, the wrappers' own seqs only
ENV_FR_STUCK_S = "RANKLENS_FR_STUCK_S"  # dump the ring when a collective is stuck this long
ENV_FR_INTERVAL_S = "RANKLENS_FR_INTERVAL_S"  # also dump it every this many seconds
ENV_DRILL = "RANKLENS_DRILL"  # `ranklens drill`'s plan: faults the bootstrap injects (also in sitecustomize.py)
ENV_ELASTIC_STORE = "RANKLENS_ELASTIC_STORE"  # 0: restarted torch elastic attempts keep torch's store keys
ENV_PROFILE_EVERY = "RANKLENS_PROFILE_EVERY"  # a profiler window every N steps
ENV_DDP = "RANKLENS_DDP"  # 0: do not instrument DDP
ENV_AUTOSTEP = "RANKLENS_AUTOSTEP"  # 0: no step inference for scripts that mark none
ENV_SIGTERM_FLUSH = "RANKLENS_SIGTERM_FLUSH"  # 0: leave SIGTERM alone (default: flush the tracer, then end)

# the collector
ENV_COLLECTOR_PREFIX = "RANKLENS_COLLECTOR_"  # RANKLENS_COLLECTOR_<KEY>: a [collector] config key
ENV_COLLECTOR_FAULT = "RANKLENS_COLLECTOR_FAULT"  # the collector's fault drill (collector/fault_drill.py)
ENV_LOG_LEVEL = "RANKLENS_LOG_LEVEL"
ENV_LOG_FORMAT = "RANKLENS_LOG_FORMAT"

# recovery
ENV_POLICY = "RANKLENS_POLICY"  # recovery policy file
ENV_OUTBOX = "RANKLENS_OUTBOX"  # durable webhook outbox directory
ENV_ALERTS_TOKEN = "RANKLENS_ALERTS_TOKEN"  # bearer token Alertmanager must send
ENV_WEBHOOK_SECRET = "RANKLENS_WEBHOOK_SECRET"  # default variable holding an endpoint's signing secret

# Slurm's variables in a job's environment: its job id, and how often it was requeued
SLURM_JOB_ID_VAR = "SLURM_JOB_ID"
SLURM_RESTART_COUNT_VAR = "SLURM_RESTART_COUNT"

DEFAULT_STORE_DIR = "ranklens-store"
DEFAULT_SPOOL_DIR = "/tmp/ranklens-spool"


def node_name() -> str:
    """This node's name as ranklens records it: ``$RANKLENS_HOST`` when set (on Kubernetes, the
    node's name from the downward API, the same in the training pods and the node's collector),
    else the host name."""
    import socket

    return os.environ.get(ENV_HOST, "").strip() or socket.gethostname()


def slurm_job_name(environ: Mapping[str, str]) -> str | None:
    """The ranklens job id of a Slurm job: ``slurm-<SLURM_JOB_ID>``, ``-r<n>`` after its n-th requeue
    (a requeued job runs again under the same Slurm id; deploy/slurm/train.sbatch sets the same);
    None outside Slurm."""
    jid = environ.get(SLURM_JOB_ID_VAR, "").strip()
    if not jid:
        return None
    restarts = environ.get(SLURM_RESTART_COUNT_VAR, "").strip()
    return f"slurm-{jid}" + (f"-r{restarts}" if restarts and restarts != "0" else "")


def slurm_run_of(job_id: str) -> tuple[str, int] | None:
    """The Slurm job id and requeue count inside a ranklens job id made by :func:`slurm_job_name`
    (``slurm-42-r1`` -> ``("42", 1)``, ``slurm-42`` -> ``("42", 0)``), else None."""
    m = re.fullmatch(r"slurm-(\d+(?:_\d+)?)(?:-r(\d+))?", job_id)
    return (m.group(1), int(m.group(2) or 0)) if m else None


def slurm_job_of(job_id: str) -> str | None:
    """The Slurm job id inside a ranklens job id made by :func:`slurm_job_name` (``slurm-42-r1`` ->
    ``42``), else None."""
    run = slurm_run_of(job_id)
    return run[0] if run else None


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    return _env_number(name, default, int, "an integer", minimum)


def env_float(name: str, default: float, *, minimum: float | None = None) -> float:
    return _env_number(name, default, float, "a number", minimum)


_N = TypeVar("_N", int, float)


def _env_number(name: str, default: _N, parse: Callable[[str], _N], what: str, minimum: _N | None) -> _N:
    """``$name`` parsed by ``parse``; ``default`` when unset or empty; a bad or too small value is a ConfigError."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = parse(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not {what}") from None
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name}={value} must be >= {minimum}")
    return value
