"""Reading the tracer's stack dumps (``<spool>/<job>/<attempt>/stacks/stacks_rank_<r>.json``, written
by ``ranklens.tracing._stacks``): the post-mortem report (``analyze --flight-recorder``) and the
recovery executors (the stuck rank's stack before a restart) read them the same way."""

from __future__ import annotations

import json
import linecache
import re
from pathlib import Path
from typing import Any

__all__ = ["parse_faulthandler", "read_stack_dump"]


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


_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):\s*$")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def parse_faulthandler(text: str) -> list[dict[str, Any]]:
    """The threads of a :mod:`faulthandler` traceback (what ``faulthandler.dump_traceback`` and
    torch's worker-server ``dump_traceback`` handler print) in the dump format above: ``thread``,
    ``main``, ``frames`` (innermost last; ``code`` from the file where it can be read). faulthandler
    does not say which thread is the main one: it is taken to be the thread whose outermost frame is
    a module's top level (``<module>``), else the last one listed with frames."""
    threads: list[dict[str, Any]] = []
    for line in text.splitlines():
        m = _THREAD.match(line)
        if m:
            threads.append(
                {"thread": m.group(2), "main": False, "frames": [], "current": m.group(1) == "Current thread"}
            )
            continue
        f = _FRAME.match(line)
        if f and threads:
            path, lineno, func = f.group(1), int(f.group(2)), f.group(3).strip()
            code = linecache.getline(path, lineno).strip()
            threads[-1]["frames"].insert(0, {"file": path, "line": lineno, "func": func, "code": code})
    with_frames = [t for t in threads if t["frames"] and not t["current"]]
    main = next((t for t in with_frames if t["frames"][0]["func"] == "<module>"), None)
    if main is None and with_frames:
        main = with_frames[-1]
    if main is not None:
        main["main"] = True
    return [{k: v for k, v in t.items() if k != "current"} for t in threads if t["frames"]]
