"""A rank of a small real torch.distributed (gloo) job that calls many collective kinds.

Run by tests as ``python tests/dist_job.py`` with RANK/WORLD_SIZE/MASTER_* set.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import ranklens.tracing as rlt


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rlt.init(flush_interval_s=0.1)
    evens = dist.new_group([r for r in range(world) if r % 2 == 0], group_desc="evens")
    t = torch.ones(256)
    for step in range(3):
        with rlt.step(step):
            with rlt.phase("forward"):
                if rank == 1:
                    time.sleep(0.2)  # rank 1 arrives late at the first all_reduce of every step
            dist.all_reduce(t)
            dist.broadcast(t, src=0)
            out = torch.zeros(256 * world)
            dist.all_gather_into_tensor(out, t)
            rs = torch.zeros(256 // world)
            dist.reduce_scatter_tensor(rs, t[: (256 // world) * world].clone())
            if rank % 2 == 0:
                dist.all_reduce(t, group=evens)
            work = dist.all_reduce(t, async_op=True)
            time.sleep(0.2)  # a late wait() must not stretch the recorded completion
            work.wait()
            if rank in (0, 1):
                peer = 1 - rank
                if rank == 0:
                    dist.send(torch.ones(10), dst=peer)
                    req = dist.irecv(torch.zeros(10), src=peer)
                else:
                    dist.recv(torch.zeros(10), src=peer)
                    req = dist.isend(torch.ones(10), dst=peer)
                req.wait()
            # the rest of what gloo supports
            dist.reduce(t, dst=0)
            parts = [torch.zeros(256) for _ in range(world)]
            dist.all_gather(parts, t)
            dist.gather(t, gather_list=[torch.zeros(256) for _ in range(world)] if rank == 0 else None, dst=0)
            dist.scatter(
                torch.zeros(256), scatter_list=[torch.ones(256) for _ in range(world)] if rank == 0 else None, src=0
            )
            a2a_out = torch.zeros(4 * world)
            dist.all_to_all_single(a2a_out, torch.ones(4 * world))
            ops = [
                dist.P2POp(dist.isend, torch.ones(8), (rank + 1) % world),
                dist.P2POp(dist.irecv, torch.zeros(8), (rank - 1) % world),
            ]
            for req in dist.batch_isend_irecv(ops):
                req.wait()
            dist.barrier()
    rlt.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    os._exit(0)
