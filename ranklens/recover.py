"""``ranklens run --recover POLICY``: the closed loop around a launcher.

While the command runs, a :class:`RecoverySupervisor` analyses the job live (the loop of ``analyze
--follow``), follows it from attempt to attempt (torch elastic restarts the worker group as attempt
``n + 1``), and hands new findings to the recovery engine with the policy's executors (a torchrun
executor ends the stuck worker so that torch elastic restarts the group in place). After the run,
:func:`recovery_times` measures each remediation: fault onset (the finding's first sign), detection
(the decision), action done (the executor's row) and *training resumed* (the first completed step of
a later attempt); MTTD, MTTR and the GPU time they cost. Each measurement is also an ``actions``
row (outcome ``resumed``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ranklens.analyzers.findings import Finding, load_finding
from ranklens.analyzers.recovery import RecoveryEngine
from ranklens.analyzers.recovery.audit import action_row
from ranklens.analyzers.recovery.executors import ExecContext
from ranklens.analyzers.recovery.policy import Policy
from ranklens.config import node_name, slurm_run_of
from ranklens.store.api import Store
from ranklens.store.api import sql_escape as _esc

__all__ = [
    "RecoverySupervisor",
    "RecoveryTimes",
    "current_attempt",
    "earlier_runs",
    "job_recovery_summary",
    "recovery_times",
]

RETIRE_S = 120.0  # an earlier attempt is analysed this long at most after the next one started


def current_attempt(store: Store, job_id: str) -> int | None:
    """The newest attempt of a job that has sent a heartbeat (None: none yet)."""
    v = store.query(
        f"SELECT max(attempt) AS a, count() AS n FROM heartbeats WHERE job_id = '{_esc(job_id)}'"
    ).to_pylist()
    return int(v[0]["a"]) if v and int(v[0]["n"]) else None


class _Engine:
    """The engine as LiveAnalysis sees it, saying what each pass decided and did."""

    def __init__(self, engine: RecoveryEngine, log: Callable[[str], None]) -> None:
        self.engine, self.log = engine, log

    def process(self, findings: list[Finding]) -> Any:
        report = self.engine.process(findings)
        for d in report.decisions:
            mode = "suppressed (" + d.suppressed_by + ")" if d.suppressed_by else ("dry run" if d.dry_run else "live")
            self.log(f"recovery: {d.level.value} of {d.target} for {d.finding.kind} {d.finding.id} [{mode}]")
        for name, _fid, res in report.executed:
            self.log(f"recovery: executor {name}: {res.outcome}: {res.detail}")
        return report


class RecoverySupervisor:
    """Live analysis with recovery for one job, attempt after attempt, on a thread of its own."""

    def __init__(
        self,
        store: Store,
        job_id: str,
        policy: Policy | None,
        *,
        outbox_dir: str = "",
        spool_dir: str = "",
        interval_s: float = 1.0,
        log: Callable[[str], None] = lambda s: None,
    ) -> None:
        self.store, self.job_id, self.interval_s, self.log = store, job_id, interval_s, log
        # no policy: the same live analysis, attempt after attempt, acting on nothing (a drill without --recover)
        self.engine = (
            RecoveryEngine(
                policy, store, outbox_dir, context=ExecContext(store=store, host=node_name(), spool_dir=spool_dir)
            )
            if policy is not None
            else None
        )
        self.attempt: int | None = None
        self.live: Any = None
        self.retiring: list[tuple[Any, float]] = []  # earlier attempts' analyses, until their findings close
        self.found: dict[str, tuple[Finding, int]] = {}  # finding id -> newest version, when first shown (ns)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ranklens-recover", daemon=True)

    def start(self) -> RecoverySupervisor:
        self._thread.start()
        return self

    def one_pass(self) -> None:
        from ranklens.live_service import LiveAnalysis

        attempt = current_attempt(self.store, self.job_id)
        if attempt is None:
            return
        if attempt != self.attempt:
            if self.attempt is not None:
                self.log(f"recovery: job {self.job_id} is now attempt {attempt}")
                # the previous attempt is analysed (without acting) until its findings close, so a
                # hang that the restart ended is resolved rather than left open
                self.live.engine = None
                self.retiring.append((self.live, time.monotonic() + RETIRE_S))
            self.attempt = attempt
            engine = _Engine(self.engine, self.log) if self.engine is not None else None
            self.live = LiveAnalysis(self.store, self.job_id, attempt, engine=engine)
        for old, until in list(self.retiring):
            self._note(old.run_pass(), old.attempt)
            if not old.tracker.open or time.monotonic() > until:
                self.retiring.remove((old, until))
        self._note(self.live.run_pass(), attempt)

    def _note(self, update: Any, attempt: int) -> None:
        now = time.time_ns()
        for f in update.new + update.changed + update.resolved:
            first = self.found.get(f.id, (f, now))[1]
            self.found[f.id] = (f, first)
        for f in update.new:
            self.log(f"recovery: [attempt {attempt}] new [{f.severity.value.upper()}] {f.kind}: {f.title}")

    def _run(self) -> None:
        said = ""
        while not self._stop.wait(self.interval_s):
            try:
                self.one_pass()
                if said:
                    self.log("recovery: analysis passes work again")
                    said = ""
            except Exception as e:  # the store hiccupped: the next pass tries again (said once)
                msg = f"{type(e).__name__}: {e}"
                if msg != said:
                    self.log(f"recovery: analysis pass failed (retrying every {self.interval_s:g} s): {msg}")
                    said = msg

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self.engine is not None:
            self.engine.close()


@dataclass(frozen=True)
class RecoveryTimes:
    finding_id: str
    kind: str
    title: str
    attempt: int
    onset_ns: int
    detected_ns: int
    action_ns: int
    resumed_ns: int | None  # None: training did not resume
    resumed_attempt: int | None
    ranks: int
    resumed_job: str = ""  # the run that resumed when it is another job id (a requeued Slurm job's -r<n>)

    @property
    def mttd_s(self) -> float:
        return max(0.0, (self.detected_ns - self.onset_ns) / 1e9)

    @property
    def mttr_s(self) -> float | None:
        return None if self.resumed_ns is None else max(0.0, (self.resumed_ns - self.onset_ns) / 1e9)

    @property
    def lost_gpu_s(self) -> float | None:
        return None if self.mttr_s is None else self.mttr_s * self.ranks

    def line(self) -> str:
        base = (
            f"{self.kind} {self.finding_id} (attempt {self.attempt}): detected {self.mttd_s:.1f} s after onset (MTTD), "
            f"acted on at +{(self.action_ns - self.onset_ns) / 1e9:.1f} s"
        )
        if self.mttr_s is None:
            return base + "; training did not resume"
        where = f"job {self.resumed_job}" if self.resumed_job else f"attempt {self.resumed_attempt}"
        return (
            base + f", training resumed ({where}'s first step done) at +{self.mttr_s:.1f} s "
            f"(MTTR); {self.ranks} ranks x {self.mttr_s:.1f} s = {self.lost_gpu_s:.0f} GPU-s lost"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "finding_id": self.finding_id,
            "kind": self.kind,
            "attempt": self.attempt,
            "onset_ns": self.onset_ns,
            "detected_ns": self.detected_ns,
            "action_ns": self.action_ns,
            "resumed_ns": self.resumed_ns,
            "resumed_attempt": self.resumed_attempt,
            "resumed_job": self.resumed_job or None,
            "mttd_s": round(self.mttd_s, 3),
            "mttr_s": None if self.mttr_s is None else round(self.mttr_s, 3),
            "lost_gpu_s": None if self.lost_gpu_s is None else round(self.lost_gpu_s, 1),
        }


def job_recovery_summary(job_id: str, times: list[RecoveryTimes]) -> str:
    """One line for a job's remediations: how many, how many resumed training, mean MTTD and MTTR
    and the GPU time the recoveries cost in all (the per-job figures beside the per-finding lines)."""
    if not times:
        return f"job {job_id}: no remediation"
    mttd = sum(t.mttd_s for t in times) / len(times)
    resumed = [t for t in times if t.mttr_s is not None]
    line = f"job {job_id}: {len(times)} remediation(s), {len(resumed)} resumed training; mean MTTD {mttd:.1f} s"
    if resumed:
        mttr = sum(t.mttr_s or 0.0 for t in resumed) / len(resumed)
        lost = sum(t.lost_gpu_s or 0.0 for t in resumed)
        line += f", mean MTTR {mttr:.1f} s, {lost:.0f} GPU-s lost to recovery"
    return line


def _requeued_runs(store: Store, job_id: str) -> list[tuple[str, int]]:
    """The later runs of a Slurm job (``slurm-42`` -> ``slurm-42-r1``, ``-r2``, ...: a requeued job
    runs again under the same Slurm id, :func:`ranklens.config.slurm_job_name`), each with the end of
    its first completed step; empty for any other job id."""
    run = slurm_run_of(job_id)
    if run is None:
        return []
    sid, n = run
    rows = store.query(
        f"SELECT job_id, min(end_ns) AS ts FROM steps WHERE startsWith(job_id, 'slurm-{_esc(sid)}-r') GROUP BY job_id"
    ).to_pylist()
    out = []
    for r in rows:
        later = slurm_run_of(str(r["job_id"]))
        if later is not None and later[0] == sid and later[1] > n:
            out.append((str(r["job_id"]), int(r["ts"])))
    return out


def earlier_runs(job_id: str) -> list[str]:
    """The runs a requeued Slurm job had before this one (``slurm-42-r2`` -> ``slurm-42``,
    ``slurm-42-r1``); empty for any other job id. Their remediations end in this run."""
    run = slurm_run_of(job_id)
    if run is None:
        return []
    sid, n = run
    return [f"slurm-{sid}" + (f"-r{k}" if k else "") for k in range(n)]


def recovery_times(store: Store, job_id: str, *, record: bool = True) -> list[RecoveryTimes]:
    """MTTD/MTTR of every live remediation decision of a job; with ``record``, each one after which
    training resumed becomes an ``actions`` row with outcome ``resumed`` (once). Training resumed
    when a later attempt of the job completed its first step, or, for a Slurm job that was
    requeued, when its next run (``slurm-<id>-r<n>``, another job id) did."""
    j = _esc(job_id)
    # every live remediation decision; done when its executor row came (any outcome: a crashed rank
    # is restarted by torch elastic itself, the executor then skips it), else when decided
    acted = store.query(
        "SELECT finding_id, idempotency_key, action, min(ts_ns) AS ts FROM actions "
        f"WHERE job_id = '{j}' AND outcome = 'decided' AND action != 'notify' "
        "GROUP BY finding_id, idempotency_key, action ORDER BY ts"
    ).to_pylist()
    if not acted:
        return []
    decided = {str(r["idempotency_key"]): int(r["ts"]) for r in acted}
    executed = {
        str(r["idempotency_key"]): int(r["ts"])
        for r in store.query(
            f"SELECT idempotency_key, min(ts_ns) AS ts FROM actions WHERE job_id = '{j}' "
            "AND startsWith(target, 'executor:') GROUP BY idempotency_key"
        ).to_pylist()
    }
    recorded = {
        r["idempotency_key"]
        for r in store.query(
            f"SELECT DISTINCT idempotency_key FROM actions WHERE job_id = '{j}' AND outcome = 'resumed'"
        ).to_pylist()
    }
    first_step = {
        int(r["attempt"]): int(r["ts"])
        for r in store.query(
            f"SELECT attempt, min(end_ns) AS ts FROM steps WHERE job_id = '{j}' GROUP BY attempt"
        ).to_pylist()
    }
    ranks = {
        int(r["attempt"]): int(r["n"])
        for r in store.query(
            f"SELECT attempt, uniqExact(rank) AS n FROM heartbeats WHERE job_id = '{j}' GROUP BY attempt"
        ).to_pylist()
    }
    requeued = _requeued_runs(store, job_id)
    out: list[RecoveryTimes] = []
    rows = []
    for a in acted:
        f = load_finding(store, str(a["finding_id"]))
        if f is None:
            continue
        action_ns = executed.get(str(a["idempotency_key"]), int(a["ts"]))
        later = sorted((att, ts) for att, ts in first_step.items() if att > f.attempt)
        resumed = later[0] if later else None
        resumed_job = ""
        if resumed is None:  # a requeued Slurm job resumes as the next run id, with its own attempts
            nxt = [(ts, job) for job, ts in requeued if ts > action_ns]
            if nxt:
                ts, resumed_job = min(nxt)
                resumed = (0, ts)
        t = RecoveryTimes(
            finding_id=f.id,
            kind=f.kind,
            title=f.title,
            attempt=f.attempt,
            onset_ns=f.first_seen_ns or action_ns,
            detected_ns=decided.get(str(a["idempotency_key"]), action_ns),
            action_ns=action_ns,
            resumed_ns=resumed[1] if resumed else None,
            resumed_attempt=resumed[0] if resumed else None,
            ranks=ranks.get(f.attempt, 0),
            resumed_job=resumed_job,
        )
        out.append(t)
        if record and resumed and a["idempotency_key"] not in recorded:
            rows.append(
                action_row(
                    finding_id=f.id,
                    job_id=f.job_id,
                    attempt=f.attempt,
                    action=str(a["action"]),
                    target=f"job:{f.job_id}",
                    idempotency_key=str(a["idempotency_key"]),
                    outcome="resumed",
                    detail=t.to_json(),
                    ts_ns=resumed[1],
                )
            )
    if rows:
        store.write("actions", rows)
    return out
