"""Issue 13, "one of each": one Severity, one metrics server, precise names for rules, engines and
outboxes, and a Finding that survives the ``findings`` row unchanged."""

from __future__ import annotations

import pytest

from ranklens.formats.severity import Severity
from tests.recovery_helpers import finding


def test_one_severity_enum_for_log_rules_findings_and_policy() -> None:
    from ranklens.analyzers import findings
    from ranklens.analyzers.recovery import policy
    from ranklens.collector import rules

    assert rules.Severity is Severity and findings.Severity is Severity and policy.Severity is Severity
    # the stored / printed values of both former enums
    assert [s.value for s in Severity] == ["info", "warning", "error", "critical"]
    assert [s.level for s in Severity] == [0, 1, 2, 3]
    # a log rule keeps "error"; a policy's min_severity orders findings by the same levels
    assert rules.BUILTIN_RULES[1].severity is Severity.ERROR
    pol = policy.parse_policy({"rule": [{"name": "x", "level": "notify", "min_severity": "error"}]})
    assert pol.rules[0].explain_mismatch(finding(severity=Severity.WARNING)) == "severity warning below error"
    assert pol.rules[0].explain_mismatch(finding(severity=Severity.CRITICAL)) == ""
    with pytest.raises(ValueError):
        Severity("high")


def test_one_metrics_server_binds_loopback_by_default_and_says_why_it_cannot_bind() -> None:
    import urllib.request

    from prometheus_client import CollectorRegistry, Gauge

    import ranklens.analyzers.recovery as recovery
    import ranklens.analyzers.recovery.prometheus as rec_prom
    import ranklens.collector.metrics as col_metrics
    from ranklens import _metrics_http
    from ranklens.collector import agent

    # the collector's endpoint and the analyzer's are the same implementation
    assert agent.MetricsServer is _metrics_http.MetricsServer and recovery.serve_metrics is _metrics_http.serve_metrics
    assert not hasattr(col_metrics, "MetricsServer") and not hasattr(rec_prom, "MetricsServer")
    reg = CollectorRegistry()
    Gauge("ranklens_test_value", "a value", registry=reg).set(7)
    with _metrics_http.MetricsServer(reg) as server:
        assert server.addr == "127.0.0.1" and server.port > 0
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"
        body = urllib.request.urlopen(server.url, timeout=10).read().decode()
        assert "ranklens_test_value 7.0" in body
        taken = server.port
        with pytest.raises(_metrics_http.MetricsBindError, match=f"127.0.0.1:{taken}: .*--metrics-port") as e:
            _metrics_http.serve_metrics(reg, port=taken)
        from ranklens.errors import ConfigError

        assert isinstance(e.value, ConfigError)  # the CLIs map it to exit code 2
    server.close()  # idempotent
    # closed: the port is released and can be bound again
    again = _metrics_http.serve_metrics(reg, port=taken)
    again.close()
    assert _metrics_http.MetricsServer(reg, addr="::1", port=9).url == "http://[::1]:9/metrics"
