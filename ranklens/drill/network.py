"""Throttled-link drills: the job on a network-namespace bed, one torchrun agent per node.

A ``slow_link`` fault needs nodes with links of their own. The drill builds the bed of
:mod:`ranklens.analyzers.netbed` (``N`` network namespaces joined through a bridge, each with its
own ``veth0`` and host name ``node<k>``), starts one torchrun agent per namespace (``--nnodes N
--node-rank k``, static rendezvous on node 0's bed address, reachable from every namespace), and
when the target node's ranks report the fault's onset it limits that node's link with tc's token
bucket filter (netem is not available everywhere; tbf is). The fault's ground truth is the moment
tc was applied. The bed is removed on every way out: the drill's ``finally``, SIGTERM/SIGHUP
(turned into an exception while the bed is up), and, for a drill that was SIGKILLed, by the next
drill, which removes beds whose owner process is gone.

Needs root and iproute2 (``ip netns``, ``tc``) and a torchrun command; otherwise a
:class:`~ranklens.errors.ConfigError` says why (exit 2), never a silent skip.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from ranklens.analyzers.netbed import NetBed, NetBedError, unavailable_reason
from ranklens.drill.faults import DrillFault, DrillKind, truth_records
from ranklens.errors import ConfigError
from ranklens.formats.process import pid_alive

__all__ = ["DEFAULT_NODES", "LinkBed", "Throttler", "agent_commands", "needs_bed", "node_count", "torchrun_prefix"]

DEFAULT_NODES = 3
MASTER_PORT = 29500  # inside the bed's namespaces: nothing else listens there
_PREFIX = "rld"  # namespaces rld<pid>-n<k>, rld<pid>-br: the owner's pid, so stale beds can be found
# torchrun options the drill sets itself for each agent (with their values)
_OWN = {"--nnodes", "--node-rank", "--node_rank", "--master-addr", "--master_addr", "--master-port", "--master_port"}
_OWN |= {"--rdzv-backend", "--rdzv_backend", "--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-id", "--rdzv_id"}
_OWN |= {"--rdzv-conf", "--rdzv_conf", "--local-addr", "--local_addr"}
_FLAGS = {"--standalone", "-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path"}


def needs_bed(faults: Sequence[DrillFault]) -> bool:
    """True when a fault throttles a link (the drill then runs the job on the bed)."""
    return any(f.kind is DrillKind.SLOW_LINK for f in faults)


def torchrun_prefix(command: Sequence[str]) -> int | None:
    """How many leading words launch torchrun (``torchrun`` or ``python -m torch.distributed.run``),
    None when the command is not torchrun."""
    cmd = list(command)
    if cmd and os.path.basename(cmd[0]) == "torchrun":
        return 1
    for i in range(len(cmd) - 1):
        if cmd[i] == "-m" and cmd[i + 1] in ("torch.distributed.run", "torch.distributed.launch"):
            return i + 2 if os.path.basename(cmd[0]).startswith("python") else None
    return None


def _split(command: Sequence[str]) -> tuple[list[str], list[str], list[str]]:
    """The launcher words, torchrun's own options, and the script with its arguments."""
    cmd = list(command)
    n = torchrun_prefix(cmd)
    if n is None:
        raise ConfigError(
            f"a slow_link drill starts one torchrun agent per node of its network bed: the command must be "
            f"torchrun or python -m torch.distributed.run, not {cmd[0] if cmd else '(none)'!r}"
        )
    opts: list[str] = []
    i = n
    while i < len(cmd) and cmd[i].startswith("-"):
        a = cmd[i]
        if a in _FLAGS or "=" in a:
            opts.append(a)
            i += 1
            if a in ("-m", "--module"):
                break  # the module name follows
        else:
            opts += cmd[i : i + 2]
            i += 2
    return cmd[:n], opts, cmd[i:]


def _option(opts: list[str], *names: str) -> str | None:
    for i, a in enumerate(opts):
        for name in names:
            if a == name and i + 1 < len(opts):
                return opts[i + 1]
            if a.startswith(name + "="):
                return a.split("=", 1)[1]
    return None


def node_count(command: Sequence[str]) -> int:
    """Nodes of the bed for ``command``: its ``--nnodes N``, else :data:`DEFAULT_NODES`.

    Raises:
        ConfigError: not torchrun, or an elastic range (``1:4``) the bed cannot size.
    """
    _, opts, _ = _split(command)
    v = _option(opts, "--nnodes")
    if v is None:
        return DEFAULT_NODES
    if not re.fullmatch(r"\d+", v) or not 2 <= int(v) <= 16:
        raise ConfigError(f"--nnodes {v!r}: a slow_link drill's bed needs a fixed number of nodes, 2..16")
    return int(v)


def agent_commands(command: Sequence[str], bed: NetBed, *, port: int = MASTER_PORT) -> list[list[str]]:
    """One torchrun agent per node of ``bed``: ``command`` with its rendezvous options replaced by
    ``--nnodes N --node-rank k --master-addr <node 0> --master-port PORT`` (static rendezvous),
    run inside node ``k``'s namespace with host name ``node<k>``."""
    launcher, opts, script = _split(command)
    keep: list[str] = []
    i = 0
    while i < len(opts):
        a = opts[i]
        name = a.split("=", 1)[0]
        if a == "--standalone" or (name in _OWN and "=" in a):
            i += 1
        elif name in _OWN:
            i += 2
        else:
            keep.append(a)
            i += 1
    # -m (module) must stay right before the script
    module = [a for a in keep if a in ("-m", "--module")]
    keep = [a for a in keep if a not in ("-m", "--module")]
    out = []
    for k in range(bed.nodes):
        own = ["--nnodes", str(bed.nodes), "--node-rank", str(k), "--master-addr", bed.address(0)]
        own += ["--master-port", str(port)]
        out.append(bed.command(k, [*launcher, *own, *keep, *module, *script]))
    return out


def _remove_stale_beds(log: Callable[[str], None]) -> None:
    """Remove the beds of drills that are gone (SIGKILLed before their teardown)."""
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    pids = {int(m.group(1)) for m in re.finditer(rf"^{_PREFIX}(\d+)-(?:br|n\d+)\b", r.stdout, re.M)}
    for pid in sorted(pids):
        if pid != os.getpid() and not pid_alive(pid):
            log(f"drill: removing the network bed of drill process {pid}, which is gone")
            try:
                NetBed(0, prefix=f"{_PREFIX}{pid}").down()
            except NetBedError as e:
                log(f"drill: could not remove it: {e}")


class _Terminated(BaseException):
    """SIGTERM/SIGHUP while the bed is up: unwinds the drill through its ``finally`` blocks."""


class LinkBed:
    """The drill's bed of ``nodes`` namespaces, up while the context is open.

    Raises:
        ConfigError: not root, no ``ip netns`` or ``tc`` (exit 2, naming what is missing).
        NetBedError: the bed could not be built.
    """

    def __init__(self, nodes: int, *, log: Callable[[str], None] = lambda s: None) -> None:
        self.bed = NetBed(nodes, prefix=f"{_PREFIX}{os.getpid()}")
        self.log = log
        self._old: dict[int, Any] = {}

    def __enter__(self) -> NetBed:
        reason = unavailable_reason()
        if reason:
            raise ConfigError(
                f"a slow_link drill throttles a real link on a network-namespace bed, which cannot be built "
                f"here: {reason}. Run it as root on Linux with iproute2 (ip netns, tc), or drop the slow_link fault"
            )
        _remove_stale_beds(self.log)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP):
                self._old[sig] = signal.signal(sig, self._on_signal)
        try:
            self.bed.up()
        except BaseException:
            self._restore()
            raise
        self.log(f"drill: network bed up: {self.bed.nodes} nodes ({self.bed.prefix}-n0..n{self.bed.nodes - 1})")
        return self.bed

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        raise _Terminated(f"signal {signum}")

    def _restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self.bed.down()
        except NetBedError as e:
            self.log(f"drill: the network bed could not be removed: {e}")
        finally:
            self._restore()
        if isinstance(exc, _Terminated):  # end as the signal would have ended the drill
            raise SystemExit(143)


class Throttler:
    """Watches the ranks' ground truth for ``due`` slow_link faults and throttles each one's node link
    with tc at once; the onset (ground truth) is written when tc is in place, to ``<truth>/link.jsonl``."""

    def __init__(
        self, bed: NetBed, faults: list[DrillFault], truth: Path, *, log: Callable[[str], None] = lambda s: None
    ) -> None:
        self.bed, self.truth, self.log = bed, truth, log
        self.links = {i: f for i, f in enumerate(faults) if f.kind is DrillKind.SLOW_LINK}
        self.done: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ranklens-drill-throttle", daemon=True)

    def start(self) -> Throttler:
        if self.links:
            self._thread.start()
        return self

    def _due(self) -> dict[int, int]:
        due: dict[int, int] = {}
        for rec in truth_records(self.truth, "rank*.jsonl"):
            if rec.get("event") == "due" and int(rec["fault"]) in self.links:
                due.setdefault(int(rec["fault"]), int(rec.get("step", -1)))
        return due

    def _run(self) -> None:
        while not self._stop.wait(0.05) and len(self.done) < len(self.links):
            for i, step in self._due().items():
                if i in self.done:
                    continue
                self.done.add(i)
                f = self.links[i]
                try:
                    self.bed.throttle(f.node, f.detail)
                except NetBedError as e:
                    self.log(f"drill: could not throttle node {f.node}'s link: {e}")
                    continue
                rec = {"event": "onset", "fault": i, "ts_ns": time.time_ns(), "step": step, "spec": f.spec}
                with open(self.truth / "link.jsonl", "a") as out:
                    out.write(json.dumps(rec) + "\n")
                self.log(f"drill: node {f.node}'s link throttled to {f.detail} (step {step})")

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
