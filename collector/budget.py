"""The spool's disk budget: how much disk the spool may use while the store cannot take its rows.

:class:`SpoolBudget` holds the limits (a size limit and a free-space floor); :func:`measure` walks
the spool; :func:`evict` removes the oldest segments of the least valuable tables first (profiler
traces, GPU samples, heartbeats; then steps, phases and collectives; log events, GPU events and
the job's metadata last) until the spool is back a tenth below its limit, and says how many rows
of each table went, for ``drops``. The shipper decides *when* (only while the store fails: a store
that takes the rows is always given them first, issue 22 #2).
"""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from ranklens.errors import ConfigError

__all__ = [
    "EVICTION_ORDER",
    "TRACE_TABLE",
    "SpoolBudget",
    "SpoolUsage",
    "evict",
    "free_bytes",
    "measure",
    "parse_bytes",
]

log = logging.getLogger("ranklens.collector")

TRACE_TABLE = "trace_events"  # the table of profiler traces (``*.pt.trace.json`` in the spool)

# Which data goes first when the spool is over budget (lowest value first).
EVICTION_ORDER: tuple[tuple[str, ...], ...] = (
    (TRACE_TABLE, "gpu_samples", "heartbeats"),
    ("steps", "phases", "collectives"),
)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)


def parse_bytes(value: int | float | str, what: str = "size") -> int:
    """``20GiB``, ``500MB``, ``1e9`` or a plain number of bytes → bytes. Raises ConfigError."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}={value!r}: expected a size such as 20GiB or 500MB")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ConfigError(f"{what}={value!r}: must not be negative")
        return int(value)
    m = _SIZE.match(str(value))
    if not m:
        raise ConfigError(f"{what}={value!r}: expected a size such as 20GiB, 500MB or a number of bytes")
    unit = (m.group(2) or "").lower()
    base = 1024 if "i" in unit else 1000
    mult = 1 if unit in ("", "b") else base ** ("kmgt".index(unit[0]) + 1)
    return int(float(m.group(1)) * mult)


@dataclass(frozen=True)
class SpoolBudget:
    """How much disk the spool may use while the store cannot take its rows.

    Args:
        max_bytes: the spool's size limit (pending segments and profiler traces); 0: no limit.
        min_free_bytes: keep at least this much free on the spool's filesystem; 0: no floor.
        check_interval_s: how often the spool is measured (a full directory walk).

    Both limits apply only while the store cannot take the rows: a healthy store ships first.
    """

    max_bytes: int = 20 * 1024**3
    min_free_bytes: int = 1024**3
    check_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_bytes < 0 or self.min_free_bytes < 0:
            raise ConfigError("spool budget sizes must not be negative")
        if not 0 <= self.check_interval_s <= 3600:
            raise ConfigError(f"spool check_interval_s={self.check_interval_s!r}: allowed 0..3600 seconds")

    def over_by(self, usage: SpoolUsage) -> int:
        """Bytes the spool is over its budget (0 or less: within it)."""
        return max(
            usage.total_bytes - self.max_bytes if self.max_bytes else 0,
            self.min_free_bytes - usage.free_bytes if self.min_free_bytes else 0,
        )


@dataclass(frozen=True)
class SpoolUsage:
    """One measurement of the spool: its files (value class, mtime, size, path), their total size,
    the oldest one's mtime and the free space of its filesystem."""

    files: list[tuple[int, float, int, Path]]
    total_bytes: int
    oldest: float | None
    free_bytes: int


def measure(paths: Iterable[Path], free: int) -> SpoolUsage:
    """Stat every file of the spool (files that vanish meanwhile are skipped)."""
    files: list[tuple[int, float, int, Path]] = []  # (value class, mtime, size, path)
    total = 0
    for p in paths:
        try:
            st = p.stat()
        except OSError:
            continue
        files.append((_value_class(p.name), st.st_mtime, st.st_size, p))
        total += st.st_size
    return SpoolUsage(files, total, min((f[1] for f in files), default=None), free)


def evict(
    budget: SpoolBudget,
    usage: SpoolUsage,
    *,
    skip: Callable[[Path], bool],
    removed: Callable[[Path], None],
) -> tuple[int, dict[str, int]]:
    """Remove the least valuable, oldest files until the spool is a tenth below its limit.

    Args:
        skip: files to leave alone (those a running pass holds).
        removed: called with each file removed.

    Returns:
        (bytes freed, rows removed per table); nothing when the spool is within its budget.
    """
    over = budget.over_by(usage)
    if over <= 0:
        return 0, {}
    target = over + (budget.max_bytes // 10 if budget.max_bytes else 0)  # hysteresis: a tenth below the limit
    freed = 0
    evicted: dict[str, int] = {}
    for _cls, _mtime, size, p in sorted(usage.files, key=lambda f: (f[0], f[1], f[3].name)):
        if freed >= target:
            break
        if skip(p):
            continue
        table_name, rows = _table_and_rows(p)
        try:
            p.unlink()
        except FileNotFoundError:
            continue
        removed(p)
        freed += size
        evicted[table_name] = evicted.get(table_name, 0) + rows
    log.error(
        "ranklens collector: store unavailable and the spool over its budget (%s, limit %s, %s free): "
        "removed %s, oldest low-value data first: %s",
        _human(usage.total_bytes),
        _human(budget.max_bytes) if budget.max_bytes else "none",
        _human(usage.free_bytes),
        _human(freed),
        ", ".join(f"{n} {t} rows" for t, n in sorted(evicted.items())),
    )
    return freed, evicted


def free_bytes(path: Path) -> int:
    """Free space of ``path``'s filesystem (very large when it cannot be asked: no floor then)."""
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 1 << 62


def _value_class(name: str) -> int:
    table_name = TRACE_TABLE if name.endswith(".pt.trace.json") else name.split(".", 1)[0]
    for i, tables in enumerate(EVICTION_ORDER):
        if table_name in tables:
            return i
    return len(EVICTION_ORDER)


def _table_and_rows(p: Path) -> tuple[str, int]:
    """The table of a spool file and how many rows it holds (a profiler trace counts as one)."""
    if p.name.endswith(".pt.trace.json"):
        return TRACE_TABLE + "_traces", 1
    try:
        with open(p, "rb") as f:
            lines = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except OSError:
        lines = 0
    return p.name.split(".", 1)[0], max(0, lines - 1)  # the header line is not a row


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n:.1f} TiB"
