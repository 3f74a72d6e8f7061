"""The pre-flight check's records and registry: what a check is, what it returns, how results add
up to a node's verdict.

A check is a small function with a name (``group.what``, e.g. ``gpu.ecc_uncorrected``), a
threshold a person can read and a fix-it message. It takes a :class:`Context` (this node, the
options, the NVML module) and returns one :class:`CheckResult` per subject it looked at (one per
GPU, one per mount, or one for the node). A check never raises: an unexpected exception becomes an
``error`` result with the exception's text (the runner wraps every call), so one broken check
never hides the others.

Statuses: ``pass``; ``warn`` (marginal: the job can start, the node is worth watching); ``fail``
(the node should not run the job); ``skip`` (the check does not apply here, e.g. ``skipped: no
GPU``, never counted as a pass); ``error`` (the check itself could not run, counted as a warning).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ranklens.errors import ConfigError

__all__ = [
    "CHECKS",
    "Check",
    "CheckResult",
    "Context",
    "NodeReport",
    "Status",
    "check",
    "resolve_checks",
    "worst",
]


class Status(str, enum.Enum):
    """A check's outcome; ordered by :data:`SEVERITY` (``skip`` < ``pass`` < ``warn`` ≈ ``error`` < ``fail``)."""

    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"
    ERROR = "error"


SEVERITY = {Status.SKIP: 0, Status.PASS: 1, Status.ERROR: 2, Status.WARN: 2, Status.FAIL: 3}


def worst(statuses: list[Status]) -> Status:
    """The node-level status of several results: fail > warn/error > pass > skip (none: pass)."""
    if not statuses:
        return Status.PASS
    top = max(statuses, key=lambda s: SEVERITY[s])
    if top is Status.SKIP:
        return Status.PASS
    return Status.WARN if top is Status.ERROR else top


@dataclass(frozen=True)
class CheckResult:
    """One check's result on one subject of one node.

    ``value`` is the measured number (``nan`` when the check has none), ``threshold`` the limit in
    words (``">= 64 GiB"``), ``message`` what was found, ``fix`` what to do about a warn/fail.
    """

    check: str
    node: str
    status: Status
    message: str
    subject: str = ""
    value: float = float("nan")
    unit: str = ""
    threshold: str = ""
    fix: str = ""
    duration_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["status"] = self.status.value
        d["value"] = self.value if math.isfinite(self.value) else None  # JSON has no NaN or Infinity
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> CheckResult:
        kw = {f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d}
        kw["status"] = Status(kw["status"])
        kw["value"] = float("nan") if kw.get("value") is None else float(kw["value"])
        return cls(**kw)


@dataclass
class Context:
    """What a check may look at. Built once per node run by the runner.

    Args:
        node: this node's name (as the job's ``ranks.host`` will name it).
        nvml: the NVML module (``pynvml``, or a FakeNvml); None: import pynvml when first needed.
        checkpoint_path: the job's checkpoint directory ('' : not checked, the storage checks skip).
        mounts: storage mount points that must be readable and writable.
        gpus_expected: how many GPUs this node must show (-1: any number, at least one if NVML works).
        burn_s: seconds of compute burn per device (CPU matmul, CUDA matmul).
        thresholds: overrides of the checks' default limits, by name (``memory_available_gib``...).
        clock: wall clock (ns), injected for tests.
        check_timeout_s: a check still running after this many seconds (plus 10 x ``burn_s``, for the
            burns) is reported as an error and the run goes on: a hung filesystem or driver cannot
            hold the node's pre-flight (or the ``ranklens run --preflight`` before a job) forever.
    """

    node: str
    nvml: Any = None
    checkpoint_path: str = ""
    mounts: tuple[str, ...] = ()
    gpus_expected: int = -1
    burn_s: float = 1.0
    thresholds: dict[str, float] = field(default_factory=dict)
    clock: Callable[[], int] = time.time_ns
    check_timeout_s: float = 30.0
    # what the fleet checks compare across nodes (versions, burn rates), filled by the checks
    facts: dict[str, Any] = field(default_factory=dict)
    # shared between checks of one run (the NVML devices, found once)
    cache: dict[str, Any] = field(default_factory=dict)

    def limit(self, name: str, default: float) -> float:
        """The threshold ``name`` (an override from ``thresholds``, else ``default``)."""
        return float(self.thresholds.get(name, default))

    def result(self, check: str, status: Status, message: str, **kw: Any) -> CheckResult:
        """A result of ``check`` on this node."""
        return CheckResult(check=check, node=self.node, status=status, message=message, **kw)


CheckFn = Callable[[Context], list[CheckResult]]


@dataclass(frozen=True)
class Check:
    """A named check: ``fn`` runs it; ``doc`` says what it looks at and its default threshold.
    ``scope`` is ``node`` (runs on each node) or ``fleet`` (compares the nodes' results, or runs
    between nodes: run by the coordinator)."""

    name: str
    doc: str
    fn: CheckFn | None = None
    scope: str = "node"

    @property
    def group(self) -> str:
        return self.name.partition(".")[0]


# name -> check, in registration order (the order of the report)
CHECKS: dict[str, Check] = {}


def check(name: str, doc: str, *, scope: str = "node") -> Callable[[CheckFn], CheckFn]:
    """Register ``fn`` as the check ``name`` (a decorator)."""

    def deco(fn: CheckFn) -> CheckFn:
        if name in CHECKS:
            raise ValueError(f"pre-flight check {name!r} is registered twice")
        CHECKS[name] = Check(name, doc, fn, scope)
        return fn

    return deco


def register_fleet(name: str, doc: str) -> None:
    """Register a check the coordinator runs across nodes (no per-node function)."""
    if name not in CHECKS:
        CHECKS[name] = Check(name, doc, None, "fleet")


def resolve_checks(spec: str | None) -> list[Check]:
    """The checks named by ``spec``: comma-separated names, groups (``gpu``) or ``all`` (default).

    Raises:
        ConfigError: a name that is neither a check nor a group (the message lists both).
    """
    from ranklens.collector.preflight import _load_all

    _load_all()
    if not spec or spec.strip() in ("", "all"):
        return list(CHECKS.values())
    wanted: list[Check] = []
    groups = sorted({c.group for c in CHECKS.values()})
    unknown = []
    for raw in spec.split(","):
        name = raw.strip()
        if not name:
            continue
        if name in CHECKS:
            picked = [CHECKS[name]]
        elif name in groups:
            picked = [c for c in CHECKS.values() if c.group == name]
        else:
            unknown.append(name)
            continue
        wanted.extend(c for c in picked if c not in wanted)
    if unknown:
        raise ConfigError(
            f"--checks: unknown check(s) {', '.join(map(repr, unknown))}; allowed: all, a group "
            f"({', '.join(groups)}) or a check name (`ranklens preflight --list` prints them)"
        )
    return wanted


@dataclass(frozen=True)
class NodeReport:
    """Every result of one node, and facts the fleet checks compare (versions, burn rates, clock)."""

    node: str
    results: tuple[CheckResult, ...]
    facts: dict[str, Any] = field(default_factory=dict)
    started_ns: int = 0
    duration_s: float = 0.0

    @property
    def status(self) -> Status:
        return worst([r.status for r in self.results])

    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "results": [r.to_json() for r in self.results],
            "facts": self.facts,
            "started_ns": self.started_ns,
            "duration_s": self.duration_s,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> NodeReport:
        return cls(
            node=str(d["node"]),
            results=tuple(CheckResult.from_json(r) for r in d.get("results", ())),
            facts=dict(d.get("facts") or {}),
            started_ns=int(d.get("started_ns") or 0),
            duration_s=float(d.get("duration_s") or 0.0),
        )
