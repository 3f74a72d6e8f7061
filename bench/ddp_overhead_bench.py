"""Tracer overhead on an unmodified DDP job, as a user runs it: ``ranklens run -- torchrun ...`` against
plain ``torchrun`` with torch's flight recorder on (its default) and off, alternating, whole commands.

    python bench/ddp_overhead_bench.py [--rounds 5] [--nproc 2] [--steps 60] [--width 1024]

Each round runs every mode once, in turn, on bench/ddp_train.py (an MLP under DDP, several gradient
buckets a step; gloo on CPU, NCCL where CUDA is). Printed per mode: the median over rounds of rank 0's
median step time (after its warm-up steps) and of the whole command's wall time (process start to
exit: torchrun, the ranks' start-up, ranklens' bootstrap and its final flush included), and the
ratios against the peer (plain torchrun, flight recorder on). ``ranklens run`` here spools only
(``--no-collect``): shipping is the collector's cost, not the training process's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import free_port

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent


def _ranklens() -> list[str]:
    exe = BIN / "ranklens"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "ranklens"]


def run_once(mode: str, args: argparse.Namespace, tmp: Path) -> tuple[float, float]:
    torchrun = [
        str(BIN / "torchrun") if (BIN / "torchrun").exists() else "torchrun",
        f"--nproc-per-node={args.nproc}",
        f"--master-port={free_port()}",
        str(HERE / "ddp_train.py"),
        f"--steps={args.steps}",
        f"--width={args.width}",
        f"--layers={args.layers}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.pop("RANKLENS_DISABLE", None)
    if mode == "torchrun, FR off":
        env["TORCH_FR_BUFFER_SIZE"] = "0"
        cmd = torchrun
    elif mode in ("torchrun, FR on", "torchrun + torch's hook"):
        env["TORCH_FR_BUFFER_SIZE"] = env.get("TORCH_FR_BUFFER_SIZE") or "2000"
        if mode == "torchrun + torch's hook":  # torch's own Python all-reduce hook: what any hook costs
            env["DDP_TRAIN_PY_HOOK"] = "1"
        cmd = torchrun
    else:
        spool = tmp / f"spool-{time.monotonic_ns()}"
        cmd = [*_ranklens(), "run", "--no-collect", "--spool", str(spool), "--", *torchrun]
        if mode == "ranklens run, no DDP hook":
            env["RANKLENS_DDP"] = "0"
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, cwd=tmp)
    wall = time.monotonic() - t0
    if p.returncode != 0:
        sys.exit(f"{mode}: exit {p.returncode}\n{p.stderr[-2000:]}")
    step = next(float(ln.split()[1]) for ln in p.stdout.splitlines() if ln.startswith("median_step_ms "))
    return step, wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--no-hook-mode", action="store_true", help="also time ranklens run with RANKLENS_DDP=0")
    ap.add_argument(
        "--torch-hook-mode", action="store_true", help="also time plain torchrun with torch's own all-reduce hook"
    )
    args = ap.parse_args()
    if args.rounds < 3:
        ap.error("--rounds must be at least 3")
    modes = ["torchrun, FR on", "ranklens run", "torchrun, FR off"]
    if args.no_hook_mode:
        modes.append("ranklens run, no DDP hook")
    if args.torch_hook_mode:
        modes.append("torchrun + torch's hook")
    steps: dict[str, list[float]] = {m: [] for m in modes}
    walls: dict[str, list[float]] = {m: [] for m in modes}
    tmp = Path(tempfile.mkdtemp(prefix="ranklens-ddp-bench-"))
    try:
        for r in range(args.rounds):
            order = modes if r % 2 == 0 else modes[::-1]  # alternate so drift hits every mode alike
            for m in order:
                s, w = run_once(m, args, tmp)
                steps[m].append(s)
                walls[m].append(w)
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{m} {steps[m][-1]:.2f} ms" for m in modes), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    peer = "torchrun, FR on"
    ps, pw = statistics.median(steps[peer]), statistics.median(walls[peer])
    print(f"\n{args.nproc}-rank DDP job ({'NCCL' if _cuda() else 'gloo'}), {args.steps} steps, {args.rounds} rounds:")
    print(f"{'mode':26} {'step ms':>9} {'vs peer':>8} {'wall s':>8} {'vs peer':>8}")
    for m in modes:
        s, w = statistics.median(steps[m]), statistics.median(walls[m])
        # pairwise ratios (same round) are steadier than the ratio of medians on a drifting machine
        rs = statistics.median(a / b for a, b in zip(steps[m], steps[peer]))
        rw = statistics.median(a / b for a, b in zip(walls[m], walls[peer]))
        print(f"{m:26} {s:9.2f} {rs:8.3f} {w:8.2f} {rw:8.3f}")
    print(f"(peer: {peer} = {ps:.2f} ms/step, {pw:.2f} s whole command; ratios are the median of per-round ratios)")
    return 0


def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


if __name__ == "__main__":
    sys.exit(main())
