"""Collector throughput and cost: spool -> store rows/s (embedded and a ClickHouse server), and the
node agent's CPU and RSS while idle and while an 8-rank gloo job writes its spool.

    python bench/collector_bench.py [--rows 400000] [--server clickhouse://default@127.0.0.1:9000]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from _common import job_env

from ranklens.collector import Shipper
from ranklens.collector.agent import Agent, load_config
from ranklens.formats.spool import SpoolWriter
from ranklens.store import open_store


def make_spool(root: Path, rows: int, ranks: int = 8, per_segment: int = 5000) -> None:
    t0 = 1_790_000_000_000_000_000
    for r in range(ranks):
        w = SpoolWriter.for_rank(root, "bench", 0, r)
        for start in range(0, rows // ranks, per_segment):
            w.write(
                "collectives",
                [
                    {
                        "job_id": "bench",
                        "attempt": 0,
                        "rank": r,
                        "pg": "0",
                        "seq": s,
                        "op": "all_reduce",
                        "nbytes": 4096,
                        "dtype": "float32",
                        "peer": -1,
                        "step": s // 10,
                        "enter_ns": t0 + s * 1000 + r,
                        "end_ns": t0 + s * 1000 + 500,
                        "async_op": 0,
                    }
                    for s in range(start, min(start + per_segment, rows // ranks))
                ],
            )


def cpu_s() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def ship_rate(name: str, store, rows: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="ranklens-collector-bench-"))
    make_spool(root, rows)
    copy = Path(tempfile.mkdtemp(prefix="ranklens-collector-bench-copy-")) / "spool"
    shutil.copytree(root, copy)
    t = time.perf_counter()
    r = Shipper(root, store).ship_once()
    dt = time.perf_counter() - t
    n = r.rows.get("collectives", 0)
    print(f"{name:9s} spool -> store: {n:,} rows in {r.segments} segments, {dt:.2f} s = {n / dt:,.0f} rows/s")
    # The same segments again, all of them in doubt (as after a crash right after the store took
    # them): the store is asked, nothing is sent twice.
    shutil.rmtree(root)
    shutil.copytree(copy, root)
    sh = Shipper(root, store)
    sh.in_doubt = {p.relative_to(root).as_posix() for p in sh.pending()}
    t = time.perf_counter()
    r = sh.ship_once()
    dt = time.perf_counter() - t
    total = store.query("SELECT count() FROM collectives WHERE job_id = 'bench'").scalar()
    print(
        f"{name:9s} replay of the same {r.already_stored} segments, all in doubt: {dt:.2f} s, "
        f"{sum(r.rows.values())} rows sent again, {total:,} rows in the store (duplicates: {total - n:,})"
    )


def agent_cost(store) -> None:
    spool = tempfile.mkdtemp(prefix="ranklens-agent-bench-")
    agent = Agent(load_config(None, spool_dir=spool, nvml=False, metrics_port=0), store=store)
    agent.start()
    time.sleep(2)
    c0, t0 = cpu_s(), time.perf_counter()
    time.sleep(10)
    idle = (cpu_s() - c0) / (time.perf_counter() - t0)
    print(f"agent idle: {100 * idle:.2f}% of one core, RSS {rss_mb():,.0f} MiB")
    env = job_env(8, spool, f"agent-bench-{uuid.uuid4().hex[:6]}")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "ranklens.demo.worker", "--steps", "60", "--compute-ms", "40"],
            env={**env, "RANK": str(r)},
            stdout=subprocess.DEVNULL,
        )
        for r in range(8)
    ]
    c0, t0 = cpu_s(), time.perf_counter()
    for p in procs:
        p.wait()
    time.sleep(2)  # last shipping pass
    busy = (cpu_s() - c0) / (time.perf_counter() - t0)
    agent.stop()
    rows = store.query(f"SELECT count() FROM collectives WHERE job_id = '{env['RANKLENS_JOB_ID']}'").scalar()
    print(
        f"agent under an 8-rank gloo job ({time.perf_counter() - t0:.0f} s, {rows:,} collective rows shipped): "
        f"{100 * busy:.2f}% of one core, RSS {rss_mb():,.0f} MiB"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=400_000)
    ap.add_argument("--server", default=os.environ.get("RANKLENS_BENCH_CLICKHOUSE"))
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="ranklens-collector-store-")
    embedded = open_store(f"embedded://{tmp}/store")
    agent_cost(embedded)  # first, so the process's RSS is the agent's, not the throughput runs'
    ship_rate("embedded", embedded, args.rows)
    if args.server:
        server = open_store(f"{args.server.rstrip('/')}/ranklens_bench_{uuid.uuid4().hex[:8]}")
        try:
            ship_rate("server", server, args.rows)
        finally:
            server.drop_database()
            server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
