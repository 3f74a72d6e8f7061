"""A simulated job written straight into a store: the dashboards' scale benchmark and query tests.

:func:`simulate_job` synthesises, with numpy, the rows a traced job of any size would produce —
ranks on nodes, steps, phases, the collective arrival ledger (world all-reduces, node-local
tensor-parallel groups, two-member pipeline pairs across nodes), heartbeats, GPU samples and events,
log lines — with an optional straggler rank, slow node link and hang. Arrivals and completions follow
the ledger's rules (a collective completes after its last member arrives), so the analyzers and the
dashboards see what they would see on a real job. It is a fake for scale only: correctness on real
data is tested with ``ranklens.demo``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from ranklens.records import arrow_schema
from ranklens.schema import TABLES
from ranklens.store.api import Store

__all__ = ["SimulatedJob", "simulate_job"]

S = 1_000_000_000  # ns per second


@dataclass(frozen=True)
class SimulatedJob:
    """What :func:`simulate_job` wrote."""

    job_id: str
    ranks: int
    steps: int
    ranks_per_node: int
    slow_rank: int | None
    slow_from_step: int
    slow_node: str | None
    hang_rank: int | None
    rows: dict[str, int]
    first_ns: int
    last_ns: int

    def host(self, rank: int) -> str:
        return _host(rank // self.ranks_per_node)


def _host(node: int) -> str:
    return f"node-{node:05d}"


def _const(value: object, n: int, type_: pa.DataType) -> pa.Array:
    return pa.array([value], type=type_).take(pa.array(np.zeros(n, dtype=np.int64)))


def simulate_job(
    store: Store,
    *,
    ranks: int = 64,
    steps: int = 20,
    ranks_per_node: int = 8,
    slow_rank: int | None = None,
    slowdown: float = 1.4,
    slow_from_step: int = 5,
    slow_link_node: int | None = None,
    hang_rank: int | None = None,
    step_s: float = 1.0,
    gpu_sample_s: float = 5.0,
    job_id: str | None = None,
    seed: int = 0,
    chunk_steps: int = 10,
) -> SimulatedJob:
    """Write a simulated job attempt into ``store`` and describe it.

    Args:
        ranks: world size; ``ranks_per_node`` consecutive ranks share a node (and a TP group).
        steps: training steps.
        slow_rank: a rank whose compute is ``slowdown`` times slower from ``slow_from_step``.
        slow_link_node: a node whose links run at a quarter of the others' bandwidth.
        hang_rank: after the last step, this rank never enters the next world all-reduce while
            the others wait in it (heartbeats show it; no step completes).
        step_s: nominal compute time of a step.
        chunk_steps: steps written per store call (bounds memory at 10,000+ ranks).
    """
    if ranks < 2 or steps < 1 or ranks_per_node < 1:
        raise ValueError("simulate_job needs ranks >= 2, steps >= 1, ranks_per_node >= 1")
    rng = np.random.default_rng(seed)
    job_id = job_id or f"sim-{ranks}r-{uuid.uuid4().hex[:6]}"
    rpn = ranks_per_node
    r = np.arange(ranks, dtype=np.int64)
    node = r // rpn
    nodes = int(node.max()) + 1
    hosts = np.array([_host(n) for n in range(nodes)], dtype=object)
    partner = r ^ rpn  # pipeline pair: the same local rank on the neighbouring node
    has_partner = partner < ranks
    pair_lo = np.minimum(r, partner)
    bw = np.full(nodes, 40e9)  # bytes/s
    if slow_link_node is not None and 0 <= slow_link_node < nodes:
        bw[slow_link_node] /= 4.0
    t = time.time_ns() - int((steps + 30) * step_s * 1.6 * S)
    first_ns = t
    rows: dict[str, int] = {}

    def write(table: str, cols: dict[str, pa.Array | np.ndarray | list[object]], n: int) -> None:
        data = {k: (v if isinstance(v, pa.Array) else pa.array(v)) for k, v in cols.items()}
        data.setdefault("job_id", _const(job_id, n, pa.string()))
        schema = arrow_schema(table)
        for c in TABLES[table].columns:  # absent columns take the schema's "unknown" value
            if c.name not in data:
                data[c.name] = _const(c.default_value(), n, schema.field(c.name).type)
        store.write(table, pa.table(data))
        rows[table] = rows.get(table, 0) + n

    write(
        "ranks",
        {
            "attempt": np.zeros(ranks, dtype=np.int32),
            "rank": r.astype(np.int32),
            "world_size": np.full(ranks, ranks, dtype=np.int32),
            "host": pa.array(hosts[node], type=pa.string()),
            "local_rank": (r % rpn).astype(np.int32),
            "pid": (10_000 + r).astype(np.int32),
            "gpu_index": (r % rpn).astype(np.int32),
            "pp": ((r // rpn) % 4).astype(np.int32),
            "tp": (r % rpn).astype(np.int32),
            "dp": (r // (rpn * 4)).astype(np.int32),
            "started_ns": np.full(ranks, t, dtype=np.int64),
        },
        ranks,
    )
    tp_names = [f"tp{g}" for g in range(nodes)]
    pp_los = sorted({int(x) for x in pair_lo[has_partner]})
    pg_names = ["0", *tp_names, *(f"pp{lo}" for lo in pp_los)]
    members: list[list[int]] = [
        list(range(ranks)),
        *([int(x) for x in r[node == g]] for g in range(nodes)),
        *([lo, lo ^ rpn] for lo in pp_los),
    ]
    n_pg = len(pg_names)
    write(
        "process_groups",
        {
            "attempt": np.zeros(n_pg, dtype=np.int32),
            "pg": pg_names,
            "name": ["default_pg", *(f"tp_node{g}" for g in range(nodes)), *(f"pp_pair{lo}" for lo in pp_los)],
            "backend": _const("nccl", n_pg, pa.string()),
            "ranks": pa.array(members, type=pa.list_(pa.int32())),
            "created_ns": np.full(n_pg, t, dtype=np.int64),
        },
        n_pg,
    )

    world_bytes = (64 << 20, 32 << 20)
    tp_bytes, pp_bytes = 16 << 20, 8 << 20
    tp_pg = pa.array(np.array(tp_names, dtype=object)[node], type=pa.string())
    pp_pg = pa.array([f"pp{int(lo)}" for lo in pair_lo], type=pa.string())
    buf: dict[str, list[dict[str, np.ndarray | pa.Array]]] = {"steps": [], "phases": [], "collectives": []}
    last_end = np.zeros(ranks, dtype=np.int64)
    for s in range(steps):
        start = np.full(ranks, t, dtype=np.int64) + rng.integers(0, S // 2000, ranks)
        c = step_s * (1.0 + 0.02 * rng.standard_normal(ranks)).clip(0.9, 1.1)
        if slow_rank is not None and s >= slow_from_step:
            c[slow_rank] *= slowdown
        data_end = start + (0.05 * S * c).astype(np.int64)
        fwd_end = data_end + (0.3 * S * c).astype(np.int64)
        bwd_end = fwd_end + (0.55 * S * c).astype(np.int64)
        enters: list[np.ndarray] = []
        ends: list[np.ndarray] = []
        pgs: list[pa.Array] = []
        seqs: list[np.ndarray] = []
        nbytes: list[np.ndarray] = []
        ops: list[str] = []
        # two DDP bucket all-reduces on the world group: one mid-backward, one at its end
        for j, enter in enumerate((fwd_end + (bwd_end - fwd_end) // 2, bwd_end)):
            last = int(enter.max())
            xfer = int(world_bytes[j] / bw.min() * S)
            end = last + xfer + rng.integers(0, S // 10_000, ranks)
            enters.append(enter)
            ends.append(end)
            pgs.append(_const("0", ranks, pa.string()))
            seqs.append(np.full(ranks, 2 * s + j))
            nbytes.append(np.full(ranks, world_bytes[j]))
            ops.append("all_reduce")
        after_world = ends[-1] + rng.integers(S // 10_000, S // 2000, ranks)
        # tensor-parallel all-gather inside each node
        last_tp = after_world.reshape(-1, rpn).max(axis=1) if ranks % rpn == 0 else None
        if last_tp is None:
            last_tp = np.array([after_world[node == g].max() for g in range(nodes)])
        tp_end = last_tp[node] + (tp_bytes / bw[node] * S).astype(np.int64) + rng.integers(0, S // 20_000, ranks)
        enters.append(after_world)
        ends.append(tp_end)
        pgs.append(tp_pg)
        seqs.append(np.full(ranks, s))
        nbytes.append(np.full(ranks, tp_bytes))
        ops.append("all_gather")
        # pipeline pair exchange with the neighbouring node (two members per (pg, seq))
        pp_enter = tp_end + rng.integers(0, S // 1000, ranks)
        pp_last = np.maximum(pp_enter, np.where(has_partner, pp_enter[np.minimum(partner, ranks - 1)], pp_enter))
        pair_bw = np.minimum(bw[node], bw[np.minimum(partner, ranks - 1) // rpn])
        pp_end = pp_last + (pp_bytes / pair_bw * S).astype(np.int64)
        keep = has_partner
        enters.append(pp_enter[keep])
        ends.append(pp_end[keep])
        pgs.append(pp_pg.filter(pa.array(keep)))
        seqs.append(np.full(int(keep.sum()), s))
        nbytes.append(np.full(int(keep.sum()), pp_bytes))
        ops.append("send")
        comm_end = np.maximum(tp_end, np.where(has_partner, pp_end, tp_end))
        opt_end = comm_end + (0.03 * S * c).astype(np.int64)
        last_end = opt_end
        buf["steps"].append(
            {
                "rank": r.astype(np.int32),
                "step": np.full(ranks, s, dtype=np.int64),
                "start_ns": start,
                "end_ns": opt_end,
                "samples": np.full(ranks, 32, dtype=np.int64),
                "tokens": np.full(ranks, 32 * 4096, dtype=np.int64),
                "loss": 5.0 * np.exp(-s / 50) + 0.01 * rng.standard_normal(ranks),
            }
        )
        bounds = ((start, data_end, "data"), (data_end, fwd_end, "forward"), (fwd_end, bwd_end, "backward"))
        for a, b, name in (*bounds, (comm_end, opt_end, "optimizer")):
            buf["phases"].append(
                {
                    "rank": r.astype(np.int32),
                    "step": np.full(ranks, s, dtype=np.int64),
                    "phase": _const(name, ranks, pa.string()),
                    "start_ns": a,
                    "end_ns": b,
                }
            )
        for enter, end, pg, seq, nb, op in zip(enters, ends, pgs, seqs, nbytes, ops):
            n = len(enter)
            who = r if n == ranks else r[has_partner]
            buf["collectives"].append(
                {
                    "rank": who.astype(np.int32),
                    "pg": pg,
                    "seq": seq.astype(np.int64),
                    "op": _const(op, n, pa.string()),
                    "nbytes": nb.astype(np.int64),
                    "dtype": _const("bfloat16", n, pa.string()),
                    "peer": (partner[has_partner] if op == "send" else np.full(n, -1)).astype(np.int32),
                    "step": np.full(n, s, dtype=np.int64),
                    "enter_ns": enter,
                    "start_ns": enter,
                    "end_ns": end,
                    "clock": _const("cuda", n, pa.string()),
                }
            )
        t = int(opt_end.max()) + S // 1000
        if (s + 1) % chunk_steps == 0 or s == steps - 1:
            for table, parts in buf.items():
                cols = {
                    k: pa.concat_arrays([pa.array(p[k]) if not isinstance(p[k], pa.Array) else p[k] for p in parts])
                    for k in parts[0]
                }
                n = len(next(iter(cols.values())))
                cols["attempt"] = pa.array(np.zeros(n, dtype=np.int32))
                write(table, cols, n)
                parts.clear()

    # newest heartbeat of every rank; with a hang: everyone but hang_rank waits in the next world all-reduce
    now = time.time_ns()
    hb_ts = np.full(ranks, t + S // 2, dtype=np.int64)
    world_next = 2 * steps
    entered = np.full(ranks, world_next - 1)
    pending: list[list[str]] = [[] for _ in range(ranks)]
    if hang_rank is not None:
        entered[:] = world_next
        entered[hang_rank] = world_next - 1
        pending = [[] if i == hang_rank else ["0"] for i in range(ranks)]
        hb_ts[:] = now - S // 2
    hb_pgs = [["0", f"tp{int(node[i])}", *([f"pp{int(pair_lo[i])}"] if has_partner[i] else [])] for i in range(ranks)]
    ent = [[int(entered[i]), steps - 1, *([steps - 1] if has_partner[i] else [])] for i in range(ranks)]
    comp = [[world_next - 1, steps - 1, *([steps - 1] if has_partner[i] else [])] for i in range(ranks)]
    write(
        "heartbeats",
        {
            "attempt": np.zeros(ranks, dtype=np.int32),
            "rank": r.astype(np.int32),
            "ts_ns": hb_ts,
            "pid": (10_000 + r).astype(np.int32),
            "host": pa.array(hosts[node], type=pa.string()),
            "step": np.full(ranks, steps, dtype=np.int64),
            "phase": pa.array(["backward" if p or hang_rank is None else "forward" for p in pending], type=pa.string()),
            "phase_start_ns": np.full(ranks, t, dtype=np.int64),
            "last_progress_ns": np.full(ranks, t, dtype=np.int64),
            "pgs": pa.array(hb_pgs, type=pa.list_(pa.string())),
            "pg_entered": pa.array(ent, type=pa.list_(pa.int64())),
            "pg_completed": pa.array(comp, type=pa.list_(pa.int64())),
            "pending_pgs": pa.array(pending, type=pa.list_(pa.string())),
            "pending_seqs": pa.array([[world_next] * len(p) for p in pending], type=pa.list_(pa.int64())),
            "pending_ops": pa.array([["all_reduce"] * len(p) for p in pending], type=pa.list_(pa.string())),
            "pending_nbytes": pa.array([[world_bytes[0]] * len(p) for p in pending], type=pa.list_(pa.int64())),
            "pending_enter_ns": pa.array([[t + S // 4] * len(p) for p in pending], type=pa.list_(pa.int64())),
        },
        ranks,
    )

    # GPU samples every gpu_sample_s on every GPU; the straggler's GPU runs hot and clocks down
    ts = np.arange(first_ns, t, int(gpu_sample_s * S), dtype=np.int64)
    n = len(ts) * ranks
    gpu_rank = np.tile(r, len(ts))
    util = 92.0 + 3.0 * rng.standard_normal(n)
    temp = 65.0 + 2.0 * rng.standard_normal(n)
    clock = np.full(n, 1980.0)
    if slow_rank is not None:
        hot = gpu_rank == slow_rank
        util[hot] -= 30.0
        temp[hot] += 20.0
        clock[hot] = 1400.0
    write(
        "gpu_samples",
        {
            "host": pa.array(hosts[gpu_rank // rpn], type=pa.string()),
            "gpu_index": (gpu_rank % rpn).astype(np.int32),
            "ts_ns": np.repeat(ts, ranks),
            "rank": gpu_rank.astype(np.int32),
            "util_pct": util.clip(0, 100),
            "mem_used_bytes": np.full(n, 60 << 30, dtype=np.int64),
            "mem_total_bytes": np.full(n, 80 << 30, dtype=np.int64),
            "power_w": 600.0 + 20.0 * rng.standard_normal(n),
            "temp_c": temp,
            "sm_clock_mhz": clock,
            "mem_clock_mhz": np.full(n, 2619.0),
        },
        n,
    )
    events_at = [slow_rank] if slow_rank is not None else []
    if events_at:
        er = np.array(events_at, dtype=np.int64)
        k = len(er)
        write(
            "gpu_events",
            {
                "host": pa.array(hosts[er // rpn], type=pa.string()),
                "gpu_index": (er % rpn).astype(np.int32),
                "ts_ns": np.full(k, first_ns + int(slow_from_step * step_s * S)),
                "rank": er.astype(np.int32),
                "kind": _const("clocks_event", k, pa.string()),
                "code": np.full(k, 8, dtype=np.int64),
                "message": _const("HW thermal slowdown", k, pa.string()),
            },
            k,
        )
    # log lines: a warning per node now and then, and the hang's timeout
    lr = r[:: max(1, rpn)][:200]
    k = len(lr)
    klass = ["nccl_warning"] * k
    msgs = [f"NCCL WARN rank {int(x)}: net/IB: retrying connection" for x in lr]
    sev = ["warning"] * k
    if hang_rank is not None:
        lr = np.append(lr, hang_rank)
        klass.append("nccl_timeout")
        msgs.append(f"Watchdog caught collective operation timeout: rank {hang_rank} missing from all_reduce")
        sev.append("error")
        k += 1
    write(
        "log_events",
        {
            "attempt": np.zeros(k, dtype=np.int32),
            "host": pa.array(hosts[lr // rpn], type=pa.string()),
            "rank": lr.astype(np.int32),
            "ts_ns": np.linspace(first_ns, t, k, dtype=np.int64),
            "stream": _const("stderr", k, pa.string()),
            "rule": pa.array(klass, type=pa.string()),
            "klass": pa.array(klass, type=pa.string()),
            "severity": pa.array(sev, type=pa.string()),
            "message": pa.array(msgs, type=pa.string()),
            "repeat_count": np.ones(k, dtype=np.int32),
            "context": pa.array([["previous line"]] * k, type=pa.list_(pa.string())),
        },
        k,
    )
    return SimulatedJob(
        job_id=job_id,
        ranks=ranks,
        steps=steps,
        ranks_per_node=rpn,
        slow_rank=slow_rank,
        slow_from_step=slow_from_step,
        slow_node=_host(slow_link_node) if slow_link_node is not None else None,
        hang_rank=hang_rank,
        rows=rows,
        first_ns=first_ns,
        last_ns=int(last_end.max()),
    )
