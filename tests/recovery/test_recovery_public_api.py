"""The recovery package's public surface, its light imports, and that its docs stay true."""

from __future__ import annotations

import hashlib
import hmac
import re
import subprocess
import sys
import time
from pathlib import Path

import ranklens.analyzers.recovery as recovery
from ranklens.analyzers.recovery import load_policy
from ranklens.analyzers.recovery.signing import signature_headers
from tests.recovery_helpers import SECRET, finding

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs/recovery.md"


def test_public_names():
    assert {
        "RecoveryEngine",
        "Policy",
        "load_policy",
        "hook",
        "HookRegistry",
        "verify_request",
        "verify_signature",
        "FindingsExporter",
        "AlertmanagerReceiver",
        "DeliveryOutbox",
        "Level",
    } <= set(recovery.__all__)
    for name in recovery.__all__:
        assert hasattr(recovery, name), name
    # names that meant two things in the tree (issue 13): the simulator's engine, the spool outbox, log rules
    assert not {"Engine", "Outbox", "Rule"} & set(dir(recovery))


def test_importing_recovery_does_not_import_prometheus_client():
    code = "import sys, ranklens.analyzers.recovery; print('prometheus_client' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


def test_documented_policy_example_loads(tmp_path):
    toml = re.search(r"```toml\n(.*?)```", DOC.read_text(), re.S).group(1)
    p = tmp_path / "policy.toml"
    p.write_text(toml)
    pol = load_policy(p, env={"RANKLENS_WEBHOOK_SECRET": SECRET})
    assert pol.dry_run and [r.name for r in pol.rules] == ["hangs", "critical-straggler", "any-straggler"]
    assert pol.match(finding(kind="crash", evidence={"action": "replace_node"})).name == "hangs"


def test_documented_standalone_verifier_agrees():
    src = re.search(r"```python\nimport hashlib, hmac, time\n(.*?)```", DOC.read_text(), re.S).group(1)
    ns: dict = {"hashlib": hashlib, "hmac": hmac, "time": time}
    exec(src, ns)
    body = b'{"x": 1}'
    h = signature_headers(SECRET, body)
    assert ns["verify"](SECRET.encode(), h["X-Ranklens-Timestamp"], h["X-Ranklens-Signature"], body)
    assert not ns["verify"](b"wrong-secret-0123456789", h["X-Ranklens-Timestamp"], h["X-Ranklens-Signature"], body)
