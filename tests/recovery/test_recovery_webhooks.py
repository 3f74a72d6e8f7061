"""Webhook delivery against a real local HTTP receiver: signatures, retries, timeouts, a receiver
that goes down and comes back, an analyzer restarted with deliveries pending, payload limits."""

from __future__ import annotations

import base64
import dataclasses
import datetime
import email.utils
import hashlib
import json
import logging
import random
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import standardwebhooks

from ranklens.analyzers.recovery import (
    HookRegistry,
    Level,
    PayloadTooLarge,
    RecoveryEngine,
    SignatureError,
    SignatureScheme,
    build_payload,
    sign,
    verify_request,
    verify_signature,
)
from ranklens.analyzers.recovery.api import Decision, idempotency_key
from ranklens.analyzers.recovery.signing import (
    sign_standard,
    signature_headers,
    standard_key,
    standard_signature_headers,
)
from ranklens.analyzers.recovery.testing import Response, WebhookReceiver
from ranklens.analyzers.recovery.webhooks import backoff_s, parse_retry_after
from tests._sync import wait_until
from tests.recovery_helpers import SECRET, Clock, finding, policy


def actions(store) -> list[dict]:
    return store.query(
        "SELECT target, attempt_no, outcome, detail FROM actions WHERE startsWith(target, 'webhook:') "
        "ORDER BY attempt_no"
    ).to_pylist()


def engine(pol, store, outbox, clock, **kw):
    return RecoveryEngine(
        pol, store, outbox, hooks=HookRegistry(), clock_ns=clock, sleep=clock.sleep, rng=random.Random(0), **kw
    )


# -- signing --------------------------------------------------------------------------------


def test_verify_accepts_good_and_rejects_wrong_signature():
    body = b'{"a":1}'
    now = 1_790_000_000
    h = signature_headers(SECRET, body, now_s=now)
    verify_request(h, body, SECRET, now_s=now + 10)
    verify_request({k.lower(): v for k, v in h.items()}, body, ["old-secret-000000000", SECRET], now_s=now)
    with pytest.raises(SignatureError, match="does not match"):
        verify_request(h, body, "another-secret-0123456789", now_s=now)
    with pytest.raises(SignatureError, match="does not match"):
        verify_request(h, b'{"a":2}', SECRET, now_s=now)
    with pytest.raises(SignatureError, match="over the tolerance"):
        verify_request(h, body, SECRET, now_s=now + 301)
    with pytest.raises(SignatureError, match="missing"):
        verify_signature(body, None, h["X-Ranklens-Signature"], SECRET)
    with pytest.raises(SignatureError, match="no v1="):
        verify_signature(body, str(now), "v0=abc", SECRET, now_s=now)
    # the documented construction: HMAC-SHA256 over "<timestamp>." + body
    import hashlib
    import hmac

    assert (
        h["X-Ranklens-Signature"]
        == "v1=" + hmac.new(SECRET.encode(), f"{now}.".encode() + body, hashlib.sha256).hexdigest()
    )
    assert sign(SECRET, now, body) == h["X-Ranklens-Signature"][3:]


def test_receiver_with_wrong_secret_rejects_and_sender_gives_up(embedded_store, tmp_path):
    clock = Clock()
    with WebhookReceiver("not-the-senders-secret-000") as rx:
        eng = engine(policy(url=rx.url), embedded_store, tmp_path / "ob", clock)
        r = eng.process([finding(now_ns=clock.ns)])
        eng.close()
    assert r.deliveries.failed == 1  # 401 is permanent: no retry
    assert len(rx.requests) == 1 and not rx.requests[0].signature_ok
    assert [(a["outcome"], a["detail"]) for a in actions(embedded_store)] == [("failed", "HTTP 401 Unauthorized")]


# -- retries --------------------------------------------------------------------------------


def test_500_then_200_is_retried_and_delivered_once(embedded_store, tmp_path):
    clock = Clock()
    with WebhookReceiver(SECRET, responses=[500, Response(503, retry_after_s=2)]) as rx:
        eng = engine(policy(url=rx.url), embedded_store, tmp_path / "ob", clock)
        first = eng.process([finding(now_ns=clock.ns)])
        assert first.deliveries.retrying == 1
        stats = eng.drain(timeout_s=60)
        eng.close()
    assert stats.acknowledged == 1
    assert [r.status for r in rx.requests] == [500, 503, 200]
    assert len(rx.accepted) == 1
    assert len({r.idempotency_key for r in rx.requests}) == 1  # one key across retries
    assert [r.headers["x-ranklens-attempt"] for r in rx.requests] == ["1", "2", "3"]
    # backoff, then Retry-After (2 s) honoured up to the endpoint's backoff_max_s (1 s here)
    assert clock.slept[0] >= 0.005 and clock.slept[1] == 1.0
    rows = actions(embedded_store)
    assert [(a["attempt_no"], a["outcome"]) for a in rows] == [(1, "retrying"), (2, "retrying"), (3, "acknowledged")]
    assert rows[0]["detail"].startswith("HTTP 500")


def test_timeout_is_retried(embedded_store, tmp_path):
    clock = Clock()
    with WebhookReceiver(SECRET, responses=[Response(200, delay_s=1.0)]) as rx:
        eng = engine(policy(url=rx.url, timeout_s=0.2), embedded_store, tmp_path / "ob", clock)
        t0 = time.monotonic()
        r = eng.process([finding(now_ns=clock.ns)])
        assert time.monotonic() - t0 < 1.0  # the per-endpoint timeout bounds the caller
        assert r.deliveries.retrying == 1
        eng.drain(timeout_s=60)
        eng.close()
        # the receiver stops at the end of this block: first let the slow handler (1 s) finish and
        # record its request, or it would write to a closed server
        wait_until(lambda: len(rx.requests) == 2, 60, "the receiver to record both attempts (the first one slow)")
    rows = actions(embedded_store)
    assert [a["outcome"] for a in rows] == ["retrying", "acknowledged"]
    assert "timeout after 0.2 s" in rows[0]["detail"]


def test_receiver_down_then_back_delivered_once(embedded_store, tmp_path):
    clock = Clock()
    rx = WebhookReceiver(SECRET).start()
    rx.stop()  # down: connection refused
    eng = engine(policy(url=rx.url, max_attempts=50), embedded_store, tmp_path / "ob", clock)
    r = eng.process([finding(now_ns=clock.ns)])
    assert r.deliveries.retrying == 1
    eng.drain(timeout_s=0.1)  # still down
    rx.start()
    try:
        stats = eng.drain(timeout_s=120)
        again = eng.drain(timeout_s=120)
    finally:
        rx.stop()
        eng.close()
    assert stats.acknowledged == 1 and again.acknowledged == 0
    assert len(rx.requests) == 1 and len(rx.accepted) == 1
    outcomes = [a["outcome"] for a in actions(embedded_store)]
    assert outcomes[-1] == "acknowledged" and set(outcomes[:-1]) == {"retrying"}
    assert "connection refused" in actions(embedded_store)[0]["detail"]


def test_gives_up_after_max_attempts(embedded_store, tmp_path):
    clock = Clock()
    with WebhookReceiver(SECRET, default=502) as rx:
        eng = engine(policy(url=rx.url, max_attempts=3), embedded_store, tmp_path / "ob", clock)
        eng.process([finding(now_ns=clock.ns)])
        eng.drain(timeout_s=60)
        eng.close()
    assert len(rx.requests) == 3
    rows = actions(embedded_store)
    assert [a["outcome"] for a in rows] == ["retrying", "retrying", "failed"]
    assert "gave up after 3 attempt(s)" in rows[-1]["detail"]


def test_restarted_analyzer_delivers_pending_once(embedded_store, tmp_path):
    clock = Clock()
    rx = WebhookReceiver(SECRET, responses=[503]).start()
    pol = policy(url=rx.url)
    f = finding(now_ns=clock.ns)
    try:
        first = engine(pol, embedded_store, tmp_path / "ob", clock)
        assert first.process([f]).deliveries.retrying == 1
        first.close()  # the analyzer stops with the delivery pending
        clock.advance(5)
        second = engine(pol, embedded_store, tmp_path / "ob", clock)
        assert second.pending()["pending"] == 1
        assert second.process([f]).decisions == []  # re-analysis after restart: no new decision
        assert second.deliver_pending().acknowledged == 0  # process() already delivered it
        second.close()
        third = engine(pol, embedded_store, tmp_path / "ob", clock)
        clock.advance(3600)
        assert third.deliver_pending().acknowledged == 0
        assert third.pending()["delivered"] == 1
        third.close()
    finally:
        rx.stop()
    assert [r.status for r in rx.requests] == [503, 200]
    assert len(rx.accepted) == 1


def test_backoff_grows_with_jitter():
    from ranklens.analyzers.recovery import Endpoint

    ep = Endpoint(name="e", url="https://h.example/x", secret=SECRET, backoff_base_s=2, backoff_max_s=60)
    rng = random.Random(1)
    waits = [backoff_s(ep, n, rng) for n in range(1, 9)]
    for n, w in enumerate(waits, start=1):
        cap = min(60, 2 * 2 ** (n - 1))
        assert cap / 2 <= w <= cap
    assert len({round(w, 6) for w in waits}) == len(waits)


# -- payload and secrets --------------------------------------------------------------------


def _decision(f, level=Level.NOTIFY):
    return Decision(
        finding=f,
        level=level,
        target="rank:2",
        rule="r",
        reason="x",
        dry_run=False,
        key=idempotency_key(f.id, level, False),
        decided_ns=1,
    )


def test_payload_size_limit():
    # a long string is cut, a long series left out; both are named
    f = finding(evidence={"sql": "SELECT " + "x" * 50_000, "per_step": list(range(100)), "hot_steps": 7})
    doc = json.loads(build_payload(_decision(f), max_bytes=65536))
    assert len(doc["evidence"]["sql"]) == 2001 and doc["evidence"]["hot_steps"] == 7
    assert doc["evidence_omitted"] == ["per_step", "sql (truncated)"]
    # over the limit even so: only the action fields stay
    f = finding(evidence={"action": "restart_rank", **{f"q{i}": "y" * 3000 for i in range(10)}})
    body = build_payload(_decision(f), max_bytes=8192)
    doc = json.loads(body)
    assert len(body) <= 8192
    assert doc["evidence"] == {"action": "restart_rank"}
    assert {"q0", "q9", "q0 (truncated)"} <= set(doc["evidence_omitted"])
    huge = finding(evidence={})
    huge = type(huge)(**{**huge.__dict__, "title": "t" * 10_000})
    with pytest.raises(PayloadTooLarge, match="max_payload_bytes"):
        build_payload(_decision(huge), max_bytes=4096)


def test_secrets_never_logged(embedded_store, tmp_path, caplog):
    clock = Clock()
    caplog.set_level(logging.DEBUG, logger="ranklens")
    with WebhookReceiver(SECRET, responses=[500]) as rx:
        url = rx.url + "?token=URLTOKEN123"
        eng = engine(policy(url=url), embedded_store, tmp_path / "ob", clock)
        eng.process([finding(now_ns=clock.ns)])
        eng.drain(timeout_s=10)
        eng.close()
    assert caplog.records  # it does log attempts
    assert SECRET not in caplog.text and "URLTOKEN123" not in caplog.text
    dumped = json.dumps(embedded_store.query("SELECT * FROM actions").to_pylist())
    assert SECRET not in dumped and "URLTOKEN123" not in dumped


def test_no_redirects_followed(embedded_store, tmp_path):
    clock = Clock()
    with WebhookReceiver(SECRET, responses=[307]) as rx:
        eng = engine(policy(url=rx.url), embedded_store, tmp_path / "ob", clock)
        assert eng.process([finding(now_ns=clock.ns)]).deliveries.failed == 1
        eng.close()
    assert len(rx.requests) == 1


def test_unreachable_port_is_retryable():
    from ranklens.analyzers.recovery import HttpClientTransport

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    res = HttpClientTransport().post(f"http://127.0.0.1:{port}/x", b"{}", {}, 1.0)
    assert res.status == 0 and res.retryable and "refused" in res.error


def test_two_processes_sharing_an_outbox_never_claim_the_same_delivery(tmp_path):
    from ranklens.analyzers.recovery import DeliveryOutbox
    from ranklens.analyzers.recovery.outbox import NewDelivery

    clock = Clock()
    a, b = DeliveryOutbox(tmp_path / "ob", clock_ns=clock), DeliveryOutbox(tmp_path / "ob", clock_ns=clock)
    try:
        decision = dict(
            key="k1",
            finding_id="f",
            job_id="j",
            attempt=0,
            action="notify",
            target="rank:0",
            outcome="decided",
            audit_rows=[],
        )
        assert a.record_decision(**decision, deliveries=[NewDelivery("rx", b"{}")])
        assert not b.record_decision(**decision)  # the same decision again: a has it
        assert [d.key for d in a.claim_due(lease_s=30)] == ["k1"]
        assert b.claim_due(lease_s=30) == []  # leased by a
        clock.advance(31)  # a died without finishing: the lease runs out, b takes over
        assert [d.key for d in b.claim_due(lease_s=30)] == ["k1"]
    finally:
        a.close()
        b.close()


# -- Standard Webhooks (issue 20) -----------------------------------------------------------

WHSEC = "whsec_" + base64.b64encode(hashlib.sha256(b"ranklens standard webhooks test key").digest()).decode()


class StockReceiver:
    """A webhook receiver written as a user of the stock ``standardwebhooks`` library would write it:
    ``Webhook(secret).verify(body, headers)``, 401 when it raises, dedupe on ``webhook-id``."""

    def __init__(self, secret: str, statuses: list[int]) -> None:
        self.hook = standardwebhooks.Webhook(secret)
        self.statuses = list(statuses)
        self.requests: list[tuple[dict[str, str], bytes, str]] = []  # headers, body, the library's error
        self.done: set[str] = set()
        self.lock = threading.Lock()
        rx = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = dict(self.headers.items())
                try:
                    rx.hook.verify(body, headers)
                    error = ""
                except standardwebhooks.WebhookVerificationError as e:
                    error = str(e)
                with rx.lock:
                    status = 401 if error else (rx.statuses.pop(0) if rx.statuses else 204)
                    if status < 300:
                        rx.done.add(headers["webhook-id"])
                    rx.requests.append((headers, body, error))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> StockReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def standard_policy(url: str, *, secret: str = WHSEC, schemes=(SignatureScheme.STANDARD,), **kw):
    pol = policy(url=url)
    return dataclasses.replace(
        pol, endpoints=(dataclasses.replace(pol.endpoints[0], secret=secret, signature=schemes, **kw),)
    )


def test_standard_webhooks_delivery_verified_by_the_stock_library(embedded_store, tmp_path):
    clock = Clock()
    with StockReceiver(WHSEC, statuses=[503, 200]) as rx:
        eng = engine(standard_policy(rx.url), embedded_store, tmp_path / "ob", clock)
        eng.process([finding(now_ns=clock.ns)])
        assert eng.drain(timeout_s=60).acknowledged == 1
        eng.close()
    assert [err for _, _, err in rx.requests] == ["", ""]  # the stock library verified both attempts
    (h1, body, _), (h2, _, _) = rx.requests
    key = json.loads(body)["idempotency_key"]
    # the webhook-id is the decision's idempotency key: the same on the retry, so the receiver dedupes
    assert h1["webhook-id"] == h2["webhook-id"] == h1["Idempotency-Key"] == key and rx.done == {key}
    assert int(h2["webhook-timestamp"]) >= int(h1["webhook-timestamp"])  # each attempt signed anew
    assert "X-Ranklens-Signature" not in h1  # only the scheme the endpoint asked for
    assert [a["outcome"] for a in actions(embedded_store)] == ["retrying", "acknowledged"]


def test_stock_library_rejects_tampered_body_old_timestamp_and_wrong_secret(embedded_store, tmp_path):
    clock = Clock()
    with WebhookReceiver(WHSEC) as rx:  # captures a real delivery off the wire
        eng = engine(standard_policy(rx.url), embedded_store, tmp_path / "ob", clock)
        eng.process([finding(now_ns=clock.ns)])
        eng.close()
    (got,) = rx.requests
    assert got.signature_ok and got.scheme is SignatureScheme.STANDARD  # ranklens' own verifier agrees
    stock = standardwebhooks.Webhook(WHSEC)
    assert stock.verify(got.body, got.headers)["idempotency_key"] == got.headers["webhook-id"]
    with pytest.raises(standardwebhooks.WebhookVerificationError, match="No matching signature"):
        stock.verify(got.body.replace(b'"restart_rank"', b'"restart_job"'), got.headers)
    other = "whsec_" + base64.b64encode(b"x" * 32).decode()
    with pytest.raises(standardwebhooks.WebhookVerificationError, match="No matching signature"):
        standardwebhooks.Webhook(other).verify(got.body, got.headers)
    # a capture replayed later: a validly signed message whose timestamp is 10 minutes old
    old = standard_signature_headers(WHSEC, got.headers["webhook-id"], got.body, now_s=time.time() - 600)
    with pytest.raises(standardwebhooks.WebhookVerificationError, match="too old"):
        stock.verify(got.body, old)
    with pytest.raises(SignatureError, match="over the tolerance"):
        verify_request(old, got.body, WHSEC)
    # the id is signed too: a capture re-sent under another id (to slip past dedupe) fails
    with pytest.raises(standardwebhooks.WebhookVerificationError, match="No matching signature"):
        stock.verify(got.body, {**got.headers, "webhook-id": "f" * 32})


def test_standard_signature_matches_the_spec_example_and_the_stock_signer():
    # the example of the Standard Webhooks spec and its libraries' tests
    spec_secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    sig = sign_standard(spec_secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, b'{"test": 2432232314}')
    assert "v1," + sig == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    body = '{"a": "é"}'.encode()
    when = datetime.datetime.fromtimestamp(1_790_000_000, tz=datetime.timezone.utc)
    for secret in (WHSEC, WHSEC.removeprefix("whsec_"), WHSEC.removeprefix("whsec_").rstrip("=")):
        # with or without the prefix, padded or not: the key the stock library derives from the string
        assert standard_key(secret) == standard_key(WHSEC)
        stock = standardwebhooks.Webhook(secret).sign("k1", when, body.decode())
        assert stock == "v1," + sign_standard(secret, "k1", 1_790_000_000, body)
    with pytest.raises(ValueError, match="not base64"):
        standard_key(SECRET)


def test_verify_request_accepts_either_scheme_and_both():
    body = b'{"a":1}'
    now = 1_790_000_000
    ranklens = signature_headers(WHSEC, body, now_s=now)
    standard = standard_signature_headers(WHSEC, "key-1", body, now_s=now)
    assert verify_request(ranklens, body, WHSEC, now_s=now) is SignatureScheme.RANKLENS
    assert verify_request(standard, body, WHSEC, now_s=now) is SignatureScheme.STANDARD
    assert verify_request({**ranklens, **standard}, body, WHSEC, now_s=now) is SignatureScheme.STANDARD
    # rotation: a list may mix a ranklens-only secret (not base64) with whsec_ ones
    assert verify_request(standard, body, [SECRET, WHSEC], now_s=now) is SignatureScheme.STANDARD
    # both sent, the standard one broken in transit: the ranklens one still proves the sender
    broken = {**standard, "webhook-signature": "v1,AAAA"}
    assert verify_request({**ranklens, **broken}, body, WHSEC, now_s=now) is SignatureScheme.RANKLENS
    with pytest.raises(SignatureError, match="does not match the id, timestamp and body"):
        verify_request(broken, body, WHSEC, now_s=now)
    with pytest.raises(SignatureError, match="does not match the id"):
        verify_request(standard, b'{"a":2}', WHSEC, now_s=now)
    with pytest.raises(SignatureError, match="missing webhook-id"):
        verify_request({k: v for k, v in standard.items() if k != "webhook-id"}, body, WHSEC, now_s=now)
    with pytest.raises(SignatureError, match="none of the secrets is a Standard Webhooks secret"):
        verify_request(standard, body, SECRET, now_s=now)
    with pytest.raises(SignatureError, match="no v1,<base64> signature"):
        verify_request({**standard, "webhook-signature": "v1a,abc v2,def"}, body, WHSEC, now_s=now)
    with pytest.raises(SignatureError, match="missing signature headers"):
        verify_request({"Content-Type": "application/json"}, body, WHSEC, now_s=now)
    # several signatures, space-separated (a sender rotating keys): any one valid is enough
    two = {**standard, "webhook-signature": "v1,AAAA " + standard["webhook-signature"]}
    assert verify_request(two, body, WHSEC, now_s=now) is SignatureScheme.STANDARD


def test_both_schemes_on_one_endpoint(embedded_store, tmp_path):
    clock = Clock()
    schemes = (SignatureScheme.STANDARD, SignatureScheme.RANKLENS)
    with WebhookReceiver(WHSEC) as rx:
        eng = engine(standard_policy(rx.url, schemes=schemes), embedded_store, tmp_path / "ob", clock)
        eng.process([finding(now_ns=clock.ns)])
        eng.close()
    (got,) = rx.accepted
    # a stock Standard Webhooks receiver and an existing ranklens one both verify the same delivery
    standardwebhooks.Webhook(WHSEC).verify(got.body, got.headers)
    only_ranklens = {k: v for k, v in got.headers.items() if not k.startswith("webhook-")}
    assert verify_request(only_ranklens, got.body, WHSEC) is SignatureScheme.RANKLENS


# -- Retry-After ----------------------------------------------------------------------------


def test_parse_retry_after_forms():
    now = 1_790_000_000.0  # Mon, 21 Sep 2026 14:13:20 GMT
    imf = email.utils.formatdate(now + 7, usegmt=True)
    assert parse_retry_after(imf, now) == 7.0
    assert parse_retry_after(" 120 ", now) == 120.0
    assert parse_retry_after("0", now) == 0.0
    # the obsolete forms RFC 9110 says recipients must accept: RFC 850 and asctime (no zone: GMT)
    assert parse_retry_after("Monday, 21-Sep-26 14:13:30 GMT", now) == 10.0
    assert parse_retry_after("Mon Sep 21 14:13:25 2026", now) == 5.0
    assert parse_retry_after(email.utils.formatdate(now - 3600, usegmt=True), now) == 0.0  # past: now
    assert parse_retry_after("9" * 400, now) == float("inf")  # capped by the caller
    fullwidth_12 = "\uff11\uff12"  # digits to str.isdigit, not to RFC 9110
    for garbage in (None, "", "soon", "-5", "1.5", "1e3", "Mon, 99 Foo 2026 05:30:00 GMT", fullwidth_12):
        assert parse_retry_after(garbage, now) is None, garbage


@pytest.mark.parametrize(
    ("header", "backoff_max_s", "expected_s"),
    [
        ("date+5", 60.0, 5.0),  # a date 5 s ahead: waited for exactly
        ("date+30", 10.0, 10.0),  # further than backoff_max_s: capped
        ("date-100", 60.0, None),  # in the past: asks no wait, the normal backoff stands
        ("soon", 60.0, None),  # garbage: ignored, the normal backoff
        ("3", 60.0, 3.0),  # delta-seconds, as before
    ],
)
def test_retry_after_date_honoured_and_capped(embedded_store, tmp_path, header, backoff_max_s, expected_s):
    # the engine's clock is a fake one, on a whole second, so the wait is exact and no timing is measured;
    # it starts at the real time, so the receiver's signature check (against the real clock) passes
    clock = Clock(start_ns=time.time_ns() // 10**9 * 10**9)
    if header.startswith("date"):
        header = email.utils.formatdate(clock.ns / 1e9 + int(header[4:]), usegmt=True)
    with WebhookReceiver(SECRET, responses=[Response(503, retry_after=header)]) as rx:
        pol = policy(url=rx.url)
        pol = dataclasses.replace(pol, endpoints=(dataclasses.replace(pol.endpoints[0], backoff_max_s=backoff_max_s),))
        eng = engine(pol, embedded_store, tmp_path / "ob", clock)
        assert eng.process([finding(now_ns=clock.ns)]).deliveries.retrying == 1
        assert eng.drain(timeout_s=120).acknowledged == 1
        eng.close()
    assert rx.requests[0].status == 503
    if expected_s is None:  # the first backoff: base 0.01 s, half of it fixed, half jitter
        assert 0.005 <= clock.slept[0] <= 0.01
    else:
        assert clock.slept[0] == expected_s
        assert actions(embedded_store)[0]["detail"].endswith(f"next attempt in {expected_s:.1f} s")


def test_documented_stock_library_receiver_works(monkeypatch):
    doc = (Path(__file__).resolve().parents[2] / "docs/recovery.md").read_text()
    src = re.search(r"```python\n(import os\n\nfrom standardwebhooks .*?)```", doc, re.S).group(1)
    done: list[str] = []
    monkeypatch.setenv("RANKLENS_WEBHOOK_SECRET", WHSEC)
    ns: dict = {"already_done": done.__contains__, "act_on": lambda event: done.append(event["idempotency_key"])}
    exec(src, ns)
    body = json.dumps({"idempotency_key": "k" * 32, "action": {"level": "notify"}}).encode()
    headers = {"Content-Type": "application/json", **standard_signature_headers(WHSEC, "k" * 32, body)}
    assert ns["handle"](headers, body) == 204 and done == ["k" * 32]
    assert ns["handle"](headers, body) == 200 and done == ["k" * 32]  # a retry: already done
    assert ns["handle"](headers, body.replace(b"notify", b"restart_job")) == 401
