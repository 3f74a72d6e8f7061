"""``ranklens run -- <command>``: trace an unmodified training script.

The command runs with ranklens' bootstrap on ``PYTHONPATH`` (every Python process it starts,
including the ranks torchrun forks, calls ``ranklens.tracing.init()`` right after
``init_process_group``), with a job id shared by all its ranks, and — unless a collector already
serves the spool — with a collector shipping the spool into the store while it runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ranklens.collector import Shipper
from ranklens.config import ENV_JOB_ID, ENV_SPOOL
from ranklens.errors import ConfigError
from ranklens.store.api import Store

__all__ = ["BOOTSTRAP_DIR", "RunResult", "collector_lock", "run_traced"]

BOOTSTRAP_DIR = str(Path(__file__).with_name("_bootstrap"))


@dataclass
class RunResult:
    job_id: str
    returncode: int
    rows: dict[str, int]
    collector: bool


@contextlib.contextmanager
def collector_lock(spool_dir: str | os.PathLike[str]) -> Iterator[bool]:
    """Yield True when this process became the spool's collector, False when another one is."""
    Path(spool_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(spool_dir) / ".collector.lock", "a+") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def traced_env(base: dict[str, str], *, job_id: str, spool_dir: str) -> dict[str, str]:
    env = dict(base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (BOOTSTRAP_DIR, base.get("PYTHONPATH", "")) if p)
    env[ENV_JOB_ID] = job_id
    env[ENV_SPOOL] = spool_dir
    return env


def run_traced(
    command: Sequence[str],
    store: Store | None,
    *,
    spool_dir: str,
    job_id: str | None = None,
    interval_s: float = 1.0,
    log: Callable[[str], None] = lambda s: None,
) -> RunResult:
    """Run ``command`` traced; ship its spool to ``store`` while it runs (when no other collector
    serves ``spool_dir``). Returns the command's exit code. ``store=None``: spool only."""
    if not command:
        raise ConfigError("ranklens run needs a command after --, e.g. ranklens run -- torchrun ... train.py")
    job_id = job_id or os.environ.get(ENV_JOB_ID) or f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    env = traced_env(dict(os.environ), job_id=job_id, spool_dir=spool_dir)
    with collector_lock(spool_dir) as own:
        shipper = Shipper(spool_dir, store) if (own and store is not None) else None
        done = threading.Event()
        thread = None
        if shipper is not None:
            log(f"ranklens run: job {job_id}, collecting {spool_dir} into {store.url if store else '-'}")
            thread = threading.Thread(
                target=shipper.run, kwargs={"interval_s": interval_s, "stop": done.is_set}, daemon=True
            )
            thread.start()
        else:
            log(f"ranklens run: job {job_id}, spool {spool_dir} (served by another collector)")
        try:
            proc = subprocess.Popen(list(command), env=env)
        except OSError as e:
            done.set()
            raise ConfigError(f"cannot start {command[0]!r}: {e.strerror}") from None
        try:
            rc = proc.wait()
        except KeyboardInterrupt:
            proc.terminate()
            rc = proc.wait()
        done.set()
        if thread is not None:
            thread.join(timeout=300)
    return RunResult(job_id, rc, dict(shipper.totals) if shipper else {}, shipper is not None)
