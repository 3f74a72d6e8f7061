"""The one Prometheus ``/metrics`` HTTP server (issue 13): the collector's node endpoint and
``ranklens analyze --follow``'s findings endpoint both use :class:`MetricsServer`.

It binds loopback (:data:`DEFAULT_ADDR`) unless told otherwise: an endpoint that Prometheus on
another machine scrapes is opened on purpose (the collector's ``metrics_addr``, default
``0.0.0.0`` in its config, or ``--metrics-addr``), never by accident. Port 0 takes a free port
(read :attr:`MetricsServer.port` after :meth:`MetricsServer.start`).

Every endpoint serves the same conventions, whatever registry it is given:

- no ``_created`` series: prometheus-client adds one beside every counter, histogram and summary,
  and Prometheus stores each as a series of its own (a timestamp that never changes). The server
  leaves them out of what it serves (both text formats, ``name[]`` selections too) rather than
  calling ``prometheus_client.disable_created_metrics()``, which would change every registry of the
  process, a user's own included;
- ``ranklens_build_info{version, python, schema_version}`` = 1: which ranklens, which Python and
  which store schema serve the endpoint, the ``*_build_info`` convention of Prometheus' own
  exporters (join on it in PromQL). A registry may carry it itself (:class:`BuildInfo`, as the
  collector's does); the endpoint then adds no second one.

prometheus-client is imported only when a server starts.
"""

from __future__ import annotations

import platform
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from ranklens.errors import ConfigError

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import CollectorRegistry

__all__ = [
    "BUILD_INFO",
    "DEFAULT_ADDR",
    "BuildInfo",
    "MetricsBindError",
    "MetricsServer",
    "build_version",
    "serve_metrics",
]

DEFAULT_ADDR = "127.0.0.1"
BUILD_INFO = "ranklens_build_info"
# the sample types prometheus-client gives a `<name>_created` sample
_WITH_CREATED = frozenset({"counter", "histogram", "summary"})


class MetricsBindError(ConfigError):
    """The endpoint cannot listen on the address and port it was given."""


def build_version() -> str:
    """The installed ranklens distribution's version (``"unknown"`` when it is not installed, e.g.
    run from a source tree without ``pip install``)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ranklens")
    except PackageNotFoundError:
        return "unknown"


def _build_info() -> Metric:
    from prometheus_client.core import GaugeMetricFamily

    from ranklens.schema import SCHEMA_VERSION

    g = GaugeMetricFamily(
        BUILD_INFO,
        "ranklens build serving this endpoint (always 1)",
        labels=("version", "python", "schema_version"),
    )
    g.add_metric([build_version(), platform.python_version(), str(SCHEMA_VERSION)], 1.0)
    return g


class BuildInfo:
    """A collector for a registry of one's own: ``ranklens_build_info`` (register it with
    ``registry.register(BuildInfo())``)."""

    def collect(self) -> Iterator[Metric]:
        yield _build_info()


def _without_created(metrics: Iterable[Metric]) -> Iterator[Metric]:
    from prometheus_client.metrics_core import Metric

    for m in metrics:
        if m.type not in _WITH_CREATED:
            yield m
            continue
        created = m.name + "_created"
        # a copy: a custom collector may hand out the same family object on every scrape
        out = Metric(m.name, m.documentation, m.type, m.unit)
        out.samples = [s for s in m.samples if s.name != created]
        yield out


class _Exposed:
    """What a :class:`MetricsServer` serves of a registry: its metrics without ``_created``
    samples, and ``ranklens_build_info`` (unless the registry has its own). The two methods are
    the ones prometheus-client's exposition calls."""

    def __init__(self, registry: Any, *, build_info: bool = True) -> None:
        self._registry = registry
        self._build_info = build_info

    def collect(self) -> Iterator[Metric]:
        seen_build_info = False
        for m in _without_created(self._registry.collect()):
            seen_build_info = seen_build_info or m.name == BUILD_INFO
            yield m
        if self._build_info and not seen_build_info:
            yield _build_info()

    def restricted_registry(self, names: Iterable[str]) -> _Exposed:
        names = set(names)  # `?name[]=...`: only those series, build info only when asked for
        return _Exposed(self._registry.restricted_registry(names), build_info=BUILD_INFO in names)


class MetricsServer:
    """``/metrics`` for ``registry`` over HTTP, served by a daemon thread: its metrics without
    ``_created`` series, and ``ranklens_build_info`` (see the module's docstring).

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
            self._server, self._thread = start_http_server(self.port, addr=self.addr, registry=_Exposed(self.registry))
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
