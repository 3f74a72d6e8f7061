"""Follows log files (globs) through rotation and truncation, filters them at the source, and
remembers how far it got across restarts.

Files are tracked by identity (device, inode), not by name: a file renamed by a rotator is drained
to its end through the descriptor already open while its successor is read from the start; a file
that shrinks was truncated and is read again from the start (counted). Offsets are saved in a
JSON state file (written to a temporary file, fsynced, renamed) only *after* the events read up to
them are durably in the outbox, so a crash re-reads at most the lines since the last commit and
never skips one. A state entry also holds a fingerprint of the file's first bytes, so a recycled
inode is not mistaken for the old file.

A line longer than :data:`~ranklens.collector.logfilter.MAX_LINE_BYTES` (a process writing a huge
blob without a newline) is cut there: its head is filtered like any line, the rest is skipped up to
its newline without being held in memory, and the cut lines and bytes are stored in ``drops``
(``log_lines_truncated``, ``log_bytes_cut``). An offset saved inside such a line says so, so a
restart goes on skipping instead of reading the tail as a new line.
"""

from __future__ import annotations

import fnmatch
import glob as globmod
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ranklens.collector.logfilter import FilterStats, LogEvent, LogFilter, StreamFilter
from ranklens.collector.rules import RuleSet
from ranklens.errors import ConfigError

__all__ = ["CommitResult", "LogSource", "Tailer"]

log = logging.getLogger("ranklens.collector.tailer")

STATE_VERSION = 1
MAX_KNOWN = 10_000
FINGERPRINT_BYTES = 1024
STREAMS = ("stdout", "stderr", "kernel", "file")


@dataclass(frozen=True)
class LogSource:
    """Files to follow.

    Args:
        glob: a path pattern (``*``, ``?``, ``[...]``, ``**``).
        stream: ``stdout``, ``stderr``, ``kernel`` or ``file``.
        job_id: the job the lines belong to ('' unknown).
        attempt: restart attempt of the job.
        rank: a fixed rank for every matching file; otherwise ``rank_pattern`` is tried on the
            path, then the line's own ``[rankN]:`` prefix.
        rank_pattern: a regular expression whose first group is the rank, searched in the path.
        start_at: ``beginning`` or ``end``: where to start a file that exists when the collector
            first starts and has no saved offset (files that appear later are read from the start).
    """

    glob: str
    stream: str = "file"
    job_id: str = ""
    attempt: int = 0
    rank: int | None = None
    rank_pattern: str | None = r"rank[-_]?(\d+)"
    start_at: str = "beginning"

    def __post_init__(self) -> None:
        if not self.glob:
            raise ConfigError("a log source needs a glob, e.g. /var/log/job/*/rank-*.log")
        if self.stream not in STREAMS:
            raise ConfigError(f"log source {self.glob}: stream={self.stream!r}; allowed: {', '.join(STREAMS)}")
        if self.start_at not in ("beginning", "end"):
            raise ConfigError(f"log source {self.glob}: start_at={self.start_at!r}; allowed: beginning, end")
        if self.rank_pattern:
            try:
                rx = re.compile(self.rank_pattern)
            except re.error as e:
                raise ConfigError(
                    f"log source {self.glob}: rank_pattern {self.rank_pattern!r} is invalid: {e}"
                ) from None
            if rx.groups < 1:
                raise ConfigError(f"log source {self.glob}: rank_pattern needs a group, e.g. rank-(\\d+)")

    def rank_of(self, path: str) -> int:
        if self.rank is not None:
            return self.rank
        if self.rank_pattern:
            m = re.search(self.rank_pattern, path)
            if m:
                try:
                    return int(m.group(1))
                except ValueError:
                    return -1
        return -1


@dataclass
class CommitResult:
    """What one commit wrote."""

    events: int = 0
    drops: int = 0
    error: str | None = None


@dataclass
class _File:
    path: str
    dev: int
    ino: int
    fh: Any
    source: LogSource
    sf: StreamFilter
    offset: int  # bytes read
    committed: int  # offset whose events are durable
    skip: bool = False  # the committed offset is inside a cut line (see StreamFilter.skipping)
    fingerprint: str = ""
    rotated: bool = False  # no glob matches it any more (renamed away or deleted): drain, then close
    drained: bool = False  # rotated and read to its end: closed after the next commit
    idle_flushed: bool = False
    reported: FilterStats = field(default_factory=FilterStats)


def _fingerprint(fh: Any, upto: int) -> str:
    n = min(upto, FINGERPRINT_BYTES)
    if n <= 0:
        return ""
    pos = fh.tell()
    try:
        fh.seek(0)
        data = fh.read(n)
    finally:
        fh.seek(pos)
    return f"{n}:{hashlib.sha1(data).hexdigest()}"


class Tailer:
    """Reads new lines from every file matching ``sources`` and turns them into log events.

    Call :meth:`poll` often (it reads and filters) and :meth:`commit` every few seconds (it hands
    the events to ``sink`` and then saves the offsets). Not thread-safe: one thread owns it.

    With an :class:`~ranklens.collector.outbox.Outbox` as ``sink`` the commit is two-phase
    (stage segments, save offsets naming them, publish them), so each event reaches the spool
    exactly once across crashes; a plain callable gives at-least-once.

    Args:
        sources: what to follow.
        sink: an :class:`~ranklens.collector.outbox.Outbox`, or a callable ``sink(table, rows)``
            that makes rows durable; either raises on failure, and the lines are then read again.
        state_path: the offsets file (None: no memory across restarts).
        rules: the rule set (default: built-in).
        host: node name written in each row.
        engine: log filter search engine.
        read_bytes: read size; max_bytes_per_poll: fairness bound per file per poll.
        on_commit: called with the filter counters added since the last commit (metrics).
    """

    def __init__(
        self,
        sources: Sequence[LogSource],
        *,
        sink: Any,
        state_path: str | os.PathLike[str] | None = None,
        rules: RuleSet | None = None,
        host: str = "",
        engine: str = "auto",
        read_bytes: int = 4 << 20,
        max_bytes_per_poll: int = 64 << 20,
        max_files: int = 4096,
        clock: Callable[[], int] = time.time_ns,
        on_commit: Callable[[FilterStats], None] | None = None,
    ) -> None:
        self.sources = list(sources)
        self.sink = sink
        self.state_path = Path(state_path) if state_path else None
        self.filter = LogFilter(rules, engine=engine)
        self.host = host
        self.read_bytes = read_bytes
        self.max_bytes_per_poll = max_bytes_per_poll
        self.max_files = max_files
        self.clock = clock
        self.on_commit = on_commit
        self.truncations = 0
        self._files: dict[tuple[int, int], _File] = {}
        self._buf = bytearray()  # one read buffer for every file
        # files not open now (from the state file, or finished): where to resume if they reappear
        self._staged_at_start: list[str] = []
        self._known = self._load_state()
        recover = getattr(sink, "recover", None)
        if recover is not None:  # finish (or undo) a commit that a crash interrupted
            published, discarded = recover(self._staged_at_start)
            if published or discarded:
                log.info("ranklens collector: recovered %d staged segment(s), discarded %d", published, discarded)
        self._first_scan = True
        self._warned_full = False

    # --- state ----------------------------------------------------------------------------

    def _load_state(self) -> dict[tuple[int, int], dict[str, Any]]:
        if not self.state_path or not self.state_path.exists():
            return {}
        try:
            data = json.loads(self.state_path.read_text())
            if data.get("version") != STATE_VERSION:
                raise ValueError(f"version {data.get('version')!r}")
            self._staged_at_start = [str(n) for n in data.get("staged", [])]
            return {(int(e["dev"]), int(e["ino"])): e for e in data["files"]}
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning(
                "ranklens collector: ignoring unreadable tailer state %s (%s): files are read again", self.state_path, e
            )
            return {}

    def _save_state(
        self, offsets: dict[tuple[int, int], int], staged: Sequence[str] = (), skips: set[tuple[int, int]] | None = None
    ) -> None:
        if not self.state_path:
            return
        entries = list(self._known.values())[-MAX_KNOWN:]
        for key, f in self._files.items():
            off = offsets.get(key, f.committed)
            n = int(f.fingerprint.split(":", 1)[0]) if f.fingerprint else 0
            if n < min(off, FINGERPRINT_BYTES):
                f.fingerprint = _fingerprint(f.fh, off)
            entries.append({**_entry(f), "offset": off, "skip": f.skip if skips is None else key in skips})
        body = json.dumps({"version": STATE_VERSION, "files": entries, "staged": list(staged)}, indent=0)
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_name(f".{self.state_path.name}.tmp")
        with open(tmp, "w") as out:
            out.write(body)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.state_path)

    # --- discovery ------------------------------------------------------------------------

    def _resume(self, path: str, st: os.stat_result, source: LogSource, saved: dict[str, Any]) -> None:
        """Open a file where its saved state (an entry of the state file) left it."""
        self._open(
            path,
            st,
            source,
            offset=int(saved["offset"]),
            fingerprint=saved.get("fingerprint", ""),
            skip=bool(saved.get("skip")),
        )

    def _open(
        self,
        path: str,
        st: os.stat_result,
        source: LogSource,
        *,
        offset: int,
        fingerprint: str = "",
        skip: bool = False,
    ) -> None:
        if len(self._files) >= self.max_files:
            if not self._warned_full:
                log.warning("ranklens collector: following %d files already; %s and others wait", self.max_files, path)
                self._warned_full = True
            return
        try:
            fh = open(path, "rb", buffering=0)
        except OSError as e:
            log.warning("ranklens collector: cannot open %s: %s", path, e.strerror)
            return
        if fingerprint and _fingerprint(fh, int(fingerprint.split(":", 1)[0])) != fingerprint:
            offset = 0  # the inode was recycled for another file
        if offset > st.st_size:
            offset = 0
        fh.seek(offset)
        sf = self.filter.stream(source=path, stream=source.stream, rank=source.rank_of(path))
        sf.skipping = skip = skip and offset > 0
        f = _File(path, st.st_dev, st.st_ino, fh, source, sf, offset, offset, skip)
        f.fingerprint = _fingerprint(fh, max(offset, 1)) if offset else ""
        self._files[(st.st_dev, st.st_ino)] = f

    def _discover(self) -> None:
        seen: set[tuple[int, int]] = set()
        for source in self.sources:
            for path in sorted(globmod.glob(source.glob, recursive=True)):
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                if not os.path.isfile(path):
                    continue
                key = (st.st_dev, st.st_ino)
                if key in seen:
                    continue
                seen.add(key)
                f = self._files.get(key)
                if f is not None:
                    f.path = path  # renamed but still matched: just follow it
                    f.rotated = False
                    continue
                saved = self._known.pop(key, None)
                if saved is not None:
                    self._resume(path, st, source, saved)
                elif self._first_scan and source.start_at == "end":
                    self._open(path, st, source, offset=st.st_size)
                else:
                    self._open(path, st, source, offset=0)
        for key, f in self._files.items():
            if key not in seen:
                f.rotated = True  # renamed out of the globs, or deleted: drain what is left
        if self._first_scan and self._known:
            self._resume_rotated_while_down(seen)
        self._first_scan = False

    def _resume_rotated_while_down(self, seen: set[tuple[int, int]]) -> None:
        """Saved files that no glob matches any more were rotated while the collector was down:
        find them by inode next to their old name and drain them."""
        for key, saved in list(self._known.items()):
            d = os.path.dirname(saved.get("path", "")) or "."
            try:
                entries = list(os.scandir(d))
            except OSError:
                continue
            for e in entries:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if (st.st_dev, st.st_ino) == key and key not in seen:
                    source = next((s for s in self.sources if fnmatch.fnmatch(saved["path"], s.glob)), None)
                    if source is None:
                        break
                    del self._known[key]
                    self._resume(e.path, st, source, saved)
                    if key in self._files:
                        self._files[key].rotated = True
                    break

    # --- reading --------------------------------------------------------------------------

    def poll(self) -> int:
        """Find files, read what is new in each (bounded per file), filter it. Returns bytes read."""
        self._discover()
        total = 0
        now = self.clock()
        for f in list(self._files.values()):
            try:
                size = os.fstat(f.fh.fileno()).st_size
            except OSError:
                size = f.offset
            if size < f.offset:  # truncated (copytruncate rotation, or a job reusing the file)
                log.info(
                    "ranklens collector: %s was truncated (%d -> %d bytes): reading from the start",
                    f.path,
                    f.offset,
                    size,
                )
                self.truncations += 1
                f.sf.feed(b"", now_ns=now, eof=True)  # close what was open before the cut
                f.fh.seek(0)
                f.offset = 0
                f.committed = 0  # rows before the cut keep flowing; the new content starts at 0
                f.sf.skipping = f.skip = False
                f.fingerprint = ""
            got = 0
            while got < self.max_bytes_per_poll:
                n = f.sf.feed_from(f.fh, self.read_bytes, now_ns=now, buf=self._buf)
                if not n:
                    break
                got += n
            f.offset += got
            total += got
            if got:
                f.idle_flushed = False
                if not f.fingerprint and f.offset >= FINGERPRINT_BYTES:
                    f.fingerprint = _fingerprint(f.fh, FINGERPRINT_BYTES)
            elif not f.idle_flushed:
                # nothing new: a traceback at the end of the file is complete
                f.sf.feed(b"", now_ns=now, idle=True)
                f.idle_flushed = True
            if not got and f.rotated and not f.drained:
                f.sf.feed(b"", now_ns=now, eof=True)
                f.drained = True
        return total

    # --- committing -----------------------------------------------------------------------

    def commit(self) -> CommitResult:
        """Hand every event so far to the sink, then save offsets. On a sink failure the files are
        rewound to their last committed offsets, so nothing read since is lost."""
        result = CommitResult()
        files = list(self._files.values())
        rows: list[dict[str, Any]] = []
        drops: list[dict[str, Any]] = []
        now = self.clock()
        deltas: list[tuple[_File, FilterStats]] = []
        for f in files:
            evs: list[LogEvent] = f.sf.flush()
            src = f.source
            rows.extend(e.to_row(job_id=src.job_id, attempt=src.attempt, host=self.host) for e in evs)
            d = _delta(f.sf.stats, f.reported)
            deltas.append((f, d))
            rank = f.sf.rank
            for what, n in (
                ("log_lines_dropped", d.lines_dropped),
                ("log_lines_dropped_by_rule", d.lines_dropped_by_rule),
                ("log_lines_truncated", d.lines_truncated),
                ("log_bytes_cut", d.bytes_cut),
            ):
                if n:
                    drops.append(
                        {
                            "ts_ns": now,
                            "host": self.host,
                            "job_id": src.job_id,
                            "rank": rank,
                            "component": "log_filter",
                            "what": what,
                            "count": n,
                        }
                    )
        staged: list[Any] = []
        stage = getattr(self.sink, "stage", None)
        try:
            if stage is not None:  # two-phase: stage, save offsets naming the staged files, publish
                for table_name, table_rows in (("log_events", rows), ("drops", drops)):
                    p = stage(table_name, table_rows)
                    if p is not None:
                        staged.append(p)
            else:
                if rows:
                    self.sink("log_events", rows)
                if drops:
                    self.sink("drops", drops)
            offsets = {key: f.offset - f.sf.pending_bytes for key, f in self._files.items()}
            skips = {key for key, f in self._files.items() if f.sf.skipping}
            self._save_state(offsets, staged=[p.name for p in staged], skips=skips)
        except (OSError, ValueError) as e:
            result.error = f"{type(e).__name__}: {e}"
            log.error("ranklens collector: cannot commit log events (%s): re-reading from the last commit", e)
            for p in staged:  # the offsets did not move: these lines will be read again
                try:
                    os.unlink(p)
                except OSError:
                    pass
            self._rewind()
            return result
        total = FilterStats()
        for f, d in deltas:
            f.reported.add(d)
            f.committed = offsets[(f.dev, f.ino)]
            f.skip = f.sf.skipping
            total.add(d)
            if f.drained:  # done with it; remember where it ended in case it shows up again
                self._known[(f.dev, f.ino)] = _entry(f)
                del self._files[(f.dev, f.ino)]
                try:
                    f.fh.close()
                except OSError:
                    pass
        if staged:
            self.sink.publish(staged)
        result.events = len(rows)
        result.drops = sum(d["count"] for d in drops)
        if self.on_commit:
            self.on_commit(total)
        return result

    def _rewind(self) -> None:
        for f in list(self._files.values()):
            f.fh.seek(f.committed)
            f.offset = f.committed
            f.sf = self.filter.stream(source=f.path, stream=f.source.stream, rank=f.sf.rank)
            f.sf.skipping = f.skip
            f.reported = FilterStats()
            f.drained = False
            f.idle_flushed = False

    def close(self) -> None:
        """Close every file (no commit: call :meth:`commit` first)."""
        for f in self._files.values():
            try:
                f.fh.close()
            except OSError:
                pass
        self._files.clear()

    @property
    def files(self) -> list[str]:
        """Paths being followed."""
        return [f.path for f in self._files.values()]


def _entry(f: _File) -> dict[str, Any]:
    return {
        "path": f.path,
        "dev": f.dev,
        "ino": f.ino,
        "offset": f.committed,
        "fingerprint": f.fingerprint,
        "skip": f.skip,
    }


def _delta(now: FilterStats, before: FilterStats) -> FilterStats:
    d = FilterStats(
        lines_read=now.lines_read - before.lines_read,
        bytes_read=now.bytes_read - before.bytes_read,
        lines_kept=now.lines_kept - before.lines_kept,
        events=now.events - before.events,
        repeats_collapsed=now.repeats_collapsed - before.repeats_collapsed,
        lines_dropped_by_rule=now.lines_dropped_by_rule - before.lines_dropped_by_rule,
        lines_truncated=now.lines_truncated - before.lines_truncated,
        bytes_cut=now.bytes_cut - before.bytes_cut,
    )
    for src, dst, prev in (
        (now.kept_by_class, d.kept_by_class, before.kept_by_class),
        (now.events_by_class, d.events_by_class, before.events_by_class),
    ):
        for k, v in src.items():
            if v - prev.get(k, 0):
                dst[k] = v - prev.get(k, 0)
    return d
