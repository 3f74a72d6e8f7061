"""An unmodified 4-rank job (no ranklens import) whose rank 1 computes 100 ms longer in forward
from step 8: ``fsdp2`` (fully_shard per layer and at the root, Adam, a DataLoader) or ``tp``
(DTensor tensor parallelism: ColwiseParallel/RowwiseParallel on a 1-D DeviceMesh, SGD)."""

import sys
import time

import torch
import torch.distributed as dist

SLOW_RANK, SLOW_FROM, SLOW_S, STEPS = 1, 8, 0.1, 20


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(64, 256)
        self.down = torch.nn.Linear(256, 64)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if dist.get_rank() == SLOW_RANK and self.calls > SLOW_FROM:
            time.sleep(SLOW_S)
        return self.down(torch.relu(self.up(x)))


def main() -> None:
    mode = sys.argv[1]
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = MLP()
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.up)
        fully_shard(model.down)
        fully_shard(model)
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
        model = parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.utils.data.TensorDataset(torch.randn(STEPS * 16, 64))
    for step, (x,) in enumerate(torch.utils.data.DataLoader(data, batch_size=16)):
        if mode == "tp":
            torch.manual_seed(step)  # every tp rank feeds the same batch
            x = torch.randn(16, 64)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
