"""One rank of the demo job: a small MLP trained with DDP on gloo, plus an extra process group.

Run by :func:`ranklens.demo.run_demo` under torchrun (``python -m ranklens.demo.worker``); the
usual torch.distributed variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) come from the
launcher. The demo slows a rank with a drill fault from outside (the bootstrap injects it into the
model's forward, ``backward()`` or the DataLoader); ``--slow-rank`` here is the same emulation for
running the worker by hand: that rank's phase takes ``slowdown`` times as long.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ranklens.demo.worker")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slowdown", type=float, default=1.0)
    p.add_argument("--slow-from-step", type=int, default=0)
    p.add_argument("--compute-ms", type=float, default=80.0)
    p.add_argument("--slow-phase", choices=("forward", "backward", "data"), default="forward")
    p.add_argument("--report-steps", action="store_true", help="rank 0 prints 'steptime <seconds>' per step")
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset

    import ranklens.tracing as rlt

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rlt.init()

    # An extra process group next to DDP's world group: pairs of ranks (like tensor-parallel).
    pairs = [dist.new_group([r, r + 1], group_desc=f"pair_{r // 2}") for r in range(0, world - 1, 2)]
    my_pair = pairs[rank // 2] if rank // 2 < len(pairs) else None

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))
    ddp = DDP(model, bucket_cap_mb=0.25)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1000 + rank)
    data = TensorDataset(
        torch.randn(args.steps * 32, 64, generator=gen), torch.randn(args.steps * 32, 8, generator=gen)
    )
    batches = iter(DataLoader(data, batch_size=32))

    def stretch(phase: str, base_s: float) -> float:
        """The emulated device (or input) time of a phase: the same on every rank, stretched on
        the slowed rank's chosen phase from the chosen step."""
        if rank == args.slow_rank and step >= args.slow_from_step and phase == args.slow_phase:
            return base_s * args.slowdown
        return base_s

    for step in range(args.steps):
        step_start = time.perf_counter()
        with rlt.step(step, samples=32):
            with rlt.phase("data"):
                x, y = next(batches)
                time.sleep(stretch("data", args.compute_ms / 4000.0))
            with rlt.phase("forward"):
                # the emulated device time first, then the model's own (a drill fault adds to it)
                time.sleep(stretch("forward", args.compute_ms / 2000.0))
                loss = nn.functional.mse_loss(ddp(x), y)
            with rlt.phase("backward"):
                # backward compute comes before the gradient buckets are ready, so a slow backward
                # delays this rank's DDP all-reduces
                time.sleep(stretch("backward", args.compute_ms / 2000.0))
                loss.backward()  # DDP bucket all-reduces: traced (init() instruments DDP)
            with rlt.phase("optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)
            if my_pair is not None:
                metric = loss.detach().reshape(1)
                dist.all_reduce(metric, group=my_pair)
        if rank == 0:
            if args.report_steps:
                print(f"steptime {time.perf_counter() - step_start:.6f}", flush=True)
            print(f"step {step + 1}/{args.steps} loss {loss.item():.4f}", flush=True)

    dist.barrier()
    rlt.shutdown()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
