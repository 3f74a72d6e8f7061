"""Targeted confirmation of a suspected link: a short pairwise bandwidth test, outside the job.

When the link analyzer suspects a link, :func:`run_probe` measures only the suspect pairs and a
healthy reference pair with torch.distributed point-to-point sends (gloo over TCP) in separate
processes: one per node involved, started by a *launcher* that knows how to run a command on a
node (locally, ``ip netns exec`` on the test bed, ``ssh``/``srun`` on a cluster). Each direction
of each pair sends ``nbytes`` ``iters`` times, each send acknowledged by a 4-byte reply, so the
time covers delivery. :func:`attach_probe` records the result as evidence on the finding.

Run by the launcher as ``python -m ranklens.analyzers.probe --rank R --world W --master A:P
--plan plan.json --out DIR``; the worker imports torch, never the caller.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ranklens.analyzers.findings import Finding
from ranklens.errors import RanklensError

__all__ = [
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


class ProbeError(RanklensError):
    """The probe could not run (a worker failed or timed out); the message has its output."""


@dataclass(frozen=True)
class ProbePair:
    """Measure between nodes ``a`` and ``b`` (both directions); ``role``: suspect or reference."""

    a: str
    b: str
    role: str = "suspect"

    def __post_init__(self) -> None:
        if self.a == self.b:
            raise ValueError(f"a probe pair needs two different nodes, got {self.a!r} twice")
        if self.role not in ("suspect", "reference"):
            raise ValueError(f"role={self.role!r}; allowed: suspect, reference")


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
class ProbeReport:
    """All measurements, the median bandwidth of suspect and reference directions, and the verdict:
    ``confirmed`` when the reference is at least ``confirm_ratio`` times faster than the suspect."""

    results: tuple[ProbeResult, ...]
    confirm_ratio: float = 2.0

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
) -> ProbeReport:
    """Measure ``pairs`` with one process per node, started through ``launcher``.

    Args:
        pairs: what to measure (see :func:`plan_probe`).
        addresses: node -> address the other nodes reach it at; the first node of the first pair
            hosts the rendezvous.
        launcher: turns ``(node, argv)`` into a command that runs ``argv`` on that node.
        env: extra environment per node (e.g. ``GLOO_SOCKET_IFNAME``).
        nbytes, iters: each direction sends ``nbytes`` ``iters`` times (after one warm-up); size
            them so that a healthy send takes milliseconds at least.
        port: rendezvous port on the first node (0: a free port of this machine).
        timeout_s: the whole probe's limit.
        python: interpreter on the nodes.
        confirm_ratio: see :class:`ProbeReport`.

    Raises:
        ProbeError: a worker failed or the probe timed out (workers are stopped).
    """
    if not pairs:
        raise ValueError("no pairs to probe")
    nodes: list[str] = []
    for p in pairs:
        for n in (p.a, p.b):
            if n not in nodes:
                nodes.append(n)
    missing = [n for n in nodes if n not in addresses]
    if missing:
        raise ValueError(f"no address for node(s) {missing}")
    rank = {n: i for i, n in enumerate(nodes)}
    port = port or _free_port()
    plan = {
        "nbytes": int(nbytes),
        "iters": int(iters),
        "timeout_s": float(timeout_s),
        "steps": [[rank[s], rank[d], p.role, s, d] for p in pairs for s, d in ((p.a, p.b), (p.b, p.a))],
    }
    with tempfile.TemporaryDirectory(prefix="ranklens-probe-") as tmp:
        plan_path = Path(tmp) / "plan.json"
        plan_path.write_text(json.dumps(plan))
        procs = []
        for n in nodes:
            argv = [python, "-m", "ranklens.analyzers.probe", "--rank", str(rank[n]), "--world", str(len(nodes))]
            argv += ["--master", f"{addresses[nodes[0]]}:{port}", "--plan", str(plan_path), "--out", tmp]
            penv = {**os.environ, "OMP_NUM_THREADS": "1", **(env(n) if env else {})}
            procs.append(
                subprocess.Popen(
                    launcher(n, argv), env=penv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
                )
            )
        deadline = time.monotonic() + timeout_s
        outs = []
        try:
            for proc in procs:
                outs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for proc in procs:
                proc.kill()
            for proc in procs:
                proc.wait()
            raise ProbeError(f"probe timed out after {timeout_s:.0f} s") from None
        failed = [(n, proc.returncode, o) for n, proc, o in zip(nodes, procs, outs) if proc.returncode != 0]
        if failed:
            n, rc, out = failed[0]
            raise ProbeError(f"probe worker on {n} exited {rc}: {out[-2000:]}")
        results = []
        for i in range(len(nodes)):
            for r in json.loads((Path(tmp) / f"rank{i}.json").read_text()):
                results.append(ProbeResult(r["src"], r["dst"], r["role"], r["nbytes"], tuple(r["iter_seconds"])))
    return ProbeReport(tuple(results), confirm_ratio)


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
    return dataclasses.replace(finding, confidence=round(conf, 3), evidence=ev, title=f"{finding.title}; {clause}")


# --------------------------------------------------------------------------------------- worker


def _worker(args: argparse.Namespace) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    plan = json.loads(Path(args.plan).read_text())
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master}",
        rank=args.rank,
        world_size=args.world,
        timeout=timedelta(seconds=plan["timeout_s"]),
    )
    me = args.rank
    buf = torch.ones(max(1, plan["nbytes"] // 4), dtype=torch.float32)
    ack = torch.zeros(1, dtype=torch.float32)
    out = []
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
                times.append(time.perf_counter() - t0)
            out.append(
                {"src": src_node, "dst": dst_node, "role": role, "nbytes": int(buf.numel() * 4), "iter_seconds": times}
            )
        elif me == dst:
            for _ in range(plan["iters"] + 1):
                dist.recv(buf, src=src)
                dist.send(ack, dst=src)
    dist.barrier()
    Path(args.out, f"rank{me}.json").write_text(json.dumps(out))
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of a probe worker (run by :func:`run_probe` through a launcher)."""
    p = argparse.ArgumentParser(prog="python -m ranklens.analyzers.probe", description="probe worker (one per node)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master", required=True, help="address:port of rank 0")
    p.add_argument("--plan", required=True)
    p.add_argument("--out", required=True)
    return _worker(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
