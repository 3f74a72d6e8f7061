"""The durable outbox: decisions taken, webhook deliveries owed, audit rows not yet in the store.

One SQLite database (``outbox.sqlite3``) in a directory of the caller's choosing, in WAL mode,
each change one transaction. It survives restarts of the analyzer: a delivery stays ``pending``
until a receiver acknowledged it (2xx) or it ran out of attempts, so nothing is lost; it is
marked ``delivered`` in the same moment the 2xx is read, so a receiver that acknowledged is not
sent it again (only a crash between the 2xx and that commit can repeat a delivery, and it
carries the same idempotency key). Several processes may share one outbox: a delivery is
leased before it is sent, so two of them never send it at once.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ranklens.analyzers.recovery.api import DeliveryError

__all__ = ["Delivery", "DeliveryOutbox", "NewDelivery"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS decisions (
    key TEXT PRIMARY KEY, finding_id TEXT NOT NULL, job_id TEXT NOT NULL, action TEXT NOT NULL,
    target TEXT NOT NULL, outcome TEXT NOT NULL, ts_ns INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS suppressions (key TEXT NOT NULL, reason TEXT NOT NULL, ts_ns INTEGER NOT NULL,
    PRIMARY KEY (key, reason));
CREATE TABLE IF NOT EXISTS deliveries (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    key TEXT NOT NULL, endpoint TEXT NOT NULL,
    finding_id TEXT NOT NULL, job_id TEXT NOT NULL, attempt INTEGER NOT NULL, action TEXT NOT NULL,
    body BLOB NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending',
    attempts INTEGER NOT NULL DEFAULT 0,
    next_ns INTEGER NOT NULL, created_ns INTEGER NOT NULL, lease_ns INTEGER NOT NULL DEFAULT 0,
    detail TEXT NOT NULL DEFAULT '',
    UNIQUE (key, endpoint)
);
CREATE INDEX IF NOT EXISTS deliveries_due ON deliveries (state, next_ns);
CREATE TABLE IF NOT EXISTS audit (id INTEGER PRIMARY KEY AUTOINCREMENT, row TEXT NOT NULL);
"""
OUTBOX_VERSION = "1"


@dataclass(frozen=True)
class NewDelivery:
    """A webhook delivery to queue with a decision."""

    endpoint: str
    body: bytes


@dataclass(frozen=True)
class Delivery:
    """A queued webhook delivery, as claimed for sending."""

    id: int
    key: str
    endpoint: str
    finding_id: str
    job_id: str
    attempt: int
    action: str
    body: bytes
    attempts: int
    created_ns: int


class DeliveryOutbox:
    """The outbox in ``directory`` (created if needed).

    Args:
        directory: where ``outbox.sqlite3`` lives; keep it on local disk that outlives the process.
        clock_ns: wall clock in ns (injected in tests).

    Raises:
        DeliveryError: the directory or database cannot be created or opened.
    """

    FILENAME = "outbox.sqlite3"

    def __init__(self, directory: str | os.PathLike[str], *, clock_ns: Callable[[], int] = time.time_ns) -> None:
        self.directory = Path(directory)
        self.path = self.directory / self.FILENAME
        self._clock_ns = clock_ns
        self._lock = threading.RLock()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            # autocommit mode; transactions are explicit (BEGIN IMMEDIATE) so that writers serialise
            self._db = sqlite3.connect(self.path, timeout=10.0, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
            row = self._db.execute("SELECT value FROM meta WHERE key = 'version'").fetchone()
            if row is None:
                self._db.execute("INSERT OR IGNORE INTO meta VALUES ('version', ?)", (OUTBOX_VERSION,))
            elif row[0] != OUTBOX_VERSION:
                raise DeliveryError(
                    f"outbox {self.path} has format version {row[0]}, this ranklens writes {OUTBOX_VERSION}; "
                    "deliver its pending items with the ranklens that wrote it, or move it away"
                )
        except (OSError, sqlite3.Error) as e:
            raise DeliveryError(f"cannot open the outbox {self.path}: {e}") from None

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as e:
                raise DeliveryError(f"outbox {self.path}: {e}") from None
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            else:
                self._db.execute("COMMIT")

    # -- decisions ---------------------------------------------------------------------------

    def has_decision(self, key: str) -> bool:
        """Whether a decision with this idempotency key was already taken here."""
        with self._lock:
            return self._db.execute("SELECT 1 FROM decisions WHERE key = ?", (key,)).fetchone() is not None

    def decision_keys(self) -> set[str]:
        with self._lock:
            return {r[0] for r in self._db.execute("SELECT key FROM decisions")}

    def record_decision(
        self,
        *,
        key: str,
        finding_id: str,
        job_id: str,
        attempt: int,
        action: str,
        target: str,
        outcome: str,
        audit_rows: Sequence[dict[str, Any]],
        deliveries: Sequence[NewDelivery] = (),
    ) -> bool:
        """Record a decision, its audit rows and its deliveries in one transaction.

        Returns False (and changes nothing) when a decision with ``key`` exists already.
        """
        now = self._clock_ns()
        with self._tx() as db:
            cur = db.execute(
                "INSERT OR IGNORE INTO decisions VALUES (?, ?, ?, ?, ?, ?, ?)",
                (key, finding_id, job_id, action, target, outcome, now),
            )
            if cur.rowcount == 0:
                return False
            for d in deliveries:
                db.execute(
                    "INSERT OR IGNORE INTO deliveries (key, endpoint, finding_id, job_id, attempt, action, body, "
                    "next_ns, created_ns) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (key, d.endpoint, finding_id, job_id, attempt, action, d.body, now, now),
                )
            self._add_audit(db, audit_rows)
        return True

    def record_suppression(self, key: str, reason: str, audit_rows: Sequence[dict[str, Any]]) -> bool:
        """Record that ``key`` was suppressed for ``reason``; audit rows are kept once per (key, reason)."""
        with self._tx() as db:
            cur = db.execute("INSERT OR IGNORE INTO suppressions VALUES (?, ?, ?)", (key, reason, self._clock_ns()))
            if cur.rowcount == 0:
                return False
            self._add_audit(db, audit_rows)
        return True

    # -- deliveries --------------------------------------------------------------------------

    @staticmethod
    def _in(endpoints: Sequence[str] | None) -> tuple[str, tuple[str, ...]]:
        if endpoints is None:
            return "", ()
        names = tuple(endpoints)
        return f" AND endpoint IN ({', '.join('?' * len(names))})" if names else " AND 0", names

    def claim_due(
        self, *, lease_s: float = 60.0, limit: int = 100, endpoints: Sequence[str] | None = None
    ) -> list[Delivery]:
        """Lease the due pending deliveries (of these endpoints) so that no other process sends them meanwhile."""
        now = self._clock_ns()
        cond, names = self._in(endpoints)
        with self._tx() as db:
            rows = db.execute(
                "SELECT id, key, endpoint, finding_id, job_id, attempt, action, body, attempts, created_ns "
                f"FROM deliveries WHERE state = 'pending' AND next_ns <= ? AND lease_ns <= ?{cond} "
                "ORDER BY next_ns, id LIMIT ?",
                (now, now, *names, limit),
            ).fetchall()
            if rows:
                db.executemany(
                    "UPDATE deliveries SET lease_ns = ? WHERE id = ?", [(now + int(lease_s * 1e9), r[0]) for r in rows]
                )
        return [
            Delivery(
                id=r[0],
                key=r[1],
                endpoint=r[2],
                finding_id=r[3],
                job_id=r[4],
                attempt=r[5],
                action=r[6],
                body=bytes(r[7]),
                attempts=r[8],
                created_ns=r[9],
            )
            for r in rows
        ]

    def finish(
        self,
        delivery_id: int,
        *,
        state: str,
        attempts: int,
        detail: str,
        audit_rows: Sequence[dict[str, Any]],
        next_ns: int = 0,
    ) -> None:
        """Store the result of an attempt (``pending`` with ``next_ns`` to retry, ``delivered``, ``failed``)."""
        if state not in ("pending", "delivered", "failed"):
            raise ValueError(f"state {state!r}")
        with self._tx() as db:
            db.execute(
                "UPDATE deliveries SET state = ?, attempts = ?, detail = ?, next_ns = ?, lease_ns = 0 WHERE id = ?",
                (state, attempts, detail, next_ns, delivery_id),
            )
            self._add_audit(db, audit_rows)

    def counts(self) -> dict[str, int]:
        """Deliveries per state."""
        with self._lock:
            return dict(self._db.execute("SELECT state, count(*) FROM deliveries GROUP BY state").fetchall())

    def pending_by_endpoint(self) -> dict[str, int]:
        with self._lock:
            q = "SELECT endpoint, count(*) FROM deliveries WHERE state = 'pending' GROUP BY endpoint"
            return dict(self._db.execute(q).fetchall())

    def next_due_ns(self, endpoints: Sequence[str] | None = None) -> int | None:
        """When the earliest pending delivery (of these endpoints) is due; None when nothing is pending."""
        cond, names = self._in(endpoints)
        with self._lock:
            r = self._db.execute(
                f"SELECT min(max(next_ns, lease_ns)) FROM deliveries WHERE state = 'pending'{cond}", names
            ).fetchone()
        return None if r is None or r[0] is None else int(r[0])

    def deliveries(self, key: str | None = None) -> list[dict[str, Any]]:
        """Every delivery (or those of one idempotency key), without bodies: for inspection and tests."""
        q = "SELECT id, key, endpoint, finding_id, state, attempts, detail FROM deliveries"
        with self._lock:
            rows = self._db.execute(q + (" WHERE key = ?" if key else "") + " ORDER BY id", (key,) if key else ())
            cols = [c[0] for c in rows.description]
            return [dict(zip(cols, r)) for r in rows.fetchall()]

    # -- audit rows waiting for the store ----------------------------------------------------

    @staticmethod
    def _add_audit(db: sqlite3.Connection, rows: Sequence[dict[str, Any]]) -> None:
        db.executemany("INSERT INTO audit (row) VALUES (?)", [(json.dumps(r),) for r in rows])

    def add_audit(self, rows: Sequence[dict[str, Any]]) -> None:
        """Queue ``actions`` rows for the store."""
        with self._tx() as db:
            self._add_audit(db, rows)

    def pending_audit(self, limit: int = 10000) -> list[dict[str, Any]]:
        """Audit rows not yet written to the store, oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT row FROM audit ORDER BY id LIMIT ?", (limit,)).fetchall()
        return [json.loads(r[0]) for r in rows]

    def flush_audit(self, write: Callable[[list[dict[str, Any]]], object], *, limit: int = 10000) -> int:
        """Hand queued audit rows to ``write`` (the store) and drop them once it returned.

        The rows stay queued when ``write`` raises. The outbox is locked meanwhile, so two
        processes never write the same rows.
        """
        with self._tx() as db:
            rows = db.execute("SELECT id, row FROM audit ORDER BY id LIMIT ?", (limit,)).fetchall()
            if not rows:
                return 0
            write([json.loads(r) for _, r in rows])
            db.executemany("DELETE FROM audit WHERE id = ?", [(i,) for i, _ in rows])
        return len(rows)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> DeliveryOutbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
