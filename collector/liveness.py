"""Per-rank liveness, as the node sees it: is the process behind a rank's heartbeats still alive?

A rank's tracer writes heartbeats every 0.5 s (last step, per group the last ``(pg, seq)``
entered and completed, what is in flight) from a background thread. When the process is killed
(SIGKILL, the OOM killer, a segfault in a CUDA library) the heartbeats simply stop, and an analyzer
on another machine cannot tell a dead process from a frozen one. The collector runs on the rank's
node, so it can: :class:`LivenessWatcher` remembers the newest heartbeat of every local rank it
ships, checks the rank's pid at a fixed interval, and when the process is gone without having
shut tracing down cleanly it writes one more heartbeat for the rank, a copy of its last one with
``exited = 2`` ("process gone, seen by the node's collector") and ``ts_ns`` one nanosecond after
it (so the rank's silence still dates from its last real heartbeat). The live hang analyzer
classifies such a rank as crashed wherever it runs.

Only pids the collector can see are checked: heartbeats carry the rank's pid namespace
(``pid_ns``), and a rank is watched when it shares the collector's (bare metal, Slurm, or containers
with the host's pid namespace; on Kubernetes, run the collector and the training pods with
``hostPID: true``); a rank in a pid namespace of its own is left to the heartbeat timeout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ranklens.config import node_name
from ranklens.formats.process import pid_alive_local, pid_namespace

__all__ = ["EXITED_CLEAN", "EXITED_GONE", "LivenessWatcher"]

log = logging.getLogger("ranklens.collector")

EXITED_CLEAN = 1  # the rank shut tracing down itself
EXITED_GONE = 2  # the rank's process disappeared; written by the node's collector
FORGET_AFTER_S = 3600.0  # ranks silent for longer are no longer watched


class LivenessWatcher:
    """Watches the processes of the ranks whose heartbeats pass through this node's collector.

    Args:
        sink: where the ``exited = 2`` heartbeats go (an :class:`~ranklens.collector.outbox.Outbox`).
        host: the host name the tracers on this node write (default: this machine's).
        pid_alive: (host, pid) → True / False / None (unknown); default: a local ``/proc`` check.
        interval_s: how often pids are checked.
    """

    def __init__(
        self,
        sink: Any,
        *,
        host: str | None = None,
        pid_alive: Callable[[str, int], bool | None] | None = None,
        interval_s: float = 2.0,
    ) -> None:
        self.sink = sink
        self.host = host or node_name()
        self.pid_alive = pid_alive or (lambda _host, pid: pid_alive_local(node_name(), pid))
        self.interval_s = interval_s
        self.pid_ns = pid_namespace()
        self.watched: dict[tuple[str, int, int], dict[str, Any]] = {}
        self.reported = 0
        self._last_check = 0.0
        self._suspect: set[tuple[str, int, int]] = set()  # gone at the last check: confirmed at the next

    def observe(self, table_name: str, data: Any) -> None:
        """Remember the newest heartbeat per local rank from a batch of rows (an Arrow table)."""
        if table_name != "heartbeats" or data.num_rows == 0:
            return
        for row in data.to_pylist():
            if int(row.get("pid") or 0) <= 0 or not self._checkable(row):
                continue
            key = (str(row["job_id"]), int(row.get("attempt") or 0), int(row["rank"]))
            prev = self.watched.get(key)
            if prev is not None and int(prev["ts_ns"]) >= int(row["ts_ns"]):
                continue
            if int(row.get("exited") or 0):
                self.watched.pop(key, None)  # shut down cleanly (or already reported): nothing to watch
                continue
            self.watched[key] = row

    def _checkable(self, row: dict[str, Any]) -> bool:
        """Is the row's pid one of ours? Same pid namespace (the spool is node-local, so the same
        node); for tracers that do not say, the same host name."""
        ns = int(row.get("pid_ns") or 0)
        if ns and self.pid_ns:
            return ns == self.pid_ns
        return row.get("host") == self.host

    def check(self, *, force: bool = False) -> list[dict[str, Any]]:
        """Check the watched pids (at most every ``interval_s``); write and return the heartbeats of
        ranks whose process is gone (at two checks in a row, so a clean exit's last heartbeat, shipped
        in between, wins)."""
        now = time.monotonic()
        if not force and now - self._last_check < self.interval_s:
            return []
        self._last_check = now
        gone: list[dict[str, Any]] = []
        wall = time.time_ns()
        suspect, self._suspect = self._suspect, set()
        for key, hb in list(self.watched.items()):
            alive = self.pid_alive(str(hb["host"]), int(hb["pid"]))
            if alive is False and key not in suspect:
                # A rank that exits cleanly writes its last heartbeat (exited = 1) just before it
                # goes; give the shipper one more pass to bring it before calling the rank dead.
                self._suspect.add(key)
            elif alive is False:
                row = dict(hb, ts_ns=int(hb["ts_ns"]) + 1, exited=EXITED_GONE)
                row.pop("ingest_id", None)
                gone.append(row)
            elif wall - int(hb["ts_ns"]) > FORGET_AFTER_S * 1e9:
                self.watched.pop(key)
        if gone:
            try:
                self.sink.write("heartbeats", gone)
            except OSError as e:
                log.error("ranklens collector: cannot record %d dead rank(s): %s", len(gone), e)
                return []
            for row in gone:
                self.watched.pop((str(row["job_id"]), int(row.get("attempt") or 0), int(row["rank"])), None)
                log.warning(
                    "ranklens collector: rank %s of job %s (pid %s) is gone without shutting down; last step %s",
                    row["rank"],
                    row["job_id"],
                    row["pid"],
                    row.get("step"),
                )
            self.reported += len(gone)
        return gone
