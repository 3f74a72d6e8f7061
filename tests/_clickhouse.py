"""A throw-away clickhouse-server for the tests (Debian's package, started by scripts/clickhouse.sh)
on ports the OS picked free, ready once it answers a query (the script polls ``SELECT version()``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

from tests._sync import free_port, wait_until

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["ClickHouseServer", "installed"]


def installed() -> bool:
    return shutil.which("clickhouse-server") is not None and shutil.which("clickhouse-client") is not None


class ClickHouseServer:
    """A clickhouse-server of our own in ``root``, to start, stop and kill; :attr:`url` names
    ``database`` on it (none: the URL without a database)."""

    def __init__(self, root: Path, database: str = "") -> None:
        self.dir = Path(root)
        self.database = database
        self.tcp, self.http = free_port(), free_port()

    def _run(self, cmd: str) -> None:
        env = dict(os.environ, RANKLENS_CH_TCP_PORT=str(self.tcp), RANKLENS_CH_HTTP_PORT=str(self.http))
        r = subprocess.run(
            ["bash", str(ROOT / "scripts/clickhouse.sh"), cmd, str(self.dir)], env=env, capture_output=True, text=True
        )
        assert r.returncode == 0, r.stderr + r.stdout

    def start(self) -> None:
        """Start it; returns once it answers a query on :attr:`tcp`."""
        self._run("start")

    def stop(self) -> None:
        self._run("stop")

    def kill(self) -> None:
        """SIGKILL: the server dies mid-insert, with no chance to finish or refuse anything."""
        pid = int((self.dir / "pid").read_text())
        os.kill(pid, signal.SIGKILL)

        def gone() -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            return False

        wait_until(gone, 30, f"the killed clickhouse-server (pid {pid}) to exit", interval_s=0.1)
        (self.dir / "pid").unlink()

    @property
    def url(self) -> str:
        return f"clickhouse://default@127.0.0.1:{self.tcp}" + (f"/{self.database}" if self.database else "")
