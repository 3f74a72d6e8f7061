"""A rank of a real gloo job whose rank FR_RANK passes a tensor of another size to the world
all_reduce of step FR_STEP (for the flight-recorder post-mortem tests). gloo aborts the peer that
receives more data than it expects (SIGABRT, no dump); the tracer dumps the others' flight
recorder into <spool>/<job>/<attempt>/fr/ when their collective fails."""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

import ranklens.tracing as rlt


def main() -> int:
    bad = int(os.environ.get("FR_RANK", "2"))
    at = int(os.environ.get("FR_STEP", "4"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    rlt.init(flush_interval_s=0.2)
    try:
        for step in range(at + 3):
            with rlt.step(step):
                n = 1000 if (rank == bad and step == at) else 520
                dist.all_reduce(torch.ones(n))
    except Exception as e:  # the peers of the aborted rank: connection closed / reset
        print(f"rank {rank}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        rlt.shutdown()
        return 1
    rlt.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
