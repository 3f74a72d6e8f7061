"""An unmodified training script (no ranklens import) whose collectives come from APIs other than
``torch.distributed``'s functions: run as ``torchrun ... tests/jobs_capture.py MODE``.

Modes:
- ``fsdp2``: ``fully_shard`` per layer and at the root (FSDP2 on gloo/CPU), Adam, a DataLoader;
- ``tp``: a DeviceMesh and ``parallelize_module`` with ColwiseParallel/RowwiseParallel (DTensor's
  functional collectives), Adam;
- ``mix``: DDP (with ranklens' hook, and with a builtin C++ hook whose all-reduces never reach
  Python), pipeline-style ``batch_isend_irecv``, object collectives,
  coalesced ops (``_coalescing_manager``, ``all_reduce_coalesced``, functional coalesced) and
  functional collectives called directly;
- ``all``: the three in turn, in one job (one process start-up for the tests).

At the end each rank writes torch's own flight-recorder ring (``_dump_fr_trace_json``) to
``$CAPTURE_FR_DIR/rank<r>.json`` so the test compares the ledger with it.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

STEPS = 3


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))


def loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(8 * STEPS, 16, generator=g), torch.randn(8 * STEPS, 4, generator=g)
    data = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(data, batch_size=8)


def train(model: nn.Module, params) -> None:
    opt = torch.optim.Adam(params, lr=1e-3)
    for x, y in loader():
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()


def fsdp2() -> None:
    from torch.distributed.fsdp import fully_shard

    model = mlp()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    train(model, model.parameters())


def tp() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)  # the same input on every rank of the TP group
    for _ in range(STEPS):
        out = model(torch.randn(8, 16, generator=g))
        out.sum().backward()
        opt.step()
        opt.zero_grad()


def mix() -> None:
    import torch.distributed._functional_collectives as funcol
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    model = DDP(mlp())  # under ranklens run: its buckets go through ranklens' comm hook (wrapped)
    train(model, model.parameters())
    native = DDP(mlp())  # a builtin (C++) hook: its all-reduces never reach Python
    native._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    train(native, native.parameters())
    for _ in range(2):  # pipeline-style neighbour exchange
        ops = [
            dist.P2POp(dist.isend, torch.ones(8), (rank + 1) % world),
            dist.P2POp(dist.irecv, torch.zeros(8), (rank - 1) % world),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    objs: list = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    box = [{"step": 1}, "x"] if rank == 0 else [None, None]
    dist.broadcast_object_list(box, src=0)
    t = torch.ones(4)
    with dist._coalescing_manager():
        dist.all_reduce(t)
        dist.all_reduce(torch.ones(3))
    dist.all_reduce_coalesced([t, torch.ones(5)])
    for y in funcol.all_reduce_coalesced([t, torch.ones(2)], "sum", dist.group.WORLD):
        funcol.wait_tensor(y)
    funcol.wait_tensor(funcol.all_reduce(t, "sum", dist.group.WORLD))
    funcol.wait_tensor(funcol.all_gather_tensor(t, 0, dist.group.WORLD))
    evens = dist.new_group([r for r in range(world) if r % 2 == 0])
    if rank % 2 == 0:
        funcol.wait_tensor(funcol.all_reduce(t, "sum", evens))


def main() -> None:
    mode = sys.argv[1]
    dist.init_process_group("gloo")
    parts = {"fsdp2": fsdp2, "tp": tp, "mix": mix}
    for part in parts if mode == "all" else [mode]:
        parts[part]()
    dist.barrier()
    out = os.environ.get("CAPTURE_FR_DIR")
    if out:
        data = torch._C._distributed_c10d._dump_fr_trace_json()
        with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "wb") as f:
            f.write(data if isinstance(data, bytes) else str(data).encode())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
