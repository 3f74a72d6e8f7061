"""A 3D-parallel synthetic job generator with link faults (vectorized: scales to 10,000+ ranks).

Extends the idea of :func:`tests.helpers.synthetic_job` to tensor (TP), pipeline (PP) and data
(DP) parallel groups on multi-rank nodes, with ground truth for: a slowed node network link, a
slowed link between two nodes, a compute straggler (late arrival), and a congested period that
slows every inter-node transfer.

Layout: ``rank = ((pp_i * dp + dp_i) * tp) + tp_i``, node ``rank // ranks_per_node`` (named
``node<k>``). TP groups sit within a node when ``ranks_per_node`` is a multiple of ``tp``; DP
groups span nodes; PP stages exchange activations and gradients by p2p send/recv.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from ranklens.analyzers.links import GroupInfo, LinkMetrics
from ranklens.records import arrow_schema, arrow_table

T0 = 1_790_000_000_000_000_000  # an epoch in 2026, ns


@dataclass
class SimSpec:
    """What to simulate. Bandwidths are bytes/s of the bus (see analyzers/links.py)."""

    job_id: str = "job-links"
    tp: int = 2
    pp: int = 4
    dp: int = 4
    ranks_per_node: int = 2
    steps: int = 12
    microbatches: int = 1
    tp_bytes: int = 4 << 20
    pp_bytes: int = 2 << 20
    dp_bytes: int = 16 << 20
    inter_Bps: float = 2.5e9
    intra_Bps: float = 50e9
    latency_s: float = 20e-6
    compute_s: float = 0.01
    noise: float = 0.08  # lognormal sigma of transfer and compute times
    slow_nodes: dict[int, float] = field(default_factory=dict)  # node -> bandwidth divisor
    slow_pairs: dict[tuple[int, int], float] = field(default_factory=dict)  # (node a, node b) -> divisor
    slow_from: int = 0  # link faults start at this step
    straggler_rank: int | None = None
    straggler_s: float = 0.0  # extra compute per step on the straggler
    straggler_from: int = 0
    congestion: tuple[int, int] | None = None  # steps [a, b) where every inter-node link is slow
    congestion_factor: float = 4.0
    seed: int = 0

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


def rank_of(s: SimSpec, pp_i: int, dp_i: int, tp_i: int) -> int:
    return (pp_i * s.dp + dp_i) * s.tp + tp_i


def _groups(s: SimSpec) -> dict[str, list[tuple[str, list[int]]]]:
    """Per kind, the (pg, ranks) of every group (p2p: [src, dst])."""
    out: dict[str, list[tuple[str, list[int]]]] = {"tp": [], "dp": [], "fwd": [], "bwd": []}
    for p in range(s.pp):
        for d in range(s.dp):
            if s.tp > 1:
                out["tp"].append((f"tp{p}_{d}", [rank_of(s, p, d, t) for t in range(s.tp)]))
    for p in range(s.pp):
        for t in range(s.tp):
            if s.dp > 1:
                out["dp"].append((f"dp{p}_{t}", [rank_of(s, p, d, t) for d in range(s.dp)]))
    for p in range(s.pp - 1):
        for d in range(s.dp):
            for t in range(s.tp):
                a, b = rank_of(s, p, d, t), rank_of(s, p + 1, d, t)
                out["fwd"].append((f"0/p2p:{a}->{b}", [a, b]))
                out["bwd"].append((f"0/p2p:{b}->{a}", [b, a]))
    return out


def _bus_factor(kind: str, n: int) -> float:
    return 2.0 * (n - 1) / n if kind in ("tp", "dp") else 1.0


def simulate(s: SimSpec) -> dict[str, pa.Table]:
    """Rows per table (Arrow, in the store's schema) of the simulated job."""
    rng = np.random.default_rng(s.seed)
    world = s.world
    node_of = np.arange(world) // s.ranks_per_node
    groups = _groups(s)
    phases = []
    for _ in range(s.microbatches):
        phases += [("tp", "all_reduce", s.tp_bytes), ("fwd", "send", s.pp_bytes)]
    for _ in range(s.microbatches):
        phases += [("bwd", "send", s.pp_bytes), ("tp", "all_reduce", s.tp_bytes)]
    phases.append(("dp", "all_reduce", s.dp_bytes))
    phases = [p for p in phases if groups[p[0]]]
    # per kind: member matrix (G x m), names, bandwidth of each group's path (per step: fault onset)
    mats = {k: np.array([r for _, r in v], dtype=np.int64) for k, v in groups.items() if v}
    names = {k: np.array([pg for pg, _ in v], dtype=object) for k, v in groups.items() if v}
    seqs = {pg: 0 for v in groups.values() for pg, _ in v}

    def path_bw(kind: str, step: int) -> np.ndarray:
        mat = mats[kind]
        nodes = node_of[mat]
        intra = (nodes == nodes[:, :1]).all(axis=1)
        bw = np.where(intra, s.intra_Bps, s.inter_Bps).astype(np.float64)
        if step >= s.slow_from:
            for node, div in s.slow_nodes.items():
                hit = (nodes == node).any(axis=1) & ~intra
                bw = np.where(hit, np.minimum(bw, s.inter_Bps / div), bw)
            for (a, b), div in s.slow_pairs.items():
                hit = (nodes == a).any(axis=1) & (nodes == b).any(axis=1) & ~intra
                bw = np.where(hit, np.minimum(bw, s.inter_Bps / div), bw)
        if s.congestion and s.congestion[0] <= step < s.congestion[1]:
            bw = np.where(intra, bw, bw / s.congestion_factor)
        return bw

    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("rank", "pg", "seq", "op", "nbytes", "peer", "step")}
    cols.update({"enter_ns": [], "end_ns": []})
    step_rows = []
    t = float(T0)
    per_phase_compute = s.compute_s / len(phases)
    for step in range(s.steps):
        step_start = t
        for kind, op, nbytes in phases:
            mat = mats[kind]
            g, m = mat.shape
            work = per_phase_compute * rng.lognormal(0.0, s.noise, size=(g, m))
            if s.straggler_rank is not None and step >= s.straggler_from:
                work = work + np.where(mat == s.straggler_rank, s.straggler_s / len(phases), 0.0)
            enter = t + work * 1e9
            last = enter.max(axis=1)
            xfer = (s.latency_s + nbytes * _bus_factor(kind, m) / path_bw(kind, step)) * rng.lognormal(
                0.0, s.noise, size=g
            )
            end = last[:, None] + xfer[:, None] * 1e9 + np.abs(rng.normal(0, 5e3, size=(g, m)))
            pg_names = names[kind]
            seq = np.empty(g, dtype=np.int64)
            for i, pg in enumerate(pg_names):
                seqs[pg] += 1
                seq[i] = seqs[pg]
            cols["rank"].append(mat.reshape(-1))
            cols["pg"].append(np.repeat(pg_names, m))
            cols["seq"].append(np.repeat(seq, m))
            if kind in ("fwd", "bwd"):
                cols["op"].append(np.tile(np.array(["send", "recv"], dtype=object), g))
                cols["peer"].append(mat[:, ::-1].reshape(-1))
            else:
                cols["op"].append(np.full(g * m, op, dtype=object))
                cols["peer"].append(np.full(g * m, -1, dtype=np.int64))
            cols["nbytes"].append(np.full(g * m, nbytes, dtype=np.int64))
            cols["step"].append(np.full(g * m, step, dtype=np.int64))
            cols["enter_ns"].append(enter.reshape(-1))
            cols["end_ns"].append(end.reshape(-1))
            t = float(end.max())
        step_rows.append((step, step_start, t))
    n = sum(len(x) for x in cols["rank"])
    coll = arrow_table(
        {
            "job_id": pa.array(np.full(n, s.job_id, dtype=object)),
            "attempt": pa.array(np.zeros(n, np.int32)),
            "rank": pa.array(np.concatenate(cols["rank"]).astype(np.int32)),
            "pg": pa.array(np.concatenate(cols["pg"])),
            "seq": pa.array(np.concatenate(cols["seq"])),
            "op": pa.array(np.concatenate(cols["op"])),
            "nbytes": pa.array(np.concatenate(cols["nbytes"])),
            "dtype": pa.array(np.full(n, "bfloat16", dtype=object)),
            "peer": pa.array(np.concatenate(cols["peer"]).astype(np.int32)),
            "step": pa.array(np.concatenate(cols["step"])),
            "enter_ns": pa.array(np.concatenate(cols["enter_ns"]).astype(np.int64)),
            "start_ns": pa.array(np.zeros(n, np.int64)),
            "end_ns": pa.array(np.concatenate(cols["end_ns"]).astype(np.int64)),
            "clock": pa.array(np.full(n, "cpu", dtype=object)),
            "async_op": pa.array(np.zeros(n, np.uint8)),
        },
        schema=arrow_schema("collectives"),
    )
    st = np.array([r[0] for r in step_rows], dtype=np.int64)
    starts = np.array([r[1] for r in step_rows]).astype(np.int64)
    ends = np.array([r[2] for r in step_rows]).astype(np.int64)
    k = len(st)
    steps = arrow_table(
        {
            "job_id": pa.array(np.full(k * world, s.job_id, dtype=object)),
            "attempt": pa.array(np.zeros(k * world, np.int32)),
            "rank": pa.array(np.tile(np.arange(world, dtype=np.int32), k)),
            "step": pa.array(np.repeat(st, world)),
            "start_ns": pa.array(np.repeat(starts, world)),
            "end_ns": pa.array(np.repeat(ends, world)),
            "samples": pa.array(np.full(k * world, -1, np.int64)),
            "tokens": pa.array(np.full(k * world, -1, np.int64)),
            "loss": pa.array(np.full(k * world, np.nan)),
            "grad_norm": pa.array(np.full(k * world, np.nan)),
        },
        schema=arrow_schema("steps"),
    )
    ranks = arrow_table(
        [
            {
                "job_id": s.job_id,
                "attempt": 0,
                "rank": r,
                "world_size": world,
                "host": f"node{node_of[r]}",
                "local_rank": r % s.ranks_per_node,
                "pid": 1000 + r,
                "gpu_index": r % s.ranks_per_node,
                "gpu_uuid": "",
                "pp": r // (s.tp * s.dp),
                "tp": r % s.tp,
                "dp": (r // s.tp) % s.dp,
                "started_ns": T0,
            }
            for r in range(world)
        ],
        schema=arrow_schema("ranks"),
    )
    pgs = [("0", list(range(world)), "default_pg")] + [
        (pg, members, kind) for kind in ("tp", "dp") for pg, members in groups[kind]
    ]
    process_groups = arrow_table(
        [
            {"job_id": s.job_id, "attempt": 0, "pg": pg, "name": name, "backend": "sim", "ranks": r, "created_ns": T0}
            for pg, r, name in pgs
        ],
        schema=arrow_schema("process_groups"),
    )
    return {"collectives": coll, "steps": steps, "ranks": ranks, "process_groups": process_groups}


def node_name(k: int) -> str:
    return f"node{k}"


def cell_metrics(
    groups: dict[str, GroupInfo],
    hosts: dict[int, str],
    slowdowns: dict[tuple[str, int], float],
    windows: int,
    *,
    seed: int = 0,
    nbytes: int = 1 << 20,
    job_id: str = "bed",
) -> LinkMetrics:
    """Link cells as the detector sees them, without a store: one cell per group and window (one-step
    windows, one collective each), every one at ~1 GB/s (2 % noise) moving ``nbytes``, and
    ``slowdowns[(pg, window)]`` times slower; a group named ``...p2p...`` is a send/recv pair, any
    other an all-reduce of two."""
    rng = np.random.default_rng(seed)
    rows = [(pg, w) for w in range(windows) for pg in groups]
    n = len(rows)
    bw = 1e9 * rng.lognormal(0.0, 0.02, n) / np.array([slowdowns.get(r, 1.0) for r in rows])
    ints = np.zeros(n, dtype=np.int64)
    window = np.array([w for _pg, w in rows], dtype=np.int64)
    return LinkMetrics(
        job_id=job_id,
        attempt=0,
        pg=np.array([pg for pg, _w in rows], dtype=object),
        family=np.array(["p2p" if "p2p" in pg else "all_reduce" for pg, _w in rows], dtype=object),
        size_bucket=ints + 10,
        window=window,
        count=ints + 1,
        members=ints + 2,
        bw_Bps=bw,
        xfer_s=nbytes / bw,
        sum_xfer_s=nbytes / bw,
        sum_bus_bytes=ints + float(nbytes),
        spread_s=ints + 1e-4,
        first_ns=window * 50_000_000,
        last_ns=window * 50_000_000 + 40_000_000,
        min_step=window,
        max_step=window,
        groups=groups,
        hosts=dict(hosts),
        window_steps=1,
        window_ns=0,
        sql="",
    )
