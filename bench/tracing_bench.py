"""Tracer overhead: ns per traced collective call and per phase, and the step-time overhead of a
real 4-rank gloo DDP job with tracing on vs off.

    python bench/tracing_bench.py [--calls 20000] [--steps 40] [--repeats 3]

Micro numbers use a 1-rank gloo group (the collective itself is then a cheap local op, so the
difference is the tracer's cost). The job numbers run the demo's worker (DDP + a pair group) with
RANKLENS_DISABLE=1 and without it, alternating, and compare the median step time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from _common import free_port, job_env

WARMUP_STEPS = 5  # the first steps of each run are left out of its median


def micro(calls: int) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    t = torch.ones(16)

    def loop(n: int) -> float:
        start = time.perf_counter_ns()
        for _ in range(n):
            dist.all_reduce(t)
        return (time.perf_counter_ns() - start) / n

    import ranklens.tracing as rlt
    from ranklens.tracing import _patch

    tracer = rlt.init(job_id="bench", spool_dir=tempfile.mkdtemp(prefix="ranklens-bench-"), flush_interval_s=0.5)
    assert tracer is not None
    # interleave untraced and traced rounds (unpatch/patch) so drift in machine load hits both
    base, traced = [], []
    for _ in range(5):
        _patch.unpatch()
        loop(200)
        base.append(loop(calls))
        _patch.patch(tracer)
        loop(200)
        traced.append(loop(calls))
    b, tr = min(base), min(traced)
    print(
        f"all_reduce (1 rank, 16 floats), best of 5 interleaved rounds: {b:,.0f} ns/call untraced, "
        f"{tr:,.0f} ns/call traced -> tracer cost {tr - b:,.0f} ns per collective"
    )

    def phases(n: int) -> float:
        start = time.perf_counter_ns()
        for _ in range(n):
            with rlt.phase("forward"):
                pass
        return (time.perf_counter_ns() - start) / n

    def empty(n: int) -> float:
        start = time.perf_counter_ns()
        for _ in range(n):
            pass
        return (time.perf_counter_ns() - start) / n

    # the wrapper alone, around a no-op with all_reduce's signature: the tracer's own cost,
    # without the noise of the collective itself
    import torch.distributed.distributed_c10d as c10d

    from ranklens.tracing import _patch

    def noop(tensor, op=None, group=None, async_op=False):
        return None

    wrapped = _patch._wrap(tracer, "all_reduce", noop, c10d)

    def calls_of(fn, n: int) -> float:
        start = time.perf_counter_ns()
        for _ in range(n):
            fn(t)
        return (time.perf_counter_ns() - start) / n

    w = min(calls_of(wrapped, calls) for _ in range(5)) - min(calls_of(noop, calls) for _ in range(5))
    print(f"tracer wrapper alone (no-op collective): {w:,.0f} ns per collective")
    p = min(phases(calls) for _ in range(3)) - min(empty(calls) for _ in range(3))
    print(f"phase context manager: {p:,.0f} ns per phase")
    async_start = time.perf_counter_ns()
    for _ in range(calls // 4):
        dist.all_reduce(t, async_op=True).wait()
    a = (time.perf_counter_ns() - async_start) / (calls // 4)
    print(f"async all_reduce + wait, traced (future callback): {a:,.0f} ns/call")
    rlt.shutdown()
    dropped = sum(tracer._drops.values())
    print(f"records dropped: {dropped}")
    dist.destroy_process_group()


def job(steps: int, repeats: int) -> None:
    """Median step time of the demo worker job, tracing off vs on (alternating runs)."""
    results: dict[str, list[float]] = {"off": [], "on": [], "on-no-ddp-hook": []}
    for _ in range(repeats):
        for mode in results:
            spool = tempfile.mkdtemp(prefix="ranklens-bench-spool-")
            env = job_env(4, spool, f"bench-{mode}")
            if mode == "off":
                env["RANKLENS_DISABLE"] = "1"
            if mode == "on-no-ddp-hook":
                env["RANKLENS_DDP"] = "0"
            procs = [
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "ranklens.demo.worker",
                        "--steps",
                        str(steps),
                        "--compute-ms",
                        "20",
                        "--report-steps",
                    ],
                    env={**env, "RANK": str(r)},
                    stdout=subprocess.PIPE,
                    text=True,
                )
                for r in range(4)
            ]
            outs = [p.communicate()[0] for p in procs]
            times = [float(x.split()[1]) for x in outs[0].splitlines() if x.startswith("steptime ")]
            results[mode].append(statistics.median(times[WARMUP_STEPS:]))
    off = statistics.median(results["off"])
    for mode in ("on", "on-no-ddp-hook"):
        on = statistics.median(results[mode])
        print(
            f"4-rank gloo DDP job, {steps} steps x {repeats} runs: median step {off * 1e3:.2f} ms untraced, "
            f"{on * 1e3:.2f} ms traced ({mode}) -> overhead {100 * (on - off) / off:+.2f}%"
        )
    print("  per run (ms): " + ", ".join(f"{k} {[round(x * 1e3, 2) for x in v]}" for k, v in results.items()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--steps", type=int, default=40, help=f"steps per run (more than the {WARMUP_STEPS} warm-up steps)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--micro-only", action="store_true")
    args = ap.parse_args()
    if args.steps <= WARMUP_STEPS or args.repeats < 1:
        ap.error(f"--steps must be more than {WARMUP_STEPS} (the warm-up steps left out) and --repeats at least 1")
    if os.environ.get("_RANKLENS_BENCH_MICRO") == "1":
        micro(args.calls)
        return 0
    # micro in a child process so its process group does not leak into the job runs
    subprocess.run(
        [sys.executable, __file__, "--calls", str(args.calls)],
        env={**os.environ, "_RANKLENS_BENCH_MICRO": "1"},
        check=True,
    )
    if not args.micro_only:
        job(args.steps, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
