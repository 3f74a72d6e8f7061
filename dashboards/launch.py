"""Start the dashboard: ``streamlit run`` on :mod:`ranklens.dashboards.app` with the store URL passed
through ``$RANKLENS_STORE``. Loopback only unless a host is given.

``ranklens dashboard [--store URL] [--port P] [--host 127.0.0.1]`` calls :func:`run_dashboard`, which
stops the Streamlit server when it is interrupted (Ctrl-C), terminated (SIGTERM, SIGHUP) or killed
(the child is started with ``PR_SET_DEATHSIG`` on Linux), so no orphan keeps serving the port.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from ranklens.config import ENV_STORE
from ranklens.errors import ConfigError
from ranklens.formats.process import stop_process

__all__ = ["APP_PATH", "dashboard_command", "dashboard_env", "dashboard_healthy", "run_dashboard", "start_dashboard"]

APP_PATH = Path(__file__).resolve().with_name("app.py")


def _check(host: str, port: int) -> None:
    if not host or any(c.isspace() for c in host):
        raise ConfigError(f"--host {host!r}: give an address to listen on, e.g. 127.0.0.1 (the default)")
    if not isinstance(port, int) or not 1 <= port <= 65535:
        raise ConfigError(f"--port {port!r}: must be an integer in 1..65535 (default 8501)")
    if importlib.util.find_spec("streamlit") is None or importlib.util.find_spec("plotly") is None:
        raise ConfigError("the dashboard needs Streamlit and Plotly: pip install 'ranklens[dashboards]'")


def dashboard_command(host: str = "127.0.0.1", port: int = 8501, *, python: str | None = None) -> list[str]:
    """The ``streamlit run`` command line of the dashboard (no telemetry, no file watcher, headless)."""
    _check(host, port)
    return [
        python or sys.executable,
        "-m",
        "streamlit",
        "run",
        str(APP_PATH),
        "--server.address",
        host,
        "--server.port",
        str(int(port)),
        "--server.headless",
        "true",
        "--server.fileWatcherType",
        "none",
        "--server.runOnSave",
        "false",
        "--browser.gatherUsageStats",
        "false",
        "--global.developmentMode",
        "false",
        "--theme.base",
        "light",
        "--client.toolbarMode",
        "viewer",
    ]


def _resolve_store_url(store_url: str | None) -> str:
    """Check that the store opens (clear errors before a server starts) and make an embedded path absolute."""
    from ranklens.store import default_store_url, open_store

    url = store_url or default_store_url()
    store = open_store(url, create=False)
    try:
        return store.url if store.backend == "embedded" else url  # the server URL keeps its password
    finally:
        store.close()


def dashboard_env(store_url: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of the dashboard process: ``base`` (default: this one) plus the store URL."""
    env = dict(os.environ if base is None else base)
    env[ENV_STORE] = store_url
    env.setdefault("STREAMLIT_BROWSER_GATHER_USAGE_STATS", "false")
    return env


def start_dashboard(
    store_url: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8501,
    *,
    stdout: IO[Any] | int | None = None,
    stderr: IO[Any] | int | None = None,
    die_with_parent: bool = False,
) -> subprocess.Popen[bytes]:
    """Start the dashboard server in the background and return its process.

    Args:
        die_with_parent: on Linux, the server gets SIGTERM when this process dies, even by SIGKILL.

    Raises:
        ConfigError: bad host or port, or Streamlit/Plotly missing.
        StoreUnavailable, SchemaVersionError: the store cannot be used.
    """
    _check(host, port)
    url = _resolve_store_url(store_url)
    preexec = _deathsig_preexec() if die_with_parent else None
    return subprocess.Popen(
        dashboard_command(host, port), env=dashboard_env(url), stdout=stdout, stderr=stderr, preexec_fn=preexec
    )


def dashboard_healthy(base_url: str, timeout_s: float = 2.0) -> bool:
    """True when the Streamlit server at ``base_url`` (``http://host:port``) answers its health check."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{base_url}/_stcore/health", timeout=timeout_s) as r:
            return bool(r.read().strip() == b"ok")
    except OSError:
        return False


def _deathsig_preexec() -> Any:
    """A ``preexec_fn`` asking Linux to send the child SIGTERM when its parent dies (None elsewhere)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover - no libc to call
        return None
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_DEATHSIG
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(0)

    return preexec


class _Terminated(Exception):
    """SIGTERM/SIGHUP reached ``run_dashboard``."""


def _on_signal(signum: int, _frame: Any) -> None:
    raise _Terminated(signum)


def run_dashboard(store_url: str | None = None, host: str = "127.0.0.1", port: int = 8501) -> int:
    """Serve the dashboard until interrupted; return the server's exit status (0 after Ctrl-C).

    Args:
        store_url: the store to show (default: ``$RANKLENS_STORE``, else ``./ranklens-store``).
        host: address to listen on; loopback by default.
        port: TCP port.

    Raises:
        ConfigError: bad host or port, or Streamlit/Plotly missing.
        StoreUnavailable, SchemaVersionError: the store cannot be used.
    """
    # SIGTERM (kill, systemd, Kubernetes) and SIGHUP stop the server like Ctrl-C: without this the
    # parent died and its Streamlit child kept serving the port (issue 22 #10).
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    proc: subprocess.Popen[bytes] | None = None
    try:
        proc = start_dashboard(store_url, host, port, die_with_parent=True)
        print(f"ranklens dashboard: http://{host}:{port}/  (Ctrl-C stops it)", file=sys.stderr)
        return proc.wait()
    except (KeyboardInterrupt, _Terminated):
        return 0
    finally:
        for s, h in previous.items():  # a second SIGTERM kills us; PR_SET_DEATHSIG then stops the child
            signal.signal(s, h)
        if proc is not None:
            stop_process(proc)
