"""Receive Alertmanager webhooks (e.g. DCGM XID/ECC alerts) and attach them to findings.

Alertmanager's ``webhook_config`` POSTs its notification JSON (``version`` "4": ``alerts`` with
``status``, ``labels``, ``annotations``, ``startsAt``, ``endsAt``, ``fingerprint``). Each alert is
matched to findings, in order of preference, by a ``finding_id`` label (ranklens' own rules
carry it), by ``job_id`` + ``rank`` labels, or by host (``Hostname`` as dcgm-exporter labels it,
``hostname``, ``node``, or ``instance`` without its port) against the suspects of findings seen
in the last hour. Every (alert, finding) pair becomes an ``actions`` row with ``action`` =
``alert``, ``target`` = ``alertmanager:<alertname>``, ``outcome`` = ``firing``/``resolved`` and
the labels and annotations as JSON in ``detail``; an alert that matches nothing is kept with an
empty ``finding_id`` (so a finding raised later can still be correlated). Alertmanager repeats
firing alerts; the idempotency key (fingerprint, start, status) keeps one row per alert state.

The endpoint requires ``Authorization: Bearer <token>`` (Alertmanager: ``http_config.authorization``)
and refuses bodies over ``max_body_bytes``. It answers 400 for a notification it can never take
(not JSON, malformed alerts, a ``rank`` label that is not a decimal integer) so that Alertmanager
does not retry it, and 503 when the store cannot take the rows, so that Alertmanager retries.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from ranklens.analyzers.recovery.api import RecoveryError
from ranklens.analyzers.recovery.audit import action_row
from ranklens.analyzers.recovery.policy import MIN_SECRET_LEN
from ranklens.errors import ConfigError
from ranklens.store.api import Store
from ranklens.store.api import sql_string as _q

__all__ = [
    "Alert",
    "AlertAttacher",
    "AlertPayloadError",
    "AlertmanagerReceiver",
    "FindingRef",
    "StoreFindingMatcher",
    "parse_alertmanager",
]

logger = logging.getLogger("ranklens.recovery")

MAX_BODY_BYTES = 1024 * 1024
MAX_ALERTS = 1000
HOST_LABELS = ("Hostname", "hostname", "node", "instance")
# ASCII digits only: str.isdigit() also accepts "²" or "٣", which int() refuses or reads otherwise
_RANK = re.compile(r"-?[0-9]{1,9}")


class AlertPayloadError(RecoveryError):
    """An Alertmanager notification is not the expected JSON."""


@dataclass(frozen=True)
class Alert:
    """One alert of an Alertmanager notification."""

    status: str
    labels: dict[str, str]
    annotations: dict[str, str] = field(default_factory=dict)
    starts_at: str = ""
    ends_at: str = ""
    fingerprint: str = ""
    generator_url: str = ""
    receiver: str = ""

    @property
    def name(self) -> str:
        return self.labels.get("alertname", "")

    @property
    def host(self) -> str:
        for k in HOST_LABELS:
            v = self.labels.get(k, "")
            if v:
                # instance is host:port (or [v6]:port); the others are plain names
                return v.rsplit(":", 1)[0].strip("[]") if k == "instance" and ":" in v else v
        return ""

    @property
    def key(self) -> str:
        """Identity of this alert state: the same firing alert resent has the same key."""
        ident = self.fingerprint or json.dumps(self.labels, sort_keys=True)
        return hashlib.sha256(f"alert\0{ident}\0{self.starts_at}\0{self.status}".encode()).hexdigest()[:32]


def parse_alertmanager(body: bytes) -> list[Alert]:
    """The alerts of an Alertmanager webhook body.

    Raises:
        AlertPayloadError: not JSON, no ``alerts`` array, or malformed alerts.
    """
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise AlertPayloadError(f"body is not JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("alerts"), list):
        raise AlertPayloadError("expected an Alertmanager notification: an object with an 'alerts' array")
    if len(doc["alerts"]) > MAX_ALERTS:
        raise AlertPayloadError(f"{len(doc['alerts'])} alerts in one notification, at most {MAX_ALERTS}")
    receiver = str(doc.get("receiver", ""))
    out = []
    for i, a in enumerate(doc["alerts"]):
        if not isinstance(a, dict) or not isinstance(a.get("labels", {}), dict):
            raise AlertPayloadError(f"alerts[{i}] is not an object with a 'labels' object")
        status = str(a.get("status", doc.get("status", "firing")))
        if status not in ("firing", "resolved"):
            raise AlertPayloadError(f"alerts[{i}].status is {status!r}; expected 'firing' or 'resolved'")
        labels = {str(k): str(v) for k, v in a.get("labels", {}).items()}
        if labels.get("rank") and not _RANK.fullmatch(labels["rank"]):
            raise AlertPayloadError(
                f"alerts[{i}].labels.rank is {labels['rank']!r}; expected a decimal integer (e.g. '3') or no rank label"
            )
        out.append(
            Alert(
                status=status,
                labels=labels,
                annotations={str(k): str(v)[:2000] for k, v in (a.get("annotations") or {}).items()},
                starts_at=str(a.get("startsAt", "")),
                ends_at=str(a.get("endsAt", "")),
                fingerprint=str(a.get("fingerprint", "")),
                generator_url=str(a.get("generatorURL", ""))[:1000],
                receiver=receiver,
            )
        )
    return out


@dataclass(frozen=True)
class FindingRef:
    """A finding an alert is attached to, and how it was matched."""

    id: str
    job_id: str
    attempt: int
    matched_by: str


class FindingMatcher(Protocol):
    def match(self, alert: Alert) -> list[FindingRef]: ...


class StoreFindingMatcher:
    """Matches alerts to findings in the store (see the module docstring for the order).

    Args:
        store: where the ``findings`` table is.
        window_s: host matches consider findings updated this recently.
        clock_ns: wall clock (tests).
    """

    def __init__(self, store: Store, *, window_s: float = 3600.0, clock_ns: Callable[[], int] = time.time_ns) -> None:
        self.store = store
        self.window_s = window_s
        self._clock_ns = clock_ns

    def _find(self, where: str, matched_by: str) -> list[FindingRef]:
        sql = (
            "SELECT id, argMax(job_id, updated_ns) AS j, argMax(attempt, updated_ns) AS a FROM findings "
            f"WHERE {where} GROUP BY id ORDER BY id LIMIT 50"
        )
        return [FindingRef(r["id"], r["j"], int(r["a"]), matched_by) for r in self.store.query(sql).to_pylist()]

    def match(self, alert: Alert) -> list[FindingRef]:
        lb = alert.labels
        if lb.get("finding_id"):
            refs = self._find(f"id = {_q(lb['finding_id'])}", "finding_id")
            if refs:
                return refs
        if lb.get("job_id") and _RANK.fullmatch(lb.get("rank", "")):
            refs = self._find(f"job_id = {_q(lb['job_id'])} AND has(suspect_ranks, {int(lb['rank'])})", "job_id+rank")
            if refs:
                return refs
        host = alert.host
        if host:
            since = self._clock_ns() - int(self.window_s * 1e9)
            cond = f"has(suspect_hosts, {_q(host)}) AND updated_ns >= {since}"
            if lb.get("job_id"):
                cond += f" AND job_id = {_q(lb['job_id'])}"
            return self._find(cond, "host")
        return []


class AlertAttacher:
    """Turns alerts into ``actions`` rows attached to the findings they match."""

    def __init__(
        self, store: Store, matcher: FindingMatcher | None = None, *, clock_ns: Callable[[], int] = time.time_ns
    ) -> None:
        self.store = store
        self.matcher = matcher if matcher is not None else StoreFindingMatcher(store, clock_ns=clock_ns)
        self._clock_ns = clock_ns

    def rows(self, alerts: Sequence[Alert]) -> list[dict[str, Any]]:
        """The rows for ``alerts`` (one per matched finding, or one unmatched row)."""
        now = self._clock_ns()
        rows = []
        for a in alerts:
            refs = self.matcher.match(a) or [FindingRef("", a.labels.get("job_id", ""), 0, "none")]
            detail = {
                "labels": a.labels,
                "annotations": a.annotations,
                "starts_at": a.starts_at,
                "ends_at": a.ends_at,
                "generator_url": a.generator_url,
                "receiver": a.receiver,
                "host": a.host,
            }
            for ref in refs:
                rows.append(
                    action_row(
                        finding_id=ref.id,
                        job_id=ref.job_id,
                        attempt=ref.attempt,
                        action="alert",
                        target=f"alertmanager:{a.name or 'unnamed'}",
                        idempotency_key=a.key,
                        outcome=a.status,
                        detail={**detail, "matched_by": ref.matched_by},
                        ts_ns=now,
                    )
                )
        return rows

    def attach(self, alerts: Sequence[Alert]) -> int:
        """Write the rows of alerts not recorded before; returns how many rows were written."""
        rows = self.rows(alerts)
        if not rows:
            return 0
        keys = sorted({r["idempotency_key"] for r in rows})
        seen = {
            (r["idempotency_key"], r["finding_id"])
            for r in self.store.query(
                "SELECT DISTINCT idempotency_key, finding_id FROM actions WHERE action = 'alert' AND "
                f"idempotency_key IN ({', '.join(_q(k) for k in keys)})"
            ).to_pylist()
        }
        new = [r for r in rows if (r["idempotency_key"], r["finding_id"]) not in seen]
        return self.store.write("actions", new) if new else 0


class AlertmanagerReceiver:
    """An HTTP endpoint for Alertmanager's webhook notifications.

    Args:
        attacher: where alerts go.
        token: the bearer token Alertmanager must send (at least 16 characters).
        path: the URL path to accept (others: 404).
        max_body_bytes: larger bodies are refused with 413.

    Raises:
        ConfigError: no token, or a short one.
    """

    def __init__(
        self, attacher: AlertAttacher, *, token: str, path: str = "/alertmanager", max_body_bytes: int = MAX_BODY_BYTES
    ) -> None:
        if not token or len(token) < MIN_SECRET_LEN:
            raise ConfigError(
                f"the Alertmanager receiver needs a bearer token of at least {MIN_SECRET_LEN} characters "
                "(e.g. from RANKLENS_ALERTS_TOKEN); an inbound endpoint without one is refused"
            )
        self.attacher = attacher
        self._token = token.encode()
        self.path = path
        self.max_body_bytes = max_body_bytes
        self._server: ThreadingHTTPServer | None = None

    def handle(self, method: str, path: str, headers: Any, read: Callable[[int], bytes]) -> tuple[int, dict[str, Any]]:
        """Process one request; returns (HTTP status, JSON answer). Used by the HTTP handler."""
        if path.split("?", 1)[0] != self.path:
            return 404, {"error": f"not found; POST to {self.path}"}
        if method != "POST":
            return 405, {"error": "use POST"}
        auth = headers.get("Authorization", "") or ""
        scheme, _, given = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self._token):
            return 401, {"error": "missing or wrong bearer token"}
        try:
            n = int(headers.get("Content-Length") or "")
        except ValueError:
            return 411, {"error": "Content-Length required"}
        if n < 0 or n > self.max_body_bytes:
            return 413, {"error": f"body of {n} bytes, at most {self.max_body_bytes}"}
        try:
            alerts = parse_alertmanager(read(n))
        except AlertPayloadError as e:
            return 400, {"error": str(e)}
        try:
            written = self.attacher.attach(alerts)
        except Exception as e:  # the store is a boundary: 503 makes Alertmanager retry
            logger.warning("recovery: cannot record %d alerts (%s)", len(alerts), e)
            return 503, {"error": "cannot record the alerts now; retry"}
        logger.info("recovery: received %d alerts, %d rows recorded", len(alerts), written)
        return 200, {"alerts": len(alerts), "recorded": written}

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Start serving in a daemon thread; returns the port. Stop with :meth:`shutdown`."""
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "ranklens-alerts/1"
            timeout = 30  # a client that stalls mid-request loses its connection

            def _answer(self) -> None:
                status, doc = receiver.handle(self.command, self.path, self.headers, self.rfile.read)
                body = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                if status == 401:
                    self.send_header("WWW-Authenticate", "Bearer")
                self.end_headers()
                self.wfile.write(body)

            do_POST = do_GET = do_PUT = do_DELETE = _answer

            def log_message(self, format: str, *args: Any) -> None:
                logger.debug("alerts receiver: " + format, *args)

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="ranklens-alerts", daemon=True).start()
        return int(self._server.server_address[1])

    def serve_forever(self, host: str = "127.0.0.1", port: int = 0) -> None:
        """Serve in the calling thread until interrupted (for a CLI command)."""
        self.serve(host, port)
        try:
            while self._server is not None:
                time.sleep(0.5)
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
