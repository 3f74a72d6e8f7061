"""Stores: where ranklens keeps its records. Open one with :func:`open_store`.

URLs:
    ``embedded:///abs/dir`` or ``embedded://rel/dir`` (or a bare directory path): chDB over
    Parquet parts in a local directory, safe for concurrent processes.
    ``clickhouse://user:password@host:9000/database`` (``clickhouses://`` for TLS): a server.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ranklens.config import DEFAULT_STORE_DIR, ENV_STORE, ENV_STORE_PASSWORD
from ranklens.errors import ConfigError
from ranklens.store.api import (
    DEFAULT_BATCH_ROWS,
    QueryResult,
    Store,
    SupportsCompact,
    SupportsDiscardIngest,
    SupportsIngestRows,
    check_batch_rows,
)

if TYPE_CHECKING:
    from ranklens.store.server import ServerStore

__all__ = [
    "LazyStore",
    "QueryResult",
    "Store",
    "SupportsCompact",
    "SupportsDiscardIngest",
    "SupportsIngestRows",
    "default_store_url",
    "open_store",
]


def default_store_url() -> str:
    """``$RANKLENS_STORE``, else an embedded store in ``./ranklens-store``."""
    return os.environ.get(ENV_STORE) or f"embedded://{os.path.abspath(DEFAULT_STORE_DIR)}"


def open_store(url: str | None = None, *, create: bool = True) -> Store:
    """Open (and by default create) the store at ``url``.

    Raises:
        ConfigError: the URL is not understood.
        StoreUnavailable: the store cannot be reached or created.
        SchemaVersionError: the store was made by a ranklens of another schema version.
    """
    url = url or default_store_url()
    if url.startswith(("clickhouse://", "clickhouses://")):
        from ranklens.store.server import ServerConfig, ServerStore

        return ServerStore(ServerConfig.from_url(url, password_env=os.environ.get(ENV_STORE_PASSWORD)), create=create)
    if url.startswith("embedded:"):
        path = url[len("embedded:") :]
        if path.startswith("//"):
            path = path[2:]
        if not path:
            raise ConfigError(f"store URL {url!r} names no directory; e.g. embedded:///var/lib/ranklens")
    elif "://" in url:
        raise ConfigError(
            f"unknown store URL {url!r}; use embedded:///dir or clickhouse://user:pass@host:9000/db "
            f"(or set {ENV_STORE})"
        )
    else:
        path = url
    from ranklens.store.embedded import EmbeddedStore

    return EmbeddedStore(path, create=create)


class LazyStore:
    """A ClickHouse server store that is connected on first use and again after a failed attempt:
    a collector that starts before its store keeps collecting, and ships once the store is up.

    Methods raise :class:`~ranklens.errors.StoreUnavailable` while the server cannot be reached,
    like an open store whose server went away.
    """

    backend = "server"

    def __init__(self, url: str, *, create: bool = True) -> None:
        import threading

        from ranklens.store.server import ServerConfig

        if not url.startswith(("clickhouse://", "clickhouses://")):
            raise ConfigError(f"LazyStore is for ClickHouse server URLs, not {url!r}")
        self._url = url
        self._create = create
        self.url = ServerConfig.from_url(url).redacted_url()  # parses (bad URLs fail now), connects nothing
        self._store: ServerStore | None = None
        self._lock = threading.Lock()

    def _get(self) -> ServerStore:
        from ranklens.store.server import ServerConfig, ServerStore

        with self._lock:
            if self._store is None:
                cfg = ServerConfig.from_url(self._url, password_env=os.environ.get(ENV_STORE_PASSWORD))
                self._store = ServerStore(cfg, create=self._create)
            return self._store

    @property
    def connected(self) -> bool:
        return self._store is not None

    def write(self, table: str, data: Any) -> int:
        return self._get().write(table, data)

    def write_many(self, batches: Mapping[str, Any]) -> dict[str, int]:
        return self._get().write_many(batches)

    def query(self, sql: str) -> QueryResult:
        return self._get().query(sql)

    def iter_query(self, sql: str, *, batch_rows: int = DEFAULT_BATCH_ROWS) -> Iterator[QueryResult]:
        check_batch_rows(batch_rows)
        return self._iter_query(sql, batch_rows)

    def _iter_query(self, sql: str, batch_rows: int) -> Iterator[QueryResult]:
        yield from self._get().iter_query(sql, batch_rows=batch_rows)  # connects on the first batch

    def discard_ingest(self, table: str, ingest_ids: Iterable[int]) -> int:
        return self._get().discard_ingest(table, ingest_ids)

    def close(self) -> None:
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None

    def __repr__(self) -> str:
        return f"LazyStore({self.url!r}, connected={self.connected})"
