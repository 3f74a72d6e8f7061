"""A real, local webhook receiver for tests and trials: verifies signatures, records deliveries.

It is an ``http.server`` on 127.0.0.1 (port 0: a free port) in a daemon thread, answering with a
script of responses (e.g. 500 then 200, or a delay longer than the sender's timeout), checking
either signature scheme (:func:`.signing.verify_request`), and deduplicating by
``Idempotency-Key`` (or the Standard Webhooks ``webhook-id``) as a well-behaved receiver should::

    with WebhookReceiver(secret) as rx:
        ...  # point an endpoint at rx.url
        assert rx.accepted[0].payload["finding"]["kind"] == "straggler"
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ranklens.analyzers.recovery.api import SignatureError
from ranklens.analyzers.recovery.signing import SignatureScheme, verify_request

__all__ = ["Received", "Response", "WebhookReceiver"]


@dataclass(frozen=True)
class Response:
    """One scripted answer: ``status``, after sleeping ``delay_s`` (to exceed a sender's timeout).

    ``retry_after_s`` sends ``Retry-After`` as whole seconds; ``retry_after`` sends the header's
    text as given (an HTTP date, or a malformed value); at most one of the two.
    """

    status: int = 200
    delay_s: float = 0.0
    retry_after_s: float | None = None
    retry_after: str | None = None

    def __post_init__(self) -> None:
        if self.retry_after_s is not None and self.retry_after is not None:
            raise ValueError("give retry_after_s (seconds) or retry_after (the header's text), not both")

    @property
    def retry_after_header(self) -> str | None:
        return str(int(self.retry_after_s)) if self.retry_after_s is not None else self.retry_after


@dataclass(frozen=True)
class Received:
    """One request as the receiver saw it."""

    headers: dict[str, str]
    body: bytes
    signature_ok: bool
    signature_error: str
    status: int
    duplicate: bool
    scheme: SignatureScheme | None = None  # the scheme whose signature was valid

    @property
    def payload(self) -> dict[str, Any]:
        return json.loads(self.body)

    @property
    def idempotency_key(self) -> str:
        """``Idempotency-Key``, else the Standard Webhooks ``webhook-id`` (ranklens sends both, equal)."""
        return self.headers.get("idempotency-key") or self.headers.get("webhook-id", "")


class WebhookReceiver:
    """A local HTTP receiver that checks ranklens or Standard Webhooks signatures.

    Args:
        secret: the shared secret (or several; ``whsec_…`` ones for Standard Webhooks). A request
            with no valid signature gets 401.
        responses: answers to give in order; when they run out, ``default`` is given.
        tolerance_s: timestamp tolerance of the signature check.
    """

    def __init__(
        self,
        secret: str | Iterable[str],
        *,
        responses: Iterable[Response | int] = (),
        default: Response | int = 200,
        tolerance_s: float = 300,
        path: str = "/hook",
    ) -> None:
        self._secret = secret if isinstance(secret, str) else list(secret)
        self._script = [r if isinstance(r, Response) else Response(r) for r in responses]
        self._default = default if isinstance(default, Response) else Response(default)
        self._tolerance_s = tolerance_s
        self._lock = threading.Lock()
        self.requests: list[Received] = []
        self._acked_keys: set[str] = set()
        self.path = path
        self._server: ThreadingHTTPServer | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{self.path}"

    @property
    def accepted(self) -> list[Received]:
        """First acknowledged delivery of each idempotency key (what a receiver would act on)."""
        with self._lock:
            return [r for r in self.requests if r.status < 300 and r.signature_ok and not r.duplicate]

    def script(self, *responses: Response | int) -> None:
        """Append answers to the script."""
        with self._lock:
            self._script.extend(r if isinstance(r, Response) else Response(r) for r in responses)

    def _next(self) -> Response:
        with self._lock:
            return self._script.pop(0) if self._script else self._default

    def start(self) -> WebhookReceiver:
        rx = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n)
                headers = {k.lower(): v for k, v in self.headers.items()}
                scheme: SignatureScheme | None = None
                try:
                    scheme = verify_request(headers, body, rx._secret, tolerance_s=rx._tolerance_s)
                    ok, err = True, ""
                except SignatureError as e:
                    ok, err = False, str(e)
                resp = rx._next()
                if resp.delay_s:
                    time.sleep(resp.delay_s)
                status = resp.status if ok else 401
                key = headers.get("idempotency-key") or headers.get("webhook-id", "")
                with rx._lock:
                    dup = status < 300 and key in rx._acked_keys
                    if status < 300 and key:
                        rx._acked_keys.add(key)
                    rx.requests.append(Received(headers, body, ok, err, status, dup, scheme))
                try:
                    self.send_response(status)
                    if resp.retry_after_header is not None:
                        self.send_header("Retry-After", resp.retry_after_header)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                except OSError:
                    pass  # the sender timed out and closed the connection

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        threading.Thread(target=self._server.serve_forever, name="webhook-receiver", daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop listening; :meth:`start` again listens on the same port (receiver down, then back)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> WebhookReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
