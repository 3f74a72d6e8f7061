"""Reading the tracer's stack dumps (``<spool>/<job>/<attempt>/stacks/stacks_rank_<r>.json``, written
by ``ranklens.tracing._stacks``): the post-mortem report (``analyze --flight-recorder``) and the
recovery executors (the stuck rank's stack before a restart) read them the same way."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["read_stack_dump"]


def read_stack_dump(path: str | Path) -> dict[str, Any] | None:
    """One rank's dump: ``rank``, ``pid``, ``ts_ns``, ``reason`` and the training's ``threads``
    (ranklens' own left out; each ``thread``, ``main``, ``frames`` innermost last). None when the file
    is missing, truncated or not a dump (a dump is context, never a reason to fail)."""
    try:
        doc = json.loads(Path(path).read_text())
        return {
            "rank": int(doc["rank"]),
            "pid": int(doc.get("pid", -1)),
            "ts_ns": int(doc["ts_ns"]),
            "reason": str(doc.get("reason", "")),
            "threads": [
                {"thread": str(t["thread"]), "main": bool(t["main"]), "frames": list(t["frames"])}
                for t in doc["threads"]
                if not t.get("ranklens")
            ],
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
