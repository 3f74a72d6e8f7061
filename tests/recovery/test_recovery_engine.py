"""The recovery engine against a real embedded store and a real local receiver: decisions,
idempotency, guards (cool-down, cap, dry-run, escalation), hooks that raise or hang."""

from __future__ import annotations

import json
import threading
import time

import pytest

from ranklens.analyzers.recovery import Guards, HookRegistry, Level, PolicyRule, RecoveryEngine
from ranklens.analyzers.recovery.testing import WebhookReceiver
from tests.recovery_helpers import SECRET, Clock, finding, policy


def actions(store, where: str = "1") -> list[dict]:
    return store.query(
        "SELECT finding_id, job_id, attempt, action, target, idempotency_key, attempt_no, outcome, detail, ts_ns "
        f"FROM actions WHERE {where} ORDER BY ts_ns, target, attempt_no"
    ).to_pylist()


def test_signed_webhook_payload_and_audit_rows(embedded_store, tmp_path):
    clock = Clock()
    f = finding(now_ns=clock.ns)
    with WebhookReceiver(SECRET) as rx:
        eng = RecoveryEngine(
            policy(url=rx.url), embedded_store, tmp_path / "outbox", hooks=HookRegistry(), clock_ns=clock
        )
        report = eng.process([f])
        eng.close()
    assert [d.level for d in report.decisions] == [Level.RESTART_RANK]
    assert report.deliveries.acknowledged == 1
    [got] = rx.accepted
    assert got.signature_ok
    p = got.payload
    assert p["schema"] == "ranklens.recovery.action" and p["version"] == 1
    assert p["action"] == {
        "level": "restart_rank",
        "proposed_level": "restart_rank",
        "target": "rank:2",
        "rule": "stragglers",
        "reason": p["action"]["reason"],
        "escalated_from": None,
    }
    assert p["finding"]["id"] == f.id and p["finding"]["suspects"] == [{"rank": 2, "node": "node1", "gpu": ""}]
    assert p["finding"]["impact"]["seconds_lost"] == 12.5
    assert p["evidence"] == {"delay_per_step_s": 0.03} and p["evidence_omitted"] == ["per_step"]
    assert p["links"]["dashboard"].endswith(f"var-job=job-r&var-finding={f.id}")
    assert got.idempotency_key == p["idempotency_key"]

    rows = actions(embedded_store)
    assert [(r["target"], r["outcome"], r["attempt_no"]) for r in rows] == [
        ("rank:2", "decided", 1),
        ("webhook:rx", "acknowledged", 1),
    ]
    assert all(r["finding_id"] == f.id and r["action"] == "restart_rank" for r in rows)
    assert rows[1]["detail"] == "HTTP 200 OK"
    dumped = json.dumps(rows)
    assert SECRET not in dumped and "127.0.0.1" not in dumped  # no secret, no URL in the audit trail


def test_rerunning_analysis_does_not_refire(embedded_store, tmp_path):
    clock = Clock()
    f = finding(now_ns=clock.ns)
    with WebhookReceiver(SECRET) as rx:
        pol = policy(url=rx.url)
        RecoveryEngine(pol, embedded_store, tmp_path / "ob", hooks=HookRegistry(), clock_ns=clock).process([f])
        clock.advance(7200)  # past the cool-down: only idempotency can stop it now
        again = RecoveryEngine(pol, embedded_store, tmp_path / "ob", hooks=HookRegistry(), clock_ns=clock).process([f])
        # a second deployment with its own outbox also sees the decision, through the store
        other = RecoveryEngine(pol, embedded_store, tmp_path / "ob2", hooks=HookRegistry(), clock_ns=clock).process([f])
    assert again.decisions == [] and again.already_decided == [f.id]
    assert other.decisions == [] and other.already_decided == [f.id]
    assert len(rx.requests) == 1


def test_dry_run_records_and_delivers_only_as_notify(embedded_store, tmp_path):
    clock = Clock()
    hooks = HookRegistry()
    calls: list[tuple[str, str, bool]] = []
    hooks.register(
        lambda d: calls.append(("restart", d.level.value, d.dry_run)), name="restarter", levels=["restart_rank"]
    )
    hooks.register(
        lambda d: calls.append(("notify", d.delivered_level.value, d.dry_run)), name="pager", levels=["notify"]
    )
    with WebhookReceiver(SECRET) as rx:
        eng = RecoveryEngine(
            policy(url=rx.url, dry_run=True), embedded_store, tmp_path / "ob", hooks=hooks, clock_ns=clock
        )
        report = eng.process([finding(now_ns=clock.ns)])
        eng.close()
    assert report.decisions[0].dry_run
    assert calls == [("notify", "notify", True)]  # the restart hook was not called
    p = rx.accepted[0].payload
    assert p["dry_run"] is True and p["action"]["level"] == "notify" and p["action"]["proposed_level"] == "restart_rank"
    outcomes = {(r["target"], r["outcome"]) for r in actions(embedded_store)}
    assert outcomes == {("rank:2", "dry_run"), ("webhook:rx", "acknowledged"), ("hook:pager", "acknowledged")}


def test_cooldown_stops_a_flapping_finding(embedded_store, tmp_path):
    clock = Clock()
    pol = policy(guards=Guards(cooldown_s=1800, max_actions_per_job_per_hour=10, escalate_after=0))
    eng = RecoveryEngine(pol, embedded_store, tmp_path / "ob", hooks=HookRegistry(), clock_ns=clock)
    first = eng.process([finding(attempt=0, now_ns=clock.ns)])
    assert [d.suppressed_by for d in first.decisions] == [""]
    # the same finding resolves and comes back: same id, nothing new
    clock.advance(60)
    eng.process([finding(attempt=0, state="resolved", now_ns=clock.ns)])
    assert eng.process([finding(attempt=0, now_ns=clock.ns)]).decisions == []
    # the job restarted (new attempt, new finding id), the same rank straggles again within the cool-down
    clock.advance(60)
    second = eng.process([finding(attempt=1, now_ns=clock.ns)])
    assert [d.suppressed_by for d in second.decisions] == ["cooldown"]
    # re-analysis while still cooling down: no second suppressed row
    clock.advance(60)
    eng.process([finding(attempt=1, now_ns=clock.ns)])
    # after the cool-down it goes ahead
    clock.advance(1800)
    third = eng.process([finding(attempt=1, now_ns=clock.ns)])
    assert [d.suppressed_by for d in third.decisions] == [""]
    eng.close()
    rows = actions(embedded_store, "target = 'rank:2'")
    assert [r["outcome"] for r in rows] == ["decided", "suppressed", "decided"]
    assert json.loads(rows[1]["detail"])["suppressed_by"] == "cooldown"


def test_cap_per_job_per_hour(embedded_store, tmp_path):
    clock = Clock()
    pol = policy(guards=Guards(cooldown_s=0, max_actions_per_job_per_hour=2, escalate_after=0))
    eng = RecoveryEngine(pol, embedded_store, tmp_path / "ob", hooks=HookRegistry(), clock_ns=clock)
    r = eng.process([finding(rank=k, now_ns=clock.ns) for k in range(3)])
    assert [d.suppressed_by for d in r.decisions] == ["", "", "rate_cap"]
    # another job is not capped by this one
    assert eng.process([finding(job_id="job-other", now_ns=clock.ns)]).decisions[0].suppressed_by == ""
    clock.advance(3601)
    assert eng.process([finding(rank=2, now_ns=clock.ns)]).decisions[0].suppressed_by == ""
    eng.close()


def test_escalation_after_two_failed_restarts(embedded_store, tmp_path):
    clock = Clock()
    pol = policy(guards=Guards(cooldown_s=600, max_actions_per_job_per_hour=10, escalate_after=2))
    levels = []
    for attempt in range(3):
        # a fresh engine each time: the history the guards need comes from the store
        with RecoveryEngine(pol, embedded_store, tmp_path / "ob", hooks=HookRegistry(), clock_ns=clock) as eng:
            d = eng.process([finding(attempt=attempt, now_ns=clock.ns)]).decisions[0]
        levels.append((d.level, d.target, d.escalated_from))
        clock.advance(900)
    assert levels == [
        (Level.RESTART_RANK, "rank:2", None),
        (Level.RESTART_RANK, "rank:2", None),
        (Level.REPLACE_NODE, "node:node1", Level.RESTART_RANK),
    ]
    [row] = actions(embedded_store, "action = 'replace_node'")
    assert json.loads(row["detail"])["escalated_from"] == "restart_rank"


def test_hook_that_raises_or_hangs_does_not_stall(embedded_store, tmp_path):
    hooks = HookRegistry()
    release = threading.Event()

    @hooks.hook("straggler", name="boom")
    def boom(decision):
        raise RuntimeError("cannot reach the launcher")

    @hooks.hook("straggler", name="stuck", timeout_s=0.3)
    def stuck(decision):
        release.wait(30)

    @hooks.hook("hang", name="other-kind")
    def other(decision):
        raise AssertionError("must not be called for a straggler")

    clock = Clock()
    pol = policy(guards=Guards(cooldown_s=0, max_actions_per_job_per_hour=10, escalate_after=0))
    eng = RecoveryEngine(pol, embedded_store, tmp_path / "ob", hooks=hooks, clock_ns=clock)
    t0 = time.monotonic()
    r1 = eng.process([finding(rank=1, now_ns=clock.ns)])
    r2 = eng.process([finding(rank=3, now_ns=clock.ns)])  # "stuck" still hangs from the first call
    took = time.monotonic() - t0
    release.set()
    eng.close()
    assert took < 5
    assert r1.hooks == [
        ("boom", r1.decisions[0].finding.id, "failed"),
        ("stuck", r1.decisions[0].finding.id, "timeout"),
    ]
    assert [h[2] for h in r2.hooks] == ["failed", "skipped"]
    rows = {(r["target"], r["outcome"], r["finding_id"]): r["detail"] for r in actions(embedded_store)}
    fid = r1.decisions[0].finding.id
    assert "RuntimeError: cannot reach the launcher" in rows[("hook:boom", "failed", fid)]
    assert "still running after 0.3 s" in rows[("hook:stuck", "timeout", fid)]


def test_store_down_only_notify_goes_ahead_and_audit_rows_wait(embedded_store, tmp_path):
    from ranklens.store.testing import DownStore

    clock = Clock()
    rules = (
        PolicyRule(name="restart", kinds=("straggler",), level=Level.RESTART_RANK),
        PolicyRule(name="tell", kinds=("hang",), level=Level.NOTIFY),
    )
    down = DownStore("embedded:///nowhere", "embedded")  # the boundary a test machine cannot make fail on demand
    eng = RecoveryEngine(policy(rules=rules), down, tmp_path / "ob", hooks=HookRegistry(), clock_ns=clock)
    r = eng.process([finding(now_ns=clock.ns), finding(kind="hang", rank=0, now_ns=clock.ns)])
    assert [(d.level, d.suppressed_by) for d in r.decisions] == [
        (Level.RESTART_RANK, "history_unavailable"),
        (Level.NOTIFY, ""),
    ]
    assert eng.pending()["audit_queued"] == 2
    eng.close()
    # the store is back: the queued rows reach it
    eng = RecoveryEngine(policy(rules=rules), embedded_store, tmp_path / "ob", hooks=HookRegistry(), clock_ns=clock)
    assert eng.flush_audit() == 2
    assert eng.pending()["audit_queued"] == 0
    eng.close()
    assert sorted(r["outcome"] for r in actions(embedded_store)) == ["decided", "suppressed"]


def test_hook_registration_errors_and_entry_points(monkeypatch):
    from ranklens.analyzers.recovery import RecoveryError
    from ranklens.analyzers.recovery import hooks as hooks_mod

    reg = HookRegistry()
    with pytest.raises(RecoveryError, match="timeout_s must be > 0"):
        reg.register(lambda d: None, timeout_s=0)
    with pytest.raises(RecoveryError, match="levels are"):
        reg.register(lambda d: None, levels=["reboot"])

    def plain(decision):
        return "ok"

    class EP:
        def __init__(self, name, obj, fail=False):
            self.name, self.value, self._obj, self._fail = name, f"pkg:{name}", obj, fail

        def load(self):
            if self._fail:
                raise ImportError("broken plugin")
            return self._obj

    decorated_reg = HookRegistry()
    decorated = decorated_reg.hook("hang", name="cordon")(lambda d: None)
    eps = [EP("plain", plain), EP("cordon", decorated), EP("broken", None, fail=True)]
    monkeypatch.setattr(hooks_mod, "entry_points", lambda group: eps if group == "ranklens.hooks" else [])
    assert reg.load_entry_points() == ["plain", "cordon"]
    specs = {s.name: s for s in reg.specs()}
    assert specs["plain"].kinds == ("*",) and specs["cordon"].kinds == ("hang",)
