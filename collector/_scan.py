"""Search engines for the log filter's fast path: find candidate lines in a whole buffer at once.

Most log lines match no rule, so the filter never loops over lines in Python: an engine searches
the whole buffer for all rule patterns together and returns only the starts of lines that may
match, with the rule indexes that fired when the engine can tell. Python ``re`` then confirms each
candidate line (see :mod:`ranklens.collector.logfilter`), so every engine only has to find a
superset and all engines classify identically.

Engines, fastest first: Hyperscan (``hyperscan`` on PyPI, x86-64), RE2 (``google-re2``), Python
``re``. ``auto`` takes the first one that is installed and accepts every pattern. Hyperscan's
compiled database is cached on disk (``_hs_cache.py``: ~0.08 s to compile the 50 built-in rules,
~0.1 ms to load), and Hyperscan searches without the GIL, so the filter searches a big chunk in
two lanes at once (``logfilter.SEARCH_LANES``). Measured with ``bench/logfilter_bench.py`` (1M
lines, 132 MB, the whole ``ranklens logs classify`` process against ``grep -E -f`` with the same
49 patterns, alternating, on a 2-core host with other work on it): 0.19-0.25 s against grep's
0.36-0.40 s, 1.5-1.9x; through the click-free console entry (``ranklens._entry``) 0.17 s, 2.1x.
In-process, Hyperscan searches ~1.4 GB/s on one core, RE2 ~0.6 GB/s;
Python ``re`` is a last resort only (~100x slower: it warns).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any, Protocol

from ranklens.collector._hs_cache import HyperscanCache, default_cache_dir
from ranklens.errors import ConfigError

__all__ = ["DEFAULT_CACHE", "ENGINES", "Scanner", "make_scanner"]


def _log() -> Any:
    # logging is imported when there is something to say: ~4 ms of a one-shot run otherwise
    import logging

    return logging.getLogger("ranklens.collector.logfilter")


ENGINES = ("auto", "hyperscan", "re2", "re")
DEFAULT_CACHE = "default"  # make_scanner(cache_dir=...): the user's cache directory (see _hs_cache)

Candidates = dict[int, "tuple[int, ...] | None"]


class Scanner(Protocol):
    """Finds lines of ``buf[start:limit]`` that may match a rule.

    Returns ``{line_start: rule indexes or None}``; ``None`` means "unknown, check every rule".
    ``limit`` is just past a newline and ``start`` is a line start.
    """

    name: str

    def candidates(self, buf: bytes, start: int, limit: int) -> Candidates: ...


class _HyperscanScanner:
    name = "hyperscan"
    releases_gil = True  # hs_scan runs without the GIL (the match callback takes it back)

    def __init__(
        self, patterns: Sequence[tuple[str, bool]], *, cache_dir: str | os.PathLike[str] | None = None
    ) -> None:
        import hyperscan

        self._hs = hyperscan
        # one expression per top-level alternative (same id): Hyperscan compiles a few dozen simple
        # expressions much faster than one with many ".*" branches (0.27 s -> 0.0x s for the rules)
        exprs: list[bytes] = []
        ids: list[int] = []
        flags: list[int] = []
        for i, (p, ci) in enumerate(patterns):
            for alt in _top_level_alternatives(p):
                exprs.append(alt.encode())
                ids.append(i)
                flags.append(hyperscan.HS_FLAG_MULTILINE | (hyperscan.HS_FLAG_CASELESS if ci else 0))
        # compiling the built-in rules takes ~0.08 s, a fifth of a one-shot `logs classify` of 128 MB;
        # loading the serialised database takes ~0.1 ms (issue 18)
        cache = HyperscanCache(cache_dir, exprs, ids, flags) if cache_dir is not None else None
        db = cache.load() if cache is not None else None
        self.from_cache = db is not None
        if db is None:
            db = hyperscan.Database(mode=hyperscan.HS_MODE_BLOCK)
            try:
                db.compile(expressions=exprs, ids=ids, elements=len(exprs), flags=flags)
            except hyperscan.error as e:
                raise ValueError(f"hyperscan rejects a pattern: {e}") from None
            if cache is not None:
                cache.store(db)
        self._db = db
        self._scratch: list[Any] = [db.scratch]

    def scratch(self, lane: int) -> Any:
        """Scratch space for search lane ``lane`` (0 is the database's own): each thread that
        searches at the same time needs its own."""
        while len(self._scratch) <= lane:
            self._scratch.append(self._db.scratch.clone())
        return self._scratch[lane]

    def candidates(self, buf: bytes, start: int, limit: int, lane: int = 0) -> Candidates:
        hits: list[tuple[int, int]] = []
        append = hits.append

        def on_match(rule: int, _from: int, to: int, _flags: int, _ctx: Any) -> None:
            append((rule, to))

        view = memoryview(buf)[start:limit]
        self._db.scan(view, match_event_handler=on_match, scratch=self.scratch(lane))  # type: ignore[type-var]
        out: dict[int, Any] = {}
        rfind = buf.rfind
        for rule, to in hits:
            # the line that holds the match's last byte (offsets are relative to ``start``)
            end = start + to - 1
            ls = rfind(b"\n", start, end) + 1 if end > start else start
            if ls == 0:
                ls = start
            ids = out.get(ls)
            if ids is None:
                out[ls] = [rule]
            elif rule not in ids:
                ids.append(rule)
        return {k: tuple(v) for k, v in out.items()}


def bracket_end(pattern: str, i: int) -> int:
    """Index of the ``]`` closing the bracket expression that opens at ``pattern[i]`` (``[^]...]``
    and ``[]...]`` included; escapes skipped), or ``len(pattern)`` when it is not closed."""
    n = len(pattern)
    j = i + 1
    if j < n and pattern[j] == "^":
        j += 1
    if j < n and pattern[j] == "]":
        j += 1
    while j < n and pattern[j] != "]":
        j += 2 if pattern[j] == "\\" else 1
    return min(j, n)


def _top_level_alternatives(pattern: str) -> list[str]:
    """``a|b(?:c|d)|[|]`` -> ``["a", "b(?:c|d)", "[|]"]``: split at ``|`` outside groups, brackets
    and escapes (the union matches exactly what the pattern matches)."""
    out: list[str] = []
    depth = 0
    start = 0
    i = 0
    n = len(pattern)
    while i < n:
        ch = pattern[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "[":
            i = bracket_end(pattern, i) + 1
            continue
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "|" and depth == 0:
            out.append(pattern[start:i])
            start = i + 1
        i += 1
    out.append(pattern[start:])
    return out if all(out) else [pattern]


class _RegexScanner:
    """RE2 or Python ``re``: one alternation searched over the buffer, line by matching line."""

    def __init__(self, name: str, patterns: Sequence[tuple[str, bool]]) -> None:
        self.name = name
        parts = [f"(?i:{p})" if ci else f"(?:{p})" for p, ci in patterns]
        combined = ("(?m)" + "|".join(parts)).encode()
        self._set: Any = None
        if name == "re2":
            import re2

            try:
                self._rx: Any = re2.compile(combined)
                rset = re2.Set.SearchSet()
                for p, ci in patterns:
                    rset.Add((("(?i)" if ci else "") + p).encode())
                rset.Compile()
            except re2.error as e:
                raise ValueError(f"RE2 rejects a pattern: {e}") from None
            self._set = rset
        else:
            self._rx = re.compile(combined)

    def candidates(self, buf: bytes, start: int, limit: int) -> Candidates:
        out: Candidates = {}
        search = self._rx.search
        find = buf.find
        rfind = buf.rfind
        pos = start
        while pos < limit:
            m = search(buf, pos, limit)
            if m is None:
                break
            s = m.start()
            ls = rfind(b"\n", start, s) + 1 if s > start else start
            if ls == 0:
                ls = start
            le = find(b"\n", s, limit)
            if self._set is not None:
                ids = self._set.Match(buf[ls:le])
                if ids:
                    out[ls] = tuple(ids)
            else:
                out[ls] = None
            pos = le + 1
        return out


def _available(name: str) -> bool:
    try:
        __import__("hyperscan" if name == "hyperscan" else name)
    except ImportError:
        return False
    return True


def make_scanner(
    patterns: Sequence[tuple[str, bool]],
    engine: str = "auto",
    *,
    cache_dir: str | os.PathLike[str] | None = DEFAULT_CACHE,
) -> Scanner:
    """Build the engine for ``patterns`` (``(pattern, ignore_case)`` pairs).

    ``cache_dir`` is where compiled Hyperscan databases are cached (:data:`DEFAULT_CACHE`: the
    user's cache directory, ``$XDG_CACHE_HOME/ranklens/hyperscan``; None: never cached).

    Raises:
        ConfigError: an unknown engine, an engine that is not installed, or one that rejects a
            pattern when it was asked for by name.
    """
    if engine not in ENGINES:
        raise ConfigError(f"log filter engine {engine!r} is unknown; allowed: {', '.join(ENGINES)}")
    order = ["hyperscan", "re2", "re"] if engine == "auto" else [engine]
    errors: list[str] = []
    for name in order:
        if name != "re" and not _available(name):
            msg = f"{name} is not installed (pip install {'hyperscan' if name == 'hyperscan' else 'google-re2'})"
            if engine != "auto":
                raise ConfigError(f"log filter engine {msg}")
            errors.append(msg)
            continue
        try:
            if name == "hyperscan":
                where = default_cache_dir() if cache_dir == DEFAULT_CACHE else cache_dir
                return _HyperscanScanner(patterns, cache_dir=where)
            if name == "re" and engine == "auto":
                _log().warning(
                    "ranklens log filter: neither hyperscan nor google-re2 is usable (%s); the pure-Python "
                    "engine is about 100x slower: pip install google-re2",
                    "; ".join(errors),
                )
            return _RegexScanner(name, patterns)
        except ValueError as e:
            if engine != "auto":
                raise ConfigError(f"log filter engine {name}: {e}") from None
            _log().warning("ranklens log filter: %s; trying the next engine", e)
            errors.append(str(e))
    if errors:  # pragma: no cover - 're' accepts everything LogRule() accepted
        raise ConfigError("no log filter engine accepts the rules: " + "; ".join(errors))
    raise AssertionError("unreachable")


def available_engines() -> list[str]:
    """Engines installed here, fastest first."""
    return [n for n in ("hyperscan", "re2") if _available(n)] + ["re"]
