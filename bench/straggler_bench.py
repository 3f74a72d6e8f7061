"""Straggler analysis at scale: time and peak memory to analyze a simulated 10,240-rank x 100-step
3D-parallel job (one slow GPU) on the embedded store and, with --server, on a ClickHouse server.

    python bench/straggler_bench.py [--ranks 10240] [--steps 100] [--server clickhouse://default@127.0.0.1:9000]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
import time
import uuid

from ranklens.analyzers import find_stragglers
from ranklens.simulate import simulate
from ranklens.store import open_store


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(name: str, store, ranks: int, steps: int) -> None:
    culprit = ranks // 2 + 3
    t = time.perf_counter()
    sim = simulate(store, ranks=ranks, steps=steps, pp=8, tp=8, faults=[f"slow_gpu:{culprit}:1.2@40"], seed=1)
    gen = time.perf_counter() - t
    print(f"{name:9s} simulated {ranks:,} ranks x {steps} steps: {sum(sim.rows.values()):,} rows in {gen:.1f} s")
    for i in range(2):
        t = time.perf_counter()
        findings = find_stragglers(store, sim.job_id)
        dt = time.perf_counter() - t
        named = [s.rank for f in findings for s in f.suspects]
        onset = [f.first_seen_step for f in findings]
        print(
            f"{name:9s} analyze pass {i + 1}: {dt:.2f} s, peak RSS of this process {rss_mb():,.0f} MiB; "
            f"named {named} (truth {culprit}), onset {onset} (truth 40)"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=10240)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--server", default=os.environ.get("RANKLENS_BENCH_CLICKHOUSE"))
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="ranklens-straggler-bench-")
    try:
        run("embedded", open_store(f"embedded://{tmp}/store"), args.ranks, args.steps)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.server:
        store = open_store(f"{args.server.rstrip('/')}/ranklens_bench_{uuid.uuid4().hex[:8]}")
        try:
            run("server", store, args.ranks, args.steps)
        finally:
            store.drop_database()
            store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
