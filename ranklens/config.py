"""Names of environment variables and defaults, read in one place, never at import time."""

from __future__ import annotations

import os

from ranklens.errors import ConfigError

__all__ = [
    "DEFAULT_STORE_DIR",
    "ENV_ATTEMPT",
    "ENV_COLLECTOR_FAULT",
    "ENV_DISABLE",
    "ENV_HOST",
    "ENV_JOB_ID",
    "ENV_SPOOL",
    "ENV_STORE",
    "ENV_STORE_PASSWORD",
    "env_float",
    "env_int",
    "node_name",
]

ENV_STORE = "RANKLENS_STORE"
ENV_STORE_PASSWORD = "RANKLENS_STORE_PASSWORD"
ENV_SPOOL = "RANKLENS_SPOOL"
ENV_JOB_ID = "RANKLENS_JOB_ID"
ENV_ATTEMPT = "RANKLENS_ATTEMPT"
ENV_DISABLE = "RANKLENS_DISABLE"
ENV_HOST = "RANKLENS_HOST"
ENV_COLLECTOR_FAULT = "RANKLENS_COLLECTOR_FAULT"  # the collector's fault drill (collector/fault_drill.py)

DEFAULT_STORE_DIR = "ranklens-store"
DEFAULT_SPOOL_DIR = "/tmp/ranklens-spool"


def node_name() -> str:
    """This node's name as ranklens records it: ``$RANKLENS_HOST`` when set (on Kubernetes, the
    node's name from the downward API, the same in the training pods and the node's collector),
    else the host name."""
    import socket

    return os.environ.get(ENV_HOST, "").strip() or socket.gethostname()


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name}={value} must be >= {minimum}")
    return value


def env_float(name: str, default: float, *, minimum: float | None = None) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name}={value} must be >= {minimum}")
    return value
