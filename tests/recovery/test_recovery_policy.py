"""The recovery policy file: parsing, matching, and errors that name the file, key and value."""

from __future__ import annotations

import base64
import textwrap

import pytest

from ranklens.analyzers.findings import Severity
from ranklens.analyzers.recovery import Endpoint, Level, PolicyError, SignatureScheme, load_policy, parse_policy
from ranklens.analyzers.recovery.policy import validate_webhook_url
from ranklens.errors import ConfigError
from tests.recovery_helpers import SECRET, finding

GOOD = """
version = 1
dry_run = false
dashboard_url = "https://grafana.example/d/x?var-job={job_id}"

[guards]
cooldown_s = 600
max_actions_per_job_per_hour = 2
escalate_after = 2

[[rule]]
name = "hangs"
kinds = ["hang", "crash", "desync"]
level = "recommended"
max_level = "replace_node"

[[rule]]
name = "critical-straggler"
kinds = ["straggler"]
min_severity = "critical"
min_confidence = 0.8
min_duration_s = 120
min_steps = 10
level = "restart_rank"

[[rule]]
name = "any-straggler"
kinds = ["straggler"]
level = "notify"

[[endpoint]]
name = "oncall"
url = "https://hooks.example/ranklens"
secret_env = "RL_TEST_SECRET"
timeout_s = 3
levels = ["notify", "restart_rank"]
"""


def write(tmp_path, text: str):
    p = tmp_path / "policy.toml"
    p.write_text(textwrap.dedent(text))
    return p


def test_load_policy_and_match(tmp_path):
    pol = load_policy(write(tmp_path, GOOD), env={"RL_TEST_SECRET": SECRET})
    assert not pol.dry_run
    assert pol.guards.cooldown_s == 600 and pol.guards.max_actions_per_job_per_hour == 2
    assert [r.name for r in pol.rules] == ["hangs", "critical-straggler", "any-straggler"]
    ep = pol.endpoints[0]
    assert ep.secret == SECRET and ep.timeout_s == 3 and ep.levels == (Level.NOTIFY, Level.RESTART_RANK)
    assert SECRET not in repr(pol) and SECRET not in repr(ep)

    strong = finding()
    assert pol.match(strong).name == "critical-straggler"
    assert pol.match(strong).level_for(strong) is Level.RESTART_RANK
    # too short, too weak, warning: falls through to the notify rule
    assert pol.match(finding(duration_s=30)).name == "any-straggler"
    assert pol.match(finding(confidence=0.5)).name == "any-straggler"
    assert pol.match(finding(severity=Severity.WARNING)).name == "any-straggler"
    assert pol.match(finding(steps=3)).name == "any-straggler"
    # resolved findings match no rule (states defaults to open)
    assert pol.match(finding(state="resolved")) is None
    # the hang analyzer's recommendation, capped by max_level
    crash = finding(kind="crash", evidence={"action": "replace_node"})
    desync = finding(kind="desync", evidence={"action": "restart_job"})
    assert pol.match(crash).level_for(crash) is Level.REPLACE_NODE
    assert pol.match(desync).level_for(desync) is Level.REPLACE_NODE
    assert pol.dashboard_link(strong) == f"https://grafana.example/d/x?var-job={strong.job_id}"


def test_dry_run_is_the_default():
    pol = parse_policy({"rule": [{"name": "r", "level": "notify"}]})
    assert pol.dry_run is True


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("version = 2", "version: 2 is not supported"),
        ("[guards]\ncooldown = 5", "guards: unknown key(s) ['cooldown']"),
        ("[guards]\ncooldown_s = -1", "guards.cooldown_s: -1 is out of range"),
        ("[[rule]]\nname = 'x'\nlevel = 'reboot'", "rule[0] (x).level: 'reboot' is not a recovery level"),
        ("[[rule]]\nname = 'x'", "rule[0] (x).level: missing"),
        ("[[rule]]\nname = 'x'\nlevel = 'notify'\nmin_confidnce = 0.9", "unknown key(s) ['min_confidnce']"),
        ("[[rule]]\nname = 'x'\nlevel = 'notify'\nmin_confidence = 1.5", "min_confidence: 1.5 is out of range"),
        ("[[rule]]\nname = 'x'\nlevel = 'notify'\nmin_severity = 'high'", "'high' is not a severity"),
        ("[[rule]]\nname = 'x'\nlevel = 'notify'\n[[rule]]\nname = 'x'\nlevel = 'notify'", "'x' is used by 2 rules"),
        ("dry_run = 'no'", "dry_run: expected true or false, got 'no'"),
        ("dashboard_url = 'https://g/{job}'", "dashboard_url: bad placeholder"),
        ("[[endpoint]]\nname = 'e'\nurl = 'https://h/x'\nsecret = 'abc'", "secrets are not written in the policy"),
        ("[[endpoint]]\nname = 'e'\nurl = 'https://h/x'", "exactly one of secret_env"),
        ("[[endpoint]]\nname = 'e'\nurl = 'https://h/x'\nsecret_env = 'NOPE_X'", "NOPE_X is not set"),
        ("[[endpoint]]\nname = 'e'\nurl = 'http://h.example/x'\nsecret_env = 'S'", "plain http to h.example"),
        ("[[endpoint]]\nname = 'e'\nurl = 'ftp://h/x'\nsecret_env = 'S'", "scheme 'ftp'"),
        ("[[endpoint]]\nname = 'e'\nurl = 'https://u:p@h/x'\nsecret_env = 'S'", "carries credentials"),
        ("[[endpoint]]\nname = 'e'\nurl = 'https://h/x'\nsecret_env = 'SHORT'", "the secret is 5 characters"),
        ("this is = not toml [", "not valid TOML"),
    ],
)
def test_bad_policy_names_file_key_and_value(tmp_path, text, needle):
    p = write(tmp_path, text)
    with pytest.raises(PolicyError) as e:
        load_policy(p, env={"S": SECRET, "SHORT": "short"})
    assert str(p) in str(e.value)
    assert needle in str(e.value)
    assert isinstance(e.value, ConfigError)  # the CLI maps it to exit code 2
    assert SECRET not in str(e.value)


def test_missing_file_and_secret_file(tmp_path):
    with pytest.raises(PolicyError, match="cannot read the policy file"):
        load_policy(tmp_path / "nope.toml")
    (tmp_path / "secret").write_text(SECRET + "\n")
    p = write(
        tmp_path,
        "[[endpoint]]\nname = 'e'\nurl = 'http://127.0.0.1:9/x'\nsecret_file = 'secret'\n",
    )
    assert load_policy(p, env={}).endpoints[0].secret == SECRET


def test_url_validation_hides_query_and_allows_loopback_http():
    assert validate_webhook_url("http://127.0.0.1:8080/hook")
    assert validate_webhook_url("http://localhost/hook")
    assert validate_webhook_url("http://10.0.0.5/hook", allow_http=True)
    with pytest.raises(PolicyError) as e:
        validate_webhook_url("ftp://h.example/x?token=TOPSECRET")
    assert "TOPSECRET" not in str(e.value)
    with pytest.raises(PolicyError, match="whitespace"):
        validate_webhook_url("https://h.example/x y")


# -- signature schemes (issue 20) -----------------------------------------------------------

WHSEC = "whsec_" + base64.b64encode(bytes(range(32))).decode()
ENDPOINT = "[[endpoint]]\nname = 'e'\nurl = 'https://h.example/x'\nsecret_env = 'S'\n"


def test_endpoint_signature_schemes(tmp_path):
    def endpoint(extra: str, secret: str = WHSEC):
        return load_policy(write(tmp_path, ENDPOINT + extra), env={"S": secret}).endpoints[0]

    assert endpoint("", SECRET).signature == (SignatureScheme.RANKLENS,)  # the default: unchanged
    assert endpoint("signature = 'standard'").signature == (SignatureScheme.STANDARD,)
    both = endpoint("signature = ['standard', 'ranklens']")
    assert both.signature == (SignatureScheme.STANDARD, SignatureScheme.RANKLENS)
    # bare base64 (no whsec_ prefix) is a Standard Webhooks secret too, as the stock libraries read it
    assert endpoint("signature = 'standard'", base64.b64encode(b"k" * 24).decode()).signature
    # the ranklens scheme takes any secret of 16+ characters, a whsec_ one included
    assert endpoint("signature = 'ranklens'").secret == WHSEC


@pytest.mark.parametrize(
    ("extra", "secret", "needle"),
    [
        ("signature = 'svix'", WHSEC, "e).signature: 'svix' is not a signature scheme; one of 'ranklens', 'standard'"),
        ("signature = []", WHSEC, "signature: expected a non-empty array of strings"),
        ("signature = ['standard', 'standard']", WHSEC, "each once"),
        ("signature = 'standard'", SECRET, "'standard' with secret_env S: a Standard Webhooks secret is whsec_"),
        ("signature = 'standard'", "whsec_" + base64.b64encode(b"k" * 16).decode(), "at least 24 bytes"),
        ("signature = 'standard'", "whsec_" + "A" * 33, "is not base64"),  # 33 characters cannot be base64
    ],
)
def test_bad_signature_names_the_key_and_never_the_secret(tmp_path, extra, secret, needle):
    p = write(tmp_path, ENDPOINT + extra)
    with pytest.raises(PolicyError) as e:
        load_policy(p, env={"S": secret})
    assert needle in str(e.value) and str(p) in str(e.value)
    assert secret not in str(e.value) and secret.removeprefix("whsec_") not in str(e.value)


def test_endpoint_built_in_code_checks_its_signature_too():
    with pytest.raises(PolicyError, match="not base64"):
        Endpoint(name="e", url="https://h.example/x", secret=SECRET, signature=(SignatureScheme.STANDARD,))
    with pytest.raises(PolicyError, match="give one or both"):
        Endpoint(name="e", url="https://h.example/x", secret=WHSEC, signature=())
