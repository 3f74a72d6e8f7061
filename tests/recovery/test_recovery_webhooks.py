"""Webhook delivery against a real local HTTP receiver: signatures, retries, timeouts, a receiver
that goes down and comes back, an analyzer restarted with deliveries pending, payload limits."""

from __future__ import annotations

import json
import logging
import random
import socket
import time

import pytest

from ranklens.analyzers.recovery import (
    HookRegistry,
    Level,
    PayloadTooLarge,
    RecoveryEngine,
    SignatureError,
    build_payload,
    sign,
    verify_request,
    verify_signature,
)
from ranklens.analyzers.recovery.api import Decision, idempotency_key
from ranklens.analyzers.recovery.signing import signature_headers
from ranklens.analyzers.recovery.testing import Response, WebhookReceiver
from ranklens.analyzers.recovery.webhooks import backoff_s
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
