"""End to end with the real servers: Prometheus (Debian's ``prometheus``) scrapes the analyzer's
metrics for a job with an injected straggler, the shipped rule fires, Alertmanager (Debian's
``prometheus-alertmanager``) delivers to ranklens' receiver, which attaches it to the finding;
and separately the policy fires a signed webhook that a local receiver verifies.

The shipped rules wait minutes (``for: 5m``); here a copy with ``for: 0s`` keeps the test short.
Skipped with the reason when the binaries are absent; CI installs both packages.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ranklens.analyzers import find_stragglers, save_findings
from ranklens.analyzers.recovery import (
    AlertAttacher,
    AlertmanagerReceiver,
    FindingsExporter,
    HookRegistry,
    RecoveryEngine,
    serve_metrics,
)
from ranklens.analyzers.recovery.testing import WebhookReceiver
from ranklens.demo import run_demo
from tests._sync import free_port, wait_until
from tests.recovery_helpers import SECRET, policy

# both tests analyse a real 4-rank gloo job (run_demo)
pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus")
ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
TOKEN = "alerts-token-0123456789abcdef"

needs_servers = pytest.mark.skipif(
    PROMETHEUS is None or ALERTMANAGER is None,
    reason="prometheus and/or alertmanager are not installed "
    "(Debian: apt-get install prometheus prometheus-alertmanager); CI installs them",
)


def straggler_findings(store):
    """Findings of a real 4-rank gloo job whose rank 2 is slowed (collected into ``store``)."""
    result = run_demo(store, ranks=4, slow_rank=2, slowdown=2.0, steps=16, slow_from_step=3)
    findings = find_stragglers(store, result.job_id)
    assert [f.suspects[0].rank for f in findings] == [2]
    return findings


@needs_servers
@pytest.mark.timeout(600)
def test_prometheus_rule_fires_and_alertmanager_delivers_to_ranklens(embedded_store, tmp_path):
    findings = straggler_findings(embedded_store)
    save_findings(embedded_store, findings)
    (f,) = findings
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    FindingsExporter(reg).update(findings)
    metrics = serve_metrics(reg)
    receiver = AlertmanagerReceiver(AlertAttacher(embedded_store), token=TOKEN)
    rx_port = receiver.serve()
    am_port, prom_port = free_port(), free_port()

    rules = re.sub(r"for: \d+m", "for: 0s", (ROOT / "deploy/prometheus/ranklens-rules.yml").read_text())
    (tmp_path / "rules.yml").write_text(rules)
    (tmp_path / "token").write_text(TOKEN)
    (tmp_path / "prometheus.yml").write_text(
        f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: [{tmp_path / "rules.yml"}]
alerting:
  alertmanagers: [{{static_configs: [{{targets: ["127.0.0.1:{am_port}"]}}]}}]
scrape_configs:
  - job_name: ranklens-analyzer
    static_configs: [{{targets: ["127.0.0.1:{metrics.port}"]}}]
"""
    )
    (tmp_path / "alertmanager.yml").write_text(
        f"""
route:
  receiver: ranklens
  group_by: [alertname, finding_id]
  group_wait: 1s
  group_interval: 1s
  repeat_interval: 1h
receivers:
  - name: ranklens
    webhook_configs:
      - url: http://127.0.0.1:{rx_port}/alertmanager
        send_resolved: true
        http_config:
          authorization: {{type: Bearer, credentials_file: {tmp_path / "token"}}}
"""
    )
    procs = []
    logs = {n: open(tmp_path / f"{n}.log", "w") for n in ("alertmanager", "prometheus")}
    try:
        procs.append(
            subprocess.Popen(
                [
                    ALERTMANAGER,
                    f"--config.file={tmp_path / 'alertmanager.yml'}",
                    f"--storage.path={tmp_path / 'am-data'}",
                    f"--web.listen-address=127.0.0.1:{am_port}",
                    "--cluster.listen-address=",
                ],
                stdout=logs["alertmanager"],
                stderr=subprocess.STDOUT,
            )
        )
        procs.append(
            subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={tmp_path / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp_path / 'prom-data'}",
                    f"--web.listen-address=127.0.0.1:{prom_port}",
                ],
                stdout=logs["prometheus"],
                stderr=subprocess.STDOUT,
            )
        )

        def alerted() -> list[dict]:
            rows = embedded_store.query(
                "SELECT finding_id, target, outcome, detail FROM actions WHERE action = 'alert'"
            ).to_pylist()
            return rows if any(r["target"] == "alertmanager:RanklensStraggler" for r in rows) else []

        # readiness: two servers start, scrape (1 s), evaluate (1 s) and route (1 s group wait); on a
        # loaded machine that can take minutes, so the deadline is generous (the test's timeout is 600 s)
        rows = wait_until(
            alerted,
            300,
            "the straggler alert back from Alertmanager",
            interval_s=0.5,
            procs=procs,
            detail=lambda: (
                (tmp_path / "prometheus.log").read_text()[-3000:] + (tmp_path / "alertmanager.log").read_text()[-3000:]
            ),
        )
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for fh in logs.values():
            fh.close()
        receiver.shutdown()
        metrics.close()
    straggler = [r for r in rows if r["target"] == "alertmanager:RanklensStraggler"]
    assert straggler, (tmp_path / "prometheus.log").read_text()[-3000:] + (tmp_path / "alertmanager.log").read_text()[
        -3000:
    ]
    r = straggler[0]
    assert r["finding_id"] == f.id and r["outcome"] == "firing"
    detail = json.loads(r["detail"])
    assert detail["matched_by"] == "finding_id" and detail["labels"]["rank"] == "2"


def test_policy_fires_signed_webhook_for_analyzed_straggler(embedded_store, tmp_path):
    findings = straggler_findings(embedded_store)
    with WebhookReceiver(SECRET) as rx:
        pol = policy(url=rx.url, rules=None)
        with RecoveryEngine(pol, embedded_store, tmp_path / "ob", hooks=HookRegistry()) as eng:
            report = eng.process(findings)
    assert report.deliveries.acknowledged == 1
    [got] = rx.accepted
    assert got.signature_ok
    assert got.payload["finding"]["suspects"][0]["rank"] == 2
    assert got.payload["action"]["level"] == "restart_rank"
