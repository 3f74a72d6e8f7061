"""Logging of ranklens' own long-running processes (the collector, ``analyze --follow``).

``text`` is one readable line per record; ``json`` is one JSON object per line (``ts``, ``level``,
``logger``, ``msg``, ``pid``, ``host`` and, for errors, ``exc``) for log pipelines, the collector's
own logs being shipped like any other node log.
"""

from __future__ import annotations

import json
import logging
import socket
import sys
import time
from typing import Any

__all__ = ["JsonFormatter", "setup_logging"]

FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error")


class JsonFormatter(logging.Formatter):
    """One JSON object per record."""

    def __init__(self) -> None:
        super().__init__()
        self._host = socket.gethostname()

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            "pid": record.process,
            "host": self._host,
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    """Send ``ranklens.*`` records at ``level`` and above to stderr in ``fmt`` (text or json)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("ranklens")
    for h in list(logger.handlers):
        if getattr(h, "_ranklens", False):
            logger.removeHandler(h)
    handler._ranklens = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(getattr(logging, level.upper()))
    logger.propagate = False
