"""The one Prometheus ``/metrics`` HTTP server (issue 13): the collector's node endpoint and
``ranklens analyze --follow``'s findings endpoint both use :class:`MetricsServer`.

It binds loopback (:data:`DEFAULT_ADDR`) unless told otherwise: an endpoint that Prometheus on
another machine scrapes is opened on purpose (the collector's ``metrics_addr``, default
``0.0.0.0`` in its config, or ``--metrics-addr``), never by accident. Port 0 takes a free port
(read :attr:`MetricsServer.port` after :meth:`MetricsServer.start`).

prometheus-client is imported only when a server starts.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from ranklens.errors import ConfigError

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

__all__ = ["DEFAULT_ADDR", "MetricsBindError", "MetricsServer", "serve_metrics"]

DEFAULT_ADDR = "127.0.0.1"


class MetricsBindError(ConfigError):
    """The endpoint cannot listen on the address and port it was given."""


class MetricsServer:
    """``/metrics`` for ``registry`` over HTTP, served by a daemon thread.

    Args:
        registry: what to expose.
        port: TCP port (0: a free one; read :attr:`port` after :meth:`start`).
        addr: address to bind (default :data:`DEFAULT_ADDR`, loopback; ``0.0.0.0`` or ``::`` so that
            Prometheus on another machine can scrape).
    """

    def __init__(self, registry: CollectorRegistry, *, port: int = 0, addr: str = DEFAULT_ADDR) -> None:
        self.registry = registry
        self.addr = addr
        self.port = port
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``http://addr:port/metrics`` (IPv6 addresses in brackets)."""
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def start(self) -> int:
        """Start serving (again a no-op once started); returns the bound port.

        Raises:
            MetricsBindError: the address or port cannot be bound (in use, not local, no permission).
        """
        if self._server is not None:
            return self.port
        from prometheus_client import start_http_server

        try:
            self._server, self._thread = start_http_server(self.port, addr=self.addr, registry=self.registry)
        except OSError as e:
            raise MetricsBindError(
                f"cannot serve metrics on {self.addr}:{self.port}: {e.strerror or e}; "
                "choose another port (--metrics-port, 0: any free one) or address (--metrics-addr)"
            ) from None
        self.port = int(self._server.server_address[1])
        return self.port

    def close(self) -> None:
        """Stop serving and release the port (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> MetricsServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_metrics(registry: CollectorRegistry, *, port: int = 0, addr: str = DEFAULT_ADDR) -> MetricsServer:
    """Start a :class:`MetricsServer` and return it (``.port`` is the bound port, ``.close()`` stops it).

    Raises:
        MetricsBindError: as :meth:`MetricsServer.start`.
    """
    s = MetricsServer(registry, port=port, addr=addr)
    s.start()
    return s
