"""Run tests/zero_code_job.py (an unmodified script) under ``ranklens run`` and score what
``ranklens analyze --json`` says about it. Shared by tests/analyzers/test_zero_code_accuracy.py and
bench/zero_code_accuracy.py."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests._jobs import analyze_report, ranklens_run

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "zero_code_job.py"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
RANKS = 4


@dataclass(frozen=True)
class Case:
    """One run of the matrix: ``slow_rank`` sleeps ``slow_s`` per step in ``phase`` from ``slow_from``."""

    name: str
    slow_rank: int | None = None
    phase: str = ""
    slow_s: float = 0.0
    slow_from: int = 6
    steps: int = 16
    optimizer: bool = True  # False: a custom update loop, no step can be inferred (step_source "none")


@dataclass
class Outcome:
    case: Case
    loaded: bool
    report: dict[str, Any]
    stragglers: list[dict[str, Any]] = field(default_factory=list)

    @property
    def named_ranks(self) -> set[int]:
        """Ranks named by straggler findings (a node finding names the ranks in its evidence)."""
        out: set[int] = set()
        for f in self.stragglers:
            out |= {int(s["rank"]) for s in f["suspects"] if int(s["rank"]) >= 0}
            out |= {int(r) for r in f["evidence"].get("ranks", [])}
        return out

    @property
    def onset_error(self) -> int | None:
        if self.case.slow_rank is None or not self.stragglers:
            return None
        return int(self.stragglers[0]["first_seen_step"]) - self.case.slow_from

    @property
    def phase_named(self) -> str:
        return str(self.stragglers[0]["evidence"].get("phase", "")) if self.stragglers else ""


def run_case(case: Case, workdir: Path, *, loaded: bool = False, timeout_s: float = 240) -> Outcome:
    """Run one case as a user would (``ranklens run ... -- torchrun ...``), then ``ranklens analyze --json``."""
    workdir.mkdir(parents=True, exist_ok=True)
    store = f"embedded://{workdir}/store"
    job = f"zc-{case.name}-{'loaded' if loaded else 'quiet'}"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "ZC_STEPS": str(case.steps),
        "ZC_SLOW_RANK": str(case.slow_rank if case.slow_rank is not None else -1),
        "ZC_SLOW_PHASE": case.phase,
        "ZC_SLOW_S": str(case.slow_s),
        "ZC_SLOW_FROM": str(case.slow_from),
        "ZC_NO_OPTIMIZER": "0" if case.optimizer else "1",
    }
    env.pop("RANKLENS_JOB_ID", None)
    env.pop("RANKLENS_STORE", None)
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", str(RANKS), str(JOB)]
    with cpu_hogs(2 if loaded else 0):
        run = ranklens_run(store, workdir / "spool", cmd, job_id=job, timeout=timeout_s, env=env, cwd=workdir)
    if run.returncode != 0:
        raise RuntimeError(f"ranklens run failed ({run.returncode}): {run.stderr[-3000:]}")
    report = analyze_report(store, job, timeout=120, env=env, cwd=workdir)
    stragglers = [f for f in report["findings"] if f["kind"] == "straggler"]
    return Outcome(case, loaded, report, stragglers)


@contextlib.contextmanager
def cpu_hogs(n: int) -> Iterator[None]:
    """``n`` processes spinning on the CPU (``python -c 'while True: pass'``) for the duration."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def matrix(
    delays: tuple[float, ...] = (0.05, 0.2), phases: tuple[str, ...] = ("forward", "backward", "data")
) -> list[Case]:
    """The accuracy matrix: healthy, and rank 2 slowed in each phase at each delay."""
    cases = [Case("healthy")]
    for phase in phases:
        for d in delays:
            cases.append(Case(f"{phase}-{int(d * 1000)}ms", slow_rank=2, phase=phase, slow_s=d))
    return cases


def score(outcomes: list[Outcome]) -> dict[str, Any]:
    """Precision and recall of the named ranks over the runs, phase accuracy and onset errors."""
    tp = fp = fn = 0
    phase_ok = phase_n = 0
    onsets: list[int] = []
    for o in outcomes:
        truth = {o.case.slow_rank} if o.case.slow_rank is not None else set()
        named = o.named_ranks
        tp += len(named & truth)
        fp += len(named - truth)
        fn += len(truth - named)
        if truth and named & truth:
            phase_n += 1
            phase_ok += o.phase_named == o.case.phase
            if o.onset_error is not None:
                onsets.append(o.onset_error)
    return {
        "precision": tp / (tp + fp) if tp + fp else 1.0,
        "recall": tp / (tp + fn) if tp + fn else 1.0,
        "tp": tp,
        "fp": fp,
        "fn": fn,
        "phase_accuracy": phase_ok / phase_n if phase_n else None,
        "onset_errors": onsets,
    }
