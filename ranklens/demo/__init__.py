"""``ranklens demo``: a real multi-rank training job, observed end to end.

Launches N gloo ranks on this machine under torchrun (a small DDP model plus an extra process
group), traced as ``ranklens run`` traces a job, with one rank optionally slowed: a fault of the
drill machinery (:mod:`ranklens.drill`), injected through the tracer's bootstrap, so the worker
script has no slow path of its own. The spools are shipped into the store *while the job runs*
and watched live; then the job is analyzed and the findings returned.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ranklens.analyzers import Finding, find_stragglers, save_findings
from ranklens.drill.faults import DrillFault, parse_drill_fault
from ranklens.drill.suites import standalone_command
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
    log_dir: str = ""  # the job's log file (every rank's output, as torchrun prints it)
    drill: Any = None  # the drill's result (ranklens.drill.runner.DrillResult): the fault's scorecard
    # a rank that was behind because the host starved it of CPU: a note, not a finding (as `analyze` says)
    contention: list[Any] = field(default_factory=list)


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
    # the job is the demo worker under torchrun, traced as `ranklens run` traces it; the slowed
    # rank is a fault the drill injects (ranklens/drill/inject.py), so the worker has no slow path
    faults = [] if slow_rank is None else [_fault(slow_rank, slowdown, slow_from_step, compute_ms, slow_phase)]
    command = standalone_command("ranklens.demo.worker", ranks, "--steps", str(steps), "--compute-ms", str(compute_ms))
    log(
        f"job {job_id}: {ranks} ranks x {steps} steps on gloo"
        + (
            f", rank {slow_rank}'s {slow_phase} slowed {slowdown}x from step {slow_from_step}"
            if slow_rank is not None
            else ", healthy"
        )
    )
    state = {"last": 0}

    def progress(job_log: Path) -> None:
        s = _last_step(job_log)
        if on_step is not None and s > state["last"]:
            state["last"] = s
            on_step(s)

    from ranklens.drill.runner import run_drill

    with _env({"OMP_NUM_THREADS": "1"}):
        result = run_drill(
            store,
            command,
            faults,
            name="demo",
            job_id=job_id,
            world_size=ranks,
            timeout_s=timeout_s,
            require_fault=False,
            save=False,
            on_pass=progress,
            log=lambda s: log(s) if s.startswith("drill: ") else None,
        )
    progress(Path(result.log_path))
    if result.job_failed or result.exit_code != 0:
        why = result.job_failed or f"exited with code {result.exit_code}"
        try:
            tail = Path(result.log_path).read_text(errors="replace")[-3000:]
        except OSError:
            tail = ""
        raise DemoFailed(f"the demo job {why}; log {result.log_path}\n--- job log ---\n{tail}")
    contention: list[Any] = []
    findings = find_stragglers(store, job_id, 0, contention=contention)
    save_findings(store, findings)
    return DemoResult(
        job_id=job_id,
        ranks=ranks,
        steps=steps,
        slow_rank=slow_rank,
        wall_s=result.wall_s,
        rows=result.rows,
        findings=findings,
        log_dir=result.log_path,
        drill=result,
        contention=contention,
    )


def _fault(rank: int, slowdown: float, from_step: int, compute_ms: float, phase: str) -> DrillFault:
    """The demo's slowed rank as a drill fault: the phase's own time (forward and backward are half
    the compute each, data loading a quarter) stretched ``slowdown`` times from ``from_step``."""
    base_ms = compute_ms / 4.0 if phase == "data" else compute_ms / 2.0
    extra_ms = (slowdown - 1.0) * base_ms
    if phase == "data":
        return parse_drill_fault(f"slow_data:{rank}:{extra_ms:g}ms@{from_step}")
    return parse_drill_fault(f"slow_gpu:{rank}:{extra_ms:g}ms:{phase}@{from_step}")


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    """``values`` in the environment the job inherits, unless already set there."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


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
