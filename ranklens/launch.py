"""``ranklens run -- <command>``: trace an unmodified training script.

The command runs with ranklens' bootstrap on ``PYTHONPATH`` (every Python process it starts,
including the ranks torchrun forks, calls ``ranklens.tracing.init()`` right after
``init_process_group``), with a job id shared by all its ranks, and — unless a collector already
serves the spool — with a collector shipping the spool into the store while it runs.

Tracing never stops training from starting (issue 22, defect 7): a spool the ranks cannot write
(read-only file system, a path through a file, no permission) runs the command untraced after one
warning; a store that is down is the CLI's business (it ships once the store is up).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ranklens.collector import Shipper
from ranklens.collector.shipper import ShipResult
from ranklens.collector.shipper import hold_collector_lock as collector_lock  # the node agent's own lock
from ranklens.config import ENV_DISABLE, ENV_JOB_ID, ENV_SPOOL, slurm_job_name
from ranklens.errors import ConfigError
from ranklens.store.api import Store

__all__ = ["BOOTSTRAP_DIR", "RunResult", "collector_lock", "resolve_job_id", "run_traced", "spool_problem"]

BOOTSTRAP_DIR = str(Path(__file__).with_name("_bootstrap"))


@dataclass
class RunResult:
    job_id: str
    returncode: int
    rows: dict[str, int]
    collector: bool
    traced: bool = True  # False: the spool could not be written, the command ran untraced
    store_error: str | None = None  # the last shipping pass could not reach the store
    left_segments: int = 0  # segments of this job still in the spool after the last pass


def spool_problem(spool_dir: str | os.PathLike[str]) -> str | None:
    """Why the ranks could not write segments under ``spool_dir`` (None: they can). Creates the
    directory when it is missing, like the ranks would."""
    try:
        Path(spool_dir).mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".ranklens-probe-", dir=spool_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"
    return None


def traced_env(base: dict[str, str], *, job_id: str, spool_dir: str) -> dict[str, str]:
    env = dict(base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (BOOTSTRAP_DIR, base.get("PYTHONPATH", "")) if p)
    env[ENV_JOB_ID] = job_id
    env[ENV_SPOOL] = spool_dir
    return env


def resolve_job_id(job_id: str | None) -> str:
    """The job id ``ranklens run`` uses: the one given, else ``$RANKLENS_JOB_ID``, else in a Slurm job
    ``slurm-<SLURM_JOB_ID>`` (``-r<n>`` once requeued: every node of the job computes the same, and
    the Slurm executor finds the job from it), else a fresh ``run-<date>-<time>-<6 hex>``."""
    return (
        job_id
        or os.environ.get(ENV_JOB_ID)
        or slurm_job_name(os.environ)
        or f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    )


def run_traced(
    command: Sequence[str],
    store: Store | None,
    *,
    spool_dir: str,
    job_id: str | None = None,
    interval_s: float = 1.0,
    log: Callable[[str], None] = lambda s: None,
    supervise: Callable[[str], Any] | None = None,
) -> RunResult:
    """Run ``command`` traced; ship its spool to ``store`` while it runs (when no other collector
    serves ``spool_dir``). Returns the command's exit code. ``store=None``: spool only.

    ``supervise(job_id)``, when given, is called once the shipper runs and returns something with a
    ``stop()`` (``ranklens run --recover``'s supervisor), stopped after the last shipping pass."""
    if not command:
        raise ConfigError("ranklens run needs a command after --, e.g. ranklens run -- torchrun ... train.py")
    job_id = resolve_job_id(job_id)
    problem = spool_problem(spool_dir)
    if problem is not None:  # training is not delayed or stopped by tracing: it runs untraced
        log(
            f"ranklens run: warning: cannot write the spool {spool_dir} ({problem}): running the command "
            f"untraced (job {job_id}); pass --spool DIR (or RANKLENS_SPOOL) with a writable directory to trace it"
        )
        return RunResult(job_id, _run_child(command, {**os.environ, ENV_DISABLE: "1"}), {}, False, traced=False)
    env = traced_env(dict(os.environ), job_id=job_id, spool_dir=spool_dir)
    last: list[ShipResult] = []

    def _keep_last(r: ShipResult) -> None:
        last[:] = [r]

    with collector_lock(spool_dir) as own:
        shipper = Shipper(spool_dir, store) if (own and store is not None) else None
        loop = None
        if shipper is not None:
            log(f"ranklens run: job {job_id}, collecting {spool_dir} into {store.url if store else '-'}")
            loop = shipper.start(interval_s=interval_s, on_pass=_keep_last)
        elif not own:
            log(f"ranklens run: job {job_id}, spool {spool_dir} (served by another collector)")
        else:
            log(f"ranklens run: job {job_id}, spool {spool_dir} (not shipped by this run)")
        supervisor = supervise(job_id) if supervise is not None else None
        try:
            rc = _run_child(command, env)
        except BaseException:
            if loop is not None:
                loop.close(timeout_s=0)  # the last pass starts; a failed start does not wait for it
            if supervisor is not None:
                supervisor.stop()
            raise
        if loop is not None:
            loop.close(timeout_s=300)  # the last pass: what the ranks wrote last
        if supervisor is not None:
            supervisor.stop()
    store_error = last[-1].error if last else None
    left = sum(1 for _ in Path(spool_dir, job_id).rglob("*.jsonl")) if store_error else 0
    return RunResult(job_id, rc, dict(shipper.totals) if shipper else {}, shipper is not None, True, store_error, left)


def _run_child(command: Sequence[str], env: dict[str, str]) -> int:
    """Run the command to its end. A SIGTERM to ``ranklens run`` (Slurm's scancel, requeue, time
    limit; Kubernetes deleting the pod) is passed on to the command instead of ending ranklens at
    once, so the caller's last shipping pass and the recovery supervisor's current pass (an executor
    that just requeued this very job, its ``actions`` row) still run before the process ends."""
    # the handler goes in before the command starts: installed after, a SIGTERM that came while this
    # thread waited for the GIL (the shipper's first pass loading pyarrow) killed ranklens at once and
    # left the command running, never told (a CI run hung on it). One that comes before the command
    # exists is passed on as soon as it does.
    forwarding = threading.current_thread() is threading.main_thread()
    started: list[subprocess.Popen[bytes]] = []
    early: list[int] = []
    previous: Any = None
    if forwarding:

        def _forward(signum: int, _frame: object) -> None:
            if not started:
                early.append(signum)
                return
            with contextlib.suppress(ProcessLookupError):
                started[0].send_signal(signum)

        previous = signal.signal(signal.SIGTERM, _forward)
    try:
        try:
            proc = subprocess.Popen(list(command), env=env)
        except OSError as e:
            raise ConfigError(f"cannot start {command[0]!r}: {e.strerror}") from None
        started.append(proc)
        for signum in early:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)
        try:
            return proc.wait()
        except KeyboardInterrupt:
            proc.terminate()
            return proc.wait()
    finally:
        if forwarding:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
