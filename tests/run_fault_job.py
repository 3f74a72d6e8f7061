"""A small real gloo job for the `ranklens run` fault tests (tests/app/test_run_faults.py).

Run as ``python tests/run_fault_job.py`` with RANK/WORLD_SIZE/MASTER_* set. After its first
collective it creates ``$RUN_FAULT_STARTED`` (when set) and waits for ``$RUN_FAULT_GO`` to exist
(when set), so a test can change the world (a spool made unwritable, a store started) at a known
point; then it runs ``$RUN_FAULT_STEPS`` more all-reduces, 0.1 s apart, and prints "trained".
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    t = torch.ones(64)
    dist.all_reduce(t)
    started, go = os.environ.get("RUN_FAULT_STARTED"), os.environ.get("RUN_FAULT_GO")
    if started:
        Path(started).touch()
    if go:
        deadline = time.monotonic() + 300  # the test starts a ClickHouse server first: slow on a loaded machine
        while not os.path.exists(go):
            if time.monotonic() > deadline:
                sys.exit("run_fault_job: nobody created " + go)
            time.sleep(0.05)
    steps = int(os.environ.get("RUN_FAULT_STEPS", "3"))
    for _ in range(steps):
        dist.all_reduce(t)
        time.sleep(0.1)
    dist.destroy_process_group()
    print(f"trained {steps} steps on rank {dist.get_rank() if dist.is_initialized() else os.environ['RANK']}")


if __name__ == "__main__":
    main()
