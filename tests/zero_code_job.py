"""An unmodified DDP training script (no ranklens import) with one rank slowed on purpose.

Run under ``ranklens run -- torchrun --standalone --nproc-per-node 4 tests/zero_code_job.py`` by
tests/zero_code_helpers.py. Everything a new user's script has: gloo, a DataLoader, DDP, an
optimizer. The slowdown is a sleep of ``ZC_SLOW_S`` seconds per step on rank ``ZC_SLOW_RANK`` from
iteration ``ZC_SLOW_FROM`` (0-based) on, in the phase ``ZC_SLOW_PHASE``:

- ``forward``: inside the model's forward;
- ``backward``: at the start of backward (before any gradient bucket is ready, so every bucket
  all-reduce of that rank is late);
- ``data``: inside the DataLoader's collate function (the main process: ``num_workers=0``).

With ``ZC_NO_OPTIMIZER=1`` the update is a hand-written SGD loop (no torch.optim): nothing tells
the tracer where a step ends, and the analysis works from the arrival ledger alone.

Every rank also computes ~``ZC_BASE_S`` per step (real matmuls, so a busy CPU slows it like a real job).
"""

import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

STEPS = int(os.environ.get("ZC_STEPS", "16"))
SLOW_RANK = int(os.environ.get("ZC_SLOW_RANK", "-1"))
SLOW_PHASE = os.environ.get("ZC_SLOW_PHASE", "forward")
SLOW_S = float(os.environ.get("ZC_SLOW_S", "0"))
SLOW_FROM = int(os.environ.get("ZC_SLOW_FROM", "6"))
BATCH = 16


def _slow_here(phase: str, it: int) -> bool:
    return dist.get_rank() == SLOW_RANK and phase == SLOW_PHASE and it >= SLOW_FROM and SLOW_S > 0


class Data(Dataset):
    def __len__(self) -> int:
        return STEPS * BATCH

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(64, generator=g), torch.randn(8, generator=g)


class Collate:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        if _slow_here("data", self.calls):
            time.sleep(SLOW_S)
        self.calls += 1
        return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


class SlowBackward(torch.autograd.Function):
    it = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if _slow_here("backward", SlowBackward.it):
            time.sleep(SLOW_S)
        return g


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))
        self.it = 0
        self.work = torch.randn(160, 160)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _slow_here("forward", self.it):
            time.sleep(SLOW_S)
        w = self.work
        for _ in range(int(os.environ.get("ZC_BASE_MATMULS", "40"))):  # the step's "compute"
            w = torch.tanh(w @ self.work)
        self.it += 1
        return SlowBackward.apply(self.body(x) + 0.0 * w.mean())


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = DDP(Model(), bucket_cap_mb=0.1)
    # ZC_NO_OPTIMIZER=1: a custom update loop (no torch.optim), so no step can be inferred
    opt = None if os.environ.get("ZC_NO_OPTIMIZER") == "1" else torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Data(), batch_size=BATCH, collate_fn=Collate(), num_workers=0)
    for it, (x, y) in enumerate(loader):
        SlowBackward.it = it
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()
        else:
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.01 * p.grad
                    p.grad = None
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
