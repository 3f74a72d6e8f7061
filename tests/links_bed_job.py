"""One rank of a small 3D-parallel gloo job on the network-namespace test bed (tests/analyzers/test_links_netbed.py).

8 ranks on 4 nodes (node k holds ranks 2k, 2k+1). TP pairs within a node all-reduce 1 MiB (over
lo, never throttled); pipeline stages are nodes {0, 1} and {2, 3}, rank r exchanges activations
and gradients (512 KiB) with r + 4; data-parallel pairs across nodes of one stage ({0,2}, {1,3},
{4,6}, {5,7}) all-reduce 1 MiB. So node 3's link carries DP pairs with node 2 and PP pairs with
node 1, and every other node also has groups that avoid node 3.

The job runs several scenarios in the same processes (a new tracer and job id each, sharing the
expensive start-up); between scenarios rank 0 writes ``<ctl>/done-<name>`` and waits for
``<ctl>/go-<next>`` so the test can throttle or unthrottle the bed. Env: RANK, WORLD_SIZE,
MASTER_ADDR/PORT, RANKLENS_SPOOL, BED_JOB (job id prefix), BED_CTL, BED_SCENARIOS
("name:steps[:straggler_rank]" comma-separated).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import ranklens.tracing as rlt

STRAGGLER_S = 0.15


def _wait_for(path: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} after {timeout_s} s")
        time.sleep(0.02)


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 8, "the bed job is laid out for 4 nodes x 2 ranks"
    node = rank // 2
    tp_groups = [dist.new_group([2 * k, 2 * k + 1]) for k in range(4)]
    dp_groups = [dist.new_group(list(r)) for r in ((0, 2), (1, 3), (4, 6), (5, 7))]
    tp = tp_groups[node]
    dp = next(g for g, r in zip(dp_groups, ((0, 2), (1, 3), (4, 6), (5, 7))) if rank in r)
    first_stage = rank < 4
    peer = rank + 4 if first_stage else rank - 4
    tp_buf = torch.ones(1 << 18)  # 1 MiB
    dp_buf = torch.ones(1 << 18)
    act = torch.ones(1 << 17)  # 512 KiB
    ctl = Path(os.environ["BED_CTL"])
    scenarios = [s.split(":") for s in os.environ["BED_SCENARIOS"].split(",")]
    for i, spec in enumerate(scenarios):
        name, steps = spec[0], int(spec[1])
        straggler = int(spec[2]) if len(spec) > 2 else -1
        if i > 0:
            if rank == 0:
                _wait_for(ctl / f"go-{name}")
            dist.barrier()
        rlt.init(job_id=f"{os.environ['BED_JOB']}-{name}", flush_interval_s=0.2)
        for step in range(steps):
            with rlt.step(step):
                with rlt.phase("forward"):
                    time.sleep(0.02 + (STRAGGLER_S if rank == straggler and step >= 1 else 0.0))
                    dist.all_reduce(tp_buf, group=tp)
                    if first_stage:
                        dist.send(act, dst=peer)
                    else:
                        dist.recv(act, src=peer)
                with rlt.phase("backward"):
                    if first_stage:
                        dist.recv(act, src=peer)
                    else:
                        dist.send(act, dst=peer)
                    dist.all_reduce(dp_buf, group=dp)
        rlt.shutdown()
        dist.barrier()
        if rank == 0:
            (ctl / f"done-{name}").write_text("ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    os._exit(0)
