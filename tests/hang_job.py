"""A rank of a real gloo job that injects one fault (for the live hang tests).

Env: HANG_MODE = sleep | exit | desync | subgroup | slow | healthy, HANG_RANK, HANG_STEP,
HANG_SECONDS, HANG_MARKER (a file the faulty rank writes "<epoch ns>" to when the fault starts).
Each step: a pair all_reduce ([0,1], [2,3], ...), then a world all_reduce.
"""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

import ranklens.tracing as rlt


def mark() -> None:
    with open(os.environ["HANG_MARKER"], "w") as f:
        f.write(str(time.time_ns()))


def main() -> None:
    mode = os.environ.get("HANG_MODE", "healthy")
    bad = int(os.environ.get("HANG_RANK", "-1"))
    at = int(os.environ.get("HANG_STEP", "3"))
    secs = float(os.environ.get("HANG_SECONDS", "60"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    rlt.init(flush_interval_s=0.2)
    pairs = [dist.new_group([r, r + 1], group_desc=f"pair_{r // 2}") for r in range(0, world, 2)]
    mine = pairs[rank // 2]
    t = torch.ones(64)
    for step in range(int(os.environ.get("HANG_STEPS", "1000"))):
        with rlt.step(step):
            with rlt.phase("compute"):
                time.sleep(1.0 if mode == "slow" else 0.03)
                if mode == "slow" and rank == bad:
                    time.sleep(0.4)
                if step == at and rank == bad and mode == "subgroup":
                    mark()
                    time.sleep(secs)
            dist.all_reduce(t, group=mine)
            with rlt.phase("data"):
                if step == at and rank == bad and mode == "sleep":
                    mark()
                    time.sleep(secs)
                if step == at and rank == bad and mode == "exit":
                    mark()
                    os._exit(3)
            if step == at and rank == bad and mode == "desync":
                mark()
                dist.broadcast(t, src=0)
            else:
                dist.all_reduce(t)
    rlt.shutdown()


if __name__ == "__main__":
    main()
