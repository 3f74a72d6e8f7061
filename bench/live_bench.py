"""Live detection latency on real 4-rank gloo jobs: fault onset -> finding, with the collector
shipping every 0.5 s and the analyzer polling every 0.5 s (as `ranklens analyze --follow` would).

    python bench/live_bench.py [--repeats 3]

Scenarios: a rank that stops before a collective (hang), a rank that exits (crash), and a rank
whose forward pass becomes 2x slower (straggler).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import job_env, kill_all

from ranklens.analyzers.job import analyze_job
from ranklens.analyzers.live_hangs import HangConfig
from ranklens.collector import Shipper
from ranklens.store import open_store

ROOT = Path(__file__).resolve().parents[1]


def hang_latency(mode: str, kind: str) -> float | None:
    tmp = Path(tempfile.mkdtemp(prefix="ranklens-live-"))
    job = f"live-{mode}"
    env = job_env(
        4, str(tmp / "spool"), job, HANG_MODE=mode, HANG_RANK="2", HANG_STEP="15", HANG_MARKER=str(tmp / "fault")
    )
    logs = [open(tmp / f"r{r}.log", "w") for r in range(4)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "tests/hang_job.py")],
            env={**env, "RANK": str(r)},
            stdout=logs[r],
            stderr=subprocess.STDOUT,
        )
        for r in range(4)
    ]
    store = open_store(f"embedded://{tmp}/store")
    shipper = Shipper(tmp / "spool", store)
    cfg = HangConfig(min_stall_s=5.0)
    try:
        deadline = time.time() + 90
        while time.time() < deadline:
            shipper.ship_once()
            codes = {r: p.returncode for r, p in enumerate(procs) if p.poll() is not None}
            from ranklens.analyzers.live_hangs import detect_live_hangs

            found = [f for f in detect_live_hangs(store, job, config=cfg, exit_codes=codes) if f.kind == kind]
            if found and (tmp / "fault").exists():
                return (time.time_ns() - int((tmp / "fault").read_text())) / 1e9
            time.sleep(0.5)
        return None
    finally:
        kill_all(procs)
        for f in logs:
            f.close()


def straggler_latency() -> float | None:
    tmp = Path(tempfile.mkdtemp(prefix="ranklens-live-"))
    env = job_env(4, str(tmp / "spool"), "live-straggler")
    args = ["--steps", "120", "--slow-rank", "1", "--slowdown", "2", "--slow-from-step", "30", "--report-steps"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "ranklens.demo.worker", *args],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
            text=True,
        )
        for r in range(4)
    ]
    store = open_store(f"embedded://{tmp}/store")
    shipper = Shipper(tmp / "spool", store)
    onset_ns = None
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            shipper.ship_once()
            if onset_ns is None:
                q = store.query("SELECT min(start_ns) FROM steps WHERE job_id = 'live-straggler' AND step = 30")
                v = q.scalar() if q.num_rows else None
                onset_ns = int(v) if v else None
            findings = [f for f in analyze_job(store, "live-straggler") if f.kind == "straggler"]
            if onset_ns and any(s.rank == 1 for f in findings for s in f.suspects):
                return (time.time_ns() - onset_ns) / 1e9
            time.sleep(0.5)
        return None
    finally:
        kill_all(procs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    for name, fn in (
        ("hang (rank stops before a collective)", lambda: hang_latency("sleep", "hang")),
        ("crash (rank exits)", lambda: hang_latency("exit", "crash")),
        ("straggler (forward 2x slower)", straggler_latency),
    ):
        xs = [fn() for _ in range(args.repeats)]
        ok = [x for x in xs if x is not None]
        med = f"{statistics.median(ok):.1f} s" if ok else "-"
        print(f"{name}: onset -> finding median {med}; runs {[None if x is None else round(x, 1) for x in xs]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
