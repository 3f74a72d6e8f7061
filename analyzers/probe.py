"""Targeted confirmation of a suspected link: a short pairwise bandwidth test, outside the job.

When the link analyzer suspects a link, :func:`run_probe` measures only the suspect pairs and a
healthy reference pair with torch.distributed point-to-point sends (gloo over TCP) in separate
processes: one per node involved, started by a *launcher* that knows how to run a command on a
node (locally, ``ip netns exec`` on the test bed, ``ssh``/``srun`` on a cluster). Each direction
of each pair sends ``nbytes`` ``iters`` times, each send acknowledged by a 4-byte reply, so the
time covers delivery. :func:`attach_probe` records the result as evidence on the finding.

Run by the launcher as ``python -m ranklens.analyzers.probe --rank R --world W --master A:P
--plan JSON``; the worker imports torch, never the caller. Nothing goes through a file system the
caller and the nodes would have to share (issue 22 #11: a remote node has its own ``/tmp``): the
plan is passed inline on the command line, rank 0 binds the rendezvous port *on its own node* (a
free one there, unless a port is given) and prints ``RANKLENS-PROBE-PORT <port>`` before the other
workers are started with it, and every worker prints its measurements as one
``RANKLENS-PROBE-RESULT <json>`` line on its standard output, which the launcher (``ssh``,
``srun``, ``kubectl exec``) carries back.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ranklens.analyzers.findings import Finding
from ranklens.errors import RanklensError

__all__ = [
    "AllreduceResult",
    "ProbeError",
    "ProbePair",
    "ProbeReport",
    "ProbeResult",
    "attach_probe",
    "local_launcher",
    "plan_probe",
    "run_probe",
]

Launcher = Callable[[str, list[str]], list[str]]  # (node, argv) -> the command that runs argv on node

PORT_TAG = "RANKLENS-PROBE-PORT"
RESULT_TAG = "RANKLENS-PROBE-RESULT"


class ProbeError(RanklensError):
    """The probe could not run (a worker failed or timed out); the message has its output."""


# suspect / reference: confirming a finding; survey: one of many pairs compared with each other
# (the pre-flight check's ring of pairs)
ROLES = ("suspect", "reference", "survey")


@dataclass(frozen=True)
class ProbePair:
    """Measure between nodes ``a`` and ``b`` (both directions); ``role``: suspect or reference."""

    a: str
    b: str
    role: str = "suspect"

    def __post_init__(self) -> None:
        if self.a == self.b:
            raise ValueError(f"a probe pair needs two different nodes, got {self.a!r} twice")
        if self.role not in ROLES:
            raise ValueError(f"role={self.role!r}; allowed: {', '.join(ROLES)}")


@dataclass(frozen=True)
class ProbeResult:
    """One direction of one pair: ``nbytes`` sent ``len(iter_seconds)`` times, each acknowledged.
    The bandwidth uses the median send (robust to one disturbed send)."""

    src: str
    dst: str
    role: str
    nbytes: int
    iter_seconds: tuple[float, ...]

    @property
    def bandwidth_Bps(self) -> float:
        t = float(np.median(self.iter_seconds)) if self.iter_seconds else 0.0
        return self.nbytes / t if t > 0 else float("inf")


@dataclass(frozen=True)
class AllreduceResult:
    """One node's view of the all-reduce over every node of the probe: ``nbytes`` summed
    ``len(iter_seconds)`` times; ``correct`` when every element came back equal to the world size."""

    node: str
    nbytes: int
    iter_seconds: tuple[float, ...]
    correct: bool
    backend: str = "gloo"

    @property
    def seconds(self) -> float:
        return float(np.median(self.iter_seconds)) if self.iter_seconds else float("nan")

    @property
    def algbw_Bps(self) -> float:
        t = self.seconds
        return self.nbytes / t if t > 0 else float("inf")


@dataclass(frozen=True)
class ProbeReport:
    """All measurements, the median bandwidth of suspect and reference directions, and the verdict:
    ``confirmed`` when the reference is at least ``confirm_ratio`` times faster than the suspect."""

    results: tuple[ProbeResult, ...]
    confirm_ratio: float = 2.0
    allreduce: tuple[AllreduceResult, ...] = ()

    def _median(self, role: str) -> float:
        vals = [r.bandwidth_Bps for r in self.results if r.role == role]
        return float(np.median(vals)) if vals else float("nan")

    @property
    def suspect_Bps(self) -> float:
        return self._median("suspect")

    @property
    def reference_Bps(self) -> float:
        return self._median("reference")

    @property
    def ratio(self) -> float:
        s, r = self.suspect_Bps, self.reference_Bps
        return r / s if s > 0 and np.isfinite(r) else float("nan")

    @property
    def confirmed(self) -> bool:
        return bool(np.isfinite(self.ratio) and self.ratio >= self.confirm_ratio)

    def to_evidence(self) -> dict[str, Any]:
        """The report as JSON-able evidence for a finding."""
        return {
            "method": "torch.distributed gloo send/recv, each send acknowledged, outside the job",
            "results": [
                {**dataclasses.asdict(r), "bandwidth_MBps": round(r.bandwidth_Bps / 1e6, 3)} for r in self.results
            ],
            "suspect_MBps": round(self.suspect_Bps / 1e6, 3),
            "reference_MBps": round(self.reference_Bps / 1e6, 3),
            "ratio": round(self.ratio, 2) if np.isfinite(self.ratio) else None,
            "confirm_ratio": self.confirm_ratio,
            "confirmed": self.confirmed,
        }


def local_launcher(node: str, argv: list[str]) -> list[str]:
    """Runs every endpoint on this machine (for tests and single-host checks)."""
    return argv


def plan_probe(finding: Finding, nodes: list[str]) -> list[ProbePair]:
    """Suspect pairs and one healthy reference pair for a ``slow_link`` finding.

    A node's network link is probed against the first healthy node; a link between two nodes is
    probed directly; the reference is two healthy nodes. ``nodes`` are the job's nodes.
    """
    link_nodes = list(finding.evidence.get("nodes") or sorted({s.node for s in finding.suspects if s.node}))
    if not link_nodes:
        raise ValueError(f"finding {finding.id} names no node to probe")
    healthy = [n for n in nodes if n not in link_nodes]
    if len(link_nodes) >= 2 and finding.evidence.get("link_kind") == "pair":
        pairs = [ProbePair(link_nodes[0], link_nodes[1])]
    else:
        if not healthy:
            raise ValueError("no healthy node to probe the suspect against")
        pairs = [ProbePair(link_nodes[0], healthy[0])]
    if len(healthy) >= 2:
        pairs.append(ProbePair(healthy[-2], healthy[-1], "reference"))
    return pairs


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class _Worker:
    """One launched worker: its output read by threads (so no pipe fills), the tagged lines kept."""

    def __init__(self, node: str, cmd: list[str], env: dict[str, str], result_tag: str = "") -> None:
        self.node = node
        self.result_tag = result_tag or RESULT_TAG
        self.proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.lines: list[str] = []
        self._port: int | None = None
        self._result: Any = None
        self._tagged = threading.Event()
        self._threads = [
            threading.Thread(target=self._read, args=(stream,), daemon=True)
            for stream in (self.proc.stdout, self.proc.stderr)
        ]
        for t in self._threads:
            t.start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            line = line.rstrip("\n")
            tag, _, rest = line.partition(" ")
            if tag == PORT_TAG and rest.strip().isascii() and rest.strip().isdigit():
                self._port = int(rest)
                self._tagged.set()
            elif tag == self.result_tag:
                try:
                    self._result = json.loads(rest)
                except ValueError:
                    self.lines.append(line)
            else:
                self.lines.append(line)
        stream.close()
        if stream is self.proc.stdout:  # no more output: nobody waits for a port that will not come
            self._tagged.set()

    def wait_for_port(self, deadline: float) -> int | None:
        self._tagged.wait(max(0.0, deadline - time.monotonic()))
        return self._port

    def wait(self, deadline: float) -> bool:
        try:
            self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
        for t in self._threads:
            t.join(timeout=max(0.1, deadline - time.monotonic()))
        return True

    def result(self) -> Any:
        return self._result

    def output(self) -> str:
        return "\n".join(self.lines)[-2000:]

    def stop(self, grace_s: float = 2.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``: a launcher (ssh, srun) given the chance to exit
        closes its session, so the remote worker is hung up on instead of left running."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait()
        for t in self._threads:
            t.join(timeout=5)


def run_probe(
    pairs: list[ProbePair],
    addresses: dict[str, str],
    *,
    launcher: Launcher = local_launcher,
    env: Callable[[str], dict[str, str]] | None = None,
    nbytes: int = 16 << 20,
    iters: int = 5,
    port: int = 0,
    timeout_s: float = 120.0,
    python: str = sys.executable,
    confirm_ratio: float = 2.0,
    allreduce_bytes: int = 0,
    backend: str = "gloo",
) -> ProbeReport:
    """Measure ``pairs`` with one process per node, started through ``launcher``.

    Args:
        pairs: what to measure (see :func:`plan_probe`).
        addresses: node -> address the other nodes reach it at; the first node of the first pair
            hosts the rendezvous (its worker is started first and reports the port it bound).
        launcher: turns ``(node, argv)`` into a command that runs ``argv`` on that node.
        env: extra environment per node (e.g. ``GLOO_SOCKET_IFNAME``), set on the node by the command.
        nbytes, iters: each direction sends ``nbytes`` ``iters`` times (after one warm-up); size
            them so that a healthy send takes milliseconds at least.
        port: rendezvous port on the first node (0: a free port that the first node's worker picks
            there; nothing is assumed about the caller's machine).
        timeout_s: the whole probe's limit.
        python: interpreter on the nodes.
        confirm_ratio: see :class:`ProbeReport`.
        allreduce_bytes: after the pairs, all-reduce this many bytes over every node ``iters``
            times and check the sum (0: no all-reduce); see :class:`AllreduceResult`.
        backend: ``gloo`` (CPU tensors, TCP) or ``nccl`` (tensors on each node's first GPU).

    Raises:
        ProbeError: a worker failed or the probe timed out (workers are stopped).
    """
    if not pairs:
        raise ValueError("no pairs to probe")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}; allowed: gloo, nccl")
    nodes: list[str] = []
    for p in pairs:
        for n in (p.a, p.b):
            if n not in nodes:
                nodes.append(n)
    missing = [n for n in nodes if n not in addresses]
    if missing:
        raise ValueError(f"no address for node(s) {missing}")
    rank = {n: i for i, n in enumerate(nodes)}
    plan = {
        "nbytes": int(nbytes),
        "iters": int(iters),
        "timeout_s": float(timeout_s),
        "steps": [[rank[s], rank[d], p.role, s, d] for p in pairs for s, d in ((p.a, p.b), (p.b, p.a))],
        "backend": backend,
        "nodes": nodes,
    }
    if allreduce_bytes:
        plan["allreduce_bytes"] = int(allreduce_bytes)
    master = addresses[nodes[0]]
    deadline = time.monotonic() + timeout_s
    workers: list[_Worker] = []

    def start(n: str, master_at: str) -> _Worker:
        # the node's environment travels in the command (``env K=V``): ssh and srun do not pass on ours
        node_env = {"OMP_NUM_THREADS": "1", **(env(n) if env else {})}
        argv = ["env", *(f"{k}={v}" for k, v in node_env.items()), python, "-m", "ranklens.analyzers.probe"]
        argv += ["--rank", str(rank[n]), "--world", str(len(nodes)), "--master", master_at]
        argv += ["--plan", json.dumps(plan, separators=(",", ":"))]
        w = _Worker(n, launcher(n, argv), {**os.environ, **node_env})
        workers.append(w)
        return w

    try:
        # rank 0 first: it binds the rendezvous port on its node and says which
        first = start(nodes[0], _host_port(master, int(port)))
        bound = first.wait_for_port(deadline)
        if bound is None:
            first.stop()
            if first.proc.returncode not in (None, 0):
                raise ProbeError(f"probe worker on {nodes[0]} exited {first.proc.returncode}: {first.output()}")
            raise ProbeError(
                f"probe timed out after {timeout_s:.0f} s: the worker on {nodes[0]} did not open the rendezvous "
                f"port: {first.output()}"
            )
        for n in nodes[1:]:
            start(n, _host_port(master, bound))
        for w in workers:
            if not w.wait(deadline):
                raise ProbeError(f"probe timed out after {timeout_s:.0f} s (worker on {w.node}): {w.output()}")
        failed = [w for w in workers if w.proc.returncode != 0]
        if failed:
            w = failed[0]
            raise ProbeError(f"probe worker on {w.node} exited {w.proc.returncode}: {w.output()}")
        results = []
        allreduce = []
        for w in workers:
            doc = w.result()
            if doc is None:
                raise ProbeError(f"probe worker on {w.node} printed no {RESULT_TAG} line: {w.output()}")
            for r in doc:
                if r.get("kind") == "allreduce":
                    allreduce.append(
                        AllreduceResult(w.node, r["nbytes"], tuple(r["iter_seconds"]), bool(r["correct"]), backend)
                    )
                else:
                    results.append(ProbeResult(r["src"], r["dst"], r["role"], r["nbytes"], tuple(r["iter_seconds"])))
    finally:
        for w in workers:
            w.stop()
    return ProbeReport(tuple(results), confirm_ratio, tuple(allreduce))


def attach_probe(finding: Finding, report: ProbeReport) -> Finding:
    """The finding with the probe recorded as ``evidence["probe"]``; a confirmation raises its
    confidence (to at least 0.95), a refutation halves it; the title says which."""
    ev = {**finding.evidence, "probe": report.to_evidence()}
    s, r = report.suspect_Bps / 1e6, report.reference_Bps / 1e6
    if report.confirmed:
        conf = max(finding.confidence, 0.95)
        clause = f"probe confirmed: {s:.1f} MB/s vs {r:.1f} MB/s on a healthy pair"
    else:
        conf = finding.confidence * 0.5
        clause = f"probe did not confirm: {s:.1f} MB/s vs {r:.1f} MB/s on a healthy pair"
    # a new version of the finding: newer than the one it revises (readers take the newest per id)
    updated = max(time.time_ns(), finding.updated_ns + 1)
    return dataclasses.replace(
        finding, confidence=round(conf, 3), evidence=ev, title=f"{finding.title}; {clause}", updated_ns=updated
    )


# --------------------------------------------------------------------------------------- worker


def _listen(port: int) -> Any:
    """A listening socket on every address of this node (``port`` 0: a free one)."""
    import socket

    if socket.has_dualstack_ipv6():
        try:
            return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
        except OSError:  # IPv6 off on this node (or in its network namespace)
            pass
    return socket.create_server(("0.0.0.0", port))


def _worker(args: argparse.Namespace) -> int:
    plan = json.loads(args.plan)
    host, _, port = args.master.rpartition(":")
    host = host.strip("[]")
    listener = None
    if args.rank == 0:
        # the rendezvous lives on this node: bind here (port 0: a free port of *this* node) and say
        # which at once, before the slow torch import, so the caller can start the others meanwhile
        listener = _listen(int(port))
        port = str(listener.getsockname()[1])
        print(f"{PORT_TAG} {port}", flush=True)

    from datetime import timedelta

    import torch
    import torch.distributed as dist

    timeout = timedelta(seconds=plan["timeout_s"])
    if listener is not None:
        try:
            store = dist.TCPStore(
                host, int(port), args.world, is_master=True, timeout=timeout, wait_for_workers=False,
                master_listen_fd=listener.fileno(),
            )  # fmt: skip
        except TypeError:  # a torch without master_listen_fd: let it bind the port itself
            listener.close()
            listener = None
            store = dist.TCPStore(host, int(port), args.world, is_master=True, timeout=timeout, wait_for_workers=False)
    else:
        store = dist.TCPStore(host, int(port), args.world, is_master=False, timeout=timeout)
    backend = plan.get("backend", "gloo")
    device = torch.device("cpu")
    if backend == "nccl":  # one GPU per node is enough to measure the node's links
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=args.rank, world_size=args.world, timeout=timeout)

    def sync() -> None:  # NCCL returns before the transfer is done: time to completion
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    me = args.rank
    buf = torch.ones(max(1, plan["nbytes"] // 4), dtype=torch.float32, device=device)
    ack = torch.zeros(1, dtype=torch.float32, device=device)
    out: list[dict[str, Any]] = []
    for src, dst, role, src_node, dst_node in plan["steps"]:
        dist.barrier()
        if me == src:
            dist.send(buf, dst=dst)  # warm-up: connection set-up is not bandwidth
            dist.recv(ack, src=dst)
            times = []
            for _ in range(plan["iters"]):
                t0 = time.perf_counter()
                dist.send(buf, dst=dst)
                dist.recv(ack, src=dst)
                sync()
                times.append(time.perf_counter() - t0)
            out.append(
                {"src": src_node, "dst": dst_node, "role": role, "nbytes": int(buf.numel() * 4), "iter_seconds": times}
            )
        elif me == dst:
            for _ in range(plan["iters"] + 1):
                dist.recv(buf, src=src)
                dist.send(ack, dst=src)
            sync()
    if plan.get("allreduce_bytes"):
        out.append(_allreduce(dist, torch, plan, args.world, device, sync))
    dist.barrier()
    print(f"{RESULT_TAG} {json.dumps(out)}", flush=True)  # back to the caller over the launcher's stdout
    dist.destroy_process_group()
    return 0


def _allreduce(dist: Any, torch: Any, plan: dict[str, Any], world: int, device: Any, sync: Any) -> dict[str, Any]:
    """All-reduce ``allreduce_bytes`` over every worker ``iters`` times (after one warm-up), each
    checked: ones summed over the world must come back as ``world`` everywhere."""
    n = max(1, int(plan["allreduce_bytes"]) // 4)
    t = torch.ones(n, dtype=torch.float32, device=device)
    dist.all_reduce(t)
    sync()
    correct = bool((t == world).all().item())
    times = []
    for _ in range(plan["iters"]):
        t.fill_(1.0)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        sync()
        times.append(time.perf_counter() - t0)
        correct = correct and bool((t == world).all().item())
    return {"kind": "allreduce", "nbytes": n * 4, "iter_seconds": times, "correct": correct}


def main(argv: list[str] | None = None) -> int:
    """Entry point of a probe worker (run by :func:`run_probe` through a launcher)."""
    p = argparse.ArgumentParser(prog="python -m ranklens.analyzers.probe", description="probe worker (one per node)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master", required=True, help="address:port of rank 0 (rank 0 with port 0: a free one)")
    p.add_argument("--plan", required=True, help="the plan, as JSON text")
    return _worker(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
