"""The collector's fault drill: SIGKILL itself right after the N-th store write.

``RANKLENS_COLLECTOR_FAULT=kill_after_write:N`` (:data:`ranklens.config.ENV_COLLECTOR_FAULT`)
kills the shipping process after the store acknowledged a write and before the shipped segments
are deleted: the moment exactly-once delivery has to survive (fault drills, and the exactly-once
tests). Read once, when a :class:`~ranklens.collector.shipper.Shipper` is built.
"""

from __future__ import annotations

import logging
import os
import re
import signal
from collections.abc import Mapping

from ranklens.config import ENV_COLLECTOR_FAULT
from ranklens.errors import ConfigError

__all__ = ["FaultDrill"]

log = logging.getLogger("ranklens.collector")


class FaultDrill:
    """Kills this process after store write number ``kill_after_write`` (0: never).

    Raises:
        ConfigError: from :meth:`parse` / :meth:`from_env`, for a spec other than
            ``kill_after_write[:N]``.
    """

    def __init__(self, kill_after_write: int = 0) -> None:
        self.kill_after_write = kill_after_write
        self.writes = 0

    @classmethod
    def parse(cls, spec: str) -> FaultDrill:
        """``kill_after_write`` (after the first write) or ``kill_after_write:N``; empty: no drill."""
        if not spec:
            return cls(0)
        m = re.fullmatch(r"kill_after_write(?::(\d+))?", spec.strip())
        if not m:
            raise ConfigError(f"{ENV_COLLECTOR_FAULT}={spec!r}: allowed kill_after_write[:N]")
        return cls(int(m.group(1) or 1))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> FaultDrill:
        return cls.parse(environ.get(ENV_COLLECTOR_FAULT, ""))

    def wrote(self) -> None:
        """A store write succeeded: count it, and strike when its number is due."""
        self.writes += 1
        if self.kill_after_write and self.writes >= self.kill_after_write:
            log.error(
                "ranklens collector: %s: killing this process after store write %d", ENV_COLLECTOR_FAULT, self.writes
            )
            os.kill(os.getpid(), signal.SIGKILL)
