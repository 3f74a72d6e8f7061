"""HMAC-SHA256 signing of webhook deliveries, in two schemes, and the verifier receivers use.

**ranklens** (the default; unchanged since the first release)::

    X-Ranklens-Timestamp: 1790000000            (Unix seconds, when this attempt was sent)
    X-Ranklens-Signature: v1=<hex HMAC-SHA256(secret, timestamp + "." + body)>

keyed with the secret's UTF-8 bytes, whatever its form.

**standard**: `Standard Webhooks <https://www.standardwebhooks.com>`_ (spec 1.0), so that a receiver
can verify with that project's stock libraries (Python ``standardwebhooks``, and the Go, JS, Rust,
… ones)::

    webhook-id: <the delivery's idempotency key: the same on every retry>
    webhook-timestamp: 1790000000
    webhook-signature: v1,<base64 HMAC-SHA256(key, id + "." + timestamp + "." + body)>

keyed with the *decoded* secret: a secret is ``whsec_<base64>`` as the spec serialises it, and one
without the prefix is read as base64 too, as the stock libraries read any string secret. A string
that is not base64 of at least 24 bytes (the spec's lower bound) is refused rather than turned into
some other key: the stock libraries decode leniently (they drop characters outside the alphabet), so
a sender keying with anything else would sign with a key the receiver never derives. Strict decoding
of an acceptable secret gives exactly the key the lenient decoder gives.

In both schemes the timestamp is inside the signed message, so a captured request cannot be
replayed later than the receiver's tolerance (5 minutes by default, as in the Standard Webhooks
libraries). Each retry is signed anew with its own timestamp. This module needs only the standard
library.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import time
from collections.abc import Iterable, Mapping
from enum import Enum

from ranklens.analyzers.recovery.api import SignatureError

__all__ = [
    "MIN_STANDARD_KEY_BYTES",
    "SIGNATURE_HEADER",
    "STANDARD_SECRET_PREFIX",
    "TIMESTAMP_HEADER",
    "WEBHOOK_ID_HEADER",
    "WEBHOOK_SIGNATURE_HEADER",
    "WEBHOOK_TIMESTAMP_HEADER",
    "SignatureScheme",
    "sign",
    "sign_standard",
    "signature_headers",
    "standard_key",
    "standard_signature_headers",
    "verify_request",
    "verify_signature",
    "verify_standard",
]

SIGNATURE_HEADER = "X-Ranklens-Signature"
TIMESTAMP_HEADER = "X-Ranklens-Timestamp"
SCHEME = "v1"
DEFAULT_TOLERANCE_S = 300

# https://github.com/standard-webhooks/standard-webhooks/blob/main/spec/standard-webhooks.md
WEBHOOK_ID_HEADER = "webhook-id"
WEBHOOK_TIMESTAMP_HEADER = "webhook-timestamp"
WEBHOOK_SIGNATURE_HEADER = "webhook-signature"
STANDARD_SECRET_PREFIX = "whsec_"
MIN_STANDARD_KEY_BYTES = 24
_STANDARD_VERSION = "v1"
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")


class SignatureScheme(str, Enum):
    """How a delivery is signed (an endpoint's ``signature`` in the policy)."""

    RANKLENS = "ranklens"  # X-Ranklens-Timestamp / X-Ranklens-Signature, hex
    STANDARD = "standard"  # Standard Webhooks: webhook-id / webhook-timestamp / webhook-signature, base64


# -- the ranklens scheme --------------------------------------------------------------------


def sign(secret: str | bytes, timestamp: int, body: bytes) -> str:
    """The hex HMAC-SHA256 of ``f"{timestamp}."`` followed by ``body``, keyed with ``secret``."""
    key = secret.encode() if isinstance(secret, str) else secret
    return hmac.new(key, f"{int(timestamp)}.".encode() + body, hashlib.sha256).hexdigest()


def signature_headers(secret: str | bytes, body: bytes, *, now_s: float | None = None) -> dict[str, str]:
    """The two ranklens-scheme signature headers for ``body``, timestamped ``now_s`` (default: now)."""
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
    """Check a delivery's ranklens-scheme signature; return None when it is valid.

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
    ts = _fresh_timestamp(timestamp, TIMESTAMP_HEADER, tolerance_s, now_s)
    given = []
    for part in signature.split(","):
        scheme, _, value = part.strip().partition("=")
        if scheme == SCHEME and value:
            given.append(value.strip().lower())
    if not given:
        raise SignatureError(f"{SIGNATURE_HEADER} has no {SCHEME}= signature")
    keys = _secrets(secrets)
    for key in keys:
        expected = sign(key, ts, body)
        # compare_digest: constant time, so timing does not reveal how much of a forgery matched
        if any(hmac.compare_digest(expected, g) for g in given):
            return
    raise SignatureError("signature does not match the body and timestamp (wrong secret, or the body was altered)")


# -- the Standard Webhooks scheme -----------------------------------------------------------


def standard_key(secret: str | bytes) -> bytes:
    """The HMAC key of a Standard Webhooks secret: ``whsec_<base64>`` (or bare base64), decoded.

    ``bytes`` are the key itself (as the stock libraries take them). Missing base64 padding is
    allowed, as the stock libraries allow it.

    Raises:
        ValueError: the string is not base64 or decodes to fewer than 24 bytes (the message never
            shows the secret).
    """
    if isinstance(secret, bytes):
        key = secret
    else:
        text = secret.strip()
        text = text[len(STANDARD_SECRET_PREFIX) :] if text.startswith(STANDARD_SECRET_PREFIX) else text
        try:
            if not _BASE64.fullmatch(text) or len(text.rstrip("=")) % 4 == 1:
                raise binascii.Error
            key = base64.b64decode(text.rstrip("=") + "=" * (-len(text.rstrip("=")) % 4), validate=True)
        except binascii.Error:
            raise ValueError(
                "a Standard Webhooks secret is whsec_ followed by base64 (the key's bytes), and this one "
                'is not base64; make one with `python -c "import base64, secrets; '
                "print('whsec_' + base64.b64encode(secrets.token_bytes(32)).decode())\"`"
            ) from None
    if len(key) < MIN_STANDARD_KEY_BYTES:
        raise ValueError(
            f"a Standard Webhooks key must be at least {MIN_STANDARD_KEY_BYTES} bytes and this one is "
            f"{len(key)} (the part after whsec_ is base64 of the key: 32 random bytes are 44 characters)"
        )
    return key


def sign_standard(secret: str | bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """The base64 HMAC-SHA256 of ``f"{msg_id}.{timestamp}."`` followed by ``body``, keyed with
    :func:`standard_key` of ``secret`` (the ``webhook-signature`` header is ``v1,`` + this)."""
    digest = hmac.new(standard_key(secret), f"{msg_id}.{int(timestamp)}.".encode() + body, hashlib.sha256).digest()
    return base64.b64encode(digest).decode("ascii")


def standard_signature_headers(
    secret: str | bytes, msg_id: str, body: bytes, *, now_s: float | None = None
) -> dict[str, str]:
    """The three Standard Webhooks headers for ``body`` as message ``msg_id``, timestamped ``now_s``.

    Raises:
        ValueError: ``secret`` is not a Standard Webhooks secret (see :func:`standard_key`), or
            ``msg_id`` is empty or not printable ASCII (it is a header value and part of the
            signed message).
    """
    if not msg_id or not msg_id.isascii() or not msg_id.isprintable():
        raise ValueError(f"a webhook-id must be non-empty printable ASCII, got {msg_id[:40]!r}")
    ts = int(time.time() if now_s is None else now_s)
    return {
        WEBHOOK_ID_HEADER: msg_id,
        WEBHOOK_TIMESTAMP_HEADER: str(ts),
        WEBHOOK_SIGNATURE_HEADER: f"{_STANDARD_VERSION},{sign_standard(secret, msg_id, ts, body)}",
    }


def verify_standard(
    body: bytes,
    msg_id: str | None,
    timestamp: str | None,
    signature: str | None,
    secrets: str | bytes | Iterable[str | bytes],
    *,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
    now_s: float | None = None,
) -> None:
    """Check a delivery's Standard Webhooks signature; return None when it is valid.

    Args:
        body: the raw request body, exactly as received.
        msg_id, timestamp, signature: the ``webhook-id``, ``webhook-timestamp`` and
            ``webhook-signature`` header values (the last: space-separated ``v1,<base64>``
            entries; entries of other versions are ignored, as the spec asks).
        secrets: ``whsec_…`` secrets (or keys as bytes); strings that are not Standard Webhooks
            secrets are skipped.
        tolerance_s, now_s: as in :func:`verify_signature`.

    Raises:
        SignatureError: missing or malformed headers, a stale timestamp, or no secret matches.
    """
    if not msg_id or not timestamp or not signature:
        raise SignatureError(
            f"missing {WEBHOOK_ID_HEADER}, {WEBHOOK_TIMESTAMP_HEADER} or {WEBHOOK_SIGNATURE_HEADER} header"
        )
    ts = _fresh_timestamp(timestamp, WEBHOOK_TIMESTAMP_HEADER, tolerance_s, now_s)
    given = []
    for entry in signature.split():
        version, _, value = entry.partition(",")
        if version != _STANDARD_VERSION or not value:
            continue
        try:
            given.append(base64.b64decode(value, validate=True))
        except binascii.Error:
            continue
    if not given:
        raise SignatureError(f"{WEBHOOK_SIGNATURE_HEADER} has no {_STANDARD_VERSION},<base64> signature")
    keys = []
    for s in _secrets(secrets):
        try:
            keys.append(standard_key(s))
        except ValueError:
            continue  # a ranklens-scheme secret among several: it cannot sign this scheme
    if not keys:
        raise SignatureError("none of the secrets is a Standard Webhooks secret (whsec_<base64>)")
    message = f"{msg_id}.{ts}.".encode() + body
    for key in keys:
        expected = hmac.new(key, message, hashlib.sha256).digest()
        if any(hmac.compare_digest(expected, g) for g in given):
            return
    raise SignatureError("signature does not match the id, timestamp and body (wrong secret, or the body was altered)")


# -- either ---------------------------------------------------------------------------------


def verify_request(
    headers: Mapping[str, str],
    body: bytes,
    secrets: str | bytes | Iterable[str | bytes],
    *,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
    now_s: float | None = None,
) -> SignatureScheme:
    """Verify a request signed in either scheme, taking its headers (any case) as a mapping.

    A request carrying Standard Webhooks headers is checked by them, one carrying ranklens headers
    by those; one carrying both (an endpoint with ``signature = ["standard", "ranklens"]``) is
    valid when either signature is (both need the secret).

    Returns:
        The scheme whose signature was valid.

    Raises:
        SignatureError: no signature headers, or none of the present signatures is valid (the
            message is the Standard Webhooks check's when it was tried).
    """
    lower = {k.lower(): v for k, v in headers.items()}
    standard = any(h in lower for h in (WEBHOOK_ID_HEADER, WEBHOOK_TIMESTAMP_HEADER, WEBHOOK_SIGNATURE_HEADER))
    ranklens = any(h.lower() in lower for h in (TIMESTAMP_HEADER, SIGNATURE_HEADER))
    if not standard and not ranklens:
        raise SignatureError(
            f"missing signature headers: neither {WEBHOOK_SIGNATURE_HEADER} (Standard Webhooks) "
            f"nor {SIGNATURE_HEADER} (ranklens)"
        )
    first: SignatureError | None = None
    if standard:
        try:
            verify_standard(
                body,
                lower.get(WEBHOOK_ID_HEADER),
                lower.get(WEBHOOK_TIMESTAMP_HEADER),
                lower.get(WEBHOOK_SIGNATURE_HEADER),
                secrets,
                tolerance_s=tolerance_s,
                now_s=now_s,
            )
            return SignatureScheme.STANDARD
        except SignatureError as e:
            if not ranklens:
                raise
            first = e
    try:
        verify_signature(
            body,
            lower.get(TIMESTAMP_HEADER.lower()),
            lower.get(SIGNATURE_HEADER.lower()),
            secrets,
            tolerance_s=tolerance_s,
            now_s=now_s,
        )
    except SignatureError as e:
        raise (first or e) from None
    return SignatureScheme.RANKLENS


def _fresh_timestamp(value: str, header: str, tolerance_s: float, now_s: float | None) -> int:
    try:
        ts = int(value.strip())
    except ValueError:
        raise SignatureError(f"{header} is not an integer: {value[:40]!r}") from None
    now = time.time() if now_s is None else now_s
    if abs(now - ts) > tolerance_s:
        raise SignatureError(
            f"timestamp {ts} is {abs(now - ts):.0f} s from now, over the tolerance of {tolerance_s:.0f} s "
            "(a replay, or clocks out of sync)"
        )
    return ts


def _secrets(secrets: str | bytes | Iterable[str | bytes]) -> list[str | bytes]:
    keys = [secrets] if isinstance(secrets, (str, bytes)) else list(secrets)
    if not keys:
        raise SignatureError("no secret to verify with")
    return keys
