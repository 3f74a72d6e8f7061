"""A plain DDP training script with no ranklens code in it.

    ranklens run -- torchrun --nproc-per-node 4 examples/train.py

traces it: steps are not marked (the script has no step markers), but every collective, DDP's
gradient buckets included, lands in the arrival ledger. With EXAMPLE_EXPLICIT=1 the same script
calls ranklens' explicit API instead (tests compare the two).
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    steps = int(os.environ.get("EXAMPLE_STEPS", "5"))
    dist.init_process_group("gloo")
    if os.environ.get("EXAMPLE_EXPLICIT") == "1":
        import ranklens.tracing as rlt

        rlt.init()
    torch.manual_seed(0)
    rank = dist.get_rank()
    evens = dist.new_group([r for r in range(dist.get_world_size()) if r % 2 == 0])
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)), bucket_cap_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        loss = model(torch.randn(8, 32)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        stat = loss.detach().reshape(1)
        dist.all_reduce(stat)
        if rank % 2 == 0:
            dist.broadcast(stat, src=0, group=evens)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
