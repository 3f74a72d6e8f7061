"""What makes a one-shot ``ranklens logs classify`` fast (issue 18) without changing one result:
the cached Hyperscan database (used only when it is exactly the one asked for), a big chunk
searched in two lanes at once, and the light import path."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ranklens.collector import _hs_cache, _scan, logfilter
from ranklens.collector.logfilter import FilterStats, LogFilter, classify_file
from ranklens.collector.rules import LogRule, RuleSet
from ranklens.errors import ConfigError
from tests._sync import wait_until

DATA = Path(__file__).parent.parent / "data" / "logs" / "real_log_lines.jsonl"
LINES = [json.loads(line)["line"] for line in DATA.read_text().splitlines()]
BENIGN = "iteration {} | lm loss: 2.5E+00 | number of nan iterations:   0 |"
MIXED = ("\n".join(f"{BENIGN.format(i)}\n{x}" for i, x in enumerate(LINES)) + "\n").encode()


def _events(lf: LogFilter, data: bytes = MIXED) -> list[tuple]:
    sf = lf.stream(source="s")
    sf.feed(data, now_ns=1, eof=True)
    return [(e.klass, e.rule, e.line_no, e.line_count, e.repeat_count, e.message, e.context) for e in sf.flush()]


@pytest.fixture
def hs():
    return pytest.importorskip("hyperscan")


def _cache_files(d: Path) -> list[Path]:
    return sorted(d.glob("*.hsdb"))


def test_a_cached_database_is_loaded_and_classifies_the_same(hs, tmp_path):
    uncached = _events(LogFilter(engine="hyperscan", cache_dir=None))
    first = LogFilter(engine="hyperscan", cache_dir=tmp_path)
    assert first.scanner.from_cache is False  # type: ignore[attr-defined]
    (f,) = _cache_files(tmp_path)
    assert f.stat().st_mode & 0o777 == 0o600
    second = LogFilter(engine="hyperscan", cache_dir=tmp_path)
    assert second.scanner.from_cache is True  # type: ignore[attr-defined]
    assert _events(first) == _events(second) == uncached
    assert len(uncached) > 100


def test_another_rule_set_gets_its_own_entry(hs, tmp_path):
    LogFilter(engine="hyperscan", cache_dir=tmp_path)
    rs = RuleSet.builtin().with_rules([LogRule("app_fatal", "app", "FATAL: ")])
    lf = LogFilter(rs, engine="hyperscan", cache_dir=tmp_path)
    assert lf.scanner.from_cache is False  # type: ignore[attr-defined]
    assert len(_cache_files(tmp_path)) == 2
    (ev,) = _events(lf, b"ok\nFATAL: disk on fire\n")
    assert ev[0] == "app"


@pytest.mark.parametrize(
    "damage",
    ["truncate", "flip_payload", "garbage", "empty", "other_key"],
)
def test_a_damaged_or_foreign_cache_file_means_compile_never_a_wrong_result(hs, tmp_path, damage):
    LogFilter(engine="hyperscan", cache_dir=tmp_path)
    (f,) = _cache_files(tmp_path)
    raw = f.read_bytes()
    if damage == "truncate":
        f.write_bytes(raw[: len(raw) // 2])
    elif damage == "flip_payload":
        f.write_bytes(raw[:-100] + bytes(b ^ 0xFF for b in raw[-100:]))
    elif damage == "garbage":
        f.write_bytes(os.urandom(len(raw)))
    elif damage == "empty":
        f.write_bytes(b"")
    else:  # a valid file of another rule set under this one's name (a checksum collision)
        other = tmp_path / "other"
        LogFilter(RuleSet((LogRule("only", "x", "zzz"),)), engine="hyperscan", cache_dir=other)
        (g,) = _cache_files(other)
        f.write_bytes(g.read_bytes())
    lf = LogFilter(engine="hyperscan", cache_dir=tmp_path)
    assert lf.scanner.from_cache is False  # type: ignore[attr-defined]
    assert _events(lf) == _events(LogFilter(engine="hyperscan", cache_dir=None))
    # and the entry was written again, whole
    assert LogFilter(engine="hyperscan", cache_dir=tmp_path).scanner.from_cache is True  # type: ignore[attr-defined]


def test_another_cpu_or_hyperscan_build_misses(hs, tmp_path, monkeypatch):
    LogFilter(engine="hyperscan", cache_dir=tmp_path)
    monkeypatch.setattr(_hs_cache, "_cpu_id", lambda: b"flags : none")
    assert LogFilter(engine="hyperscan", cache_dir=tmp_path).scanner.from_cache is False  # type: ignore[attr-defined]
    monkeypatch.setattr(_hs_cache, "_binding_id", lambda _hs: b"hyperscan 99")
    assert LogFilter(engine="hyperscan", cache_dir=tmp_path).scanner.from_cache is False  # type: ignore[attr-defined]
    assert len(_cache_files(tmp_path)) == 3


def test_an_unwritable_cache_directory_is_not_an_error(hs, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    lf = LogFilter(engine="hyperscan", cache_dir=blocker / "hs")
    assert lf.scanner.from_cache is False  # type: ignore[attr-defined]
    assert _events(lf) == _events(LogFilter(engine="hyperscan", cache_dir=None))
    assert not list(tmp_path.glob("**/.*.tmp"))


def test_the_default_cache_directory_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _hs_cache.default_cache_dir() == tmp_path / "ranklens" / "hyperscan"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # the XDG spec: relative values are invalid
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert _hs_cache.default_cache_dir() == tmp_path / "home" / ".cache" / "ranklens" / "hyperscan"


def test_searching_in_lanes_changes_nothing(hs, tmp_path, monkeypatch):
    # a file of several chunks, each big enough to be searched in two lanes, with events and
    # tracebacks across chunk and lane boundaries
    rng = random.Random(5)
    block = MIXED + b'[rank1]: Traceback (most recent call last):\n[rank1]:   File "x.py", line 1\n'
    block += b"[rank1]: RuntimeError: CUDA error: an illegal memory access was encountered\n"
    parts = []
    for _ in range(40):
        parts.append(block)
        parts.append(b"".join(b"benign %d\n" % rng.randrange(10**6) for _ in range(rng.randrange(1, 30000))))
    p = tmp_path / "big.log"
    p.write_bytes(b"".join(parts))
    chunk = logfilter.PARALLEL_SCAN_BYTES * 2

    def run() -> tuple[list[dict], FilterStats]:
        st = FilterStats()
        evs = [e.to_json() for e in classify_file(p, engine="hyperscan", chunk_bytes=chunk, stats=st)]
        for e in evs:  # a line without a time of its own takes the time it was read
            e.pop("ts_ns")
        return evs, st

    lanes: list[int] = []
    real = _scan._HyperscanScanner.candidates

    def spy(self: object, buf: bytes, start: int, limit: int, lane: int = 0) -> object:
        lanes.append(lane)
        return real(self, buf, start, limit, lane)  # type: ignore[arg-type]

    monkeypatch.setattr(_scan._HyperscanScanner, "candidates", spy)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0}, raising=False)
    one_cpu, one_cpu_st = run()
    assert set(lanes) == {0}  # one processor: one search at a time
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    lanes.clear()
    two, two_st = run()
    assert lanes.count(1) >= 3  # the chunks were searched in two lanes
    monkeypatch.setattr(logfilter, "PARALLEL_SCAN_BYTES", 1 << 62)
    lanes.clear()
    one_lane, one_lane_st = run()
    assert set(lanes) == {0}
    assert two == one_lane == one_cpu and two_st == one_lane_st == one_cpu_st
    assert two_st.lines_read == p.read_bytes().count(b"\n") and two_st.events > 40


def test_a_user_rule_is_still_checked_when_it_is_made():
    with pytest.raises(ConfigError, match="not a valid regular expression"):
        LogRule("bad", "x", "(unclosed")
    with pytest.raises(ConfigError, match="inline flag"):
        LogRule("flag", "x", "(?i)nccl")


def test_logs_classify_imports_no_store_or_dataframe_code(tmp_path):
    p = tmp_path / "r.log"
    p.write_text("ok\nRuntimeError: CUDA error: an illegal memory access was encountered\n")
    code = (
        "import sys\n"
        "from ranklens.cli import cli\n"
        f"cli(['logs', 'classify', {str(p)!r}], standalone_mode=False)\n"
        "heavy = ('numpy', 'pyarrow', 'clickhouse_driver', 'chdb', 'ranklens.store', 'ranklens.collector.shipper')\n"
        "print(sorted(m for m in sys.modules if m.startswith(heavy)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr
    assert "cuda_error" in out.stdout


def test_search_hints_match_wherever_their_patterns_do():
    from ranklens.collector.rules import BUILTIN_RULES, SEARCH_HINTS

    by_pattern = {r.pattern: r for r in BUILTIN_RULES}
    assert SEARCH_HINTS and set(SEARCH_HINTS) <= set(by_pattern)
    held = Path(__file__).parent.parent / "data" / "logs_heldout"
    lines = LINES + [json.loads(x)["line"] for p in sorted(held.glob("*.jsonl")) for x in p.read_text().splitlines()]
    for pattern, hint in SEARCH_HINTS.items():
        # by construction: the pattern is PREFIX.*(?:HINT), so a match of it holds one of the hint
        prefix = pattern[: -len(f".*(?:{hint})")]
        assert pattern == f"{prefix}.*(?:{hint})" and "|" not in prefix and "(" not in prefix
        flags = re.IGNORECASE if by_pattern[pattern].ignore_case else 0
        hits = [x for x in lines if re.search(pattern, x, flags)]
        assert hits, pattern  # the labelled lines exercise it
        assert all(re.search(hint, x, flags) for x in hits)


def test_read_ahead_gives_the_file_whole_and_raises_its_read_errors(tmp_path):
    data = b"".join(b"line %d\n" % i for i in range(20000))
    p = tmp_path / "f.log"
    p.write_bytes(data)
    with open(p, "rb", buffering=0) as raw:
        ra = logfilter._ReadAhead(raw, 4096)
        buf, got = bytearray(4096), []
        while n := ra.readinto(memoryview(buf)):
            got.append(bytes(buf[:n]))
        assert b"".join(got) == data and ra.readinto(memoryview(buf)) == 0
        ra.close()

    class Failing:
        def __init__(self) -> None:
            self.reads = 0

        def readinto(self, b: bytearray) -> int:
            self.reads += 1
            if self.reads > 2:
                raise OSError(5, "Input/output error")
            b[:3] = b"ab\n"
            return 3

    ra = logfilter._ReadAhead(Failing(), 64)
    buf = bytearray(64)
    assert ra.readinto(memoryview(buf)) == 3 and ra.readinto(memoryview(buf)) == 3
    with pytest.raises(OSError, match="Input/output error"):
        ra.readinto(memoryview(buf))
    ra.close()


def test_a_read_ahead_closed_early_stops_its_reader(tmp_path, monkeypatch):
    p = tmp_path / "f.log"
    p.write_bytes(b"benign\n" * 200000)
    with open(p, "rb", buffering=0) as raw:
        ra = logfilter._ReadAhead(raw, 4096)
        buf = bytearray(4096)
        assert ra.readinto(memoryview(buf)) == 4096
        wait_until(ra._free.empty, 10, "the reader to wait for a free buffer")
        ra.close()
        assert not ra._thread.is_alive()
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    assert list(classify_file(p, chunk_bytes=4096)) == []
    assert not [t for t in threading.enumerate() if t.name == "ranklens-log-read"]


# --- the compiled newline count (collector/_lines.c) -------------------------------------------


def test_the_compiled_newline_count_is_built_by_the_install():
    # optional for users (no compiler: bytes.count), required here: a CI machine that silently lost
    # it would measure issue 18's logs row without it
    from ranklens.collector import _lines

    assert logfilter._count_newlines is _lines.count


@pytest.mark.parametrize("seed", range(4))
def test_the_compiled_newline_count_matches_bytes_count_with_its_slice_rules(seed):
    from ranklens.collector._lines import count

    rng = random.Random(seed)
    # sizes around the vector width, the 255-block sums and the no-GIL threshold
    for size in (0, 1, 15, 16, 17, 255 * 16 - 1, 255 * 16 + 33, 64 * 1024 - 1, 64 * 1024, 300_001):
        data = bytes(rng.choice(b"\n\nab\xff\x0a\x0b") for _ in range(size))
        for buf in (data, bytearray(data), memoryview(data)):
            assert count(buf) == data.count(b"\n")
            for _ in range(6):
                a, b = rng.randint(-size - 3, size + 3), rng.randint(-size - 3, size + 3)
                assert count(buf, a) == data.count(b"\n", a), (size, a)
                assert count(buf, a, b) == data.count(b"\n", a, b), (size, a, b)
    with pytest.raises(TypeError):
        count("text\n")  # type: ignore[arg-type]


def test_events_and_line_numbers_are_the_same_with_either_count(monkeypatch, tmp_path):
    # ~0.5 MB (ranges past the no-GIL threshold as well), then one new event deep into the file
    data = MIXED * 40 + (LINES[0] + " zzqx-only-once\n").encode()
    compiled = _events(LogFilter(cache_dir=None), data)
    p = tmp_path / "x.log"
    p.write_bytes(data)
    stats_c = FilterStats()
    file_c = list(classify_file(p, chunk_bytes=1 << 16, stats=stats_c))
    monkeypatch.setattr(logfilter, "_count_newlines", None)
    assert _events(LogFilter(cache_dir=None), data) == compiled
    stats_py = FilterStats()
    file_py = list(classify_file(p, chunk_bytes=1 << 16, stats=stats_py))
    # (a line without a time of its own is stamped with the run's start: not compared)
    assert [{**e.to_json(), "ts_ns": 0} for e in file_py] == [{**e.to_json(), "ts_ns": 0} for e in file_c]
    assert stats_py.lines_read == stats_c.lines_read == data.count(b"\n")
    last = max(compiled, key=lambda e: e[2])
    assert "zzqx-only-once" in last[5] and last[2] == data.count(b"\n")  # its line number, counted
