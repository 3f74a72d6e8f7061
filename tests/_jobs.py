"""The CLI as the end-to-end tests run it: ``python -m ranklens.cli ...`` in a child process, a job
under ``ranklens run --store ... --spool ... -- CMD``, and ``ranklens analyze --json``'s report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
# torch's gloo aborts a rank in its teardown now and then (std::terminate of a joinable thread at
# exit), also with tracing off (seen in two fresh-clone CI runs): a job that failed with this, and
# only this, is run once more by the tests whose subject is not teardown
GLOO_TEARDOWN_ABORT = "terminate called without an active exception"


def ranklens(
    *args: str, timeout: float, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``ranklens ARGS`` (this interpreter's), its output captured as text; no check of the exit code."""
    return subprocess.run(
        [sys.executable, "-m", "ranklens.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd,
    )


def ranklens_run(
    store: str,
    spool: Path,
    cmd: list[str],
    *,
    job_id: str | None = None,
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """``ranklens run --store STORE --spool SPOOL [--job-id JOB] -- CMD``; no check of the exit code."""
    job = ["--job-id", job_id] if job_id is not None else []
    return ranklens("run", "--store", store, "--spool", str(spool), *job, "--", *cmd, timeout=timeout, env=env, cwd=cwd)


def analyze_report(
    store: str, job: str, *, timeout: float, env: dict[str, str] | None = None, cwd: Path | None = None
) -> dict[str, Any]:
    """``ranklens analyze --store STORE --job JOB --json --no-save``'s report; it must exit 0."""
    out = ranklens("analyze", "--store", store, "--job", job, "--json", "--no-save", timeout=timeout, env=env, cwd=cwd)
    assert out.returncode == 0, out.stderr[-3000:]
    report: dict[str, Any] = json.loads(out.stdout)
    return report
