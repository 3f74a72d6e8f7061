"""Severity: how bad a kept log line or a finding is (the one enum; issue 13).

The values are what the store keeps (``log_events.severity``, ``findings.severity``) and what the
CLI prints, so they never change. Log rules use all four; analyzers decide findings as ``info``,
``warning`` or ``critical`` (``error`` is a log line's level: a recovery policy's
``min_severity = "error"`` means "critical only" for findings).
"""

from __future__ import annotations

import enum

__all__ = ["Severity"]


class Severity(str, enum.Enum):
    """How bad something is, least to most: ``info < warning < error < critical``."""

    INFO = "info"
    WARNING = "warning"
    ERROR = "error"
    CRITICAL = "critical"

    @property
    def level(self) -> int:
        """0 (info) .. 3 (critical): compare severities with this, not with the string values."""
        return _LEVELS[self]


_LEVELS = {Severity.INFO: 0, Severity.WARNING: 1, Severity.ERROR: 2, Severity.CRITICAL: 3}
