"""deploy/grafana/ is generated, current, and keeps the generator's promises: panels reference the
provisioned datasources, PromQL is valid (promtool) and uses metrics ranklens exports, and the
ClickHouse SQL runs against a real store holding a job."""

from __future__ import annotations

import json
import re
import runpy
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import synthetic_job

ROOT = Path(__file__).resolve().parents[2]
GEN = runpy.run_path(str(ROOT / "scripts/gen_grafana.py"))
FILES: dict[str, str] = GEN["render"]()


def load(path: str) -> dict:
    text = FILES[path]
    return json.loads("\n".join(line for line in text.splitlines() if not line.startswith("#")))


def dashboards() -> list[dict]:
    return [load(p) for p in FILES if p.startswith("dashboards/")]


def targets(ds_type: str) -> list[str]:
    out = []
    for d in dashboards():
        for p in d["panels"]:
            for t in p["targets"]:
                if t["datasource"]["type"] == ds_type:
                    out.append(t["expr"] if ds_type == "prometheus" else t["rawSql"])
    return out


def test_generated_files_are_current():
    for path, text in FILES.items():
        on_disk = ROOT / "deploy/grafana" / path
        assert on_disk.exists() and on_disk.read_text() == text, f"run python scripts/gen_grafana.py ({path})"


def test_panels_reference_provisioned_datasources():
    uids = {d["uid"]: d["type"] for d in load("provisioning/datasources/ranklens.yml")["datasources"]}
    assert set(uids.values()) == {"prometheus", "grafana-clickhouse-datasource"}
    for d in dashboards():
        assert d["uid"] and d["title"] and d["panels"]
        assert len({p["id"] for p in d["panels"]}) == len(d["panels"])
        variables = {v["name"] for v in d["templating"]["list"]}
        for p in d["panels"]:
            assert uids[p["datasource"]["uid"]] == p["datasource"]["type"], p["title"]
            assert p["targets"], p["title"]
            for t in p["targets"]:
                assert t["datasource"] == p["datasource"]
                query = t.get("expr") or t.get("rawSql")
                for var in re.findall(r"\$\{?(\w+)", query):
                    assert var in variables, (p["title"], var)
    for group in load("provisioning/alerting/ranklens.yml")["groups"]:
        for rule in group["rules"]:
            assert {q["datasourceUid"] for q in rule["data"]} <= set(uids) | {"__expr__"}
            assert rule["condition"] in {q["refId"] for q in rule["data"]}
    provider = load("provisioning/dashboards/ranklens.yml")["providers"][0]
    assert provider["type"] == "file"


def _promql() -> list[str]:
    alerts = [
        q["model"]["expr"]
        for g in load("provisioning/alerting/ranklens.yml")["groups"]
        for r in g["rules"]
        for q in r["data"]
        if "expr" in q["model"]
    ]
    return [e.replace("$job_id", ".*") for e in targets("prometheus") + alerts]


def test_promql_uses_exported_metrics():
    from prometheus_client import CollectorRegistry

    from ranklens.analyzers.recovery import FindingsExporter, RecoveryMetrics
    from ranklens.collector.metrics import CollectorMetrics
    from ranklens.records import to_arrow
    from tests.recovery_helpers import finding

    reg = CollectorRegistry()
    FindingsExporter(reg).update([finding()])
    RecoveryMetrics(reg).decision("notify", "decided")
    cm = CollectorMetrics(reg)  # the node collectors' metrics (the nodes dashboard)
    cm.observe_rows("steps", to_arrow("steps", [{"job_id": "j", "rank": 0, "step": 1, "start_ns": 1, "end_ns": 9}]))
    cm.observe_rows("heartbeats", to_arrow("heartbeats", [{"job_id": "j", "rank": 0, "ts_ns": 5}]))
    cm.observe_gpus([{"host": "n", "gpu_index": 0, "gpu_uuid": "u", "job_id": "j", "rank": 0, "util_pct": 50.0,
                      "mem_used_bytes": 1, "mem_total_bytes": 2, "power_w": 1.0, "temp_c": 1.0, "sm_clock_mhz": 1.0,
                      "mem_clock_mhz": 1.0, "throttle_reasons": 0, "ecc_corrected": 0, "ecc_uncorrected": 0,
                      "pcie_replay": 0, "nvlink_errors": 0}], [{}])  # fmt: skip
    cm.rows_shipped.labels("steps").inc()
    cm.spool_evicted_rows.labels("gpu_samples").inc()
    exported = {s.name for fam in reg.collect() for s in fam.samples}
    used = {m for e in _promql() for m in re.findall(r"\b(ranklens_[a-z_]+)", e)}
    assert used and used <= exported, used - exported


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (apt-get install prometheus)")
def test_promql_is_valid(tmp_path):
    rules = {
        "groups": [
            {"name": "grafana", "rules": [{"record": f"check:q{i}", "expr": e} for i, e in enumerate(_promql())]}
        ]
    }
    (tmp_path / "q.yml").write_text(json.dumps(rules))
    r = subprocess.run(
        ["promtool", "check", "rules", str(tmp_path / "q.yml")], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_clickhouse_queries_run_on_a_real_store(embedded_store):
    from ranklens.analyzers import find_stragglers, save_findings

    embedded_store.write_many(synthetic_job(slow_rank=2, steps=12))
    save_findings(embedded_store, find_stragglers(embedded_store, "job-synth"))
    embedded_store.write(
        "actions",
        [{"finding_id": "f", "job_id": "job-synth", "action": "notify", "outcome": "decided", "ts_ns": 1}],
    )
    sqls = targets("grafana-clickhouse-datasource")
    assert len(sqls) == 4
    for sql in sqls:
        rows = embedded_store.query(sql.replace("${job_id}", "job-synth")).to_pylist()
        assert rows, sql
    wait = embedded_store.query(sqls[0].replace("${job_id}", "job-synth")).to_pylist()
    per_rank = {}
    for r in wait:
        per_rank[r["rank"]] = per_rank.get(r["rank"], 0) + r["wait_ms"]
    # the slowed rank is the one the others wait for: it waits least
    assert min(per_rank, key=per_rank.get) == "2"
