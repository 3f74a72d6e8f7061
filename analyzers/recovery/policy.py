"""The recovery policy: which findings lead to which recovery level, under which guards.

A policy is a TOML file (see ``docs/recovery.md``)::

    version = 1
    dry_run = true                        # the default: decide and record, change nothing
    dashboard_url = "https://grafana.example/d/ranklens?var-job={job_id}"

    [guards]
    cooldown_s = 1800                     # per (target, level)
    max_actions_per_job_per_hour = 3      # remediation levels only
    escalate_after = 2                    # restart_rank failed twice -> replace_node
    escalation_window_s = 86400

    [[rule]]
    name = "critical-straggler"
    kinds = ["straggler"]
    min_severity = "critical"
    min_confidence = 0.8
    min_duration_s = 120
    level = "restart_rank"

    [[endpoint]]
    name = "oncall"
    url = "https://hooks.example/ranklens"
    secret_env = "RANKLENS_WEBHOOK_SECRET"
    # signature = "standard"              # Standard Webhooks headers (a whsec_ secret); default "ranklens"

Rules are tried in file order; the first that matches a finding decides its level. Unknown
keys are errors (a misspelt ``min_confidence`` must not silently lower the bar). Secrets are
never written in the file: an endpoint names an environment variable or a file holding it.
"""

from __future__ import annotations

import ipaddress
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ranklens.analyzers.findings import Finding
from ranklens.analyzers.recovery.api import Level, PolicyError
from ranklens.analyzers.recovery.executors.api import EXECUTOR_KINDS, NOT_YET, ExecutorSpec, Option, executor_class
from ranklens.analyzers.recovery.signing import SignatureScheme, standard_key
from ranklens.formats.severity import Severity

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI (the `recovery` extra)
    import tomli as tomllib

__all__ = [
    "Endpoint",
    "Guards",
    "Policy",
    "PolicyRule",
    "check_secret",
    "check_signature",
    "load_policy",
    "parse_policy",
    "validate_webhook_url",
]

POLICY_VERSION = 1
RECOMMENDED = "recommended"
_LEVEL_ORDER = {lv: i for i, lv in enumerate(Level)}
MIN_SECRET_LEN = 16
MAX_URL_LEN = 2048


@dataclass(frozen=True)
class PolicyRule:
    """Maps findings to a recovery level.

    A finding matches when its kind is in ``kinds`` (``"*"``: any), its severity is at least
    ``min_severity``, its confidence at least ``min_confidence``, it lasted at least
    ``min_duration_s`` (``last_seen_ns - first_seen_ns``) and ``min_steps`` steps, and its state
    is in ``states``. ``level`` ``None`` means the analyzer's own recommendation
    (``evidence["action"]``, as the hang analyzer gives), capped at ``max_level``.
    """

    name: str
    level: Level | None
    kinds: tuple[str, ...] = ("*",)
    min_severity: Severity = Severity.INFO
    min_confidence: float = 0.0
    min_duration_s: float = 0.0
    min_steps: int = 0
    states: tuple[str, ...] = ("open",)
    max_level: Level = Level.RESTART_JOB

    def explain_mismatch(self, f: Finding) -> str:
        """Why ``f`` does not match (empty string when it does)."""
        if "*" not in self.kinds and f.kind not in self.kinds:
            return f"kind {f.kind} not in {list(self.kinds)}"
        if Severity(f.severity).level < self.min_severity.level:
            return f"severity {Severity(f.severity).value} below {self.min_severity.value}"
        if f.confidence < self.min_confidence:
            return f"confidence {f.confidence:.2f} below {self.min_confidence:.2f}"
        if self.min_duration_s > 0:
            dur = (f.last_seen_ns - f.first_seen_ns) / 1e9 if f.first_seen_ns > 0 else 0.0
            if dur < self.min_duration_s:
                return f"lasted {dur:.0f} s, below {self.min_duration_s:.0f} s"
        if self.min_steps > 0:
            steps = f.last_seen_step - f.first_seen_step + 1 if f.first_seen_step >= 0 else 0
            if steps < self.min_steps:
                return f"lasted {steps} steps, below {self.min_steps}"
        if f.state not in self.states:
            return f"state {f.state} not in {list(self.states)}"
        return ""

    def level_for(self, f: Finding) -> Level:
        """The level this rule asks for ``f`` (the analyzer's recommendation when ``level`` is None)."""
        if self.level is not None:
            return self.level
        try:
            lv = Level(str(f.evidence.get("action", Level.NOTIFY.value)))
        except ValueError:
            lv = Level.NOTIFY
        return lv if _LEVEL_ORDER[lv] <= _LEVEL_ORDER[self.max_level] else self.max_level


@dataclass(frozen=True)
class Guards:
    """Limits on acting, checked against the ``actions`` history.

    ``cooldown_s``: after a decision for a target at a level, the same (target, level) waits.
    ``max_actions_per_job_per_hour``: remediation decisions (not ``notify``) per job in any hour.
    ``escalate_after``: a ``restart_rank`` on a target that already had this many in
    ``escalation_window_s`` (the problem came back each time: the in-place restart failed)
    becomes ``replace_node``.
    """

    cooldown_s: float = 1800.0
    max_actions_per_job_per_hour: int = 3
    escalate_after: int = 2
    escalation_window_s: float = 86400.0


@dataclass(frozen=True)
class Endpoint:
    """A webhook receiver. ``secret`` signs every delivery; it never appears in a repr or a log.

    ``signature``: the schemes each delivery is signed with (see :mod:`.signing`), by default the
    ranklens one; with :attr:`SignatureScheme.STANDARD` (Standard Webhooks) the secret must be a
    ``whsec_<base64>`` secret, which a receiver gives as is to a stock Standard Webhooks library.
    """

    name: str
    url: str
    secret: str = field(repr=False)
    timeout_s: float = 5.0
    levels: tuple[Level, ...] = tuple(Level)
    kinds: tuple[str, ...] = ("*",)
    max_attempts: int = 8
    backoff_base_s: float = 2.0
    backoff_max_s: float = 300.0
    max_age_s: float = 86400.0
    allow_http: bool = False
    signature: tuple[SignatureScheme, ...] = (SignatureScheme.RANKLENS,)

    def __post_init__(self) -> None:
        validate_webhook_url(self.url, allow_http=self.allow_http, where=f"endpoint {self.name!r}.url")
        check_secret(self.secret, where=f"endpoint {self.name!r}.secret")
        check_signature(self.signature, self.secret, where=f"endpoint {self.name!r}")

    def accepts(self, level: Level, kind: str) -> bool:
        return level in self.levels and ("*" in self.kinds or kind in self.kinds)


@dataclass(frozen=True)
class Policy:
    """Rules, guards and endpoints. ``dry_run`` (the default) decides and records but changes nothing."""

    rules: tuple[PolicyRule, ...] = ()
    guards: Guards = field(default_factory=Guards)
    endpoints: tuple[Endpoint, ...] = ()
    dry_run: bool = True
    dashboard_url: str = ""
    max_payload_bytes: int = 65536
    source: str = "<policy>"
    executors: tuple[ExecutorSpec, ...] = ()

    def match(self, f: Finding) -> PolicyRule | None:
        """The first rule that matches ``f``, or None."""
        for r in self.rules:
            if not r.explain_mismatch(f):
                return r
        return None

    def dashboard_link(self, f: Finding) -> str:
        if not self.dashboard_url:
            return ""
        return self.dashboard_url.format(job_id=f.job_id, attempt=f.attempt, finding_id=f.id, kind=f.kind)


def validate_webhook_url(url: str, *, allow_http: bool = False, where: str = "url", source: str = "<endpoint>") -> str:
    """Check a webhook URL: http(s), a host, no credentials, https unless loopback or ``allow_http``.

    Raises:
        PolicyError: naming ``where`` and what is wrong (never echoing a query string).
    """
    if not isinstance(url, str) or not url:
        raise PolicyError(source, where, "url is empty")
    if len(url) > MAX_URL_LEN:
        raise PolicyError(source, where, f"url is {len(url)} characters, at most {MAX_URL_LEN}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise PolicyError(source, where, f"url is not valid ({e})") from None
    shown = f"{parts.scheme}://{parts.hostname or ''}{f':{port}' if port else ''}{parts.path}"
    if parts.scheme not in ("http", "https"):
        raise PolicyError(source, where, f"scheme {parts.scheme!r} in {shown}: use https (or http)")
    if not parts.hostname:
        raise PolicyError(source, where, f"url {shown} has no host")
    if parts.username or parts.password:
        raise PolicyError(source, where, "url carries credentials (user:password@): use the signing secret")
    if parts.fragment:
        raise PolicyError(source, where, f"url {shown} has a #fragment, which is never sent")
    if any(c in url for c in "\r\n\t "):
        raise PolicyError(source, where, "url contains whitespace or control characters")
    if parts.scheme == "http" and not allow_http and not _is_loopback(parts.hostname):
        raise PolicyError(
            source,
            where,
            f"plain http to {parts.hostname}: use https, or set allow_http = true for a trusted network",
        )
    return url


def check_secret(secret: str, *, where: str = "secret", source: str = "<endpoint>") -> str:
    """Refuse short signing secrets (the message never shows the secret)."""
    if not isinstance(secret, str) or len(secret) < MIN_SECRET_LEN:
        n = len(secret) if isinstance(secret, str) else 0
        raise PolicyError(
            source,
            where,
            f"the secret is {n} characters; use at least {MIN_SECRET_LEN} "
            "(e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`)",
        )
    return secret


def check_signature(
    schemes: tuple[SignatureScheme, ...],
    secret: str,
    *,
    where: str = "endpoint",
    source: str = "<endpoint>",
    secret_from: str = "the secret",
) -> tuple[SignatureScheme, ...]:
    """Check an endpoint's signature schemes, and that its secret suits them (never shown).

    ``secret_from`` says where the secret was read (e.g. ``secret_env RANKLENS_WEBHOOK_SECRET``).

    Raises:
        PolicyError: no scheme, one twice, a value that is not a :class:`SignatureScheme`, or the
            Standard Webhooks scheme with a secret that is not ``whsec_<base64>`` of 24+ bytes.
    """
    if not schemes or not all(isinstance(x, SignatureScheme) for x in schemes) or len(set(schemes)) < len(schemes):
        raise PolicyError(
            source,
            f"{where}.signature",
            f"{[getattr(x, 'value', x) for x in schemes]!r}: give one or both of {_scheme_choices()}, each once",
        )
    if SignatureScheme.STANDARD in schemes:
        try:
            standard_key(secret)
        except ValueError as e:
            raise PolicyError(
                source, f"{where}.signature", f"signature {SignatureScheme.STANDARD.value!r} with {secret_from}: {e}"
            ) from None
    return schemes


def _scheme_choices() -> str:
    return ", ".join(repr(x.value) for x in SignatureScheme)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_policy(path: str | os.PathLike[str], *, env: Mapping[str, str] | None = None) -> Policy:
    """Read and validate a policy file.

    Args:
        path: the TOML file.
        env: where ``secret_env`` names are looked up (default ``os.environ``).

    Raises:
        PolicyError: the file is missing, not TOML, or a key has a bad value (named in the message).
    """
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise PolicyError(str(p), "", f"cannot read the policy file: {e.strerror or e}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise PolicyError(str(p), "", f"not valid TOML: {e}") from None
    return parse_policy(data, source=str(p), base_dir=p.parent, env=env)


def parse_policy(
    data: Mapping[str, Any],
    *,
    source: str = "<policy>",
    base_dir: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> Policy:
    """Build a :class:`Policy` from parsed TOML (a dict); see :func:`load_policy`."""
    env = os.environ if env is None else env
    r = _Reader(source)
    r.keys(
        data, "", {"version", "dry_run", "dashboard_url", "max_payload_bytes", "guards", "rule", "endpoint", "executor"}
    )
    version = data.get("version", POLICY_VERSION)
    if version != POLICY_VERSION:
        raise PolicyError(
            source, "version", f"{version!r} is not supported; this ranklens reads version {POLICY_VERSION}"
        )
    g = data.get("guards", {})
    r.table(g, "guards")
    r.keys(g, "guards", {"cooldown_s", "max_actions_per_job_per_hour", "escalate_after", "escalation_window_s"})
    guards = Guards(
        cooldown_s=r.number(g, "guards", "cooldown_s", Guards.cooldown_s, lo=0),
        max_actions_per_job_per_hour=r.integer(
            g, "guards", "max_actions_per_job_per_hour", Guards.max_actions_per_job_per_hour, lo=0
        ),
        escalate_after=r.integer(g, "guards", "escalate_after", Guards.escalate_after, lo=0),
        escalation_window_s=r.number(g, "guards", "escalation_window_s", Guards.escalation_window_s, lo=0),
    )
    rules = tuple(_rule(r, d, i) for i, d in enumerate(r.array(data, "", "rule")))
    names = [x.name for x in rules]
    for n in names:
        if names.count(n) > 1:
            raise PolicyError(source, "rule.name", f"{n!r} is used by {names.count(n)} rules; names must be unique")
    endpoints = tuple(_endpoint(r, d, i, base_dir, env, source) for i, d in enumerate(r.array(data, "", "endpoint")))
    enames = [e.name for e in endpoints]
    for n in enames:
        if enames.count(n) > 1:
            raise PolicyError(source, "endpoint.name", f"{n!r} is used by {enames.count(n)} endpoints")
    executors = tuple(_executor(r, d, i) for i, d in enumerate(r.array(data, "", "executor")))
    xnames = [x.name for x in executors]
    for n in xnames:
        if xnames.count(n) > 1:
            raise PolicyError(source, "executor.name", f"{n!r} is used by {xnames.count(n)} executors")
    dashboard_url = r.string(data, "", "dashboard_url", "")
    try:
        dashboard_url.format(job_id="j", attempt=0, finding_id="f", kind="k")
    except (KeyError, IndexError, ValueError) as e:
        raise PolicyError(
            source, "dashboard_url", f"bad placeholder {e}; allowed: {{job_id}}, {{attempt}}, {{finding_id}}, {{kind}}"
        ) from None
    return Policy(
        rules=rules,
        guards=guards,
        endpoints=endpoints,
        dry_run=r.boolean(data, "", "dry_run", True),
        dashboard_url=dashboard_url,
        max_payload_bytes=r.integer(data, "", "max_payload_bytes", 65536, lo=4096, hi=16 * 1024 * 1024),
        source=source,
        executors=executors,
    )


def _executor(r: _Reader, d: Any, i: int) -> ExecutorSpec:
    where0 = f"executor[{i}]"
    r.table(d, where0)
    kind = r.string(d, where0, "kind", "")
    if kind in NOT_YET:
        raise PolicyError(r.source, f"{where0}.kind", f"{kind!r}: {NOT_YET[kind]}")
    if kind not in EXECUTOR_KINDS:
        raise PolicyError(
            r.source, f"{where0}.kind", f"{kind!r} is not an executor kind; one of {sorted(EXECUTOR_KINDS)}"
        )
    options = executor_class(kind).OPTIONS
    name, where = r.entry(d, "executor", i, {"name", "kind", "levels", "kinds", *options})
    levels = tuple(
        r.level(v, f"{where}.levels")
        for v in r.strings(d, where, "levels", (Level.RESTART_RANK.value, Level.RESTART_JOB.value))
    )
    opts = {key: _option(r, d, where, key, o) for key, o in options.items()}
    return ExecutorSpec(name=name, kind=kind, levels=levels, kinds=r.strings(d, where, "kinds", ("*",)), options=opts)


def _option(r: _Reader, d: Any, where: str, key: str, o: Option) -> Any:
    """One kind-specific key of an ``[[executor]]`` table, read as its :class:`Option` says."""
    if o.type == "boolean":
        return r.boolean(d, where, key, bool(o.default))
    if o.type == "strings":
        return r.strings(d, where, key, tuple(o.default))
    if o.type == "integer":
        lo, hi = (None if b is None else int(b) for b in (o.lo, o.hi))
        return r.integer(d, where, key, int(o.default), lo=lo, hi=hi)
    if o.type == "number":
        return r.number(d, where, key, float(o.default), lo=o.lo, hi=o.hi)
    value = r.string(d, where, key, str(o.default))
    if o.choices:
        norm = value.upper() if all(c.isupper() for c in o.choices) else value
        if norm not in o.choices:
            raise PolicyError(r.source, f"{where}.{key}", f"{value!r}: one of {', '.join(map(repr, o.choices))}")
        return norm
    if o.placeholders:
        try:
            value.format(**dict.fromkeys(o.placeholders, "x"))
        except (KeyError, IndexError, ValueError) as e:
            allowed = ", ".join(f"{{{p}}}" for p in o.placeholders)
            raise PolicyError(
                r.source, f"{where}.{key}", f"{value!r}: bad placeholder {e}; allowed: {allowed}"
            ) from None
    return value


def _rule(r: _Reader, d: Any, i: int) -> PolicyRule:
    name, where = r.entry(
        d,
        "rule",
        i,
        {
            "name",
            "kinds",
            "min_severity",
            "min_confidence",
            "min_duration_s",
            "min_steps",
            "states",
            "level",
            "max_level",
        },
    )
    if "level" not in d:
        raise PolicyError(r.source, f"{where}.level", f"missing; one of {_choices()} or {RECOMMENDED!r}")
    lv_raw = r.string(d, where, "level", "")
    level = None if lv_raw == RECOMMENDED else r.level(lv_raw, f"{where}.level", allow_recommended=True)
    return PolicyRule(
        name=name,
        level=level,
        kinds=r.strings(d, where, "kinds", ("*",)),
        min_severity=r.severity(d, where, "min_severity", Severity.INFO),
        min_confidence=r.number(d, where, "min_confidence", 0.0, lo=0, hi=1),
        min_duration_s=r.number(d, where, "min_duration_s", 0.0, lo=0),
        min_steps=r.integer(d, where, "min_steps", 0, lo=0),
        states=r.strings(d, where, "states", ("open",)),
        max_level=r.level(r.string(d, where, "max_level", Level.RESTART_JOB.value), f"{where}.max_level"),
    )


def _endpoint(
    r: _Reader, d: Any, i: int, base_dir: str | os.PathLike[str] | None, env: Mapping[str, str], source: str
) -> Endpoint:
    name, where = r.entry(
        d,
        "endpoint",
        i,
        {
            "name",
            "url",
            "secret_env",
            "secret_file",
            "timeout_s",
            "levels",
            "kinds",
            "max_attempts",
            "backoff_base_s",
            "backoff_max_s",
            "max_age_s",
            "allow_http",
            "signature",
            "secret",
        },
    )
    if "secret" in d:
        raise PolicyError(
            source, f"{where}.secret", "secrets are not written in the policy file; use secret_env or secret_file"
        )
    if ("secret_env" in d) == ("secret_file" in d):
        raise PolicyError(source, where, "give exactly one of secret_env (a variable name) or secret_file (a path)")
    if "secret_env" in d:
        var = r.string(d, where, "secret_env", "")
        secret = env.get(var, "")
        secret_from = f"secret_env {var}"
        if not secret:
            raise PolicyError(source, f"{where}.secret_env", f"environment variable {var} is not set or empty")
    else:
        sp = Path(r.string(d, where, "secret_file", ""))
        if not sp.is_absolute() and base_dir is not None:
            sp = Path(base_dir) / sp
        secret_from = f"secret_file {sp}"
        try:
            secret = sp.read_text().strip()
        except OSError as e:
            raise PolicyError(source, f"{where}.secret_file", f"cannot read {sp}: {e.strerror or e}") from None
    if "url" not in d:
        raise PolicyError(source, f"{where}.url", "missing")
    levels = tuple(
        r.level(x, f"{where}.levels") for x in r.strings(d, where, "levels", tuple(lv.value for lv in Level))
    )
    allow_http = r.boolean(d, where, "allow_http", False)
    url = validate_webhook_url(
        r.string(d, where, "url", ""), allow_http=allow_http, where=f"{where}.url", source=source
    )
    check_secret(secret, where=f"{where}.{'secret_env' if 'secret_env' in d else 'secret_file'}", source=source)
    signature = check_signature(
        tuple(
            r.scheme(x, f"{where}.signature")
            for x in r.strings(d, where, "signature", (SignatureScheme.RANKLENS.value,))
        ),
        secret,
        where=where,
        source=source,
        secret_from=secret_from,
    )
    return Endpoint(
        name=name,
        url=url,
        secret=secret,
        timeout_s=r.number(d, where, "timeout_s", 5.0, lo=0.001, hi=300),
        levels=levels,
        kinds=r.strings(d, where, "kinds", ("*",)),
        max_attempts=r.integer(d, where, "max_attempts", 8, lo=1, hi=1000),
        backoff_base_s=r.number(d, where, "backoff_base_s", 2.0, lo=0),
        backoff_max_s=r.number(d, where, "backoff_max_s", 300.0, lo=0),
        max_age_s=r.number(d, where, "max_age_s", 86400.0, lo=1),
        allow_http=allow_http,
        signature=signature,
    )


def _choices() -> str:
    return ", ".join(repr(lv.value) for lv in Level)


class _Reader:
    """Typed access to TOML values with errors that name the file, the key and the value."""

    def __init__(self, source: str) -> None:
        self.source = source

    def _err(self, where: str, key: str, msg: str) -> PolicyError:
        return PolicyError(self.source, f"{where}.{key}" if where else key, msg)

    def keys(self, d: Mapping[str, Any], where: str, allowed: set[str]) -> None:
        unknown = sorted(set(d) - allowed)
        if unknown:
            raise PolicyError(
                self.source, where or "(top level)", f"unknown key(s) {unknown}; allowed: {sorted(allowed)}"
            )

    def table(self, d: Any, where: str) -> None:
        if not isinstance(d, dict):
            raise PolicyError(self.source, where, f"expected a table, got {type(d).__name__} {d!r}")

    def entry(self, d: Any, section: str, i: int, allowed: set[str]) -> tuple[str, str]:
        """The ``i``-th table of the ``[[section]]`` array, checked (a table, no unknown key): its
        name (``section-i`` when it has none) and where its keys are, for messages: ``section[i] (name)``."""
        where = f"{section}[{i}]"
        self.table(d, where)
        self.keys(d, where, allowed)
        name = self.string(d, where, "name", f"{section}-{i}")
        return name, f"{where} ({name})"

    def array(self, d: Mapping[str, Any], where: str, key: str) -> list[Any]:
        v = d.get(key, [])
        if not isinstance(v, list):
            raise self._err(where, key, f"expected an array of tables ([[{key}]]), got {type(v).__name__}")
        return v

    def string(self, d: Mapping[str, Any], where: str, key: str, default: str) -> str:
        v = d.get(key, default)
        if not isinstance(v, str):
            raise self._err(where, key, f"expected a string, got {v!r}")
        return v

    def strings(self, d: Mapping[str, Any], where: str, key: str, default: tuple[str, ...]) -> tuple[str, ...]:
        v = d.get(key, list(default))
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not v or not all(isinstance(x, str) and x for x in v):
            raise self._err(where, key, f"expected a non-empty array of strings, got {v!r}")
        return tuple(v)

    def boolean(self, d: Mapping[str, Any], where: str, key: str, default: bool) -> bool:
        v = d.get(key, default)
        if not isinstance(v, bool):
            raise self._err(where, key, f"expected true or false, got {v!r}")
        return v

    def number(
        self,
        d: Mapping[str, Any],
        where: str,
        key: str,
        default: float,
        lo: float | None = None,
        hi: float | None = None,
    ) -> float:
        v = d.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self._err(where, key, f"expected a number, got {v!r}")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise self._err(where, key, f"{v!r} is out of range [{lo}, {hi if hi is not None else 'inf'}]")
        return float(v)

    def integer(
        self, d: Mapping[str, Any], where: str, key: str, default: int, lo: int | None = None, hi: int | None = None
    ) -> int:
        v = d.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._err(where, key, f"expected an integer, got {v!r}")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise self._err(where, key, f"{v!r} is out of range [{lo}, {hi if hi is not None else 'inf'}]")
        return v

    def severity(self, d: Mapping[str, Any], where: str, key: str, default: Severity) -> Severity:
        v = d.get(key, default.value)
        try:
            return Severity(v)
        except ValueError:
            allowed = ", ".join(repr(s.value) for s in Severity)
            raise self._err(where, key, f"{v!r} is not a severity; one of {allowed}") from None

    def scheme(self, v: str, key: str) -> SignatureScheme:
        try:
            return SignatureScheme(v)
        except ValueError:
            raise PolicyError(
                self.source, key, f"{v!r} is not a signature scheme; one of {_scheme_choices()}"
            ) from None

    def level(self, v: Any, key: str, *, allow_recommended: bool = False) -> Level:
        try:
            return Level(v)
        except ValueError:
            extra = f" or {RECOMMENDED!r}" if allow_recommended else ""
            raise PolicyError(self.source, key, f"{v!r} is not a recovery level; one of {_choices()}{extra}") from None
