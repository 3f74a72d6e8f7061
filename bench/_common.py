"""What the bench scripts share: a free loopback port, the environment of one rank of a local
gloo job that spools to a directory, and stopping a job's rank processes. Imported as ``_common``
(the scripts run as ``python bench/NAME.py``, so bench/ is on the path)."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterable


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job_env(world: int, spool: str, job_id: str, **extra: str) -> dict[str, str]:
    """This process's environment for the ranks of a ``world``-rank job on this host (a fresh master
    port, one OpenMP thread) that spool to ``spool`` as ``job_id``; ``RANK`` is each rank's to add."""
    return {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world),
        "RANKLENS_SPOOL": spool,
        "RANKLENS_JOB_ID": job_id,
        "OMP_NUM_THREADS": "1",
        **extra,
    }


def kill_all(procs: Iterable[subprocess.Popen]) -> None:
    """Kill the processes and reap them."""
    for p in procs:
        p.kill()
        p.wait()
