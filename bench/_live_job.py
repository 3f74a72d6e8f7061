"""An unmodified DDP training script (no ranklens import) with one fault, for bench/live_bench.py.

Run as ``ranklens run ... -- torchrun --standalone --nproc-per-node 4 bench/_live_job.py``: the
zero-code path users take. Each iteration: a batch, a forward pass of ~``LIVE_STEP_S`` seconds
(a sleep plus a small matmul: the pace stays steady on a loaded 2-core machine), backward (DDP's
bucket all-reduces), an optimizer step.

Env: ``LIVE_MODE`` = hang | straggler | healthy, ``LIVE_RANK`` (the faulty rank), ``LIVE_FROM``
(the iteration the fault starts at), ``LIVE_SLOWDOWN`` (straggler: its forward takes this many
times as long), ``LIVE_STEPS``, ``LIVE_MARKER`` (the faulty rank writes the fault's onset there,
epoch nanoseconds, as the fault starts). A hang is a rank that stops before its backward (alive,
in host code: a stuck data loader or a deadlock), so its peers wait in the bucket all-reduce.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

MODE = os.environ.get("LIVE_MODE", "healthy")
BAD = int(os.environ.get("LIVE_RANK", "-1"))
FROM = int(os.environ.get("LIVE_FROM", "20"))
SLOWDOWN = float(os.environ.get("LIVE_SLOWDOWN", "2"))
STEP_S = float(os.environ.get("LIVE_STEP_S", "0.1"))
STEPS = int(os.environ.get("LIVE_STEPS", "100000"))


def mark() -> None:
    path = os.environ["LIVE_MARKER"]
    with open(f"{path}.tmp", "w") as f:
        f.write(str(time.time_ns()))
    os.replace(f"{path}.tmp", path)  # the bench never reads half a number


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    work = torch.randn(64, 64)
    for it in range(STEPS):
        x, y = torch.randn(16, 64), torch.randn(16, 8)
        faulty = rank == BAD and it >= FROM
        if faulty and it == FROM and MODE in ("hang", "straggler"):
            mark()
        t0 = time.monotonic()
        out = model(x) + 0.0 * torch.tanh(work @ work).mean()
        pace = STEP_S * (SLOWDOWN if faulty and MODE == "straggler" else 1.0)
        time.sleep(max(0.0, pace - (time.monotonic() - t0)))
        if faulty and MODE == "hang":
            time.sleep(3600)  # stops before backward: the peers wait in the bucket all-reduce
        (out - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
