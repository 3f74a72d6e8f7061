"""Stores: where ranklens keeps its records. Open one with :func:`open_store`.

URLs:
    ``embedded:///abs/dir`` or ``embedded://rel/dir`` (or a bare directory path): chDB over
    Parquet parts in a local directory, safe for concurrent processes.
    ``clickhouse://user:password@host:9000/database`` (``clickhouses://`` for TLS): a server.
"""

from __future__ import annotations

import os

from ranklens.config import DEFAULT_STORE_DIR, ENV_STORE, ENV_STORE_PASSWORD
from ranklens.errors import ConfigError
from ranklens.store.api import QueryResult, Store

__all__ = ["QueryResult", "Store", "default_store_url", "open_store"]


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
