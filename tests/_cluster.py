"""A throw-away ClickHouse cluster for the tests: ZooKeeper and four clickhouse-server (18.16)
processes, 2 shards x 2 replicas, started by scripts/clickhouse_cluster.sh (which polls readiness
and picks free ports, kept in ``DIR/cluster.env``); nodes can be stopped, killed and started again.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts/clickhouse_cluster.sh"
CLUSTER = "ranklens"
NODES = (1, 2, 3, 4)

__all__ = ["CLUSTER", "NODES", "Cluster", "missing"]


def missing() -> str:
    """Why no cluster can start here ('' when it can)."""
    for tool, pkg in (("clickhouse-server", "clickhouse-server"), ("clickhouse-client", "clickhouse-client")):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install {pkg})"
    if shutil.which("java") is None or not Path("/usr/share/java/zookeeper.jar").exists():
        return "ZooKeeper is not installed (apt-get install zookeeper)"
    return ""


@dataclass
class Cluster:
    """The cluster in ``dir``: node N is shard (N+1)//2, replica 1 for odd N, 2 for even N."""

    dir: Path
    ports: dict[str, int] = field(default_factory=dict)

    def _run(self, *args: str) -> str:
        r = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"clickhouse_cluster.sh {' '.join(args)}: {r.stderr}{r.stdout}"
        return r.stdout

    def start(self) -> str:
        out = self._run("start", str(self.dir))
        for line in (self.dir / "cluster.env").read_text().split():
            k, _, v = line.partition("=")
            self.ports[k] = int(v)
        return out

    def stop(self) -> None:
        self._run("stop", str(self.dir))

    def start_node(self, n: int) -> None:
        self._run("start-node", str(self.dir), str(n))

    def stop_node(self, n: int) -> None:
        self._run("stop-node", str(self.dir), str(n))

    def kill_node(self, n: int) -> None:
        """SIGKILL: the server dies with whatever it was doing half done."""
        self._run("kill-node", str(self.dir), str(n))

    def tcp(self, n: int) -> int:
        return self.ports[f"CH{n}_TCP"]

    def url(self, database: str = "", node: int = 1) -> str:
        return f"clickhouse://default@127.0.0.1:{self.tcp(node)}" + (f"/{database}" if database else "")

    @staticmethod
    def shard_of(n: int) -> int:
        return (n + 1) // 2
