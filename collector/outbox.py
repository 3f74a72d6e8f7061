"""The collector's own rows (log events, GPU samples and events, drop counts) as spool segments.

Rows are written by the spool's one writer (:class:`ranklens.formats.spool.SpoolWriter`, the same
format and writer as the rank spools) under ``<spool>/_collector/<host>/``, validated against their
table and fsynced, so the one :class:`~ranklens.collector.shipper.Shipper` ships them with everything
else and deletes a segment only after the store acknowledged it: a store that is down costs disk,
never rows. The tailer commits in two phases (:meth:`~SpoolWriter.stage`, save its offsets,
:meth:`~SpoolWriter.publish`; :meth:`~SpoolWriter.recover` after a crash).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ranklens.formats.spool import COLLECTOR_DIR, SpoolWriter, safe_part

__all__ = ["COLLECTOR_DIR", "Outbox"]


class Outbox(SpoolWriter):
    """The node collector's spool writer: a :class:`SpoolWriter` of ``<spool>/_collector/<host>/`` (validated rows,
    fsynced segments). Thread-safe.

    Args:
        spool_dir: the spool root the shipper reads.
        host: node name (a sub-directory, so several collectors may share a spool).
        fsync: fsync each segment and its directory (durable across a power loss).
        on_write: called with (table, rows) after each segment is in place (metrics).
    """

    def __init__(
        self,
        spool_dir: str | os.PathLike[str],
        *,
        host: str,
        fsync: bool = True,
        on_write: Callable[[str, int], None] | None = None,
    ) -> None:
        super().__init__(
            os.path.join(spool_dir, COLLECTOR_DIR, safe_part(host)), fsync=fsync, validate=True, on_write=on_write
        )
