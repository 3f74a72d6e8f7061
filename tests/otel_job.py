"""A rank of a small real gloo job for the OpenTelemetry export test: no ranklens setup (``ranklens
run`` starts the tracer), explicit step and phase markers, rank 1 slower in every step.

Run as ``ranklens run ... -- torchrun --standalone --nproc-per-node 2 tests/otel_job.py STEPS``.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

import ranklens.tracing as rlt


def main(steps: int) -> None:
    dist.init_process_group("gloo")  # ranklens run's bootstrap starts the tracer here
    rank = dist.get_rank()
    t = torch.ones(64)
    for n in range(steps):
        with rlt.step(n):
            with rlt.phase("forward"):
                time.sleep(0.2 if rank == 1 else 0.0)  # rank 0 waits for rank 1 at the all-reduce
            with rlt.phase("backward"):
                dist.all_reduce(t)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]))
