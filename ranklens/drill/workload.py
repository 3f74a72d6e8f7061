"""The drills' training job: a plain DDP script with no ranklens code in it.

    python -m torch.distributed.run --standalone --nproc-per-node 4 -m ranklens.drill.workload --steps 40

A small MLP on gloo, fed by a DataLoader, with an all-reduce of the loss every step (as scripts
log a global loss). A model on this machine's CPU computes in microseconds, so each forward and
backward also waits ``--compute-ms`` (the device time a real model would take), which keeps four
ranks on two cores from measuring the host instead of the job.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ranklens.drill.workload")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--compute-ms", type=float, default=60.0, help="device time of forward + backward per step")
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    device_s = args.compute_ms / 2000.0

    class Device(nn.Module):
        """Waits the device time of a layer (forward here, backward in its gradient hook)."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(device_s)
            if x.requires_grad:
                x.register_hook(_backward_wait)
            return x

    def _backward_wait(grad: torch.Tensor) -> torch.Tensor:
        time.sleep(device_s)
        return grad

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 128), nn.ReLU(), Device(), nn.Linear(128, 4)), bucket_cap_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    data = TensorDataset(
        torch.randn(args.steps * 16, 32, generator=gen), torch.randn(args.steps * 16, 4, generator=gen)
    )
    loader = DataLoader(data, batch_size=16)
    for step, (x, y) in enumerate(loader):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().reshape(1)
        dist.all_reduce(total)
        if rank == 0:
            print(f"step {step + 1}/{args.steps} loss {total.item() / dist.get_world_size():.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
