"""Names of environment variables and defaults, read in one place, never at import time."""

from __future__ import annotations

import os

from ranklens.errors import ConfigError

__all__ = [
    "DEFAULT_STORE_DIR",
    "ENV_ATTEMPT",
    "ENV_DISABLE",
    "ENV_JOB_ID",
    "ENV_SPOOL",
    "ENV_STORE",
    "ENV_STORE_PASSWORD",
    "env_float",
    "env_int",
]

ENV_STORE = "RANKLENS_STORE"
ENV_STORE_PASSWORD = "RANKLENS_STORE_PASSWORD"
ENV_SPOOL = "RANKLENS_SPOOL"
ENV_JOB_ID = "RANKLENS_JOB_ID"
ENV_ATTEMPT = "RANKLENS_ATTEMPT"
ENV_DISABLE = "RANKLENS_DISABLE"

DEFAULT_STORE_DIR = "ranklens-store"
DEFAULT_SPOOL_DIR = "/tmp/ranklens-spool"


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
