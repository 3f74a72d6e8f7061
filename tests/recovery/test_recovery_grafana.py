"""deploy/grafana/ is generated, current, and keeps the generator's promises: each dashboard
imports into any Grafana (``__inputs``, ``__requires``) and works provisioned (datasource
variables named like the inputs); ClickHouse panels use grafana-clickhouse-datasource v4's query
model and ``$__timeFilter``, and their SQL, with the macros expanded as the plugin expands them,
runs on a real store (chDB; and ClickHouse 18.16 where a server is configured) and is bounded by
the time range; PromQL is valid (promtool) and names only series ranklens' /metrics serve;
Grafana's alert rules are the store's (none duplicates a Prometheus rule) and its webhook
contact point delivers a Grafana-shaped notification to the real `ranklens alerts-receiver`."""

from __future__ import annotations

import json
import re
import runpy
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import T0, synthetic_job

ROOT = Path(__file__).resolve().parents[2]
GEN = runpy.run_path(str(ROOT / "scripts/gen_grafana.py"))
FILES: dict[str, str] = GEN["render"]()
CH_PLUGIN = "grafana-clickhouse-datasource"
# grafana-clickhouse-datasource v4: queryType -> the sqlds format number it goes with
CH_QUERY_TYPES = {"timeseries": 0, "table": 1, "logs": 2}
# the plugin's macros used here, and the v4 release whose expansion runs on ClickHouse 18.16
CH_MACROS = {"timeFilter", "interval_s"}
TOKEN = "grafana-alerts-token-0123456789"


def load(path: str) -> dict:
    text = FILES[path]
    return json.loads("\n".join(line for line in text.splitlines() if not line.startswith("#")))


def dashboards() -> dict[str, dict]:
    return {p: load(p) for p in FILES if p.startswith("dashboards/")}


def rules() -> list[dict]:
    return [r for g in load("provisioning/alerting/ranklens-rules.yml")["groups"] for r in g["rules"]]


def provisioned_uids() -> dict[str, str]:
    return {d["uid"]: d["type"] for d in load("provisioning/datasources/ranklens.yml")["datasources"]}


def targets(plugin: str) -> list[tuple[str, dict]]:
    """(panel title, target) of every dashboard target on ``plugin``."""
    return [
        (p["title"], t)
        for d in dashboards().values()
        for p in d["panels"]
        for t in p["targets"]
        if t["datasource"]["type"] == plugin
    ]


def variable_queries(plugin: str) -> list[str]:
    out = []
    for d in dashboards().values():
        for v in d["templating"]["list"]:
            if v["type"] == "query" and v["datasource"]["type"] == plugin:
                out.append(v["query"]["query"] if isinstance(v["query"], dict) else v["query"])
    return out


# --- generated and importable --------------------------------------------------------------------


def test_generated_files_are_current():
    for path, text in FILES.items():
        on_disk = ROOT / "deploy/grafana" / path
        assert on_disk.exists() and on_disk.read_text() == text, f"run python scripts/gen_grafana.py ({path})"
    extra = GEN["on_disk"]() - set(FILES)
    assert not extra, f"deploy/grafana/ holds files the generator does not make: {sorted(extra)}"
    assert subprocess.run([sys.executable, str(ROOT / "scripts/gen_grafana.py"), "--check"]).returncode == 0


def _refs(d: dict) -> list[tuple[str, dict]]:
    """Every datasource reference of a dashboard: panels, their targets, query variables."""
    out = []
    for p in d["panels"]:
        out.append((p["title"], p["datasource"]))
        out += [(p["title"], t["datasource"]) for t in p["targets"]]
    out += [(v["name"], v["datasource"]) for v in d["templating"]["list"] if v["type"] == "query"]
    return out


def test_dashboards_carry_inputs_requires_and_datasource_variables():
    for path, d in dashboards().items():
        assert d["uid"] and d["title"] and d["panels"], path
        assert len({p["id"] for p in d["panels"]}) == len(d["panels"]), path
        inputs = {i["name"]: i for i in d["__inputs"]}
        assert inputs and all(i["type"] == "datasource" for i in inputs.values()), path
        assert set(inputs) <= {"DS_PROMETHEUS", "DS_CLICKHOUSE"}
        ds_vars = {v["name"]: v for v in d["templating"]["list"] if v["type"] == "datasource"}
        # one datasource variable per input, of the input's plugin, listed before the variables using it
        assert set(ds_vars) == set(inputs), path
        names = [v["name"] for v in d["templating"]["list"]]
        assert names[: len(ds_vars)] == [n for n in names if n in ds_vars], path
        for name, v in ds_vars.items():
            assert v["query"] == inputs[name]["pluginId"], (path, name)
        requires = {(r["type"], r["id"]) for r in d["__requires"]}
        assert ("grafana", "grafana") in requires
        assert {("datasource", i["pluginId"]) for i in inputs.values()} <= requires, path
        assert {("panel", p["type"]) for p in d["panels"]} <= requires, path
        # every panel, target and query variable goes through a datasource variable of its own plugin
        for where, ref in _refs(d):
            m = re.fullmatch(r"\$\{(\w+)\}", ref["uid"])
            assert m and m[1] in inputs, (path, where, ref)
            assert inputs[m[1]]["pluginId"] == ref["type"], (path, where, ref)
        # and every ${var} a query uses is defined
        variables = set(names)
        for where, t in [(p["title"], t) for p in d["panels"] for t in p["targets"]]:
            query = t.get("expr") or t.get("rawSql")
            for var in re.findall(r"\$\{?(?!__)(\w+)", query):
                assert var in variables, (path, where, var)


def _import(d: dict, chosen: dict[str, str]) -> dict:
    """What Grafana's dashboard import does (pkg/services/dashboardimport/utils/
    dash_template_evaluator.go): each ``${<input>}`` in any string becomes the chosen value; the
    rest (``${job_id:singlequote}``, ``$__timeFilter``) is left for query time."""
    values = {"${" + i["name"] + "}": chosen[i["pluginId"]] for i in d["__inputs"]}

    def ev(x):
        if isinstance(x, str):
            return re.sub(r"\$\{.+?\}", lambda m: values.get(m[0], m[0]), x)
        if isinstance(x, list):
            return [ev(v) for v in x]
        if isinstance(x, dict):
            return {k: ev(v) for k, v in x.items() if k != "__inputs"}
        return x

    return ev(d)


def test_dashboards_work_imported_and_provisioned():
    uids = provisioned_uids()
    assert set(uids.values()) == {"prometheus", CH_PLUGIN}
    elsewhere = {"prometheus": "prom-of-another-grafana", CH_PLUGIN: "ch-of-another-grafana"}
    for path, d in dashboards().items():
        # imported into another Grafana: every reference is the datasource picked at import
        imported = _import(d, elsewhere)
        assert "${DS_" not in json.dumps(imported), path
        for where, ref in _refs(imported):
            assert ref["uid"] == elsewhere[ref["type"]], (path, where)
        # provisioned (no import step): ${DS_...} resolves through the variable of that name, which
        # starts on the provisioned datasource of that plugin
        current = {v["name"]: v["current"]["value"] for v in d["templating"]["list"] if v["type"] == "datasource"}
        for where, ref in _refs(d):
            uid = current[ref["uid"][2:-1]]
            assert uids[uid] == ref["type"], (path, where)
    for rule in rules():
        assert {q["datasourceUid"] for q in rule["data"]} <= set(uids) | {"__expr__"}
        assert rule["condition"] in {q["refId"] for q in rule["data"]}
    provider = load("provisioning/dashboards/ranklens.yml")["providers"][0]
    assert provider["type"] == "file"


# --- ClickHouse: the plugin's query model, its macros, a real store ------------------------------


def _ch_queries() -> list[tuple[str, dict]]:
    """(where, query model) of every ClickHouse query: panel targets and alert rules."""
    out = targets(CH_PLUGIN)
    for r in rules():
        out += [(r["title"], q["model"]) for q in r["data"] if q["datasourceUid"] == GEN["CH_UID"]]
    return out


def test_clickhouse_queries_use_the_v4_query_model_and_the_time_filter():
    queries = _ch_queries()
    assert {q["queryType"] for _, q in queries} == set(CH_QUERY_TYPES)  # tables, time series and logs
    for where, q in queries:
        assert q["editorType"] == "sql" and q["rawSql"], where
        assert q["format"] == CH_QUERY_TYPES[q["queryType"]], where
        major, minor, patch = map(int, q["pluginVersion"].split("."))
        assert (major, minor, patch) >= (4, 0, 3), where
    for where, sql in [(w, q["rawSql"]) for w, q in queries] + [("variable", s) for s in variable_queries(CH_PLUGIN)]:
        assert set(re.findall(r"\$__(\w+)", sql)) <= CH_MACROS, where
        # every table read is bounded by the time range; the macro's argument is one plain alias
        # (the plugin splits macro arguments on commas)
        filters = re.findall(r"\$__timeFilter\(([^)]*)\)", sql)
        assert filters and all(re.fullmatch(r"\w+", a) for a in filters), where
        assert len(filters) == len(re.findall(r"\bFROM (?!\()", sql)), where


def grafana_singlequote(value: str) -> str:
    """Grafana's ``${var:singlequote}`` format (the value quoted, its quotes escaped)."""
    return "'" + value.replace("'", "\\'") + "'"


def expand(sql: str, *, from_s: int, to_s: int, interval_s: int = 1, job_id: str = "") -> str:
    """The SQL ClickHouse receives: Grafana's variables, then the plugin's macros as v4.0.3+
    expands them (pkg/macros/macros.go: toDateTime(<unix seconds>))."""
    sql = sql.replace("${job_id:singlequote}", grafana_singlequote(job_id))
    sql = re.sub(
        r"\$__timeFilter\((\w+)\)", lambda m: f"{m[1]} >= toDateTime({from_s}) AND {m[1]} <= toDateTime({to_s})", sql
    )
    sql = sql.replace("$__interval_s", str(interval_s))
    assert "$" not in sql, sql  # nothing left that ClickHouse would choke on
    return sql


def test_clickhouse_queries_run_on_a_real_store_within_the_time_range(store):
    from ranklens.analyzers import find_stragglers, save_findings

    store.write_many(synthetic_job(slow_rank=2, steps=12))
    save_findings(store, find_stragglers(store, "job-synth"))
    store.write(
        "actions", [{"finding_id": "f", "job_id": "job-synth", "action": "notify", "outcome": "decided", "ts_ns": T0}]
    )
    store.write("log_events", [
        {"job_id": "job-synth", "host": "node1", "rank": 2, "ts_ns": T0 + 10**9, "klass": "nccl_timeout",
         "severity": "critical", "message": "Watchdog caught collective operation timeout", "repeat_count": 3},
        {"job_id": "job-synth", "host": "node1", "rank": -1, "ts_ns": T0 + 10**9, "klass": "gpu_xid",
         "severity": "critical", "message": "NVRM: GPU has fallen off the bus"},
    ])  # fmt: skip
    store.write("drops", [
        {"ts_ns": T0 + 10**9, "host": "node1", "job_id": "job-synth", "rank": 2, "component": "tracer",
         "what": "ring:collectives_dropped", "count": 7},
        {"ts_ns": T0 + 10**9, "host": "node1", "component": "collector", "what": "log_lines", "count": 5},
    ])  # fmt: skip
    now_s = int(store.query("SELECT max(updated_ns) AS u FROM findings").to_pylist()[0]["u"] // 10**9)
    covering = {"from_s": T0 // 10**9 - 3600, "to_s": now_s + 3600, "job_id": "job-synth"}
    before = {"from_s": T0 // 10**9 - 7200, "to_s": T0 // 10**9 - 3600, "job_id": "job-synth"}
    panels = [(w, q) for w, q in targets(CH_PLUGIN)]
    assert len(panels) == 5
    for where, q in panels:
        for interval_s in (1, 60) if q["queryType"] == "timeseries" else (1,):  # $__interval_s buckets
            assert store.query(expand(q["rawSql"], interval_s=interval_s, **covering)).to_pylist(), where
        assert not store.query(expand(q["rawSql"], **before)).to_pylist(), where  # the filter bounds it
    (jobs_sql,) = variable_queries(CH_PLUGIN)
    assert [r["job_id"] for r in store.query(expand(jobs_sql, **covering)).to_pylist()] == ["job-synth"]
    assert not store.query(expand(jobs_sql, **before)).to_pylist()

    wait = store.query(expand(panels[0][1]["rawSql"], interval_s=3600 * 24, **covering)).to_pylist()
    per_rank = {r["rank"]: r["wait_ms"] for r in wait}
    # the slowed rank is the one the others wait for: it waits least
    assert set(per_rank) == {"0", "1", "2", "3"} and min(per_rank, key=per_rank.get) == "2"

    # the store alerts: one numeric column, string labels; the XID line is Prometheus'/dcgm's
    fired = {}
    for rule in rules():
        (model,) = [q["model"] for q in rule["data"] if q["refId"] == "A"]
        window = {"from_s": T0 // 10**9 - 60, "to_s": T0 // 10**9 + 540, "job_id": ""}
        rows = store.query(expand(model["rawSql"], **window)).to_pylist()
        for row in rows:
            numbers = [k for k, v in row.items() if not isinstance(v, str)]
            assert len(numbers) == 1 and {"job_id", "node", "rank"} <= set(row), (rule["title"], row)
        fired[rule["title"]] = rows
        assert not store.query(expand(model["rawSql"], **before)).to_pylist()
    assert fired["RanklensCriticalLogLines"] == [
        {"job_id": "job-synth", "node": "node1", "rank": "2", "klass": "nccl_timeout", "lines": 3.0}
    ]
    assert fired["RanklensTracerDropping"] == [
        {"job_id": "job-synth", "node": "node1", "rank": "2", "what": "ring:collectives_dropped", "dropped": 7.0}
    ]


# --- Prometheus: names ranklens serves, valid PromQL ---------------------------------------------


def _promql() -> list[str]:
    exprs = [t["expr"] for _, t in targets("prometheus")]
    exprs += [q["model"]["expr"] for r in rules() for q in r["data"] if "expr" in q["model"]]
    return [e.replace("$job_id", ".*") for e in exprs]


def test_promql_uses_metrics_ranklens_serves():
    """The series ranklens' endpoints serve (scraped over HTTP from the real MetricsServer: no
    _created, with build info), not what the code might register."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.parser import text_string_to_metric_families

    from ranklens._metrics_http import MetricsServer
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
                      "mem_clock_mhz": 1.0, "throttle_reasons": 4, "ecc_corrected": 0, "ecc_uncorrected": 0,
                      "pcie_replay": 0, "nvlink_errors": 0}], [{}])  # fmt: skip
    cm.rows_shipped.labels("steps").inc()
    cm.spool_evicted_rows.labels("gpu_samples").inc()
    server = MetricsServer(reg)
    server.start()
    try:
        with urllib.request.urlopen(server.url, timeout=30) as r:
            text = r.read().decode()
    finally:
        server.close()
    served = {s.name: s.labels for fam in text_string_to_metric_families(text) for s in fam.samples}
    used = {m for e in _promql() for m in re.findall(r"\b((?:ranklens|process)_[a-z_]+)", e)}
    assert used and used <= set(served), used - set(served)
    # the labels the panels group and select by are on those series
    assert {"node", "gpu", "reason"} <= set(served["ranklens_gpu_clocks_event_reason"])
    assert {"version", "python"} <= set(served["ranklens_build_info"])


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (apt-get install prometheus)")
def test_promql_is_valid(tmp_path):
    exprs = _promql()
    rules_file = {
        "groups": [{"name": "grafana", "rules": [{"record": f"check:q{i}", "expr": e} for i, e in enumerate(exprs)]}]
    }
    (tmp_path / "q.yml").write_text(json.dumps(rules_file))
    r = subprocess.run(
        ["promtool", "check", "rules", str(tmp_path / "q.yml")], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{len(exprs)} rules found" in r.stdout, r.stdout


# --- alerting: one owner per alert, delivered to the receiver ------------------------------------


def test_each_alert_has_one_owner():
    """Grafana's rules are the store's (ClickHouse); Prometheus' are the metrics'. No name, and no
    Prometheus query, on both sides."""
    prom_rules = (ROOT / "deploy/prometheus/ranklens-rules.yml").read_text()
    prom_names = set(re.findall(r"^\s*- alert: (\w+)", prom_rules, re.M))
    assert prom_names
    for rule in rules():
        assert rule["title"] not in prom_names, rule["title"]
        sources = {q["datasourceUid"] for q in rule["data"]} - {"__expr__"}
        assert sources == {GEN["CH_UID"]}, rule["title"]
        assert rule["labels"]["source"] == "ranklens" and rule["labels"]["severity"] in {"warning", "critical"}
    doc = (ROOT / "docs/grafana.md").read_text()
    for name in prom_names | {r["title"] for r in rules()}:
        assert f"`{name}`" in doc, f"docs/grafana.md's ownership table lacks {name}"


def grafana_interpolate(value: str, env: dict[str, str]) -> str:
    """Grafana's environment expansion of provisioning values (pkg/services/provisioning/values:
    ``$VAR`` / ``${VAR}``, ``$$`` a literal ``$``)."""
    expand = lambda s: re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m[1] or m[2], ""), s)  # noqa: E731
    return "$".join(expand(part) for part in value.split("$$"))


def grafana_notification(status: str, labels: dict[str, str]) -> bytes:
    """A notification as Grafana's webhook contact point sends it (grafana/alerting
    receivers/webhook: Alertmanager's fields, plus orgId, state, title, message, values, ...)."""
    alert = {
        "status": status,
        "labels": labels,
        "annotations": {"summary": "nccl_timeout on node1 (rank 2) in job job-synth"},
        "startsAt": "2026-12-02T05:00:00Z",
        "endsAt": "0001-01-01T00:00:00Z" if status == "firing" else "2026-12-02T05:10:00Z",
        "generatorURL": "http://grafana:3000/alerting/grafana/ranklens-critical-log-lines/view?orgId=1",
        "fingerprint": "5b3fcd6a2f2c1e9d",
        "silenceURL": "http://grafana:3000/alerting/silence/new",
        "dashboardURL": "",
        "panelURL": "",
        "values": {"A": 3, "C": 1},
        "valueString": "[ var='A' labels={job_id=job-synth, node=node1, rank=2} value=3 ]",
    }
    return json.dumps(
        {
            "receiver": "ranklens alerts-receiver",
            "status": status,
            "orgId": 1,
            "alerts": [alert],
            "groupLabels": {"alertname": labels["alertname"], "job_id": labels["job_id"]},
            "commonLabels": labels,
            "commonAnnotations": alert["annotations"],
            "externalURL": "http://grafana:3000/",
            "version": "1",
            "groupKey": '{}/{source="ranklens"}:{alertname="RanklensCriticalLogLines", job_id="job-synth"}',
            "truncatedAlerts": 0,
            "title": f"[{status.upper()}:1] RanklensCriticalLogLines",
            "state": "alerting" if status == "firing" else "ok",
            "message": "**Firing**\n\nValue: A=3, C=1",
        }
    ).encode()


def test_grafana_contact_point_delivers_to_the_alerts_receiver(embedded_store):
    from ranklens.analyzers import find_stragglers, save_findings
    from ranklens.analyzers.recovery import AlertAttacher, AlertmanagerReceiver
    from ranklens.config import ENV_ALERTS_TOKEN

    # the policy routes the rules' alerts (source=ranklens) to the contact point
    (policy,) = load("provisioning/alerting/ranklens-policies.yml")["policies"]
    (route,) = policy["routes"]
    (cp,) = load("provisioning/alerting/ranklens-contact-points.yml")["contactPoints"]
    assert route["receiver"] == cp["name"] and route["object_matchers"] == [["source", "=", "ranklens"]]
    assert all(r["labels"]["source"] == "ranklens" for r in rules())
    (webhook,) = cp["receivers"]
    assert webhook["type"] == "webhook"
    settings = {k: grafana_interpolate(str(v), {ENV_ALERTS_TOKEN: TOKEN}) for k, v in webhook["settings"].items()}
    assert settings["authorization_credentials"] == TOKEN  # from the variable `ranklens alerts-receiver` reads

    store = embedded_store
    store.write_many(synthetic_job(slow_rank=2, steps=12))
    (f,) = find_stragglers(store, "job-synth")
    save_findings(store, [f])
    rx = AlertmanagerReceiver(AlertAttacher(store), token=TOKEN)
    port = rx.serve()
    # Grafana's request, at the contact point's path and with its header, to the real receiver
    url = re.sub(r"^http://[^/]+", f"http://127.0.0.1:{port}", settings["url"])
    labels = {"alertname": "RanklensCriticalLogLines", "grafana_folder": "ranklens", "job_id": "job-synth"}
    labels |= {"node": "node1", "rank": "2", "klass": "nccl_timeout", "severity": "critical", "source": "ranklens"}

    def send(status: str) -> dict:
        req = urllib.request.Request(
            url,
            data=grafana_notification(status, labels),
            method=settings["httpMethod"],
            headers={
                "Content-Type": "application/json",
                "Authorization": f"{settings['authorization_scheme']} {settings['authorization_credentials']}",
            },
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200
            return json.loads(r.read())

    try:
        assert send("firing") == {"alerts": 1, "recorded": 1}
        assert send("firing") == {"alerts": 1, "recorded": 0}  # Grafana's repeat: recorded once
        assert send("resolved") == {"alerts": 1, "recorded": 1}
    finally:
        rx.shutdown()
    rows = store.query("SELECT finding_id, outcome, detail FROM actions ORDER BY ts_ns, outcome").to_pylist()
    assert [(r["finding_id"], r["outcome"]) for r in rows] == [(f.id, "firing"), (f.id, "resolved")]
    detail = json.loads(rows[0]["detail"])
    assert detail["matched_by"] == "job_id+rank" and detail["receiver"] == "ranklens alerts-receiver"
    assert detail["generator_url"].startswith("http://grafana:3000/")
