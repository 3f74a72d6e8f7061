"""``ranklens dashboard`` stops its Streamlit server when it is terminated (issue 22 #10): SIGTERM to
the command left the Streamlit child serving the port, an orphan nobody would stop."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests._sync import free_port, wait_until

pytest.importorskip("streamlit")
pytest.importorskip("plotly")

RANKLENS = [sys.executable, "-m", "ranklens.cli"]


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_signal_to_dashboard_stops_its_streamlit_server(tmp_path, sig):
    from ranklens.store import open_store

    open_store(f"embedded://{tmp_path / 'store'}").close()
    port = free_port()
    err = tmp_path / "stderr.log"
    with err.open("wb") as err_file:
        proc = subprocess.Popen(
            [*RANKLENS, "dashboard", "--store", f"embedded://{tmp_path / 'store'}", "--port", str(port)],
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=err_file,
        )
    child = None
    try:
        wait_until(lambda: _listening(port), 120, f"the dashboard on port {port}", procs=[proc], detail=err.read_text)
        (child,) = _children(proc.pid)
        proc.send_signal(sig)
        rc = proc.wait(timeout=30)
        assert rc == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
        wait_until(lambda: not _alive(child), 30, f"the Streamlit child {child} to exit", interval_s=0.1)
        wait_until(lambda: not _listening(port), 10, f"port {port} to close", interval_s=0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)
