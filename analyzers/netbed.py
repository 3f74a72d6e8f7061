"""A real slow-link test bed from Python: network namespaces as nodes (``scripts/netbed.sh``).

Each node is a network namespace with one interface (``veth0``, address ``10.77.0.<k+1>``) joined
to the others through a bridge in its own namespace; one node's link can be throttled with tc's
token bucket filter. Processes started with :meth:`NetBed.command` run inside a node with their
own hostname (``node<k>``, so ``ranks.host`` names the node), and :meth:`NetBed.env` points gloo at
the node's interface. Used by tests and by drills; it needs root and iproute2, and
:func:`unavailable_reason` says why not when it cannot run::

    with NetBed(4) as bed:
        bed.throttle(3, "30mbit")
        subprocess.run(bed.command(3, ["python", "train.py"]), env={**os.environ, **bed.env(3)})
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ranklens.errors import RanklensError

__all__ = ["NetBed", "NetBedError", "default_script", "unavailable_reason"]

IFACE = "veth0"
EXIT_UNAVAILABLE = 3


class NetBedError(RanklensError):
    """The bed could not be built, changed or removed; the message carries the script's output."""


def default_script() -> Path:
    """``scripts/netbed.sh`` of the source tree this module lives in."""
    return Path(__file__).resolve().parents[1] / "scripts" / "netbed.sh"


def unavailable_reason(script: Path | None = None) -> str | None:
    """Why a bed cannot be built here (not root, no ``ip netns``, ...), or None when it can."""
    script = script or default_script()
    if not script.is_file():
        return f"{script} not found (the test bed ships with the source tree)"
    if os.geteuid() != 0:
        return f"the network-namespace test bed needs root (uid {os.geteuid()})"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed (iproute2, util-linux)"
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"'ip netns' is not available: {r.stderr.strip()}"
    return None


@dataclass
class NetBed:
    """A bed of ``nodes`` namespaces; ``prefix`` names them (several beds may coexist).

    Args:
        nodes: how many nodes.
        prefix: namespace names are ``<prefix>-n<k>`` and ``<prefix>-br`` (bridge).
        subnet: the first three octets of the private /24 that exists only inside the bed.
        script: the shell script that does the work (default: :func:`default_script`).
    """

    nodes: int
    prefix: str = "rlbed"
    subnet: str = "10.77.0"
    script: Path | None = None

    def _run(self, *args: str) -> str:
        script = self.script or default_script()
        env = {**os.environ, "NETBED_PREFIX": self.prefix, "NETBED_SUBNET": self.subnet}
        r = subprocess.run(["bash", str(script), *args], capture_output=True, text=True, env=env, timeout=120)
        if r.returncode != 0:
            raise NetBedError(f"netbed {' '.join(args)} failed (exit {r.returncode}): {r.stderr.strip() or r.stdout}")
        return r.stdout

    def up(self, throttle: tuple[int, str] | None = None) -> NetBed:
        """Build the bed (replacing an old one of the same prefix); optionally throttle one node."""
        args = ["up", str(self.nodes)]
        if throttle is not None:
            args += ["--throttle", str(throttle[0]), throttle[1]]
        self._run(*args)
        return self

    def down(self) -> None:
        """Remove every namespace of the bed (idempotent)."""
        self._run("down")

    def throttle(self, node: int, rate: str) -> None:
        """Limit node ``node``'s link to ``rate`` (a tc rate such as ``30mbit``), both directions."""
        self._run("throttle", str(node), rate)

    def unthrottle(self, node: int) -> None:
        """Remove node ``node``'s throttle (idempotent)."""
        self._run("unthrottle", str(node))

    def status(self) -> str:
        """Namespaces, addresses and qdiscs of the bed, as the script prints them."""
        return self._run("status")

    def namespace(self, node: int) -> str:
        """The network namespace of node ``node``."""
        return f"{self.prefix}-n{node}"

    def address(self, node: int) -> str:
        """The node's IPv4 address inside the bed."""
        return f"{self.subnet}.{node + 1}"

    def hostname(self, node: int) -> str:
        """The hostname processes see on node ``node`` (``node<k>``)."""
        return f"node{node}"

    def env(self, node: int) -> dict[str, str]:
        """Environment for a torch.distributed (gloo) process on ``node``."""
        return {"GLOO_SOCKET_IFNAME": IFACE, "TP_SOCKET_IFNAME": IFACE}

    def command(self, node: int, argv: list[str], *, hostname: bool = True) -> list[str]:
        """``argv`` run inside node ``node`` (and, by default, with the hostname ``node<k>``)."""
        cmd = ["ip", "netns", "exec", self.namespace(node)]
        if hostname:
            cmd += ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', self.hostname(node)]
        return cmd + list(argv)

    def __enter__(self) -> NetBed:
        return self.up()

    def __exit__(self, *exc: Any) -> None:
        self.down()
