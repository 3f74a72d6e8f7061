"""A rank of a real 8-rank gloo job laid out with a DeviceMesh (pp x dp_replicate x tp, named),
so the tracer learns the rank's coordinates without being told. Run by tests/tracing/test_tracing.py."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import ranklens.tracing as rlt


def main() -> None:
    dist.init_process_group("gloo")
    rlt.init(flush_interval_s=0.1)  # no pp=/tp=/dp=: they come from the mesh
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp_replicate", "tp"))
    tp = mesh["tp"]  # a sub-mesh: must not be taken for the job's layout
    for step in range(2):
        with rlt.step(step):
            dist.all_reduce(torch.ones(4), group=tp.get_group())
            dist.all_reduce(torch.ones(4), group=mesh.get_group("dp_replicate"))
    rlt.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    os._exit(0)
