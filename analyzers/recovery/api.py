"""Records and errors of recovery: what a decision is, what a delivery attempt ended with.

A :class:`Decision` is what the policy concluded for one finding (a recovery level for a target,
or why it was suppressed); deliveries of a decision to webhooks and hooks each end with an
:class:`Outcome`. Both become rows of the store's ``actions`` table (see :mod:`.audit`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ranklens.analyzers.findings import Finding
from ranklens.errors import ConfigError, RanklensError

__all__ = [
    "Decision",
    "DeliveryError",
    "Level",
    "Outcome",
    "PayloadTooLarge",
    "PolicyError",
    "RecoveryError",
    "SignatureError",
    "idempotency_key",
]


class Level(str, Enum):
    """Recovery levels, least to most disruptive."""

    NOTIFY = "notify"
    RESTART_RANK = "restart_rank"
    REPLACE_NODE = "replace_node"
    RESTART_JOB = "restart_job"

    @property
    def remediates(self) -> bool:
        """True for the levels that change the job (everything but ``notify``)."""
        return self is not Level.NOTIFY


class Outcome(str, Enum):
    """The ``outcome`` column of ``actions`` rows.

    Decision rows: ``decided`` (live), ``dry_run`` (what live would have done), ``suppressed``
    (a guard said no; ``detail`` says which). Delivery rows: ``acknowledged`` (2xx, or a hook that
    returned), ``retrying`` (failed, will be tried again), ``failed`` (gave up or permanent
    error), ``timeout`` (a hook ran past its time), ``skipped`` (not attempted; ``detail`` says
    why). Alert rows (:mod:`.alertmanager`): ``firing``, ``resolved``.
    """

    DECIDED = "decided"
    DRY_RUN = "dry_run"
    SUPPRESSED = "suppressed"
    ACKNOWLEDGED = "acknowledged"
    RETRYING = "retrying"
    FAILED = "failed"
    TIMEOUT = "timeout"
    SKIPPED = "skipped"
    FIRING = "firing"
    RESOLVED = "resolved"


def idempotency_key(finding_id: str, level: Level | str, dry_run: bool) -> str:
    """The key of one decision: the same finding and level (in the same mode) is acted on once.

    A finding keeps its id while the problem lasts (see ``finding_id``), so re-running analysis
    yields the same key and nothing fires again; a switch from dry-run to live is a new key.
    """
    lv = level.value if isinstance(level, Level) else str(level)
    return hashlib.sha256(f"ranklens-action\0{finding_id}\0{lv}\0{'dry' if dry_run else 'live'}".encode()).hexdigest()[
        :32
    ]


@dataclass(frozen=True)
class Decision:
    """What the policy decided for one finding.

    ``level`` is what the policy asks for (after escalation); ``delivered_level`` is what
    deliveries carry: in dry-run every decision goes out as ``notify`` so that no receiver acts.
    ``suppressed_by`` names the guard that stopped it (empty when it goes ahead).
    """

    finding: Finding
    level: Level
    target: str
    rule: str
    reason: str
    dry_run: bool
    key: str
    decided_ns: int
    escalated_from: Level | None = None
    suppressed_by: str = ""
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def delivered_level(self) -> Level:
        return Level.NOTIFY if self.dry_run else self.level

    @property
    def proceeds(self) -> bool:
        return not self.suppressed_by


class RecoveryError(RanklensError):
    """Base of the errors of ranklens.analyzers.recovery."""


class PolicyError(RecoveryError, ConfigError):
    """A policy file (or a webhook endpoint in it) is invalid; the message names file, key and value."""

    def __init__(self, source: str, key: str, message: str) -> None:
        self.source = source
        self.key = key
        super().__init__(f"{source}: {key}: {message}" if key else f"{source}: {message}")


class SignatureError(RecoveryError):
    """A webhook's signature is missing, malformed, too old or does not match."""


class PayloadTooLarge(RecoveryError):
    """A payload is over its size limit even after its evidence was cut down."""


class DeliveryError(RecoveryError):
    """The outbox cannot be opened or written (path, permissions, corrupt database)."""
