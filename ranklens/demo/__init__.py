"""``ranklens demo``: a real multi-rank training job, observed end to end.

Launches N gloo ranks on this machine (a small DDP model plus an extra process group), one of
them optionally slowed, ships their spools into the store *while the job runs*, then analyzes
the job and returns the findings.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ranklens.analyzers import Finding, find_stragglers, save_findings
from ranklens.collector import Shipper
from ranklens.config import ENV_JOB_ID, ENV_SPOOL
from ranklens.errors import ConfigError, RanklensError
from ranklens.store.api import Store

__all__ = ["DemoFailed", "DemoResult", "run_demo"]


class DemoFailed(RanklensError):
    """The demo's training job did not finish."""

    exit_code = 7


@dataclass
class DemoResult:
    job_id: str
    ranks: int
    steps: int
    slow_rank: int | None
    wall_s: float
    rows: dict[str, int]
    findings: list[Finding] = field(default_factory=list)
    log_dir: str = ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_demo(
    store: Store,
    *,
    ranks: int = 4,
    slow_rank: int | None = 2,
    slowdown: float = 2.0,
    steps: int = 30,
    slow_from_step: int = 5,
    compute_ms: float = 80.0,
    slow_phase: str = "forward",
    timeout_s: float = 600.0,
    log: Callable[[str], None] = lambda s: None,
    on_step: Callable[[int], None] | None = None,
) -> DemoResult:
    """Run the demo job and analyze it. ``slow_rank=None`` runs a healthy job.

    Raises:
        ConfigError: bad options. DemoFailed: a rank failed or the job timed out.
    """
    if ranks < 2:
        raise ConfigError(f"--ranks {ranks}: the demo needs at least 2 ranks")
    if steps < 5:
        raise ConfigError(f"--steps {steps}: the demo needs at least 5 steps")
    if slow_rank is not None:
        if not 0 <= slow_rank < ranks:
            raise ConfigError(f"--slow-rank {slow_rank} is not a rank of a {ranks}-rank job (0..{ranks - 1})")
        if slowdown <= 1.0:
            raise ConfigError(f"--slowdown {slowdown}: must be > 1 (1.5 = compute takes 50% longer)")
        if slow_phase not in ("forward", "backward", "data"):
            raise ConfigError(f"--slow-phase {slow_phase!r}: choose forward, backward or data")
        if not 0 <= slow_from_step < steps:
            raise ConfigError(f"--slow-from-step {slow_from_step} must be in 0..{steps - 1}")
    job_id = f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    work = Path(tempfile.mkdtemp(prefix="ranklens-demo-"))
    spool = work / "spool"
    logs = work / "logs"
    logs.mkdir(parents=True)
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(ranks),
        ENV_JOB_ID: job_id,
        ENV_SPOOL: str(spool),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    args = ["--steps", str(steps), "--compute-ms", str(compute_ms)]
    if slow_rank is not None:
        args += [
            "--slow-rank",
            str(slow_rank),
            "--slowdown",
            str(slowdown),
            "--slow-from-step",
            str(slow_from_step),
            "--slow-phase",
            slow_phase,
        ]
    procs = []
    start = time.monotonic()
    for r in range(ranks):
        out = open(logs / f"rank{r}.log", "w")
        procs.append(
            (
                subprocess.Popen(
                    [sys.executable, "-m", "ranklens.demo.worker", *args],
                    env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=work,
                ),
                out,
            )
        )
    log(
        f"job {job_id}: {ranks} ranks x {steps} steps on gloo"
        + (
            f", rank {slow_rank}'s {slow_phase} slowed {slowdown}x from step {slow_from_step}"
            if slow_rank is not None
            else ", healthy"
        )
    )

    # Ship spools into the store while the job runs (the live path).
    shipper = Shipper(spool, store)
    loop = shipper.start(interval_s=0.5)
    failed = None
    last_step = 0
    try:
        while any(p.poll() is None for p, _ in procs):
            if time.monotonic() - start > timeout_s:
                failed = f"timed out after {timeout_s:.0f} s"
                break
            if any(p.poll() not in (None, 0) for p, _ in procs):
                failed = "a rank failed"
                time.sleep(2.0)  # let the others notice and exit
                break
            if on_step:
                s = _last_step(logs / "rank0.log")
                if s > last_step:
                    last_step = s
                    on_step(s)
            time.sleep(0.2)
    finally:
        for p, out in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            out.close()
    codes = {r: p.returncode for r, (p, _) in enumerate(procs)}
    if failed is None and any(codes.values()):
        failed = "a rank failed"
    loop.close(timeout_s=120)  # the last pass
    if failed:
        bad = [r for r, c in codes.items() if c != 0] or list(codes)
        tail = (logs / f"rank{bad[0]}.log").read_text()[-3000:]
        raise DemoFailed(f"the demo job {failed} (exit codes {codes}); logs in {logs}\n--- rank {bad[0]} ---\n{tail}")
    findings = find_stragglers(store, job_id, 0)
    save_findings(store, findings)
    shutil.rmtree(spool, ignore_errors=True)
    return DemoResult(
        job_id=job_id,
        ranks=ranks,
        steps=steps,
        slow_rank=slow_rank,
        wall_s=time.monotonic() - start,
        rows=dict(shipper.totals),
        findings=findings,
        log_dir=str(logs),
    )


def _last_step(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 200))
            tail = f.read().decode(errors="replace")
    except OSError:
        return 0
    for line in reversed(tail.splitlines()):
        if line.startswith("step ") and "/" in line:
            try:
                return int(line.split()[1].split("/")[0])
            except ValueError:
                return 0
    return 0
