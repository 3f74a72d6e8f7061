"""Webhook delivery from the outbox: signed POSTs, retries with backoff and jitter, audit rows.

The HTTP client is the standard library's ``http.client`` behind a one-method
:class:`Transport` protocol (tests and users may pass their own). Redirects are not followed (a
signed body is never forwarded to a host the policy did not name). Every attempt becomes an
``actions`` row whose ``target`` is ``webhook:<endpoint name>``; the URL, the headers and the
secret are never logged nor stored. Each attempt is signed afresh in the endpoint's schemes
(:mod:`.signing`); the Standard Webhooks ``webhook-id`` is the decision's idempotency key, the
same on every retry, so a receiver deduplicates on it.

Classification of an attempt: 2xx acknowledged; 408, 425, 429, 5xx, timeouts and connection
errors are retried; any other status is a permanent failure (e.g. 401: the receiver rejects the
signature; retrying will not help). Retries wait ``min(backoff_max_s, backoff_base_s * 2**(n-1))``,
half of it fixed and half random ("equal jitter"), and stop after ``max_attempts`` or
``max_age_s``. A ``Retry-After`` header (RFC 9110 §10.2.3: delay-seconds, or an HTTP date read
against the dispatcher's clock) lengthens that wait to what it asks, up to ``backoff_max_s``; it
never shortens it (a date in the past asks for no wait, so the backoff stands: a receiver that
always answers "now" cannot burn through the attempts at once), as the OpenTelemetry Collector's
exporters treat a throttling answer. A value that is neither is ignored.
"""

from __future__ import annotations

import email.utils
import http.client
import logging
import random
import re
import ssl
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timezone
from typing import Protocol, runtime_checkable
from urllib.parse import urlsplit

from ranklens.analyzers.recovery.audit import action_row
from ranklens.analyzers.recovery.outbox import Delivery, DeliveryOutbox
from ranklens.analyzers.recovery.policy import Endpoint
from ranklens.analyzers.recovery.signing import SignatureScheme, signature_headers, standard_signature_headers

__all__ = [
    "DeliveryStats",
    "HttpClientTransport",
    "HttpResult",
    "Transport",
    "WebhookDispatcher",
    "backoff_s",
    "delivery_headers",
    "parse_retry_after",
]

logger = logging.getLogger("ranklens.recovery")

RETRY_STATUSES = frozenset({408, 425, 429})
MAX_RESPONSE_BYTES = 65536
USER_AGENT = "ranklens-recovery/1"


@dataclass(frozen=True)
class HttpResult:
    """What one POST ended with. ``status`` 0: no HTTP response (``error`` says why).

    ``retry_after``: the response's ``Retry-After`` header as sent (seconds or an HTTP date; the
    dispatcher reads it with its own clock, see :func:`parse_retry_after`). ``retry_after_s``: the same
    already in seconds, for a transport that parsed it itself; it wins over ``retry_after``.
    """

    status: int
    reason: str = ""
    retry_after_s: float | None = None
    error: str = ""
    retry_after: str | None = None

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    @property
    def retryable(self) -> bool:
        return self.status == 0 or self.status in RETRY_STATUSES or self.status >= 500

    def describe(self) -> str:
        return self.error if self.status == 0 else f"HTTP {self.status} {self.reason}".strip()


@runtime_checkable
class Transport(Protocol):
    """Sends one POST; returns a result rather than raising for network errors."""

    def post(self, url: str, body: bytes, headers: Mapping[str, str], timeout_s: float) -> HttpResult: ...


class HttpClientTransport:
    """:class:`Transport` over the standard library's ``http.client`` (one connection per POST).

    Args:
        ssl_context: for https endpoints (default: the system's trusted CAs, hostname checked).
    """

    def __init__(self, *, ssl_context: ssl.SSLContext | None = None) -> None:
        self._ssl = ssl_context

    def post(self, url: str, body: bytes, headers: Mapping[str, str], timeout_s: float) -> HttpResult:
        parts = urlsplit(url)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn: http.client.HTTPConnection
        try:
            if parts.scheme == "https":
                ctx = self._ssl or ssl.create_default_context()
                conn = http.client.HTTPSConnection(parts.hostname or "", parts.port, timeout=timeout_s, context=ctx)
            else:
                conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout_s)
            try:
                conn.request("POST", path, body=body, headers=dict(headers))
                resp = conn.getresponse()
                resp.read(MAX_RESPONSE_BYTES)
                return HttpResult(resp.status, resp.reason or "", retry_after=resp.getheader("Retry-After"))
            finally:
                conn.close()
        except TimeoutError:
            return HttpResult(0, error=f"timeout after {timeout_s:g} s")
        except ConnectionRefusedError:
            return HttpResult(0, error="connection refused")
        except (OSError, http.client.HTTPException) as e:
            # the message of these never contains the URL's query or our headers
            return HttpResult(0, error=f"{type(e).__name__}: {e}"[:300])


_DELAY_SECONDS = re.compile(r"[0-9]+")


def parse_retry_after(value: str | None, now_s: float) -> float | None:
    """The wait a ``Retry-After`` header asks for, in seconds from ``now_s``; None if it asks nothing.

    RFC 9110 §10.2.3: either delay-seconds (digits) or an HTTP-date. The IMF-fixdate form
    (``Wed, 02 Dec 2026 05:30:00 GMT``) and the obsolete RFC 850 and asctime forms, which
    recipients must accept, are all read by :func:`email.utils.parsedate_to_datetime`; a date with
    no zone is GMT, as every HTTP date is. A date in the past asks for 0 s. Anything else (a
    negative or fractional number, text, an empty header) is ignored: None.
    """
    if value is None:
        return None
    v = value.strip()
    if _DELAY_SECONDS.fullmatch(v):
        return float(v)  # digits only: a 400-digit value is inf, capped later
    try:
        when = email.utils.parsedate_to_datetime(v)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, when.timestamp() - now_s)


def backoff_s(endpoint: Endpoint, attempt_no: int, rng: random.Random) -> float:
    """Wait before attempt ``attempt_no + 1``: exponential in ``attempt_no``, with equal jitter."""
    cap = min(endpoint.backoff_max_s, endpoint.backoff_base_s * 2 ** max(0, attempt_no - 1))
    return cap / 2 + rng.uniform(0, cap / 2)


def delivery_headers(endpoint: Endpoint, d: Delivery, attempt_no: int, now_s: float) -> dict[str, str]:
    """Every header of one attempt, signed afresh in each of the endpoint's schemes (the timestamp
    is that of the attempt; the Standard Webhooks ``webhook-id`` is the delivery's idempotency key)."""
    headers = {
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        "Idempotency-Key": d.key,
        "X-Ranklens-Event": "action",
        "X-Ranklens-Delivery": str(d.id),
        "X-Ranklens-Attempt": str(attempt_no),
    }
    for scheme in endpoint.signature:
        if scheme is SignatureScheme.STANDARD:
            headers.update(standard_signature_headers(endpoint.secret, d.key, d.body, now_s=now_s))
        else:
            headers.update(signature_headers(endpoint.secret, d.body, now_s=now_s))
    return headers


@dataclass
class DeliveryStats:
    """Counts of one pass over the outbox."""

    acknowledged: int = 0
    retrying: int = 0
    failed: int = 0
    outcomes: list[tuple[str, str]] = field(default_factory=list)


class WebhookDispatcher:
    """Sends the outbox's due deliveries to their endpoints.

    Args:
        outbox: where deliveries wait.
        endpoints: the policy's endpoints (a delivery whose endpoint is not among them stays queued).
        transport: the HTTP client (default :class:`HttpClientTransport`).
        clock_ns: wall clock, ns. rng: jitter source. sleep: used by :meth:`drain` (injected in tests).
        on_outcome: called with (endpoint name, outcome) after each attempt (metrics).
    """

    def __init__(
        self,
        outbox: DeliveryOutbox,
        endpoints: Sequence[Endpoint],
        *,
        transport: Transport | None = None,
        clock_ns: Callable[[], int] = time.time_ns,
        rng: random.Random | None = None,
        sleep: Callable[[float], None] = time.sleep,
        lease_s: float = 60.0,
        on_outcome: Callable[[str, str], None] | None = None,
    ) -> None:
        self.outbox = outbox
        self.endpoints = {e.name: e for e in endpoints}
        self.transport: Transport = transport or HttpClientTransport()
        self._clock_ns = clock_ns
        self._rng = rng or random.Random()
        self._sleep = sleep
        self._lease_s = lease_s
        self._on_outcome = on_outcome
        unknown = {k: n for k, n in outbox.pending_by_endpoint().items() if k not in self.endpoints}
        if unknown:
            logger.warning(
                "recovery: %d deliveries wait for endpoints not in the policy: %s",
                sum(unknown.values()),
                ", ".join(sorted(unknown)),
            )

    def deliver_due(self, *, limit: int = 100) -> DeliveryStats:
        """One pass: attempt every delivery that is due now (each at most once)."""
        stats = DeliveryStats()
        lease = max(self._lease_s, max((e.timeout_s for e in self.endpoints.values()), default=0) * 2)
        for d in self.outbox.claim_due(lease_s=lease, limit=limit, endpoints=list(self.endpoints)):
            outcome = self._attempt(self.endpoints[d.endpoint], d)
            setattr(stats, outcome, getattr(stats, outcome) + 1)
            stats.outcomes.append((d.endpoint, outcome))
        return stats

    def _attempt(self, ep: Endpoint, d: Delivery) -> str:
        n = d.attempts + 1
        now_ns = self._clock_ns()
        result = self.transport.post(ep.url, d.body, delivery_headers(ep, d, n, now_ns / 1e9), ep.timeout_s)
        done_ns = self._clock_ns()
        age_s = (done_ns - d.created_ns) / 1e9
        if result.ok:
            state, outcome, next_ns = "delivered", "acknowledged", 0
        elif not result.retryable or n >= ep.max_attempts or age_s >= ep.max_age_s:
            state, outcome, next_ns = "failed", "failed", 0
        else:
            wait = backoff_s(ep, n, self._rng)
            asked = result.retry_after_s
            if asked is None:
                asked = parse_retry_after(result.retry_after, done_ns / 1e9)
            if asked is not None:
                wait = max(wait, min(asked, ep.backoff_max_s))
            state, outcome, next_ns = "pending", "retrying", done_ns + int(wait * 1e9)
        detail = result.describe()
        if outcome == "failed" and result.retryable:
            detail += f"; gave up after {n} attempt(s), {age_s:.0f} s"
        elif outcome == "retrying":
            detail += f"; next attempt in {(next_ns - done_ns) / 1e9:.1f} s"
        row = action_row(
            finding_id=d.finding_id,
            job_id=d.job_id,
            attempt=d.attempt,
            action=d.action,
            target=f"webhook:{ep.name}",
            idempotency_key=d.key,
            attempt_no=n,
            outcome=outcome,
            detail=detail,
            ts_ns=done_ns,
        )
        self.outbox.finish(d.id, state=state, attempts=n, detail=detail, audit_rows=[row], next_ns=next_ns)
        log = logger.warning if outcome == "failed" else logger.info
        log("recovery: webhook %s, delivery %d attempt %d: %s (%s)", ep.name, d.id, n, outcome, detail)
        if self._on_outcome is not None:
            self._on_outcome(ep.name, outcome)
        return outcome

    def drain(self, timeout_s: float) -> DeliveryStats:
        """Deliver until nothing is pending or ``timeout_s`` passed, sleeping until the next retry is due."""
        total = DeliveryStats()
        deadline = self._clock_ns() + int(timeout_s * 1e9)
        while True:
            s = self.deliver_due()
            for k in ("acknowledged", "retrying", "failed"):
                setattr(total, k, getattr(total, k) + getattr(s, k))
            total.outcomes.extend(s.outcomes)
            nxt = self.outbox.next_due_ns(list(self.endpoints))
            now = self._clock_ns()
            if nxt is None or now >= deadline or nxt > deadline:
                return total
            if nxt > now:
                self._sleep((nxt - now) / 1e9)
