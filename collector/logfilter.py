"""Log filtering at the source: keep the lines that matter, classified, and count the rest.

A :class:`LogFilter` holds a compiled :class:`~ranklens.collector.rules.RuleSet`; a
:class:`StreamFilter` (one per file) turns bytes into :class:`LogEvent` records:

- the fast path searches whole buffers for every rule at once (Hyperscan, RE2 or ``re``, see
  ``_scan.py``; with Hyperscan, a big buffer in two lanes at once) and touches in Python only the
  few lines that may match;
- a candidate line is confirmed with Python ``re``; the highest-priority matching rule gives its
  class and severity; a winning ``drop`` rule discards it;
- a Python traceback is kept whole as one event (chained exceptions and a torchrun
  ``ChildFailedError`` summary included); C++/CUDA trailers (``what():``, ``Exception raised
  from``, ``frame #N:``, "CUDA kernel errors might be ...") stay with the line they explain; the
  event takes the class of the most specific rule matching any of its lines;
- each event carries a few lines of context before it, its rank (from the source or the line's
  ``[rankN]:`` prefix) and its time (parsed from the line when it has one);
- repeated events (same rule, same text once times of day are removed) are collapsed into one with
  a ``repeat_count`` until :meth:`StreamFilter.flush`;
- every other line is dropped and counted (:class:`FilterStats`).

The same code path serves the collector's tailer and ``ranklens logs classify``
(:func:`classify_file`).
"""

from __future__ import annotations

import functools
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ranklens.collector._scan import DEFAULT_CACHE, Scanner, make_scanner
from ranklens.collector.rules import SEARCH_HINTS, Action, LogRule, RuleSet, load_rules

_count_newlines: Callable[..., int] | None
try:  # the compiled newline count (collector/_lines.c): ~4x bytes.count, without the GIL
    from ranklens.collector._lines import count as _count_newlines
except ImportError:  # not built (no compiler at install time): bytes.count, the same numbers
    _count_newlines = None

__all__ = [
    "FilterStats",
    "LogEvent",
    "LogFilter",
    "StreamFilter",
    "classify_file",
    "classify_paths",
]

# A longer line is cut there and the rest of it, up to its newline, skipped (counted in bytes_cut):
# memory stays flat however long a line without a newline grows (issue 22, defect 4).
MAX_LINE_BYTES = 1 << 20
# A block (traceback, trailers) still being written is closed once this much waits on it.
MAX_DEFER_BYTES = 8 << 20
MAX_EVENT_LINES = 400  # a traceback longer than this is cut (the rest is dropped and counted)
MAX_EVENT_CHARS = 64 * 1024
CUT_MARK = " [... truncated by ranklens]"  # ends an event's message that was cut
MAX_CONTEXT_CHARS = 1000  # per context line
MAX_GROUPS = 1024  # distinct events held for collapsing before the oldest is released
MAX_TRAILER_LINES = 200
MAX_MESSAGE_LINES = 3  # lines of the same class after a traceback taken as more of its exception's text
# From this much new data on, a chunk is searched in pieces on SEARCH_LANES threads at once
# (Hyperscan lets go of the GIL): 128 MB take ~0.09 s to search on one core (issue 18). A live
# tail's few kilobytes are searched in line.
PARALLEL_SCAN_BYTES = 1 << 20
SEARCH_LANES = 2  # what a 2-core node can give a one-shot run; more would crowd a training node

# A prefix that torchrun / pdsh / DeepSpeed / mpirun put before every line of a rank's output
# (``host: ``, ``[1,5]<stderr>:``, ``[default3]:``, ``[rank3]:``, ``[default3]:[rank3]: ``).
_PREFIX_RE = re.compile(rb"(?:[\w.\-]+: (?=\[))?(?:\[\d+,\d+\]<std(?:out|err)>: ?)?(?:\[(?:rank|default)\d+\]: ?)*")
_TRACEBACK = b"Traceback (most recent call last):"
_TRAILER_RE = re.compile(
    rb"^\s*(?:what\(\):|Exception raised from .* \(most recent call first\)|frame #\d+: |"
    rb"CUDA kernel errors might be asynchronously reported|For debugging consider passing CUDA_LAUNCH_BLOCKING|"
    rb"Compile with .TORCH_USE_CUDA_DSA|Device-side assertions? |Search for .cudaError[A-Za-z]*. in )"
)
_CHAIN = (
    b"During handling of the above exception, another exception occurred:",
    b"The above exception was the direct cause of the following exception:",
)
_SEPARATOR_RE = re.compile(rb"^={20,}\s*$")
# NCCL's exception text ends with "Last error:" and the line NCCL logged last (which may name a CUDA
# error): both belong to the exception before them, whatever that line matches
_LAST_ERROR = b"Last error:"

_RANK_PREFIX_RE = re.compile(r"^(?:[\w.\-]+: )?(?:\[default\d+\]: ?)?\[rank(\d+)\]:")
_RANK_WORD_RE = re.compile(r"\bRank (\d+)\b")

_TS_ISO_RE = re.compile(
    r"(\d{4})-(\d\d)-(\d\d)[ T_](\d\d):(\d\d):(\d\d)(?:[.,](\d{1,9}))?(?: ?(Z|[+-]\d\d:?\d\d))?(?![\d:])"
)
_TS_GLOG_RE = re.compile(r"(?:^|[\[\s:])[IWEF](\d{1,2})(\d\d) (\d\d):(\d\d):(\d\d)(?:\.(\d{1,9}))?")
_TS_CTIME_RE = re.compile(r"\[?[A-Z][a-z]{2} ([A-Z][a-z]{2}) +(\d{1,2}) (\d\d):(\d\d):(\d\d) (\d{4})\]?")
# what makes repeats differ: times of day and dmesg uptimes (dates change once a day: left in)
_TS_STRIP_RE = re.compile(r"\d\d:\d\d:\d\d(?:[.,]\d+)?|\[ *\d+\.\d+\]")
_MISS: Any = object()
_MONTHS = {
    m: i for i, m in enumerate(("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"), 1)
}


@dataclass(frozen=True)
class LogEvent:
    """One kept event: a line (or a whole traceback) with its class, severity and context.

    ``line_no`` is the 1-based line of its first line in the stream; ``line_count`` how many lines
    it spans; ``repeat_count`` how many times it occurred (collapsed repeats included).
    """

    klass: str
    severity: str
    rule: str
    message: str
    line_no: int
    line_count: int = 1
    repeat_count: int = 1
    context: tuple[str, ...] = ()
    rank: int = -1
    ts_ns: int = 0
    source: str = ""
    stream: str = ""

    def to_row(self, *, job_id: str = "", attempt: int = 0, host: str = "") -> dict[str, Any]:
        """The ``log_events`` row of this event."""
        return {
            "job_id": job_id,
            "attempt": attempt,
            "host": host,
            "rank": self.rank,
            "ts_ns": self.ts_ns,
            "stream": self.stream,
            "source": self.source,
            "rule": self.rule,
            "klass": self.klass,
            "severity": self.severity,
            "message": self.message,
            "repeat_count": min(self.repeat_count, 2**31 - 1),
            "context": list(self.context),
        }

    def to_json(self) -> dict[str, Any]:
        """The ``ranklens logs classify --json`` object."""
        return {
            "class": self.klass,
            "severity": self.severity,
            "rule": self.rule,
            "line_no": self.line_no,
            "line_count": self.line_count,
            "message": self.message,
            "repeat_count": self.repeat_count,
            "rank": self.rank,
            "ts_ns": self.ts_ns,
            "source": self.source,
            "context": list(self.context),
        }


@dataclass
class FilterStats:
    """Counters of one stream (or, summed, of many). ``lines_dropped`` = read - kept."""

    lines_read: int = 0
    bytes_read: int = 0
    lines_kept: int = 0
    events: int = 0
    repeats_collapsed: int = 0
    lines_dropped_by_rule: int = 0
    lines_truncated: int = 0  # lines longer than MAX_LINE_BYTES, cut there
    bytes_cut: int = 0  # the bytes cut off those lines (skipped, not read)
    kept_by_class: dict[str, int] = field(default_factory=dict)
    events_by_class: dict[str, int] = field(default_factory=dict)

    @property
    def lines_dropped(self) -> int:
        return self.lines_read - self.lines_kept

    def add(self, other: FilterStats) -> None:
        """Add ``other``'s counts to these."""
        for name in ("lines_read", "bytes_read", "lines_kept", "events", "repeats_collapsed"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.lines_dropped_by_rule += other.lines_dropped_by_rule
        self.lines_truncated += other.lines_truncated
        self.bytes_cut += other.bytes_cut
        for mine, theirs in ((self.kept_by_class, other.kept_by_class), (self.events_by_class, other.events_by_class)):
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0) + v


class LogFilter:
    """A compiled rule set. Make one per thread (the search engines keep scratch state).

    Args:
        rules: the rule set (default: the built-in rules).
        engine: ``auto`` (fastest installed), ``hyperscan``, ``re2`` or ``re``.
        cache_dir: where compiled Hyperscan databases are cached (default: the user's cache
            directory, ``$XDG_CACHE_HOME/ranklens/hyperscan``; None: not cached).
    """

    def __init__(
        self,
        rules: RuleSet | None = None,
        *,
        engine: str = "auto",
        cache_dir: str | os.PathLike[str] | None = DEFAULT_CACHE,
    ) -> None:
        self.rules = rules or RuleSet.builtin()
        self._rules: tuple[LogRule, ...] = self.rules.rules
        self.scanner: Scanner = make_scanner(
            [(SEARCH_HINTS.get(r.pattern, r.pattern), r.ignore_case) for r in self._rules], engine, cache_dir=cache_dir
        )
        self.engine = self.scanner.name
        # candidate rule indexes are tried best first: priority, then rule order
        self._order = sorted(range(len(self._rules)), key=lambda i: (-self._rules[i].priority, i))
        self._rank_of = {i: pos for pos, i in enumerate(self._order)}
        # the processors this process may run on: with one, searching and counting at once only costs
        self.cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

    def stream(self, *, source: str = "", stream: str = "", rank: int = -1) -> StreamFilter:
        """A filter for one stream (file): it keeps context, partial lines and open tracebacks."""
        return StreamFilter(self, source=source, stream=stream, rank=rank)

    def classify_line(self, text: str, ids: Sequence[int] | None = None) -> LogRule | None:
        """The winning rule for one line (``None``: no rule matches)."""
        order = self._order if ids is None else sorted(ids, key=self._rank_of.__getitem__)
        rules = self._rules
        for i in order:
            r = rules[i]
            if r.regex.search(text):
                return r
        return None


@dataclass
class _Group:
    event: LogEvent
    count: int


class StreamFilter:
    """Filters one byte stream fed in chunks. Not thread-safe.

    Call :meth:`feed` with new bytes, then :meth:`flush` to get the events (repeats are collapsed
    until then). ``pending_bytes`` is what has been fed but not processed yet (a partial last line,
    or a traceback still being written): a tailer commits its offset minus that. ``skipping`` is
    true while the rest of a cut line is being skipped (pending is empty then): a tailer that
    resumes at that offset sets it again.
    """

    def __init__(self, lf: LogFilter, *, source: str = "", stream: str = "", rank: int = -1) -> None:
        self._lf = lf
        self.source = source
        self.stream = stream
        self.rank = rank
        self.stats = FilterStats()
        self._ctx = b""  # already processed lines kept for context
        self._pending = b""  # fed, not processed yet
        self.skipping = False  # inside a line cut at MAX_LINE_BYTES: drop bytes up to its newline
        self._buf = bytearray()
        self._class_cache: dict[str, LogRule | None] = {}
        self._groups: dict[tuple[str, str], _Group] = {}
        self._ready: list[LogEvent] = []
        self._n_ctx = lf.rules.context_lines

    @property
    def pending_bytes(self) -> int:
        return len(self._pending)

    def feed(self, data: bytes, *, now_ns: int | None = None, idle: bool = False, eof: bool = False) -> None:
        """Process ``data``.

        Args:
            data: the next bytes of the stream.
            now_ns: time of lines that carry no timestamp (default: now).
            idle: no more data is coming right now: close a traceback or trailer that reaches the
                end of what was fed instead of waiting for more lines.
            eof: the stream ended: also process a last line that has no newline.
        """
        carry = self._ctx + self._pending
        work = carry + data if carry else data
        self._process(work, len(self._ctx), len(work), now_ns, idle or eof, eof)

    def feed_from(self, f: Any, size: int = 4 << 20, *, now_ns: int | None = None, buf: bytearray | None = None) -> int:
        """Read up to ``size`` bytes from the binary file ``f`` straight into a buffer and process
        them (no copy of the data); returns the bytes read (0 at end of file).

        ``buf`` is a scratch buffer to use (a tailer shares one among all its files, so following
        many files does not cost a read buffer each); by default the filter keeps its own."""
        carry = self._ctx + self._pending
        c = len(carry)
        if buf is None:
            if not self._buf:  # a fresh buffer: its pages are mapped as the reads fill them
                self._buf = bytearray(c + size + (64 << 10))
            buf = self._buf
        if len(buf) < c + size:
            # with room for a carry that grows a little (context, a partial line): one allocation,
            # not one per read
            buf.extend(bytes(c + size + (64 << 10) - len(buf)))
        buf[:c] = carry
        n = f.readinto(memoryview(buf)[c : c + size])
        if not n:
            return 0
        self._process(buf, len(self._ctx), c + n, now_ns, False, False)
        return int(n)

    def _process(self, work: Any, start: int, valid: int, now_ns: int | None, idle: bool, eof: bool) -> None:
        if now_ns is None:
            now_ns = time.time_ns()
        st = self.stats
        if self.skipping:  # the rest of a cut line: drop it up to its newline (pending is empty)
            nl = work.find(b"\n", start, valid)
            if nl < 0:
                st.bytes_cut += valid - start
                self.skipping = not eof
                return
            st.bytes_cut += nl - start
            self.skipping = False
            work = bytes(work[:start]) + bytes(work[nl + 1 : valid])
            valid = len(work)
        if len(self._pending) > MAX_DEFER_BYTES:
            idle = True  # a block that waited this long is not a real traceback any more: close it
        last = max(work.rfind(b"\n", start, valid) + 1, start)  # where the partial last line starts
        if valid - last > MAX_LINE_BYTES:
            # no newline in sight: keep the line's head, skip the rest up to its newline, and close
            # what is open (nothing continues across a cut line), so nothing else waits on it
            cut = last + MAX_LINE_BYTES
            st.lines_truncated += 1
            st.bytes_cut += valid - cut
            work = bytes(work[:cut]) + b"\n"
            valid = cut + 1
            idle = True
            self.skipping = not eof
        elif eof and valid > start and work[valid - 1] != 10:
            work = bytes(work[:valid]) + b"\n"
            valid += 1
        limit = work.rfind(b"\n", start, valid) + 1
        if limit <= start:
            self._pending = bytes(work[start:valid])
            return
        cands = self._scan(work, start, limit)
        end, n_lines = self._extract(work, start, limit, cands, idle, now_ns)
        st.lines_read += n_lines
        st.bytes_read += end - start
        self._pending = bytes(work[end:valid])
        self._ctx = self._context_tail(work, end)

    def _scan(self, work: Any, start: int, limit: int) -> dict[int, Any]:
        """The candidate lines of ``work[start:limit]``.

        Where the engine searches without the GIL (Hyperscan) and a second processor is there, a
        big range is searched in :data:`SEARCH_LANES` pieces at once (split at newlines: a line is
        one piece's; each lane has its own scratch space), this thread taking the first: the
        candidates are those of one search. No thread holds the GIL for long meanwhile, so a
        lane reporting a match never waits out the interpreter's 5 ms switch interval."""
        scanner: Any = self._lf.scanner
        lanes = min(SEARCH_LANES, self._lf.cpus)
        if limit - start < PARALLEL_SCAN_BYTES or lanes < 2 or not getattr(scanner, "releases_gil", False):
            return scanner.candidates(work, start, limit)
        cuts = [start]
        for k in range(1, lanes):
            c = work.find(b"\n", start + (limit - start) * k // lanes, limit) + 1
            if cuts[-1] < c < limit:
                cuts.append(c)
        cuts.append(limit)
        out: list[Any] = [None] * (len(cuts) - 1)

        def search(lane: int) -> None:
            try:
                out[lane] = scanner.candidates(work, cuts[lane], cuts[lane + 1], lane)
            except BaseException as e:  # handed to the caller below
                out[lane] = e

        started: list[threading.Thread] = []
        try:
            for k in range(1, len(out)):
                t = threading.Thread(target=search, args=(k,), name=f"ranklens-log-search-{k}")
                t.start()
                started.append(t)
        except RuntimeError:  # no thread to be had: what did not start is searched here
            pass
        try:
            for k in [0, *range(len(started) + 1, len(out))]:
                search(k)
        finally:
            for t in started:
                t.join()
        cands: dict[int, Any] = {}
        for part in out:
            if isinstance(part, BaseException):
                raise part
            cands.update(part)
        return cands

    def flush(self) -> list[LogEvent]:
        """All events so far, repeats collapsed, in order of first occurrence."""
        out = self._ready
        self._ready = []
        for g in self._groups.values():
            out.append(self._finish(g))
        self._groups.clear()
        return out

    def take_ready(self) -> list[LogEvent]:
        """Events released early (the collapse table was full); the rest stay until flush."""
        out = self._ready
        self._ready = []
        return out

    # --- internals ----------------------------------------------------------------------

    def _finish(self, g: _Group) -> LogEvent:
        ev = g.event
        if g.count == 1:
            return ev
        return LogEvent(
            ev.klass,
            ev.severity,
            ev.rule,
            ev.message,
            ev.line_no,
            ev.line_count,
            g.count,
            ev.context,
            ev.rank,
            ev.ts_ns,
            ev.source,
            ev.stream,
        )

    def _context_tail(self, work: Any, end: int) -> bytes:
        if self._n_ctx == 0 or end == 0:
            return b""
        s = end
        for _ in range(self._n_ctx):
            if s <= 0:
                break
            s = work.rfind(b"\n", 0, s - 1) + 1
        if end - s > 64 * 1024:
            s = work.find(b"\n", end - 64 * 1024, end) + 1
        return bytes(work[s:end])

    def _context(self, work: Any, ls: int) -> tuple[str, ...]:
        out: list[str] = []
        e = ls - 1  # the newline that ends the line before
        for _ in range(self._n_ctx):
            if e < 0:
                break
            s = work.rfind(b"\n", 0, e) + 1
            out.append(_decode(work[s:e])[:MAX_CONTEXT_CHARS])
            e = s - 1
        out.reverse()
        return tuple(out)

    def _extract(
        self,
        work: Any,
        start: int,
        limit: int,
        cands: dict[int, Any],
        idle: bool,
        now_ns: int,
    ) -> tuple[int, int]:
        """Turn candidate lines into events; return where processing stopped (a deferral point when
        a traceback is still being written) and the number of lines before that point."""
        count = (
            functools.partial(_count_newlines, work)
            if _count_newlines is not None
            else functools.partial(work.count, b"\n")
        )
        lf = self._lf
        stats = self.stats
        cache = self._class_cache
        groups = self._groups
        skip = start
        line_pos, line_no = start, self.stats.lines_read  # running line count: no quadratic counting
        for ls in sorted(cands):
            if ls < skip:
                continue
            le = work.find(b"\n", ls, limit)
            line = _decode(work[ls:le].rstrip(b"\r"))
            norm = _collapse_key(line)
            # a repeated line (timestamps aside) is classified once: a log storm stays cheap
            rule = cache.get(norm, _MISS)
            if rule is _MISS:
                rule = lf.classify_line(line, cands[ls])
                if len(cache) >= MAX_GROUPS:
                    cache.clear()
                cache[norm] = rule
            if rule is None:
                continue
            if rule.action is Action.DROP:
                stats.lines_dropped_by_rule += 1
                continue
            ext = self._extent(work, ls, le, limit, rule, cands, idle)
            line_no += count(line_pos, ls)
            line_pos = ls
            if ext is None:  # a traceback or trailer still being written: wait for more
                return ls, line_no - self.stats.lines_read
            end, best, truncated = ext
            skip = end
            if end == le + 1:
                g = groups.get((rule.name, norm))
                if g is not None:  # a repeat: count it, nothing else to build
                    g.count += 1
                    stats.repeats_collapsed += 1
                    stats.lines_kept += 1
                    stats.kept_by_class[rule.klass] += 1
                    continue
                text, key = line, norm
            else:
                text = _decode(work[ls:end].rstrip(b"\r\n"))
                if truncated:
                    text += "\n[... truncated by ranklens]"
                key = _collapse_key(text)
            self._add(
                LogEvent(
                    best.klass,
                    best.severity.value,
                    best.name,
                    text if len(text) <= MAX_EVENT_CHARS else text[:MAX_EVENT_CHARS] + CUT_MARK,
                    line_no + 1,
                    count(ls, end),
                    1,
                    self._context(work, ls),
                    self._rank_of(text),
                    _parse_ts(text, now_ns),
                    self.source,
                    self.stream,
                ),
                key,
            )
        return limit, line_no - self.stats.lines_read + count(line_pos, limit)

    def _extent(
        self, work: Any, ls: int, le: int, limit: int, rule: LogRule, cands: dict[int, Any], idle: bool
    ) -> tuple[int, LogRule, bool] | None:
        """End offset of the event starting at ``ls``, the rule that classifies it, truncated?

        The event grows by *units* that explain the line before them: a C++/CUDA trailer line, a
        Python traceback (one per link of a chain), a torchrun ``ChildFailedError`` summary. A
        unit joins while its lines name no class, or the event's class; a unit that names another
        class ends the event (it starts its own; a chain's "During handling ..." lines stay with the
        first link). A generic first line (a traceback, ``terminate
        called ...``, a header such as "Process 1 terminated with the following error:") takes the
        class of the first unit that names one. A new traceback that names no class does not join
        an event that already has one (it is its own report); a chained one does. After a
        traceback, a line of the same class continues the exception's message, and NCCL's
        "Last error:" with the line after it always does."""
        m = _PREFIX_RE.match(work, ls, le)
        pre = work[ls : m.end()] if m else b""
        key = pre.rstrip()
        klass = None if rule.generic else rule.klass
        best = rule
        pos, lines, extra = le + 1, 1, 0
        tb_pre: bytes | None = None  # set while the last unit was a traceback (a chain may follow)
        conts = 0  # lines of the exception's message joined after the last traceback
        last_line_start = ls
        if rule.block == "traceback":
            seg = _segment_end(work, pos, limit, pre, idle)
            if seg is None:
                return None
            pos, lines = seg[0], 1 + seg[1]
            u = self._unit_rule(work, ls, pos, cands)
            if u is not None and not u.generic:
                klass, best = u.klass, u
            tb_pre = pre
            last_line_start = work.rfind(b"\n", 0, pos - 1) + 1
        while extra < MAX_TRAILER_LINES and lines < MAX_EVENT_LINES:
            if pos >= limit:
                if not idle:
                    return None  # a trailer may still be written
                break
            us = pos
            joined_before = 0  # lines that join whatever the unit's class (a chain's connector)
            if tb_pre is not None:
                ch = _chain_ahead(work, pos, limit, tb_pre)
                if ch is None:
                    if not idle:
                        return None
                    ch = 0
                if isinstance(ch, tuple):
                    us = work.rfind(b"\n", 0, pos + ch[0] - 1) + 1  # the chained "Traceback" line
                    joined_before = ch[1] - 1
                    seg = _segment_end(work, pos + ch[0], limit, tb_pre, idle)
                    if seg is None:
                        return None
                    uend, n, kind, upre = seg[0], ch[1] + seg[1], "chain", tb_pre
            if us == pos:
                nl = work.find(b"\n", pos, limit)
                line = work[pos:nl]
                lm = _PREFIX_RE.match(line)
                upre = line[: lm.end()] if lm else b""
                if upre and upre.rstrip() != key:
                    break  # another rank's line
                body = line[len(upre) :]
                if _TRAILER_RE.match(body):
                    uend, n, kind = nl + 1, 1, "trailer"
                elif body.rstrip() == _LAST_ERROR:
                    if nl + 1 >= limit and not idle:
                        return None
                    nl2 = work.find(b"\n", nl + 1, limit) if nl + 1 < limit else nl
                    pos, lines, extra = nl2 + 1, lines + 1 + (nl2 > nl), extra + 2
                    continue  # joins whatever it says
                elif body.startswith(_TRACEBACK):
                    seg = _segment_end(work, nl + 1, limit, upre, idle)
                    if seg is None:
                        return None
                    uend, n, kind = seg[0], 1 + seg[1], "tb"
                elif _SEPARATOR_RE.match(body) and b"ChildFailedError" in work[last_line_start:pos]:
                    summ = _summary_end(work, pos, limit, upre, idle)
                    if summ is None:
                        return None
                    uend, n, kind = summ[0], summ[1], "summary"
                elif tb_pre is not None and conts < MAX_MESSAGE_LINES and pos in cands and body.strip():
                    uend, n, kind = nl + 1, 1, "cont"  # more of the exception's message, if same class
                else:
                    break
            u = self._unit_rule(work, us, uend, cands)
            spec = u if u is not None and not u.generic else None  # the class the unit names
            if spec is not None and klass is not None and spec.klass != klass:
                pos, lines = us, lines + joined_before  # another class: it starts its own event
                break
            if kind == "cont" and (spec is None or spec.klass != klass):
                break
            if kind == "tb" and spec is None and klass is not None:
                pos, lines = us, lines + joined_before
                break
            if spec is not None:
                if klass is None:
                    klass, best = spec.klass, spec
                elif spec.priority > best.priority or best.generic:
                    best = spec
            last_line_start = work.rfind(b"\n", 0, uend - 1) + 1
            pos, lines, extra = uend, lines + n, extra + n
            if kind == "cont":
                conts += 1
            else:
                tb_pre, conts = (upre if kind in ("tb", "chain") else None), 0
        truncated = lines >= MAX_EVENT_LINES
        return pos, best, truncated

    def _unit_rule(self, work: Any, s: int, e: int, cands: dict[int, Any]) -> LogRule | None:
        """The rule that classifies the lines ``work[s:e]``: the best specific one, else a generic one."""
        best: LogRule | None = None
        classify = self._lf.classify_line
        p = s
        while p < e:
            nl = work.find(b"\n", p, e)
            if nl < 0:
                nl = e
            r = classify(_decode(work[p:nl]), cands[p]) if p in cands else None
            if (
                r is not None
                and r.action is Action.KEEP
                and (best is None or (not r.generic and (best.generic or r.priority > best.priority)))
            ):
                best = r
            p = nl + 1
        return best

    def _add(self, ev: LogEvent, norm: str) -> None:
        st = self.stats
        n_lines = ev.line_count
        st.lines_kept += n_lines
        st.kept_by_class[ev.klass] = st.kept_by_class.get(ev.klass, 0) + n_lines
        key = (ev.rule, norm)
        g = self._groups.get(key)
        if g is not None:
            g.count += 1
            st.repeats_collapsed += 1
            return
        st.events += 1
        st.events_by_class[ev.klass] = st.events_by_class.get(ev.klass, 0) + 1
        if len(self._groups) >= MAX_GROUPS:
            oldest = next(iter(self._groups))
            self._ready.append(self._finish(self._groups.pop(oldest)))
        self._groups[key] = _Group(ev, 1)

    def _rank_of(self, text: str) -> int:
        if self.rank >= 0:
            return self.rank
        m = _RANK_PREFIX_RE.match(text) or _RANK_WORD_RE.search(text, 0, 400)
        return int(m.group(1)) if m else -1


def _decode(b: bytes) -> str:
    return b.decode("utf-8", "replace")


def _segment_end(work: Any, pos: int, limit: int, pre: bytes, idle: bool) -> tuple[int, int] | None:
    """After a ``Traceback`` line, at ``pos``: the end of that one traceback (its frames and its
    exception line) and its line count, or None (wait for more). Frames are the indented lines; the
    first line that is not indented is the exception and ends it."""
    n = 0
    np = len(pre)
    while True:
        if pos >= limit:
            return (pos, n) if idle else None
        if n >= MAX_EVENT_LINES:
            return pos, n
        nl = work.find(b"\n", pos, limit)
        line = work[pos:nl]
        if pre and not line.startswith(pre):
            return pos, n  # interleaved output: the traceback ended without its exception line
        body = line[np:]
        if body[:1] in (b" ", b"\t"):
            pos, n = nl + 1, n + 1
            continue
        if not body.strip():
            return pos, n
        return nl + 1, n + 1  # the exception line


def _chain_ahead(work: Any, pos: int, limit: int, pre: bytes) -> tuple[int, int] | int | None:
    """If a chained traceback follows at ``pos``: (bytes, lines) up to its frames; 0: none; None: wait."""
    p = pos
    seen: list[bytes] = []
    for _ in range(4):
        if p >= limit:
            return None
        nl = work.find(b"\n", p, limit)
        body = work[p:nl]
        if pre and body.startswith(pre):
            body = body[len(pre) :]
        seen.append(body.strip())
        p = nl + 1
        if seen[-1].startswith(_TRACEBACK):
            if any(s in _CHAIN for s in seen):
                return p - pos, len(seen)
            return 0
        if seen[-1] and seen[-1] not in _CHAIN:
            return 0
    return 0


def _summary_end(work: Any, pos: int, limit: int, pre: bytes, idle: bool) -> tuple[int, int] | None:
    """A torchrun ``ChildFailedError`` summary from its first ``=====`` line at ``pos`` to its
    closing one: (end, lines), or None (wait for more)."""
    np = len(pre)
    p, k, seps = pos, 0, 0
    while k < 60:
        if p >= limit:
            if not idle:
                return None
            break
        nl = work.find(b"\n", p, limit)
        b2 = work[p:nl]
        b2 = b2[np:] if pre and b2.startswith(pre) else b2
        p, k = nl + 1, k + 1
        if _SEPARATOR_RE.match(b2):
            seps += 1
            if seps == 2:
                break
    return p, k


def _collapse_key(message: str) -> str:
    return _TS_STRIP_RE.sub("<ts>", message[:4096])


def _parse_ts(text: str, default_ns: int) -> int:
    """The time a line states about itself (ISO, glog or ctime form), else ``default_ns``."""
    head = text[:200]
    try:
        m = _TS_ISO_RE.search(head)
        if m:
            y, mo, d, hh, mi, ss, frac, tz = m.groups()
            frac_ns = int((frac or "0").ljust(9, "0")[:9])
            if tz:
                off = 0
                if tz != "Z":
                    sign = -1 if tz[0] == "-" else 1
                    tzd = tz[1:].replace(":", "")
                    off = sign * (int(tzd[:2]) * 3600 + int(tzd[2:]) * 60)
                import calendar  # here, not at import: ~3 ms of a one-shot run that may never need it

                secs = calendar.timegm((int(y), int(mo), int(d), int(hh), int(mi), int(ss), 0, 0, 0)) - off
            else:
                secs = int(time.mktime((int(y), int(mo), int(d), int(hh), int(mi), int(ss), 0, 0, -1)))
            return _sane(secs * 1_000_000_000 + frac_ns, default_ns)
        m = _TS_CTIME_RE.search(head)
        if m and m.group(1) in _MONTHS:
            mon, d, hh, mi, ss, y = m.groups()
            secs = int(time.mktime((int(y), _MONTHS[mon], int(d), int(hh), int(mi), int(ss), 0, 0, -1)))
            return _sane(secs * 1_000_000_000, default_ns)
        m = _TS_GLOG_RE.search(head)
        if m:
            mo, d, hh, mi, ss, frac = m.groups()
            from datetime import datetime, timezone

            year = datetime.fromtimestamp(default_ns / 1e9, timezone.utc).year
            frac_ns = int((frac or "0").ljust(9, "0")[:9])
            secs = int(time.mktime((year, int(mo), int(d), int(hh), int(mi), int(ss), 0, 0, -1)))
            ts = secs * 1_000_000_000 + frac_ns
            if ts > default_ns + 86_400 * 10**9:  # glog has no year: a December line read in January
                secs = int(time.mktime((year - 1, int(mo), int(d), int(hh), int(mi), int(ss), 0, 0, -1)))
                ts = secs * 1_000_000_000 + frac_ns
            return _sane(ts, default_ns)
    except (ValueError, OverflowError):
        pass
    return default_ns


def _sane(ts: int, default_ns: int) -> int:
    # a parsed time far from now is more likely a number that looks like a date than a real time
    return ts if 946_684_800 * 10**9 <= ts <= default_ns + 86_400 * 10**9 else default_ns


class _ReadAhead:
    """``readinto`` over a binary file whose next chunk a thread has already read: a read from
    the page cache (~1.5 GB/s here, without the GIL) runs beside the search and the line count of
    the chunk before, and a chunk costs the reader one copy in memory (~10 GB/s). Two chunk
    buffers; an error of the read is raised by the ``readinto`` that would have returned it."""

    def __init__(self, f: Any, size: int) -> None:
        import queue

        self._f = f
        self._free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
        self._full: queue.Queue[tuple[bytearray, int] | BaseException] = queue.Queue()
        self._stop = threading.Event()
        for _ in range(2):
            self._free.put(bytearray(size))
        self._eof = False
        self._thread = threading.Thread(target=self._read, name="ranklens-log-read", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            while not self._stop.is_set():
                buf = self._free.get()
                if self._stop.is_set():
                    return
                n = self._f.readinto(buf)
                self._full.put((buf, n or 0))
                if not n:
                    return
        except BaseException as e:  # the reader's error is the caller's, at its next readinto
            self._full.put(e)

    def readinto(self, out: Any) -> int:
        if self._eof:
            return 0
        got = self._full.get()
        if isinstance(got, BaseException):
            self._eof = True
            raise got
        buf, n = got
        if n > len(out):  # a caller asking for less than a chunk: never here (one size for both)
            raise ValueError(f"read-ahead chunk of {n} bytes for a {len(out)}-byte buffer")
        out[:n] = memoryview(buf)[:n]
        self._free.put(buf)
        if not n:
            self._eof = True
        return n

    def close(self) -> None:
        self._stop.set()
        self._free.put(bytearray(0))  # wakes a reader waiting for a buffer
        self._thread.join()


def classify_file(
    path: str | Path,
    rules: RuleSet | None = None,
    *,
    engine: str = "auto",
    chunk_bytes: int = 16 << 20,
    stats: FilterStats | None = None,
) -> Iterator[LogEvent]:
    """Run the source filter over one file and yield its events (the collector's code path).

    Args:
        path: the file.
        rules: the rule set (default: built-in).
        engine: search engine (see :class:`LogFilter`).
        chunk_bytes: read size.
        stats: if given, this file's counters are added to it at the end.
    """
    lf = LogFilter(rules, engine=engine)
    sf = lf.stream(source=str(path), stream="file")
    now = time.time_ns()
    with open(path, "rb", buffering=0) as raw:
        # with a second processor, the next chunk is read while this one is searched and counted (a
        # file of one chunk or less, or a pipe, is read as it is)
        ahead = lf.cpus > 1 and os.fstat(raw.fileno()).st_size > chunk_bytes
        f: Any = _ReadAhead(raw, chunk_bytes) if ahead else raw
        try:
            while sf.feed_from(f, chunk_bytes, now_ns=now):
                yield from sf.take_ready()
        finally:
            if f is not raw:
                f.close()
    sf.feed(b"", now_ns=now, eof=True)
    yield from sf.flush()
    if stats is not None:
        stats.add(sf.stats)


def classify_paths(paths: Iterable[str | Path], rules_file: str | Path | None = None, **kw: Any) -> Iterator[LogEvent]:
    """:func:`classify_file` over several files with rules from ``rules_file`` (or built-in)."""
    rules = load_rules(rules_file)
    for p in paths:
        yield from classify_file(p, rules, **kw)
