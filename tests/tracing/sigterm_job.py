"""A 2-rank gloo job for the SIGTERM tests (tests/tracing/test_sigterm.py). MODE:

- ``stuck``: after 3 steps rank 1 stops and rank 0 waits inside an all_reduce (blocked in C);
- ``user``: rank 0 installs its own SIGTERM handler after init and sleeps (world 1);
- ``fork``: rank 0 forks a child that gets SIGTERM; the parent goes on (world 1).
"""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import ranklens.tracing as rlt

mode = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
rlt.init(flush_interval_s=60.0)  # nothing leaves by the periodic flush: only the exit path
for step in range(3):
    with rlt.step(step):
        t = torch.ones(64)
        dist.all_reduce(t)
if mode == "stuck":
    if rank == 1:
        print("stopped", flush=True)
        time.sleep(600)
    print("entering", flush=True)
    dist.all_reduce(torch.ones(64))
elif mode == "user":

    def mine(signum, frame):
        with open(os.environ["MARKER"], "w") as f:
            f.write("user handler ran")
        sys.exit(0)

    signal.signal(signal.SIGTERM, mine)
    print("ready", flush=True)
    time.sleep(600)
elif mode == "fork":
    pid = os.fork()
    if pid == 0:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        os._exit(3)  # not reached: SIGTERM's default action ends the child
    _, status = os.waitpid(pid, 0)
    print(f"child status {os.waitstatus_to_exitcode(status)}", flush=True)
    time.sleep(1.0)  # the parent's thread would have acted on a stray byte by now
    print("parent alive", flush=True)
