"""The drills' training job: a plain DDP script with no ranklens code in it.

    python -m torch.distributed.run --standalone --nproc-per-node 4 -m ranklens.drill.workload --steps 40

A small MLP on gloo, fed by a DataLoader, with an all-reduce of the loss every step (as scripts
log a global loss). A model on this machine's CPU computes in microseconds, so each forward and
backward also waits ``--compute-ms`` (the device time a real model would take), which keeps four
ranks on two cores from measuring the host instead of the job.

On several nodes, ``--exchange-mb X`` adds the cross-node traffic of model-parallel groups that
span nodes (tensor, context or expert parallel): every pair of nodes has a process group per local
rank, and each forward all-reduces an X MiB activation in each of the rank's pair groups. A slow
node link is then told from a slow job: groups through the link are slow, the others are not (the
tomography of ``ranklens.analyzers.links``). The network drills (``--suite network``) use it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ranklens.drill.workload")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--compute-ms", type=float, default=60.0, help="device time of forward + backward per step")
    p.add_argument("--checkpoint", default="", help="checkpoint file: saved every 5 steps by rank 0, resumed from")
    p.add_argument(
        "--exchange-mb",
        type=float,
        default=0.0,
        help="MiB each forward all-reduces in every cross-node pair group of the rank (0: none)",
    )
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, Subset, TensorDataset

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

    pair_groups = _pair_groups(dist, torch) if args.exchange_mb > 0 else []
    activations = [torch.ones(max(1, int(args.exchange_mb * (1 << 20) / 4))) for _ in pair_groups]

    class Exchange(nn.Module):
        """The activation exchange of model-parallel groups that span nodes (see the module doc)."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # all of the rank's groups at once (as overlapped model-parallel traffic): every rank's
            # forward then waits for its slowest link, so a slow link does not make one rank look slow
            works = [dist.all_reduce(buf, group=g, async_op=True) for g, buf in zip(pair_groups, activations)]
            for w in works:
                w.wait()
            return x

    torch.manual_seed(0)
    layers = [nn.Linear(32, 128), nn.ReLU(), Device(), nn.Linear(128, 4)]
    if pair_groups:
        layers.insert(3, Exchange())
    model = DDP(nn.Sequential(*layers), bucket_cap_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    if args.checkpoint and os.path.exists(args.checkpoint):  # a restarted attempt resumes
        state = torch.load(args.checkpoint, weights_only=False)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"])
        if rank == 0:
            print(f"resumed from step {start}", flush=True)
    gen = torch.Generator().manual_seed(rank)
    data = TensorDataset(
        torch.randn(args.steps * 16, 32, generator=gen), torch.randn(args.steps * 16, 4, generator=gen)
    )
    loader = DataLoader(Subset(data, range(start * 16, args.steps * 16)), batch_size=16)
    for step, (x, y) in enumerate(loader, start):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().reshape(1)
        dist.all_reduce(total)
        if rank == 0:
            print(f"step {step + 1}/{args.steps} loss {total.item() / dist.get_world_size():.4f}", flush=True)
            if args.checkpoint and (step + 1) % 5 == 0:
                tmp = args.checkpoint + ".tmp"
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step + 1}, tmp)
                os.replace(tmp, args.checkpoint)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _pair_groups(dist: Any, torch: Any) -> list[Any]:
    """This rank's groups of the cross-node pairs: for each pair of nodes a and b, the ranks of one
    local rank on both. Every rank creates every group (torch requires it), in one order."""
    me = torch.tensor([int(os.environ.get("GROUP_RANK", "0") or 0), int(os.environ.get("LOCAL_RANK", "0") or 0)])
    layout = [torch.zeros(2, dtype=me.dtype) for _ in range(dist.get_world_size())]
    dist.all_gather(layout, me)
    where = {(int(t[0]), int(t[1])): r for r, t in enumerate(layout)}
    nodes = sorted({n for n, _ in where})
    mine = []
    for i, a in enumerate(nodes):
        for b in nodes[i + 1 :]:
            for local in sorted({lr for n, lr in where if n == a}):
                if (b, local) not in where:
                    continue
                ranks = [where[(a, local)], where[(b, local)]]
                g = dist.new_group(ranks)
                if dist.get_rank() in ranks:
                    mine.append(g)
    return mine


if __name__ == "__main__":
    sys.exit(main())
