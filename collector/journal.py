"""The delivery journal: which segments of a spool are *in doubt*.

Before a pass sends anything, the segments it is about to send are written to a small journal
(``<spool>/_collector/state/shipping.json``, fsynced, replaced atomically). A segment named there
that still exists may have reached the store: the collector may have died (kill -9, OOM, power),
or the store may have failed after the rows reached it but before the segment was deleted. The
shipper asks the store about those before sending them again (:mod:`ranklens.collector.settle`).

One journal per spool: every shipper of the spool re-reads it under the spool's lock at every pass
(issue 22 #3). An unreadable journal puts every segment of the spool in doubt (we cannot tell which
are); journals of older releases (one per host) are folded into it and removed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

__all__ = ["JOURNAL", "JOURNAL_VERSION", "Journal"]

log = logging.getLogger("ranklens.collector")

JOURNAL = "_collector/state/shipping.json"  # one per spool, beside the collector's state
JOURNAL_VERSION = 1


class Journal:
    """The journal of the spool ``spool_dir`` at ``path``.

    Args:
        path: the journal's file (every shipper of one spool must use the same one).
        spool_dir: the spool whose segments (paths relative to it) the journal names.
        host: written into the journal (who wrote it last).
        legacy: journals of older releases, read and folded into this one.
    """

    def __init__(self, path: Path, spool_dir: Path, *, host: str, legacy: Sequence[Path] = ()) -> None:
        self.path = path
        self.spool_dir = spool_dir
        self.host = host
        self.legacy = list(legacy)
        self._written: set[str] | None = set()  # what the journal on disk says (None: rewrite it)

    @property
    def stale(self) -> bool:
        """The file on disk is unreadable or an old release's: rewrite it at the next chance."""
        return self._written is None

    def load(self, every_segment: Callable[[], Iterable[str]], *, quiet: bool = False) -> set[str]:
        """The segments in doubt: what the journal (and those of older releases) say, of the
        segments that still exist; ``every_segment()`` when a journal is unreadable."""
        doubt: set[str] = set()
        readable = True
        for path in (self.path, *self.legacy):
            got = self._read(path)
            readable &= got is not None
            doubt |= got if got is not None else set(every_segment())
        # the journal lists each pass's segments; those since shipped and deleted are not in doubt
        doubt = {s for s in doubt if (self.spool_dir / s).exists()}
        self._written = set(doubt) if readable and not self._legacy_present() else None
        if doubt and not quiet:
            log.info(
                "ranklens collector: %d segment(s) in doubt from the last run; the store is asked first", len(doubt)
            )
        return doubt

    def write(self, doubt: set[str]) -> None:
        """Durably record ``doubt`` before anything of it is sent. Raises OSError."""
        if doubt == self._written:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"version": JOURNAL_VERSION, "host": self.host, "in_doubt": sorted(doubt)}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._written = set(doubt)
        for old in self.legacy:  # folded in: the spool's journal is the only one now
            if old != self.path:
                with contextlib.suppress(OSError):
                    old.unlink()

    def _legacy_present(self) -> bool:
        return any(p.exists() for p in self.legacy if p != self.path)

    def _read(self, path: Path) -> set[str] | None:
        """The segments a journal names; None when it is unreadable (then everything pending is in
        doubt: we cannot tell what is)."""
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            return set()
        except (OSError, ValueError) as e:
            log.error("ranklens collector: delivery journal %s unreadable (%s); checking every segment", path, e)
            return None
        if not isinstance(raw, dict) or raw.get("version") != JOURNAL_VERSION:
            log.error("ranklens collector: delivery journal %s has an unknown format; checking every segment", path)
            return None
        return {str(s) for s in raw.get("in_doubt", [])}
