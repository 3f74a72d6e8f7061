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
