"""Checks across nodes, run by the coordinator (``ranklens.preflight``) once every node has
reported: software the same everywhere, clocks close to the coordinator's, compute rates against
the fleet's median, every node reachable, an all-reduce over all of them, and the bandwidth of a
ring of node pairs, with the slow node or link named.

The functions here work on plain data (the nodes' reports and measured numbers), so they can be
tested without a fleet; the coordinator does the measuring.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ranklens.collector.preflight.api import CheckResult, NodeReport, Status, register_fleet

__all__ = [
    "PairBandwidth",
    "clock_offset",
    "compute_vs_fleet",
    "pair_bandwidth",
    "ring_pairs",
    "software_consistency",
]

register_fleet(
    "fleet.software_consistency",
    "python, torch, its CUDA and NCCL, the NVIDIA driver and ranklens are the same on every node; "
    "a node off the majority → fail (driver or ranklens: warn)",
)
register_fleet(
    "fleet.clock_offset",
    "each node's clock against the coordinator's when its report arrived; > 100 ms → warn, > 1 s → fail",
)
register_fleet(
    "fleet.compute",
    "each node's CPU GFLOPS and each GPU's TFLOPS against the fleet's median; < 80 % → warn, < 50 % → fail",
)
register_fleet("net.reachable", "the coordinator started the node's checks through the launcher and got its report")
register_fleet(
    "net.allreduce",
    "an all-reduce over every reachable node (gloo; NCCL where every node has GPUs) completes with the "
    "right sum; one node alone: between two processes on it",
)
register_fleet(
    "net.pair_bandwidth",
    "point-to-point bandwidth of a ring of node pairs; a node whose best pair is below half the median node's best "
    "(or --min-bandwidth) → fail, naming it; a slow pair between two healthy nodes → warn on both ends",
)

# values that must agree across nodes, and how bad a disagreement is
CONSISTENT: dict[str, Status] = {
    "python": Status.FAIL,
    "torch": Status.FAIL,
    "torch_cuda": Status.FAIL,
    "nccl": Status.FAIL,
    "backends": Status.FAIL,
    "nvidia_driver": Status.WARN,
    "cuda_driver": Status.WARN,
    "ranklens": Status.WARN,
}


def _result(node: str, check: str, status: Status, message: str, **kw: Any) -> CheckResult:
    return CheckResult(check=check, node=node, status=status, message=message, **kw)


def software_consistency(reports: Sequence[NodeReport]) -> list[CheckResult]:
    """One result per node: which of its versions differ from the majority of the nodes."""
    name = "fleet.software_consistency"
    if len(reports) < 2:
        return [_result(r.node, name, Status.SKIP, "skipped: one node, nothing to compare") for r in reports]
    sw = {r.node: dict(r.facts.get("software") or {}) for r in reports}
    if not any(sw.values()):
        return [
            _result(r.node, name, Status.SKIP, "skipped: no versions reported (run the software and gpu checks too)")
            for r in reports
        ]
    majority: dict[str, str] = {}
    split: dict[str, str] = {}
    for key in CONSISTENT:
        values = Counter(str(v[key]) for v in sw.values() if key in v)
        if not values:
            continue
        (top, n), *rest = values.most_common()
        if rest and rest[0][1] == n:  # a tie: no majority to blame anyone against
            split[key] = ", ".join(f"{v} on {c}" for v, c in values.most_common())
        else:
            majority[key] = top
    out = []
    for r in reports:
        mine = sw[r.node]
        if split:
            status = Status.FAIL if any(CONSISTENT[k] is Status.FAIL for k in split) else Status.WARN
            out.append(
                _result(
                    r.node,
                    name,
                    status,
                    "no majority version: "
                    + "; ".join(f"{k}: {v} node(s)" for k, v in split.items())
                    + " (this node: "
                    + ", ".join(f"{k} {mine.get(k, '?')}" for k in split)
                    + ")",
                    threshold="== majority",
                    fix="install one set of versions on every node (one image for the fleet)",
                )
            )
            continue
        diffs = [(k, str(mine[k]), majority[k]) for k in majority if k in mine and str(mine[k]) != majority[k]]
        missing = [k for k in majority if k not in mine and CONSISTENT[k] is Status.FAIL]
        statuses = [CONSISTENT[k] for k, _, _ in diffs] + [Status.WARN for _ in missing]
        if not statuses:
            shown = ", ".join(f"{k} {v}" for k, v in sorted(majority.items()) if k in mine)
            out.append(_result(r.node, name, Status.PASS, f"same as the fleet ({shown})", threshold="== majority"))
            continue
        status = Status.FAIL if Status.FAIL in statuses else Status.WARN
        parts = [f"{k} {mine_v} (fleet: {maj})" for k, mine_v, maj in diffs] + [f"{k} not reported" for k in missing]
        out.append(
            _result(
                r.node,
                name,
                status,
                "differs from the fleet: " + "; ".join(parts),
                threshold="== majority",
                fix="install the fleet's versions on this node (one image for every node)",
            )
        )
    return out


def clock_offset(
    reports: Sequence[NodeReport],
    received_ns: Mapping[str, int],
    *,
    warn_ms: float = 100.0,
    fail_ms: float = 1000.0,
    in_process: bool = False,
) -> list[CheckResult]:
    """One result per node: its clock (stamped as it printed its report) minus the coordinator's
    when the report arrived. The launcher's delay makes a true offset look up to that delay
    negative: the thresholds are far above a launcher's milliseconds."""
    name = "fleet.clock_offset"
    if in_process:
        return [
            _result(r.node, name, Status.SKIP, "skipped: checked in-process (the coordinator's own clock)")
            for r in reports
        ]
    out = []
    for r in reports:
        node_ns = int(r.facts.get("clock_ns") or 0)
        if not node_ns or r.node not in received_ns:
            out.append(_result(r.node, name, Status.SKIP, "skipped: the node's report has no clock stamp"))
            continue
        off_ms = (node_ns - received_ns[r.node]) / 1e6
        status = Status.FAIL if abs(off_ms) > fail_ms else Status.WARN if abs(off_ms) > warn_ms else Status.PASS
        out.append(
            _result(
                r.node,
                name,
                status,
                f"clock {off_ms:+.1f} ms from the coordinator's",
                value=round(off_ms, 3),
                unit="ms",
                threshold=f"|offset| <= {warn_ms:g} ms (fail > {fail_ms:g} ms)",
                fix=""
                if status is Status.PASS
                else "synchronise the node's clock (chrony / PTP): cross-node timelines and timeouts assume it",
            )
        )
    return out


def compute_vs_fleet(
    reports: Sequence[NodeReport], *, warn_ratio: float = 0.8, fail_ratio: float = 0.5
) -> list[CheckResult]:
    """Each node's CPU burn and each of its GPUs' burn against the fleet's median.

    The CPU comparison needs two nodes on different machines: nodes that share a boot id (network
    namespaces or containers of one host) share its CPUs, and their burns ran at the same time.
    GPUs are compared across every GPU of every node (one node with 8 GPUs compares its 8).
    """
    name = "fleet.compute"
    out: list[CheckResult] = []
    cpu = {r.node: float(r.facts["cpu_gflops"]) for r in reports if r.facts.get("cpu_gflops")}
    boots = {r.facts.get("boot_id") or r.node for r in reports if r.node in cpu}  # no boot id: assume its own machine
    gpus = {(r.node, g): float(v) for r in reports for g, v in sorted((r.facts.get("gpu_tflops") or {}).items()) if v}

    def judge(value: float, median: float) -> Status:
        ratio = value / median if median > 0 else 1.0
        return Status.FAIL if ratio < fail_ratio else Status.WARN if ratio < warn_ratio else Status.PASS

    thr = f">= {warn_ratio:.0%} of the fleet's median (fail < {fail_ratio:.0%})"
    if len(cpu) >= 2 and len(boots) == len(cpu):
        med = statistics.median(cpu.values())
        for node, v in cpu.items():
            st = judge(v, med)
            out.append(
                _result(
                    node,
                    name,
                    st,
                    f"CPU {v:.1f} GFLOPS, {v / med:.0%} of the fleet's median {med:.1f}",
                    subject="cpu",
                    value=round(v / med, 3),
                    threshold=thr,
                    fix=""
                    if st is Status.PASS
                    else "a slow CPU paces the input pipeline: check the governor, "
                    "throttling and other load on this node",
                )
            )
    elif len(cpu) >= 2:
        for node in cpu:
            out.append(
                _result(
                    node,
                    name,
                    Status.SKIP,
                    "skipped: the nodes share one machine (same boot id), their CPU burns are not independent",
                    subject="cpu",
                )
            )
    if len(gpus) >= 2:
        med = statistics.median(gpus.values())
        for (node, g), v in gpus.items():
            st = judge(v, med)
            out.append(
                _result(
                    node,
                    name,
                    st,
                    f"{g} {v:.1f} TFLOPS, {v / med:.0%} of the fleet's median {med:.1f}",
                    subject=g,
                    value=round(v / med, 3),
                    threshold=thr,
                    fix=""
                    if st is Status.PASS
                    else "a slow GPU paces every rank: check its clocks, power cap and "
                    "throttle reasons (nvidia-smi -q -d PERFORMANCE), then drain it",
                )
            )
    if not out:
        return [
            _result(r.node, name, Status.SKIP, "skipped: fewer than two nodes (or GPUs) to compare") for r in reports
        ]
    seen = {x.node for x in out}
    out += [
        _result(r.node, name, Status.SKIP, "skipped: nothing measured on this node")
        for r in reports
        if r.node not in seen
    ]
    return out


def ring_pairs(nodes: Sequence[str]) -> list[tuple[str, str]]:
    """Each node paired with the next, the last with the first: every node in two pairs (with three
    nodes or more), so a node whose two pairs are slow is named, not its neighbours."""
    n = list(nodes)
    if len(n) < 2:
        return []
    if len(n) == 2:
        return [(n[0], n[1])]
    return [(n[i], n[(i + 1) % len(n)]) for i in range(len(n))]


@dataclass(frozen=True)
class PairBandwidth:
    """The measured bandwidth between nodes ``a`` and ``b`` (bytes/s, both directions' sends)."""

    a: str
    b: str
    Bps: float


def pair_bandwidth(
    nodes: Sequence[str], pairs: Sequence[PairBandwidth], *, slow_ratio: float = 2.0, min_Bps: float = 0.0
) -> list[CheckResult]:
    """Judge a ring of pairs.

    A node's *reach* is its best pair's bandwidth. The fleet's reference is the median reach (most
    nodes are healthy, so one slow node cannot drag it down, and one lucky pair cannot lift it).
    A node whose reach is below ``1/slow_ratio`` of the reference (or below ``min_Bps``) has every
    link slow: it is the culprit (fail), provided two or more of those links go to peers that are
    not already culprits (judged slowest first, so a culprit's neighbour is not blamed for the
    culprit's slowness). A slow pair between two nodes that are not culprits is a link between them
    (warn on both ends). With two nodes there is one pair and no reference but
    ``min_Bps``: a slow pair cannot say which end (warn on both).
    """
    name = "net.pair_bandwidth"
    if not pairs:
        return [_result(n, name, Status.SKIP, "skipped: one node, no pair to measure") for n in nodes]
    mine = {n: [p for p in pairs if n in (p.a, p.b)] for n in nodes}
    reach = {n: max(p.Bps for p in ps) for n, ps in mine.items() if ps}
    ref = statistics.median(reach.values())
    limit = max(ref / slow_ratio, min_Bps) if len(pairs) > 1 else min_Bps

    # Slowest first, each culprit explains away its own pairs: a neighbour of a culprit whose one
    # other pair also measured slow (noise on a loaded host, or a bad path) has a slow *link*, not
    # a slow NIC, unless two or more of its pairs with healthy peers are slow.
    culprits: set[str] = set()
    if len(pairs) > 1:
        for n in sorted(reach, key=lambda k: reach[k]):
            if reach[n] >= limit:
                break
            if sum((p.b if p.a == n else p.a) not in culprits for p in mine[n]) >= 2:
                culprits.add(n)
    slow_links = [p for p in pairs if p.Bps < limit and p.a not in culprits and p.b not in culprits]
    if len(pairs) == 1:
        thr = f">= {min_Bps / 1e6:.0f} MB/s (--min-bandwidth; one pair has nothing to compare with)"
    else:
        thr = f">= {limit / 1e6:.0f} MB/s (1/{slow_ratio:g} of the median node's best pair, {ref / 1e6:.0f} MB/s" + (
            f"; floor {min_Bps / 1e6:.0f} MB/s)" if min_Bps else ")"
        )

    def mbps(p: PairBandwidth) -> str:
        return f"{p.a}<->{p.b} {p.Bps / 1e6:.1f} MB/s"

    out = []
    for n in nodes:
        if not mine.get(n):
            out.append(_result(n, name, Status.SKIP, "skipped: not in a measured pair"))
            continue
        fix = ""
        links = [p for p in slow_links if n in (p.a, p.b)]
        if n in culprits:
            st = Status.FAIL
            msg = f"every link of {n} is slow: {', '.join(map(mbps, mine[n]))}; this node's network is the culprit"
            fix = "check the node's NIC (link speed, errors: ethtool -S, ibstat) and its switch port; drain the node"
        elif links:
            st = Status.WARN
            p = links[0]
            msg = (
                f"the only pair is slow: {mbps(p)} (two nodes cannot say which end)"
                if len(pairs) == 1
                else f"slow link {mbps(p)}; both ends are fine with their other peers: the path between them"
            )
            fix = "check the path between the two nodes (switch, cabling, routing)"
        else:
            st = Status.PASS
            msg = ", ".join(map(mbps, mine[n]))
            blamed = sorted({(p.b if p.a == n else p.a) for p in mine[n] if p.Bps < limit} & culprits)
            if blamed:
                msg += f" (slow only towards {', '.join(blamed)})"
        out.append(_result(n, name, st, msg, value=round(reach[n] / 1e6, 3), unit="MB/s", threshold=thr, fix=fix))
    return out
