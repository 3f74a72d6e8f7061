"""Start the netbed job (tests/links_bed_job.py): its 8 ranks, two a node, on a :class:`NetBed` of 4
network-namespace nodes. Used by tests/analyzers/test_links_netbed.py and bench/netbed_noise.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ranklens.analyzers.netbed import NetBed

JOB = Path(__file__).with_name("links_bed_job.py")
RANKS = 8


def start_bed_job(
    bed: NetBed, *, job: str, ctl: Path, spool: Path, scenarios: str, port: int
) -> list[subprocess.Popen[str]]:
    """The job's ranks (rank ``r`` on node ``r // 2``), started; their output is piped. ``job``: the
    job id prefix, ``ctl``: the directory of its done-/go- files, ``scenarios``: "name:steps[:rank]"
    comma-separated (the job's docstring)."""
    env = {
        **os.environ,
        "WORLD_SIZE": str(RANKS),
        "MASTER_ADDR": bed.address(0),
        "MASTER_PORT": str(port),
        "RANKLENS_SPOOL": str(spool),
        "OMP_NUM_THREADS": "1",
        "BED_JOB": job,
        "BED_CTL": str(ctl),
        "BED_SCENARIOS": scenarios,
    }
    return [
        subprocess.Popen(
            bed.command(r // 2, [sys.executable, str(JOB)]),
            env={**env, **bed.env(r // 2), "RANK": str(r), "LOCAL_RANK": str(r % 2)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(RANKS)
    ]
