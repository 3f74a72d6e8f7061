"""Content digests of files (the ingest ids of ingested files and traces), streamed."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["feed_file"]

_CHUNK = 1 << 20


def feed_file(h: Any, path: str | os.PathLike[str]) -> Any:
    """Feed the bytes of ``path`` into the hash object ``h`` (1 MiB at a time: a trace of hundreds
    of MB is never held whole); returns ``h``. Raises OSError when the file cannot be read."""
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h
