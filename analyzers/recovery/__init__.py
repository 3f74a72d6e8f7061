"""Acting on findings: a policy decides, webhooks and hooks deliver, ``actions`` records.

See ``docs/recovery.md``. The pieces:

- :mod:`.policy`: the TOML policy (rules, guards, endpoints; dry-run by default)
- :mod:`.engine`: :class:`RecoveryEngine` turns findings into decisions and carries them out, idempotently
- :mod:`.webhooks`, :mod:`.outbox`, :mod:`.payload`, :mod:`.signing`: signed (the ranklens scheme, or
  Standard Webhooks for stock verifiers), durable, retried webhooks
- :mod:`.hooks`: ``@hook("straggler")`` Python remediation, bounded by a timeout
- :mod:`.prometheus`, :mod:`.alertmanager`: findings as metrics; Alertmanager alerts attached to findings
- :mod:`.testing`: a local webhook receiver that verifies either scheme's signatures (for tests and trials)

Heavy or optional dependencies (prometheus-client) are imported only where used.
"""

from __future__ import annotations

from ranklens._metrics_http import serve_metrics
from ranklens.analyzers.recovery.alertmanager import AlertAttacher, AlertmanagerReceiver, parse_alertmanager
from ranklens.analyzers.recovery.api import (
    Decision,
    DeliveryError,
    Level,
    Outcome,
    PayloadTooLarge,
    PolicyError,
    RecoveryError,
    SignatureError,
    idempotency_key,
)
from ranklens.analyzers.recovery.engine import RecoveryEngine, RunReport, act_on
from ranklens.analyzers.recovery.hooks import HookRegistry, HookSpec, default_registry, hook
from ranklens.analyzers.recovery.outbox import DeliveryOutbox
from ranklens.analyzers.recovery.payload import PAYLOAD_SCHEMA, PAYLOAD_VERSION, build_payload
from ranklens.analyzers.recovery.policy import Endpoint, Guards, Policy, PolicyRule, load_policy, parse_policy
from ranklens.analyzers.recovery.prometheus import FindingsExporter, RecoveryMetrics
from ranklens.analyzers.recovery.signing import (
    SignatureScheme,
    sign,
    verify_request,
    verify_signature,
    verify_standard,
)
from ranklens.analyzers.recovery.webhooks import HttpClientTransport, HttpResult, Transport, WebhookDispatcher

__all__ = [
    "PAYLOAD_SCHEMA",
    "PAYLOAD_VERSION",
    "AlertAttacher",
    "AlertmanagerReceiver",
    "Decision",
    "DeliveryError",
    "DeliveryOutbox",
    "Endpoint",
    "FindingsExporter",
    "Guards",
    "HookRegistry",
    "HookSpec",
    "HttpClientTransport",
    "HttpResult",
    "Level",
    "Outcome",
    "PayloadTooLarge",
    "Policy",
    "PolicyError",
    "PolicyRule",
    "RecoveryEngine",
    "RecoveryError",
    "RecoveryMetrics",
    "RunReport",
    "SignatureError",
    "SignatureScheme",
    "Transport",
    "WebhookDispatcher",
    "act_on",
    "build_payload",
    "default_registry",
    "hook",
    "idempotency_key",
    "load_policy",
    "parse_alertmanager",
    "parse_policy",
    "serve_metrics",
    "sign",
    "verify_request",
    "verify_signature",
    "verify_standard",
]
