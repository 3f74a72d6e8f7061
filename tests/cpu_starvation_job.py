"""tests/zero_code_job.py (an unmodified DDP script) on a host whose scheduler starves one rank.

The rank whose ``LOCAL_RANK`` is ``CS_NICE_RANK`` lowers its CPU weight by ``CS_NICE`` (``nice``:
with CPU hogs on the host it gets a smaller share of a core than its peers, as a rank in a
container with fewer CPU shares, or beside a noisy neighbour, does). Nothing else changes: it does
the same work as its peers. Used by tests/analyzers/test_cpu_starvation.py.
"""

import os
import runpy
from pathlib import Path

if os.environ.get("LOCAL_RANK", "") == os.environ.get("CS_NICE_RANK", "-1"):
    nice = int(os.environ.get("CS_NICE", "0"))
    os.nice(nice)  # this (main) thread and the threads it starts
    # torchrun starts each worker in a session of its own: with autogroup scheduling (most distros)
    # the CPU is shared between sessions first, so the weight that counts is the session's
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:
        pass  # no autogroup scheduling here (or no permission): the thread's nice is what counts
runpy.run_path(str(Path(__file__).with_name("zero_code_job.py")), run_name="__main__")
