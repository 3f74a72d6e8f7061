"""HMAC-SHA256 signing of webhook deliveries, and the verifier receivers use.

Every delivery carries::

    X-Ranklens-Timestamp: 1790000000            (Unix seconds, when this attempt was sent)
    X-Ranklens-Signature: v1=<hex HMAC-SHA256(secret, timestamp + "." + body)>

The timestamp is inside the signed message, so a captured request cannot be replayed later than
the receiver's tolerance (5 minutes by default). Each retry is signed anew with its own timestamp.
This module is stdlib-only so that receivers can copy or import it alone.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Iterable, Mapping

from ranklens.analyzers.recovery.api import SignatureError

__all__ = [
    "SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "sign",
    "signature_headers",
    "verify_request",
    "verify_signature",
]

SIGNATURE_HEADER = "X-Ranklens-Signature"
TIMESTAMP_HEADER = "X-Ranklens-Timestamp"
SCHEME = "v1"
DEFAULT_TOLERANCE_S = 300


def sign(secret: str | bytes, timestamp: int, body: bytes) -> str:
    """The hex HMAC-SHA256 of ``f"{timestamp}."`` followed by ``body``, keyed with ``secret``."""
    key = secret.encode() if isinstance(secret, str) else secret
    return hmac.new(key, f"{int(timestamp)}.".encode() + body, hashlib.sha256).hexdigest()


def signature_headers(secret: str | bytes, body: bytes, *, now_s: float | None = None) -> dict[str, str]:
    """The two signature headers for ``body``, timestamped ``now_s`` (default: now)."""
    ts = int(time.time() if now_s is None else now_s)
    return {TIMESTAMP_HEADER: str(ts), SIGNATURE_HEADER: f"{SCHEME}={sign(secret, ts, body)}"}


def verify_signature(
    body: bytes,
    timestamp: str | None,
    signature: str | None,
    secrets: str | bytes | Iterable[str | bytes],
    *,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
    now_s: float | None = None,
) -> None:
    """Check a delivery's signature; return None when it is valid.

    Args:
        body: the raw request body, exactly as received (before any JSON parsing).
        timestamp: the ``X-Ranklens-Timestamp`` header value.
        signature: the ``X-Ranklens-Signature`` header value (``v1=<hex>``; several
            comma-separated ``v1=`` values are accepted).
        secrets: the shared secret, or several (during a rotation, old and new).
        tolerance_s: how far the timestamp may be from ``now_s``, either way.
        now_s: the receiver's clock (default: now).

    Raises:
        SignatureError: missing or malformed headers, a stale timestamp, or no secret matches.
    """
    if not timestamp or not signature:
        raise SignatureError(f"missing {TIMESTAMP_HEADER} or {SIGNATURE_HEADER} header")
    try:
        ts = int(timestamp.strip())
    except ValueError:
        raise SignatureError(f"{TIMESTAMP_HEADER} is not an integer: {timestamp[:40]!r}") from None
    now = time.time() if now_s is None else now_s
    if abs(now - ts) > tolerance_s:
        raise SignatureError(
            f"timestamp {ts} is {abs(now - ts):.0f} s from now, over the tolerance of {tolerance_s:.0f} s "
            "(a replay, or clocks out of sync)"
        )
    given = []
    for part in signature.split(","):
        scheme, _, value = part.strip().partition("=")
        if scheme == SCHEME and value:
            given.append(value.strip().lower())
    if not given:
        raise SignatureError(f"{SIGNATURE_HEADER} has no {SCHEME}= signature")
    keys = [secrets] if isinstance(secrets, (str, bytes)) else list(secrets)
    if not keys:
        raise SignatureError("no secret to verify with")
    for key in keys:
        expected = sign(key, ts, body)
        # compare_digest: constant time, so timing does not reveal how much of a forgery matched
        if any(hmac.compare_digest(expected, g) for g in given):
            return
    raise SignatureError("signature does not match the body and timestamp (wrong secret, or the body was altered)")


def verify_request(
    headers: Mapping[str, str],
    body: bytes,
    secrets: str | bytes | Iterable[str | bytes],
    *,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
    now_s: float | None = None,
) -> None:
    """:func:`verify_signature` taking the request's headers (any case) as a mapping."""
    lower = {k.lower(): v for k, v in headers.items()}
    verify_signature(
        body,
        lower.get(TIMESTAMP_HEADER.lower()),
        lower.get(SIGNATURE_HEADER.lower()),
        secrets,
        tolerance_s=tolerance_s,
        now_s=now_s,
    )
