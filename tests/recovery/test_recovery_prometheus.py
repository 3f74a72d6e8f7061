"""Findings as Prometheus metrics (scraped over HTTP), the shipped alert rules under promtool, and
the Alertmanager receiver with real POSTs attaching alerts to findings in a real store."""

from __future__ import annotations

import http.client
import json
import re
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ranklens.analyzers.findings import save_findings
from ranklens.analyzers.recovery import (
    AlertAttacher,
    AlertmanagerReceiver,
    FindingsExporter,
    HookRegistry,
    RecoveryEngine,
    RecoveryMetrics,
    serve_metrics,
)
from ranklens.errors import ConfigError
from tests.recovery_helpers import Clock, finding, policy

pytest.importorskip("prometheus_client", reason="prometheus-client is not installed (pip install prometheus-client)")
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy/prometheus/ranklens-rules.yml"
RULE_TESTS = ROOT / "deploy/prometheus/ranklens-rules.test.yml"
TOKEN = "alerts-token-0123456789abcdef"


def scrape(port: int) -> dict[str, list]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_findings_exported_with_stable_labels():
    reg = CollectorRegistry()
    exp = FindingsExporter(reg, clock_s=lambda: 1_790_000_000.0)
    f_open = finding(rank=2, node="node1")
    f_done = finding(rank=3, node="node1", state="resolved")
    exp.update([f_open, f_done])
    server = serve_metrics(reg)
    try:
        m = scrape(server.port)
        exp.update([f_open])  # the next analysis: f_done gone, f_open unchanged
        m2 = scrape(server.port)
    finally:
        server.close()
    opened = {s.labels["finding_id"]: s for s in m["ranklens_finding_open"]}
    assert opened[f_open.id].value == 1 and opened[f_done.id].value == 0
    assert opened[f_open.id].labels == {
        "job_id": "job-r",
        "attempt": "0",
        "kind": "straggler",
        "severity": "critical",
        "finding_id": f_open.id,
        "rank": "2",
        "node": "node1",
    }
    conf = {s.labels["finding_id"]: s.value for s in m["ranklens_finding_confidence"]}
    assert conf[f_open.id] == pytest.approx(0.95)
    assert next(s.value for s in m["ranklens_finding_step_time_ratio"]) == pytest.approx(0.29)
    assert m["ranklens_finding_impact_seconds"][0].value == 12.5
    assert m["ranklens_analyzer_last_run_timestamp_seconds"][0].value == 1_790_000_000.0
    assert [(s.labels, s.value) for s in m["ranklens_analyzer_findings"]] == [
        ({"kind": "straggler", "severity": "critical"}, 1.0)
    ]
    # same finding, same series: labels do not churn between analyses
    assert [s.labels for s in m2["ranklens_finding_open"]] == [opened[f_open.id].labels]


def test_recovery_metrics_count_decisions(embedded_store, tmp_path):
    reg = CollectorRegistry()
    clock = Clock()
    eng = RecoveryEngine(
        policy(dry_run=True),
        embedded_store,
        tmp_path / "ob",
        hooks=HookRegistry(),
        clock_ns=clock,
        metrics=RecoveryMetrics(reg),
    )
    eng.process([finding(now_ns=clock.ns)])
    eng.close()
    assert (
        reg.get_sample_value("ranklens_recovery_decisions_total", {"level": "restart_rank", "outcome": "dry_run"}) == 1
    )
    assert reg.get_sample_value("ranklens_recovery_outbox_pending") == 0


def test_rules_use_only_metrics_ranklens_exports():
    names = set(re.findall(r"\b(ranklens_(?:finding|analyzer|recovery)_[a-z_]+)", RULES.read_text()))
    reg = CollectorRegistry()
    FindingsExporter(reg).update([finding()])
    RecoveryMetrics(reg).delivery("webhook:x", "failed")
    exported = {s.name for fam in reg.collect() for s in fam.samples} | {fam.name for fam in reg.collect()}
    assert names and names <= exported, names - exported


@pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool is not installed (Debian: apt-get install prometheus); CI installs it",
)
def test_promtool_checks_and_tests_the_shipped_rules():
    check = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    run = subprocess.run(
        ["promtool", "test", "rules", RULE_TESTS.name],
        cwd=RULE_TESTS.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout


# -- Alertmanager receiver ------------------------------------------------------------------


def post(port: int, body: bytes, token: str | None = TOKEN, path: str = "/alertmanager") -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method="POST")
    req.add_header("Content-Type", "application/json")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def claim_length(port: int, n: int) -> int:
    """Announce an n-byte body and send none: the receiver must refuse on the header alone."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest("POST", "/alertmanager")
        conn.putheader("Authorization", f"Bearer {TOKEN}")
        conn.putheader("Content-Length", str(n))
        conn.endheaders()
        return conn.getresponse().status
    finally:
        conn.close()


def dcgm_notification(host: str, status: str = "firing", **extra_labels: str) -> bytes:
    return json.dumps(
        {
            "version": "4",
            "groupKey": '{}:{alertname="GpuXidFatal"}',
            "status": status,
            "receiver": "ranklens",
            "groupLabels": {"alertname": "GpuXidFatal"},
            "commonLabels": {},
            "commonAnnotations": {},
            "externalURL": "http://alertmanager:9093",
            "alerts": [
                {
                    "status": status,
                    "labels": {"alertname": "GpuXidFatal", "Hostname": host, "gpu": "3", **extra_labels},
                    "annotations": {"summary": f"GPU 3 on {host} reported XID 79"},
                    "startsAt": "2026-11-30T08:36:01Z",
                    "endsAt": "0001-01-01T00:00:00Z",
                    "generatorURL": "http://prometheus:9090/graph",
                    "fingerprint": "c0ffee",
                }
            ],
        }
    ).encode()


def test_alertmanager_receiver_attaches_dcgm_alert_to_finding(embedded_store):
    clock = Clock()
    f = finding(rank=2, node="node7", now_ns=clock.ns)
    other = finding(job_id="job-elsewhere", rank=0, node="node8", now_ns=clock.ns)
    save_findings(embedded_store, [f, other])
    rx = AlertmanagerReceiver(AlertAttacher(embedded_store, clock_ns=clock), token=TOKEN)
    port = rx.serve()
    try:
        assert post(port, dcgm_notification("node7"), token=None)[0] == 401
        assert post(port, dcgm_notification("node7"), token="wrong-token-0123456789")[0] == 401
        assert post(port, dcgm_notification("node7"), path="/other")[0] == 404
        assert post(port, b"not json")[0] == 400
        assert post(port, json.dumps({"alerts": "x"}).encode())[0] == 400
        assert claim_length(port, 2 * 1024 * 1024) == 413
        clock.advance(1)
        status, answer = post(port, dcgm_notification("node7"))
        assert (status, answer) == (200, {"alerts": 1, "recorded": 1})
        # Alertmanager repeats a firing alert: recorded once
        assert post(port, dcgm_notification("node7"))[1]["recorded"] == 0
        # it resolves: a second row
        clock.advance(1)
        assert post(port, dcgm_notification("node7", status="resolved"))[1]["recorded"] == 1
        # an alert on a host with no finding is kept, unattached
        clock.advance(1)
        assert post(port, dcgm_notification("node99"))[1]["recorded"] == 1
        # ranklens' own rule carries the finding id
        clock.advance(1)
        assert post(port, dcgm_notification("nodeX", finding_id=other.id, alertname="RanklensHang"))[1]["recorded"] == 1
    finally:
        rx.shutdown()
    rows = embedded_store.query(
        "SELECT finding_id, job_id, action, target, outcome, detail FROM actions ORDER BY ts_ns"
    ).to_pylist()
    attached = [(r["finding_id"], r["outcome"]) for r in rows]
    assert attached == [(f.id, "firing"), (f.id, "resolved"), ("", "firing"), (other.id, "firing")]
    assert (
        rows[0]["job_id"] == "job-r"
        and rows[0]["action"] == "alert"
        and rows[0]["target"] == "alertmanager:GpuXidFatal"
    )
    detail = json.loads(rows[0]["detail"])
    assert detail["labels"]["Hostname"] == "node7" and detail["matched_by"] == "host"
    assert json.loads(rows[3]["detail"])["matched_by"] == "finding_id"
    assert TOKEN not in json.dumps(rows)


def test_alertmanager_rank_label_that_is_not_a_decimal_integer_is_a_400_not_a_503_forever(store):
    """issue 22 #10: ``"²".isdigit()`` is True but ``int("²")`` raises; the receiver answered 503
    (retry) to a notification it can never take, so Alertmanager retried it forever."""
    f = finding(rank=2, node="node7")
    save_findings(store, [f])
    rx = AlertmanagerReceiver(AlertAttacher(store), token=TOKEN)
    port = rx.serve()
    try:
        for bad in ("²", "٣", "2x", " 2"):
            status, answer = post(port, dcgm_notification("node7", job_id="job-r", rank=bad))
            assert status == 400 and "labels.rank" in answer["error"], (bad, status, answer)
        status, answer = post(port, dcgm_notification("node7", job_id="job-r", rank="2"))
        assert (status, answer) == (200, {"alerts": 1, "recorded": 1})
    finally:
        rx.shutdown()
    rows = store.query("SELECT finding_id, detail FROM actions").to_pylist()
    assert [r["finding_id"] for r in rows] == [f.id]
    assert json.loads(rows[0]["detail"])["matched_by"] == "job_id+rank"


def test_alertmanager_receiver_requires_a_token(embedded_store):
    with pytest.raises(ConfigError, match="bearer token"):
        AlertmanagerReceiver(AlertAttacher(embedded_store), token="")
    with pytest.raises(ConfigError, match="at least 16"):
        AlertmanagerReceiver(AlertAttacher(embedded_store), token="short")
