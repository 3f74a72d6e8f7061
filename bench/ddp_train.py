"""A plain DDP training script (no ranklens import): an MLP on random data, CPU/gloo or CUDA/NCCL.
bench/ddp_overhead_bench.py runs it under plain torchrun and under ``ranklens run``. Rank 0 prints
``median_step_ms <x>`` over the steps after the warm-up, and ``wall_s <x>`` for the training loop."""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    dev = torch.device("cuda", dist.get_rank() % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    model = DDP(torch.nn.Sequential(*layers).to(dev), bucket_cap_mb=4)  # several buckets a step
    if os.environ.get("DDP_TRAIN_PY_HOOK") == "1":  # torch's own Python all-reduce hook (for comparison)
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(args.batch, args.width, device=dev)
    times = []
    start = time.perf_counter()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    wall = time.perf_counter() - start
    if dist.get_rank() == 0:
        print(f"median_step_ms {statistics.median(times[args.warmup :]) * 1e3:.3f}")
        print(f"wall_s {wall:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
