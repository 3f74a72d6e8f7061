"""Stores for tests: a store that is down, one that fails a few times, one that is slow, and one
that records what it was asked. They stand in only where a test machine cannot make a real store
fail on demand (the shape of OpenTelemetry's ``InMemorySpanExporter`` or ``httpx.MockTransport``).

Every class here offers the whole :class:`~ranklens.store.api.Store` protocol. The wrappers
(:class:`FlakyStore`, :class:`SlowStore`, :class:`RecordingStore`) pass every call to a real
store, ``inner``, and offer an optional capability (:class:`~ranklens.store.api.SupportsCompact`,
:class:`~ranklens.store.api.SupportsDiscardIngest`) exactly when ``inner`` does, so a component
that tests for one with ``isinstance`` behaves as it would on ``inner``::

    from ranklens.store.testing import DownStore, FlakyStore

    shipper = Shipper(spool, DownStore())                       # every call: StoreUnavailable
    flaky = FlakyStore(open_store(tmp_path), failures=2)        # the first 2 calls fail, then it works
    lost_ack = FlakyStore(store, failures=1, ops={"write_many"}, after=True)  # written, then the answer is lost
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sized
from dataclasses import dataclass, field
from typing import Any

from ranklens.errors import StoreUnavailable
from ranklens.store.api import (
    DEFAULT_BATCH_ROWS,
    QueryResult,
    Store,
    SupportsCompact,
    SupportsDiscardIngest,
    SupportsIngestRows,
    check_batch_rows,
)

__all__ = ["Call", "DownStore", "FlakyStore", "RecordingStore", "SlowStore", "StoreWrapper"]


class _PassDiscardIngest:
    """:class:`~ranklens.store.api.SupportsDiscardIngest`, passed to ``inner`` through ``_call``."""

    def discard_ingest(self: Any, table: str, ingest_ids: Iterable[int], *args: Any, **kwargs: Any) -> int:
        return int(self._call("discard_ingest", self.inner.discard_ingest, (table, ingest_ids, *args), kwargs))


class _PassCompact:
    """:class:`~ranklens.store.api.SupportsCompact`, passed to ``inner`` through ``_call``."""

    def compact(self: Any, *args: Any, **kwargs: Any) -> dict[str, int]:  # the store's own options too
        return dict(self._call("compact", self.inner.compact, args, kwargs))


class _PassIngestRows:
    """:class:`~ranklens.store.api.SupportsIngestRows`, passed to ``inner`` through ``_call``."""

    def ingest_rows(self: Any, table: str, ingest_ids: Iterable[int]) -> dict[int, int]:
        return dict(self._call("ingest_rows", self.inner.ingest_rows, (table, ingest_ids), {}))


# the optional capabilities of store.api a wrapper passes on when its inner store offers them
_CAPABILITIES: tuple[tuple[type, type], ...] = (
    (SupportsDiscardIngest, _PassDiscardIngest),
    (SupportsCompact, _PassCompact),
    (SupportsIngestRows, _PassIngestRows),
)
_with_capabilities: dict[tuple[type, tuple[type, ...]], type] = {}


@dataclass(frozen=True)
class Call:
    """One call a store received: the operation (``"write_many"``, ``"query"``, ...), its arguments,
    and what became of it (``error`` is the exception raised, ``None`` when it returned)."""

    op: str
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    error: BaseException | None = None

    @property
    def sql(self) -> str | None:
        """The SQL of a ``query`` / ``iter_query`` call."""
        return self.args[0] if self.op in ("query", "iter_query") and self.args else None

    @property
    def tables(self) -> list[str]:
        """The tables a ``write`` / ``write_many`` / ``discard_ingest`` call named."""
        if self.op == "write_many" and self.args:
            return list(self.args[0])
        if self.op in ("write", "discard_ingest") and self.args:
            return [self.args[0]]
        return []


class DownStore:
    """A store that cannot be reached: every operation raises ``error`` (a
    :class:`~ranklens.errors.StoreUnavailable` by default) and counts the attempt.

    Args:
        url: what the store says it is (messages and logs print it).
        backend: its ``backend`` attribute.
        error: the exception raised, or a callable making one (a fresh one per call).
    """

    def __init__(
        self,
        url: str = "down://",
        backend: str = "down",
        error: BaseException | Callable[[], BaseException] | None = None,
    ) -> None:
        self.url = url
        self.backend = backend
        self._error = error
        self._lock = threading.Lock()
        self.attempts = 0

    def _fail(self) -> BaseException:
        with self._lock:
            self.attempts += 1
        e = self._error
        if e is None:
            return StoreUnavailable(f"store {self.url} is down (ranklens.store.testing.DownStore)")
        return e() if callable(e) else e

    def write(self, table: str, data: Any) -> int:
        raise self._fail()

    def write_many(self, batches: Mapping[str, Any]) -> dict[str, int]:
        raise self._fail()

    def query(self, sql: str) -> QueryResult:
        raise self._fail()

    def iter_query(self, sql: str, *, batch_rows: int = DEFAULT_BATCH_ROWS) -> Iterator[QueryResult]:
        check_batch_rows(batch_rows)
        return self._iter()

    def _iter(self) -> Iterator[QueryResult]:
        raise self._fail()  # on the first next(), like a real store's
        yield  # pragma: no cover - makes this a generator

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"DownStore({self.url!r}, attempts={self.attempts})"


class StoreWrapper:
    """A store that passes every call to ``inner`` through :meth:`_call` (override it to add a
    fault, a delay or a record). Optional capabilities are offered when ``inner`` offers them: the
    instance is of a subclass that defines their methods (so ``isinstance`` against the
    runtime-checkable protocols, which looks the methods up statically on Python 3.12+, sees them)."""

    def __new__(cls, inner: Store, *args: Any, **kwargs: Any) -> StoreWrapper:
        mixins = tuple(m for proto, m in _CAPABILITIES if isinstance(inner, proto))
        if not mixins:
            return super().__new__(cls)
        sub = _with_capabilities.get((cls, mixins))
        if sub is None:
            sub = type(cls.__name__, (cls, *mixins), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
            _with_capabilities[(cls, mixins)] = sub
        return super().__new__(sub)

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.url = inner.url
        self.backend = inner.backend

    def _call(self, op: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return fn(*args, **kwargs)

    def write(self, table: str, data: Any) -> int:
        return self._call("write", self.inner.write, (table, data), {})

    def write_many(self, batches: Mapping[str, Any]) -> dict[str, int]:
        return self._call("write_many", self.inner.write_many, (batches,), {})

    def query(self, sql: str) -> QueryResult:
        return self._call("query", self.inner.query, (sql,), {})

    def iter_query(self, sql: str, *, batch_rows: int = DEFAULT_BATCH_ROWS) -> Iterator[QueryResult]:
        check_batch_rows(batch_rows)
        return self._iter(sql, batch_rows)

    def _iter(self, sql: str, batch_rows: int) -> Iterator[QueryResult]:
        # a generator, like the stores': the fault or delay comes with the first batch
        yield from self._call("iter_query", self.inner.iter_query, (sql,), {"batch_rows": batch_rows})

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:  # anything else of the store inside (its root, ...)
        if name == "inner" or any(hasattr(m, name) for _, m in _CAPABILITIES):
            raise AttributeError(name)  # inner not set yet (copy, unpickle), or a capability it lacks
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"


class FlakyStore(StoreWrapper):
    """``inner`` whose first ``failures`` matching calls fail, then it works.

    Args:
        inner: the real store.
        failures: how many calls fail (``None``: every call, until :meth:`heal`).
        ops: the operations that may fail (default: all: ``write``, ``write_many``, ``query``,
            ``iter_query``, ``discard_ingest``, ``compact``); the others always pass.
        after: fail *after* ``inner`` did the work (a write stored, then the answer lost: the
            connection reset after the block was sent); default: before, nothing done.
        when: fail only calls for which ``when(op, args)`` is true (e.g. one bad batch).
        error: the exception raised (or a callable making one); default StoreUnavailable.
    """

    def __init__(
        self,
        inner: Store,
        *,
        failures: int | None = 1,
        ops: Collection[str] | None = None,
        after: bool = False,
        when: Callable[[str, tuple[Any, ...]], bool] | None = None,
        error: BaseException | Callable[[], BaseException] | None = None,
    ) -> None:
        super().__init__(inner)
        if failures is not None and failures < 0:
            raise ValueError(f"failures must be >= 0 or None (fail until heal()), not {failures!r}")
        self.failures = failures
        self.ops = frozenset(ops) if ops is not None else None
        self.after = after
        self.when = when
        self._error = error
        self._lock = threading.Lock()
        self.failed = 0  # calls made to fail so far

    def heal(self) -> None:
        """Every later call works."""
        with self._lock:
            self.failures = 0

    def _should_fail(self, op: str, args: tuple[Any, ...]) -> bool:
        if self.ops is not None and op not in self.ops:
            return False
        if self.when is not None and not self.when(op, args):
            return False
        with self._lock:
            if self.failures is not None:
                if self.failures <= 0:
                    return False
                self.failures -= 1
            self.failed += 1
            return True

    def _make_error(self, op: str) -> BaseException:
        e = self._error
        if e is None:
            what = "after the work was done (the answer lost)" if self.after else "before"
            return StoreUnavailable(f"{op} on {self.url} failed {what} (ranklens.store.testing.FlakyStore)")
        return e() if callable(e) else e

    def _call(self, op: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self._should_fail(op, args):
            return fn(*args, **kwargs)
        if self.after:
            out = fn(*args, **kwargs)
            if op == "iter_query":
                for _ in out:  # the whole result read, then lost
                    pass
        raise self._make_error(op)


class SlowStore(StoreWrapper):
    """``inner`` that answers late: each matching call waits ``delay_s``, or until ``until()`` is
    true (polled; bounded by ``timeout_s``), then runs.

    Args:
        inner: the real store.
        delay_s: a fixed delay per call.
        until: a condition to wait for instead (a :class:`threading.Event`'s ``is_set``, or any
            callable), e.g. "the other thread had its go".
        timeout_s: the most a call waits for ``until`` (then it runs anyway).
        ops: the operations that are slow (default: all).

    ``entered`` is set when a slow call starts waiting (a test waits for it, not for a guess).
    """

    def __init__(
        self,
        inner: Store,
        *,
        delay_s: float = 0.0,
        until: Callable[[], object] | None = None,
        timeout_s: float = 60.0,
        ops: Collection[str] | None = None,
    ) -> None:
        super().__init__(inner)
        if delay_s < 0 or timeout_s < 0:
            raise ValueError(f"delay_s and timeout_s must be >= 0, not {delay_s!r}, {timeout_s!r}")
        self.delay_s = delay_s
        self.until = until
        self.timeout_s = timeout_s
        self.ops = frozenset(ops) if ops is not None else None
        self.entered = threading.Event()

    def _call(self, op: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.ops is None or op in self.ops:
            self.entered.set()
            if self.until is None:
                time.sleep(self.delay_s)
            else:
                deadline = time.monotonic() + self.timeout_s
                while not self.until() and time.monotonic() < deadline:
                    time.sleep(0.01)
        return fn(*args, **kwargs)


class RecordingStore(StoreWrapper):
    """``inner`` that records every call it receives in :attr:`calls` (thread-safe), with the
    exception it raised, if any."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()
        self.calls: list[Call] = []

    def _call(self, op: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            out = fn(*args, **kwargs)
        except BaseException as e:
            self._record(Call(op, args, dict(kwargs), e))
            raise
        self._record(Call(op, args, dict(kwargs)))
        return out

    def _record(self, call: Call) -> None:
        with self._lock:
            self.calls.append(call)

    def ops(self) -> list[str]:
        """The operations received, in order."""
        with self._lock:
            return [c.op for c in self.calls]

    def written(self) -> dict[str, int]:
        """Rows the store acknowledged per table (``write`` and ``write_many`` that returned)."""
        out: dict[str, int] = {}
        with self._lock:
            calls = list(self.calls)
        for c in calls:
            if c.error is None and c.op in ("write", "write_many"):
                batches = {c.args[0]: c.args[1]} if c.op == "write" else c.args[0]
                for name, data in batches.items():
                    out[name] = out.get(name, 0) + _rows(data)
        return out


def _rows(data: Any) -> int:
    n = getattr(data, "num_rows", None)
    if n is not None:
        return int(n)
    return len(data) if isinstance(data, Iterable) and isinstance(data, Sized) else 1
