"""Fault-simulator benchmark: rows, seconds and peak memory to generate a simulated job into a store.

    python bench/simulate_bench.py                       # 1,024 and 10,240 ranks x 100 steps, embedded store
    python bench/simulate_bench.py --ranks 10240 --steps 100 --pp 8 --tp 8 --microbatches 4
    python bench/simulate_bench.py --target files        # Parquet files instead of the store
    python bench/simulate_bench.py --target none         # generation only

Each configuration runs in a fresh child process, so its peak RSS (``ru_maxrss``) is its own.
The store (or files) goes to a temporary directory, removed afterwards unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_CONFIGS = [
    # ranks, steps, pp, tp
    (1024, 100, 4, 8),
    (10240, 100, 8, 8),
]


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def run_one(args: argparse.Namespace) -> dict:
    """Simulate one job in this process; return its numbers."""
    from ranklens.simulate import SimParams, simulate

    work = Path(args.dir)
    store = None
    if args.target == "store":
        from ranklens.store import open_store

        store = open_store(f"embedded://{work / 'store'}")
    params = SimParams(tp_collectives=args.tp_collectives, microbatches=args.microbatches)
    t0 = time.perf_counter()
    res = simulate(
        store,
        ranks=args.ranks,
        steps=args.steps,
        pp=args.pp,
        tp=args.tp,
        faults=["slow_gpu:17:1.3@20", "clock_skew:3:2.5"],
        params=params,
        seed=0,
        out_dir=work / "files" if args.target == "files" else None,
    )
    wall = time.perf_counter() - t0
    if store is not None:
        t1 = time.perf_counter()
        n = store.query(f"SELECT count() FROM collectives WHERE job_id = '{res.job_id}'").scalar()
        count_s = time.perf_counter() - t1
        assert n == res.rows["collectives"], (n, res.rows)
    else:
        count_s = float("nan")
    rows = sum(res.rows.values())
    return {
        "ranks": args.ranks,
        "steps": args.steps,
        "layout": res.truth["layout"],
        "K": args.tp_collectives,
        "M": args.microbatches,
        "target": args.target,
        "rows": res.rows,
        "rows_total": rows,
        "seconds": round(wall, 2),
        "rows_per_s": round(rows / wall),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "bytes_on_disk": _du(work),
        "count_query_s": round(count_s, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=None, help="one configuration of this size (else the defaults)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--pp", type=int, default=8)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--tp-collectives", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--target", choices=["store", "files", "none"], default="store")
    ap.add_argument("--keep", action="store_true", help="keep the generated store / files")
    ap.add_argument("--json", action="store_true", help="print one JSON object per configuration")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(args)))
        return
    configs = [(args.ranks, args.steps, args.pp, args.tp)] if args.ranks else DEFAULT_CONFIGS
    for ranks, steps, pp, tp in configs:
        work = Path(tempfile.mkdtemp(prefix="ranklens-simbench-"))
        try:
            cmd = [
                sys.executable,
                __file__,
                "--one",
                "--dir",
                str(work),
                "--ranks",
                str(ranks),
                "--steps",
                str(steps),
                "--pp",
                str(pp),
                "--tp",
                str(tp),
                "--tp-collectives",
                str(args.tp_collectives),
                "--microbatches",
                str(args.microbatches),
                "--target",
                args.target,
            ]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ.copy()).stdout
            r = json.loads(out.strip().splitlines()[-1])
        finally:
            if args.keep:
                print(f"kept {work}", file=sys.stderr)
            else:
                shutil.rmtree(work, ignore_errors=True)
        if args.json:
            print(json.dumps(r))
            continue
        lay = r["layout"]
        print(
            f"simulate {ranks:>6,} ranks (dp {lay['dp']} x pp {lay['pp']} x tp {lay['tp']}, K={r['K']}, M={r['M']})"
            f" x {steps} steps -> {r['target']}: {r['rows_total']:,} rows "
            f"(collectives {r['rows']['collectives']:,}, phases {r['rows']['phases']:,}, steps {r['rows']['steps']:,})"
            f" in {r['seconds']:.1f} s = {r['rows_per_s']:,} rows/s; peak RSS {r['peak_rss_mib']:,} MiB; "
            f"{r['bytes_on_disk'] / 2**20:,.0f} MiB on disk"
        )


if __name__ == "__main__":
    main()
