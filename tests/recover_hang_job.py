"""A plain DDP job (no ranklens code) whose rank ``$HANG_RANK`` sleeps at step ``$HANG_STEP`` in its
first attempt only (``TORCHELASTIC_RESTART_COUNT`` 0, and not a requeued Slurm run:
``SLURM_RESTART_COUNT`` unset or 0): the `ranklens run --recover` tests. Rank 0
checkpoints every 4 steps; a restarted attempt resumes from the checkpoint ``$CKPT``. Prints
"trained N steps in attempt A" at the end."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    steps, bad, at = int(os.environ.get("STEPS", "24")), int(os.environ["HANG_RANK"]), int(os.environ["HANG_STEP"])
    ckpt = os.environ["CKPT"]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    requeued = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=False)
        model.module.load_state_dict(state["model"])
        start = int(state["step"])
    for step in range(start, steps):
        if attempt == 0 and not requeued and rank == bad and step == at:
            time.sleep(3600)  # stuck before the step's collectives (a dataloader, a host problem, ...)
        loss = model(torch.randn(8, 16)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.05)
        if rank == 0 and (step + 1) % 4 == 0:
            torch.save({"model": model.module.state_dict(), "step": step + 1}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
    dist.barrier()
    print(f"trained {steps - start} steps in attempt {attempt} on rank {rank}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
