"""The one exception tree of ranklens.

Every error a user can hit derives from :class:`RanklensError`; messages say the value, the
constraint and the fix. The CLI maps each leaf to a documented exit code (see ``EXIT_CODES``).
"""

from __future__ import annotations

__all__ = [
    "EXIT_CODES",
    "ConfigError",
    "IngestError",
    "NotFound",
    "RanklensError",
    "SchemaVersionError",
    "StoreAuthError",
    "StoreError",
    "StoreUnavailable",
]


class RanklensError(Exception):
    """Base of every ranklens error."""

    exit_code = 1


class ConfigError(RanklensError):
    """A setting (argument, environment variable, URL) has a value ranklens cannot use."""

    exit_code = 2


class StoreError(RanklensError):
    """The store rejected an operation (bad SQL, unknown table, ...)."""

    exit_code = 3


class StoreUnavailable(StoreError):
    """The store cannot be reached (server down, directory missing, timeout)."""

    exit_code = 4


class StoreAuthError(StoreUnavailable):
    """The store refused the credentials (unknown user, wrong or missing password, address not allowed)."""

    exit_code = 4


class SchemaVersionError(StoreError):
    """The store was created by a ranklens with a different schema version."""

    exit_code = 5


class IngestError(RanklensError):
    """An input file is malformed; the message names the file, the line/row and the field."""

    exit_code = 6

    def __init__(self, path: str, where: str, message: str) -> None:
        self.path = path
        self.where = where
        super().__init__(f"{path}: {where}: {message}" if where else f"{path}: {message}")


class NotFound(RanklensError):
    """What was asked for (a job, an attempt) is not in the store."""

    exit_code = 8


EXIT_CODES = {
    0: "success",
    1: "unexpected error",
    2: "bad usage or configuration",
    3: "store error (bad query, unknown table)",
    4: "store unavailable (down, timed out, or credentials refused)",
    5: "store schema version mismatch",
    6: "malformed input (nothing was written)",
    7: "the demo's training job failed",
    8: "nothing to analyze (no such job in the store)",
    9: "a drill missed a fault, named the wrong rank or kind, or raised a false alarm",
}
