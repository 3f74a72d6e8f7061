"""Store and analyzer benchmark: insert throughput (rows/s) on both backends, and the latency of
the straggler analysis over a job of ~1M collective rows.

    python bench/store_bench.py [--rows 1000000] [--server clickhouse://default@127.0.0.1:9000]

Without --server (or $RANKLENS_BENCH_CLICKHOUSE) only the embedded store is measured. Prints one
line per measurement; nothing is timed inside the test suite.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import uuid

import numpy as np
import pyarrow as pa

from ranklens.analyzers import find_stragglers
from ranklens.analyzers.blame import compute_blame
from ranklens.records import arrow_schema, arrow_table
from ranklens.store import open_store

T0 = 1_790_000_000_000_000_000


def synthetic(rows: int, ranks: int = 64, per_step: int = 16, slow_rank: int = 17, seed: int = 0) -> dict:
    """A job with ``ranks`` ranks, ``per_step`` collectives per step, one slow rank."""
    rng = np.random.default_rng(seed)
    n_coll = rows // ranks
    steps = n_coll // per_step
    n_coll = steps * per_step
    seq = np.arange(n_coll)
    step = seq // per_step
    base = T0 + seq.astype(np.int64) * 20_000_000  # a collective every 20 ms
    enter = base[:, None] + rng.integers(0, 2_000_000, size=(n_coll, ranks))
    enter[:, slow_rank] += np.where(seq % per_step == 0, 30_000_000, 0)  # 30 ms late once per step
    end = enter.max(axis=1) + 500_000
    r = np.tile(np.arange(ranks, dtype=np.int32), n_coll)
    coll = arrow_table(
        {
            "job_id": pa.array(["bench"] * (n_coll * ranks)),
            "attempt": pa.array(np.zeros(n_coll * ranks, np.int32)),
            "rank": pa.array(r),
            "pg": pa.array(["0"] * (n_coll * ranks)),
            "seq": pa.array(np.repeat(seq, ranks).astype(np.int64)),
            "op": pa.array(["all_reduce"] * (n_coll * ranks)),
            "nbytes": pa.array(np.full(n_coll * ranks, 1 << 20, np.int64)),
            "dtype": pa.array(["bfloat16"] * (n_coll * ranks)),
            "peer": pa.array(np.full(n_coll * ranks, -1, np.int32)),
            "step": pa.array(np.repeat(step, ranks).astype(np.int64)),
            "enter_ns": pa.array(enter.reshape(-1)),
            "start_ns": pa.array(np.zeros(n_coll * ranks, np.int64)),
            "end_ns": pa.array(np.repeat(end, ranks)),
            "clock": pa.array(["cpu"] * (n_coll * ranks)),
            "async_op": pa.array(np.zeros(n_coll * ranks, np.uint8)),
        },
        schema=arrow_schema("collectives"),
    )
    st = np.arange(steps)
    steps_t = arrow_table(
        {
            "job_id": ["bench"] * (steps * ranks),
            "attempt": np.zeros(steps * ranks, np.int32),
            "rank": np.tile(np.arange(ranks, dtype=np.int32), steps),
            "step": np.repeat(st, ranks).astype(np.int64),
            "start_ns": np.repeat(T0 + st * per_step * 20_000_000, ranks).astype(np.int64),
            "end_ns": np.repeat(T0 + (st + 1) * per_step * 20_000_000, ranks).astype(np.int64),
            "samples": np.full(steps * ranks, -1, np.int64),
            "tokens": np.full(steps * ranks, -1, np.int64),
            "loss": np.full(steps * ranks, np.nan),
            "grad_norm": np.full(steps * ranks, np.nan),
        },
        schema=arrow_schema("steps"),
    )
    return {"collectives": coll, "steps": steps_t}


def bench_backend(name: str, store, data: dict, batch: int) -> None:
    coll = data["collectives"]
    t = time.perf_counter()
    for off in range(0, coll.num_rows, batch):
        store.write("collectives", coll.slice(off, batch))
    dt = time.perf_counter() - t
    print(
        f"{name:9s} insert: {coll.num_rows:,} collective rows in {dt:.2f} s = "
        f"{coll.num_rows / dt:,.0f} rows/s (batches of {batch:,})"
    )
    store.write("steps", data["steps"])
    if hasattr(store, "compact"):
        store.compact(min_parts=2)
    for run in range(3):
        t = time.perf_counter()
        blame = compute_blame(store, "bench", 0)
        t_metric = time.perf_counter() - t
        findings = find_stragglers(store, "bench", 0)
        t_all = time.perf_counter() - t
        print(
            f"{name:9s} analyze ({run + 1}/3): blame matrix {t_metric:.2f} s, blame + decision again "
            f"{t_all - t_metric:.2f} s; {len(blame.ranks)} ranks x {len(blame.steps)} steps; "
            f"suspects {[s.rank for f in findings for s in f.suspects]}"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=100_000)
    p.add_argument("--server", default=os.environ.get("RANKLENS_BENCH_CLICKHOUSE"))
    args = p.parse_args()
    t = time.perf_counter()
    data = synthetic(args.rows)
    print(
        f"generated {data['collectives'].num_rows:,} collective rows in {time.perf_counter() - t:.1f} s "
        f"({os.cpu_count()} CPUs, python {sys.version.split()[0]})"
    )
    tmp = tempfile.mkdtemp(prefix="ranklens-bench-")
    try:
        bench_backend("embedded", open_store(f"embedded://{tmp}/store"), data, args.batch)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.server:
        store = open_store(f"{args.server.rstrip('/')}/ranklens_bench_{uuid.uuid4().hex[:8]}")
        try:
            bench_backend("server", store, data, args.batch)
        finally:
            store.drop_database()
            store.close()
    else:
        print("server: skipped (pass --server clickhouse://... or set RANKLENS_BENCH_CLICKHOUSE)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
