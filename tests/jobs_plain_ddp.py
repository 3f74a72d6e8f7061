"""A plain DDP training script with no ranklens code in it (tests/tracing/test_autostep.py runs it under
``ranklens run -- torchrun``): a DataLoader, a loss module, SGD or Adam.

Environment knobs (all optional):
    JOB_STEPS      training steps (default 14)
    JOB_OPT        sgd | adam | none (none: a hand-written update loop, no torch.optim)
    JOB_SLOW_RANK  the rank that is slow (default 1)
    JOB_SLOW_PHASE forward | backward | data | none (default none)
    JOB_SLOW_S     seconds it sleeps per step in that phase (default 0.15)
    JOB_SLOW_FROM  the first slow step (default 8)
    JOB_EXPLICIT   1: mark steps and phases with ranklens' explicit API instead (imports ranklens)
"""

import contextlib
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = int(os.environ.get("JOB_STEPS", "14"))
OPT = os.environ.get("JOB_OPT", "sgd")
SLOW_RANK = int(os.environ.get("JOB_SLOW_RANK", "1"))
SLOW_PHASE = os.environ.get("JOB_SLOW_PHASE", "none")
SLOW_S = float(os.environ.get("JOB_SLOW_S", "0.15"))
SLOW_FROM = int(os.environ.get("JOB_SLOW_FROM", "8"))
EXPLICIT = os.environ.get("JOB_EXPLICIT") == "1"


class Counter:
    """The training step this rank is in, counted by the script itself (no ranklens)."""

    step = 0

    @classmethod
    def slow(cls, phase: str) -> None:
        if phase == SLOW_PHASE and dist.get_rank() == SLOW_RANK and cls.step >= SLOW_FROM:
            time.sleep(SLOW_S)


class SlowGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        Counter.slow("backward")
        return g


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Counter.slow("forward")
        return self.head(SlowGrad.apply(self.body(x)))


def collate(items):
    Counter.slow("data")
    xs, ys = zip(*items)
    return torch.stack(xs), torch.stack(ys)


def main() -> None:
    dist.init_process_group("gloo")
    rlt = None
    if EXPLICIT:
        import ranklens.tracing as rlt

        rlt.init()
    torch.manual_seed(0)
    model = DDP(Net(), bucket_cap_mb=0.01)
    data = torch.utils.data.TensorDataset(torch.randn(8 * STEPS, 32), torch.randn(8 * STEPS, 4))
    loader = torch.utils.data.DataLoader(data, batch_size=8, collate_fn=collate)
    opt = None
    if OPT == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    elif OPT == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    lossf = nn.MSELoss()

    def mark(what, n=None):
        if rlt is None:
            return contextlib.nullcontext()
        return rlt.step(n) if what == "step" else rlt.phase(what)

    it = iter(loader)
    for i in range(STEPS):
        Counter.step = i
        with mark("step", i):
            with mark("data"):
                x, y = next(it)
            with mark("forward"):
                loss = lossf(model(x), y)
            with mark("backward"):
                loss.backward()
            with mark("optimizer"):
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
