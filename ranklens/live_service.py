"""The live analysis service's memory: findings outlive the pass (and the job) that saw them.

``ranklens analyze --follow`` saves a version of a finding each time it opens, changes or
resolves (``findings``, newest version per id). A later ``ranklens analyze --job ID`` runs a fresh
pass over the job's final state, which no longer shows a hang that ended with the job; this module
puts the two together: the findings of this pass, then the job's earlier ones that this pass did
not see, each with when it opened and when it closed (issue 21, item 4).

It also runs the live loop itself (:class:`LiveAnalysis`: one pass after another, findings turned
into new / changed / resolved events, saved, exported and handed to the recovery engine), and lets
``--follow`` start before the job: :func:`wait_for_job` waits, saying so, until the store exists and
the job has written its first records. The CLI only prints.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ranklens.analyzers.contention import Contention
from ranklens.analyzers.findings import Finding, finding_from_row, latest_columns, save_findings, strip_latest
from ranklens.analyzers.job import FindingTracker, Update, analyze_job
from ranklens.errors import SchemaVersionError, StoreUnavailable
from ranklens.store.api import Store
from ranklens.store.api import sql_escape as _esc

__all__ = ["FindingHistory", "LiveAnalysis", "StoredFinding", "job_history", "wait_for_job"]


@dataclass(frozen=True)
class StoredFinding:
    """The newest stored version of a finding, and when versions of it were first and last saved."""

    finding: Finding
    first_saved_ns: int
    last_saved_ns: int

    @property
    def opened_ns(self) -> int:
        return self.finding.first_seen_ns or self.first_saved_ns

    @property
    def closed_ns(self) -> int | None:
        """When it was resolved (the resolving version's time); None while it is open."""
        return self.last_saved_ns if self.finding.state == "resolved" else None


@dataclass(frozen=True)
class FindingHistory:
    """A job's findings: ``current`` from this pass, ``earlier`` stored ones this pass did not see."""

    current: list[Finding]
    earlier: list[StoredFinding]
    stored: dict[str, StoredFinding]

    def opened_ns(self, f: Finding) -> int:
        old = self.stored.get(f.id)
        times = [t for t in (f.first_seen_ns, old.opened_ns if old else 0) if t]
        return min(times) if times else 0

    def to_json(self) -> list[dict[str, Any]]:
        """Each finding's usual JSON plus ``seen_now`` (this pass saw it), ``opened_ns`` and
        ``closed_ns`` (null while open); this pass's findings first, then the earlier ones."""
        out = [
            {**f.to_json(), "seen_now": True, "opened_ns": self.opened_ns(f), "closed_ns": None} for f in self.current
        ]
        for s in self.earlier:
            out.append({**s.finding.to_json(), "seen_now": False, "opened_ns": s.opened_ns, "closed_ns": s.closed_ns})
        return out


def stored_findings(store: Store, job_id: str, attempt: int) -> dict[str, StoredFinding]:
    """The newest version of every finding saved for a job attempt, by id."""
    from ranklens.schema import TABLES

    cols = [c for c in TABLES["findings"].column_names if c not in ("id", "updated_ns", "ingest_id")]
    rows = store.query(
        f"SELECT id, {latest_columns(cols)}, max(updated_ns) AS latest_updated_ns, min(updated_ns) AS first_saved_ns "
        f"FROM findings WHERE job_id = '{_esc(job_id)}' AND attempt = {int(attempt)} GROUP BY id ORDER BY id"
    ).to_pylist()
    out = {}
    for row in rows:
        first = int(row.pop("first_saved_ns"))
        r = strip_latest(row)
        f = dataclasses.replace(finding_from_row(r), updated_ns=int(r["updated_ns"]))
        out[f.id] = StoredFinding(f, first, int(r["updated_ns"]))
    return out


def job_history(store: Store, job_id: str, attempt: int, current: list[Finding]) -> FindingHistory:
    """This pass's findings with the job's stored ones: earlier findings this pass did not see
    (open ones first, then resolved, newest first)."""
    stored = stored_findings(store, job_id, attempt)
    seen = {f.id for f in current}
    earlier = sorted(
        (s for fid, s in stored.items() if fid not in seen),
        key=lambda s: (s.finding.state == "resolved", -s.opened_ns, s.finding.id),
    )
    return FindingHistory(list(current), earlier, stored)


def _has_job(store: Store, job_id: str | None) -> bool:
    if job_id is None:
        from ranklens.analyzers import latest_job

        return latest_job(store) is not None
    return bool(store.query(f"SELECT count() FROM collectives WHERE job_id = '{_esc(job_id)}'").scalar())


def wait_for_job(
    open_store: Callable[[], Store],
    job_id: str | None,
    *,
    interval: float,
    say: Callable[[str], None],
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Return once the store exists and holds the job (any job when ``job_id`` is None), saying
    once what it waits for. A store that does not exist yet (an embedded directory, a server
    database) is waited for: the collector creates it; any other error is raised.

    Raises:
        KeyboardInterrupt: the user stopped the wait.
    """
    said = ""
    started = clock()
    while True:
        try:
            store = open_store()
        except (StoreUnavailable, SchemaVersionError) as e:
            # not created yet (the collector creates it): an embedded directory without meta.json,
            # a server database that does not exist or is being created (tables before the version
            # row); anything else is an error to report
            if not any(m in str(e) for m in ("meta.json missing", "doesn't exist", "schema version none")):
                raise
            what, store = f"the store to be created ({e})", None
        if store is not None:
            if _has_job(store, job_id):
                if said:
                    who = f"job {job_id}" if job_id else "a job"
                    say(f"{who} wrote its first records after {clock() - started:.0f} s")
                return
            what = f"job {job_id} to write its first records" if job_id else "a job to write its first records"
            what += f" into {store.url}"
        if what != said:
            say(f"waiting for {what} (Ctrl-C to stop)")
            said = what
        sleep(interval)


class LiveAnalysis:
    """The live analysis of one job attempt, pass after pass.

    Each pass analyzes the job's recent window, turns the findings into events (a finding is *new*
    the first time its id is seen, *changed*, *resolved* when it stops appearing), saves a version
    of each finding that changed (so a later ``analyze --job`` still shows it), updates the
    exporter's gauges and hands new and changed findings to the recovery engine.

    Args:
        store: the job's store.
        job_id, attempt: the job.
        save: write changed findings to the store.
        engine: a recovery engine (``process(findings)``), or None.
        exporter: a Prometheus findings exporter (``update(open findings)``), or None.
        window_steps: steps of the straggler analysis window (each pass costs the same however
            long the job has run).
        analyze: the analysis of one pass (default: :func:`~ranklens.analyzers.job.analyze_job`).
    """

    def __init__(
        self,
        store: Store,
        job_id: str,
        attempt: int,
        *,
        save: bool = True,
        engine: Any = None,
        exporter: Any = None,
        window_steps: int = 500,
        analyze: Callable[..., list[Finding]] = analyze_job,
    ) -> None:
        self.store, self.job_id, self.attempt = store, job_id, attempt
        self.save, self.engine, self.exporter = save, engine, exporter
        self.window_steps = window_steps
        self._analyze = analyze
        self.tracker = FindingTracker()
        self._unacted: list[Finding] = []
        self._noted: set[tuple[str, str, tuple[int, ...]]] = set()

    def run_pass(self) -> Update:
        """One pass; returns its events, and the host CPU contention notes not seen before (a
        straggler or slow link the host's oversubscription explains, said once per node and ranks)."""
        notes: list[Contention] = []
        current = self._analyze(self.store, self.job_id, self.attempt, window_steps=self.window_steps, contention=notes)
        update = self.tracker.update(current)
        for c in notes:
            key = (c.kind, c.node, c.ranks)
            if key not in self._noted:
                self._noted.add(key)
                update.notes.append(c)
        changed = update.all()
        if self.save and changed:
            save_findings(self.store, changed)
        if self.exporter is not None:
            self.exporter.update(list(self.tracker.open.values()))
        if self.engine is not None and (self._unacted or update.new + update.changed):
            # findings an earlier pass could not hand over (the store failed in the engine) go again:
            # they are not new any more, and the engine's idempotency keys make a repeat a no-op
            todo = {f.id: f for f in self._unacted}
            todo.update({f.id: f for f in update.new + update.changed})
            self._unacted = list(todo.values())
            report = self.engine.process(self._unacted)
            self._unacted = []
            for f in getattr(report, "annotated", None) or ():
                self.tracker.annotate(f)  # later versions keep what the executor attached (stacks)
        return update

    def run(
        self,
        emit: Callable[[str, Finding], None],
        *,
        interval: float,
        sleep: Callable[[float], None] = time.sleep,
        note: Callable[[Contention], None] | None = None,
    ) -> None:
        """Pass after pass every ``interval`` seconds, calling ``emit(event, finding)`` for each
        event and ``note(contention)`` for each new host CPU contention note, until interrupted
        (KeyboardInterrupt propagates)."""
        while True:
            update = self.run_pass()
            for event, items in (("new", update.new), ("changed", update.changed), ("resolved", update.resolved)):
                for f in items:
                    emit(event, f)
            if note is not None:
                for c in update.notes:
                    note(c)
            sleep(interval)
