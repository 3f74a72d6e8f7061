"""What a simulated job's nodes report beside the ledger: heartbeats, GPU samples and events, log lines.

:func:`telemetry_tables` derives them from the same layout and faults the engine ran (the model is
documented in :mod:`ranklens.simulate`), so the dashboards' GPU, log and hang views show the job the
analyzers see:

* ``heartbeats``: every rank's newest heartbeat, with its process groups' last entered / completed
  sequence numbers. With ``hang_rank``, after the last step every other rank entered the next world
  collective (``pg "0"``, seq 1) and waits in it, while ``hang_rank`` never entered it.
* ``gpu_samples``: one sample per GPU every ``gpu_sample_s``; the GPUs of ranks under a compute fault
  (slow_gpu, slow_node) run hot and clock down from the fault's onset.
* ``gpu_events``: a thermal clock event on each of those GPUs at the onset.
* ``log_events``: a classified NCCL warning from the first rank of each node (at most 200), and the
  watchdog's timeout line of ``hang_rank``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ranklens.simulate.model import FaultKind, Layout, ResolvedFault

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["TELEMETRY_TABLES", "telemetry_tables"]

TELEMETRY_TABLES = ("heartbeats", "gpu_samples", "gpu_events", "log_events")
S = 1_000_000_000  # ns per second
_COMPUTE_FAULTS = (FaultKind.SLOW_GPU, FaultKind.SLOW_NODE)


def _const(value: object, n: int, type_: pa.DataType) -> pa.Array:
    import pyarrow as pa

    return pa.array([value], type=type_).take(pa.array(np.zeros(n, dtype=np.int64)))


def _table(name: str, job_id: str, cols: dict[str, object], n: int) -> pa.Table:
    """An Arrow table of the schema; columns not given take the schema's "unknown" value."""
    import pyarrow as pa

    from ranklens.records import arrow_schema
    from ranklens.schema import TABLES

    schema = arrow_schema(name)
    data = {}
    for k, v in cols.items():
        want = schema.field(k).type
        data[k] = (v if v.type == want else v.cast(want)) if isinstance(v, pa.Array) else pa.array(v, type=want)
    data["job_id"] = _const(job_id, n, pa.string())
    for c in TABLES[name].columns:
        if c.name not in data:
            data[c.name] = _const(c.default_value(), n, schema.field(c.name).type)
    return pa.table({f.name: data[f.name] for f in schema}, schema=schema)


def telemetry_tables(
    *,
    job_id: str,
    layout: Layout,
    faults: list[ResolvedFault],
    groups: list[tuple[str, list[int], int]],
    steps: int,
    first_ns: int,
    last_ns: int,
    step_start_ns: Callable[[int], int],
    hang_rank: int | None = None,
    gpu_sample_s: float = 5.0,
    seed: int = 0,
    now_ns: int | None = None,
) -> dict[str, pa.Table]:
    """The telemetry tables of a simulated job (see the module docstring).

    Args:
        job_id, layout, faults: the job the engine ran.
        groups: its non-p2p process groups as ``(pg, member ranks, last seq)``.
        steps: steps run; ``first_ns``/``last_ns``: the job's first start and last end (epoch ns).
        step_start_ns: the epoch ns a step started (a fault's onset time).
        hang_rank: a rank that never enters the collective after the last step.
        gpu_sample_s: GPU sampling period.
        now_ns: "now" for a hung job's fresh heartbeats (default: the wall clock).
    """
    import pyarrow as pa

    rng = np.random.default_rng([seed, 2])
    R, rpn = layout.world_size, layout.ranks_per_node
    r = np.arange(R, dtype=np.int64)
    hosts = np.array([layout.host(int(x)) for x in r], dtype=object)
    local = (r % rpn).astype(np.int32)
    out: dict[str, pa.Table] = {}

    # heartbeats: the newest one of every rank
    my_groups: list[list[tuple[str, int]]] = [[] for _ in range(R)]
    for pg, members, last_seq in groups:
        for m in members:
            my_groups[m].append((pg, last_seq))
    hung = hang_rank is not None
    pgs = [["0", *(pg for pg, _ in g if pg != "0")] for g in my_groups]
    world_last = next((s for pg, _m, s in groups if pg == "0"), 0)
    world_entered = [world_last + (1 if hung and i != hang_rank else 0) for i in range(R)]
    entered = [[world_entered[i], *(s for pg, s in my_groups[i] if pg != "0")] for i in range(R)]
    completed = [[world_last, *(s for pg, s in my_groups[i] if pg != "0")] for i in range(R)]
    pending = [["0"] if hung and i != hang_rank else [] for i in range(R)]
    hb_ts = (int(now_ns if now_ns is not None else time.time_ns()) - S // 2) if hung else last_ns + S // 2
    wait_from = last_ns + S // 4
    out["heartbeats"] = _table(
        "heartbeats",
        job_id,
        {
            "attempt": np.zeros(R, dtype=np.int32),
            "rank": r.astype(np.int32),
            "ts_ns": np.full(R, hb_ts, dtype=np.int64),
            "pid": (local + 4000).astype(np.int32),
            "host": pa.array(hosts, type=pa.string()),
            "step": np.full(R, steps if hung else steps - 1, dtype=np.int64),
            "phase": ["forward" if i == hang_rank else ("backward" if hung else "optimizer") for i in range(R)],
            "phase_start_ns": np.full(R, last_ns, dtype=np.int64),
            "last_progress_ns": np.full(R, last_ns, dtype=np.int64),
            "pgs": pa.array(pgs, type=pa.list_(pa.string())),
            "pg_entered": pa.array(entered, type=pa.list_(pa.int64())),
            "pg_completed": pa.array(completed, type=pa.list_(pa.int64())),
            "pending_pgs": pa.array(pending, type=pa.list_(pa.string())),
            "pending_seqs": pa.array([[world_last + 1] * len(p) for p in pending], type=pa.list_(pa.int64())),
            "pending_ops": pa.array([["all_reduce"] * len(p) for p in pending], type=pa.list_(pa.string())),
            "pending_nbytes": pa.array([[4] * len(p) for p in pending], type=pa.list_(pa.int64())),
            "pending_enter_ns": pa.array([[wait_from] * len(p) for p in pending], type=pa.list_(pa.int64())),
        },
        R,
    )

    # GPU samples; the GPUs under a compute fault run hot and clock down from its onset
    ts = np.arange(first_ns, max(last_ns, first_ns + 1), int(gpu_sample_s * S), dtype=np.int64)
    n = len(ts) * R
    gpu_rank = np.tile(r, len(ts))
    sample_ts = np.repeat(ts, R)
    util = 92.0 + 3.0 * rng.standard_normal(n)
    temp = 65.0 + 2.0 * rng.standard_normal(n)
    clock = np.full(n, 1980.0)
    hot_events: list[tuple[int, int]] = []  # (rank, onset ns)
    for f in faults:
        if f.kind in _COMPUTE_FAULTS:
            onset = step_start_ns(f.onset_step)
            hot = np.isin(gpu_rank, np.asarray(f.ranks)) & (sample_ts >= onset)
            util[hot] -= 30.0
            temp[hot] += 20.0
            clock[hot] = 1400.0
            hot_events += [(int(x), onset) for x in f.ranks]
    out["gpu_samples"] = _table(
        "gpu_samples",
        job_id,
        {
            "host": pa.array(hosts[gpu_rank], type=pa.string()),
            "gpu_index": local[gpu_rank],
            "ts_ns": sample_ts,
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
    er = np.array([x for x, _ in hot_events], dtype=np.int64)
    k = len(er)
    out["gpu_events"] = _table(
        "gpu_events",
        job_id,
        {
            "host": pa.array(hosts[er], type=pa.string()),
            "gpu_index": local[er],
            "ts_ns": np.array([t for _, t in hot_events], dtype=np.int64),
            "rank": er.astype(np.int32),
            "kind": ["clocks_event"] * k,
            "code": np.full(k, 8, dtype=np.int64),
            "message": ["HW thermal slowdown"] * k,
        },
        k,
    )

    # log lines: an NCCL warning from each node's first rank, and the hang's watchdog timeout
    lr = [int(x) for x in r[::rpn][:200]]
    klass = ["nccl_warning"] * len(lr)
    msgs = [f"NCCL WARN rank {x}: net/IB: retrying connection" for x in lr]
    sev = ["warning"] * len(lr)
    if hang_rank is not None:
        lr.append(int(hang_rank))
        klass.append("nccl_timeout")
        msgs.append(f"Watchdog caught collective operation timeout: rank {hang_rank} missing from all_reduce")
        sev.append("error")
    k = len(lr)
    lra = np.asarray(lr, dtype=np.int64)
    out["log_events"] = _table(
        "log_events",
        job_id,
        {
            "attempt": np.zeros(k, dtype=np.int32),
            "host": pa.array(hosts[lra], type=pa.string()),
            "rank": lra.astype(np.int32),
            "ts_ns": np.linspace(first_ns, last_ns + S, k, dtype=np.int64),
            "stream": ["stderr"] * k,
            "rule": klass,
            "klass": klass,
            "severity": sev,
            "message": msgs,
            "repeat_count": np.ones(k, dtype=np.int32),
            "context": pa.array([["previous line"]] * k, type=pa.list_(pa.string())),
        },
        k,
    )
    return out
