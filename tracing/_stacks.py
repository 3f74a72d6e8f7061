"""The Python stacks of every thread of this rank, written next to its flight-recorder dump.

A hang's cause is in the stuck rank's stacks (a DataLoader worker that died, a barrier in user code,
a checkpoint write), and a restart wipes them. So whenever the tracer dumps torch's flight recorder
(a collective stuck on this rank, or the dump signal from another rank), it also writes
``<spool>/<job>/<attempt>/stacks/stacks_rank_<r>.json``: each thread's frames, innermost last, as
``sys._current_frames`` sees them from the tracer's background thread. That works while the training
thread waits in a collective or sleeps (the GIL is free); a thread spinning in C with the GIL held
needs an outside sampler (``py-spy dump``). ``ranklens analyze --flight-recorder DIR`` attaches the
suspects' stacks to its findings.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback
from typing import Any

__all__ = ["MAX_FRAMES", "snapshot", "write_stacks"]

MAX_FRAMES = 48  # innermost frames kept per thread


def snapshot() -> list[dict[str, Any]]:
    """Every thread's name, id, daemon flag and frames (innermost last; file, line, function, code)."""
    threads = {t.ident: t for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        t = threads.get(ident)
        frames = traceback.extract_stack(frame)[-MAX_FRAMES:]
        out.append(
            {
                "thread": t.name if t is not None else f"thread-{ident}",
                "ident": int(ident),
                "daemon": bool(t.daemon) if t is not None else True,
                "main": t is threading.main_thread(),
                "ranklens": bool(t is not None and t.name.startswith("ranklens-")),
                "frames": [
                    {"file": f.filename, "line": int(f.lineno or 0), "func": f.name, "code": (f.line or "")[:200]}
                    for f in frames
                ],
            }
        )
    out.sort(key=lambda x: (not x["main"], x["ranklens"], x["thread"]))  # the main thread first
    return out


def write_stacks(directory: str, rank: int, reason: str, ts_ns: int) -> str:
    """Write this rank's stacks as ``stacks_rank_<rank>.json`` in ``directory`` (atomically,
    replacing the previous one); returns the path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"stacks_rank_{rank}.json")
    doc = {"rank": rank, "pid": os.getpid(), "ts_ns": ts_ns, "reason": reason, "threads": snapshot()}
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)
    return path
