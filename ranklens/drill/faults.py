"""The drill's faults: kinds, the ``KIND:TARGET[:SEVERITY[:PHASE]][@ONSET]`` grammar, validation.

The grammar is ``ranklens simulate``'s (``slow_gpu:2:1.5@5``, ``slow_link:node0001:3``), extended
with the kinds a real job can be broken with and an onset in seconds (``@20s``). A target is a rank
(``2``) or a node (``node1``, also ``node0001`` as the simulator writes hosts): torch elastic's node
rank (``GROUP_RANK``, ``--node-rank``), so a node fault hits every rank of that node. ``slow_link``
targets a node only (``3`` is node 3 there, as in the simulator); a desync, a size mismatch and a
NaN loss are one rank's doing and refuse a node. What each kind does inside the rank is
:mod:`ranklens.drill.inject` (``slow_link``: :mod:`ranklens.drill.network`, tc on the node's link);
what finding detects it, :mod:`ranklens.drill.score`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from ranklens.errors import ConfigError

__all__ = [
    "KINDS",
    "NODE_KINDS",
    "DrillFault",
    "DrillKind",
    "parse_drill_fault",
    "rate_bps",
    "truth_records",
    "validate_targets",
]


class DrillKind(str, Enum):
    SLOW_GPU = "slow_gpu"  # compute on a rank takes longer (forward, backward or optimizer)
    SLOW_DATA = "slow_data"  # each DataLoader batch on a rank takes longer
    HANG = "hang"  # a rank stops before its next collective (in its forward)
    CRASH = "crash"  # a rank exits with a code, or is SIGKILLed
    DESYNC = "desync"  # a rank issues a broadcast where the others all-reduce
    SIZE_MISMATCH = "size_mismatch"  # a rank all-reduces one element more than the others
    LOG = "log"  # error lines in a rank's log (NCCL error, CUDA OOM, XID, NCCL timeout)
    GPU = "gpu"  # an XID event on the rank's GPU, through the fake NVML
    NAN = "nan"  # the rank's loss turns NaN (its model's output, one step)
    SLOW_LINK = "slow_link"  # a node's network link throttled with tc (the drill's network-namespace bed)


KINDS = tuple(k.value for k in DrillKind)
PHASES = ("forward", "backward", "optimizer")
LOG_CLASSES = ("nccl_error", "nccl_timeout", "cuda_oom", "xid")
# kinds that stop the job: the drill ends it once they are detected (or their deadline passed)
FATAL = {DrillKind.HANG, DrillKind.CRASH, DrillKind.DESYNC, DrillKind.SIZE_MISMATCH}
#: kinds that may target a node (every rank of it); slow_link targets nothing else
NODE_KINDS = {
    DrillKind.SLOW_GPU,
    DrillKind.SLOW_DATA,
    DrillKind.HANG,
    DrillKind.CRASH,
    DrillKind.LOG,
    DrillKind.GPU,
    DrillKind.SLOW_LINK,
}
DEFAULT_RATE = "40mbit"
# tc's rate units (tc-tbf(8)): bit/kbit/mbit/gbit are bits per second, bps/kbps/mbps/gbps bytes per second
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}

_EXAMPLES = {
    DrillKind.SLOW_GPU: "slow_gpu:2:1.5@5 (50% slower steps from step 5; or 40ms; :optimizer for that phase)",
    DrillKind.SLOW_DATA: "slow_data:1:0.2@5 (0.2 s more per batch; or 200ms)",
    DrillKind.HANG: "hang:3@10 (until the drill ends the job; hang:3:30@10 for 30 s)",
    DrillKind.CRASH: "crash:1:3@8 (exit code 3; crash:1:kill@8 for SIGKILL)",
    DrillKind.DESYNC: "desync:2@6",
    DrillKind.SIZE_MISMATCH: "size_mismatch:1@6",
    DrillKind.LOG: "log:0:nccl_error@4 (nccl_error, nccl_timeout, cuda_oom or xid)",
    DrillKind.GPU: "gpu:2:79@4 (XID 79 on rank 2's GPU)",
    DrillKind.NAN: "nan:1@6 (rank 1's loss is NaN at step 6)",
    DrillKind.SLOW_LINK: "slow_link:node2:40mbit@8 (node 2's network link limited to 40 Mbit/s from step 8)",
}


@dataclass(frozen=True)
class DrillFault:
    """One fault of a drill.

    Attributes:
        kind: what is broken.
        rank: the rank it is injected into (-1: a node fault).
        severity: slow_gpu: a step-time factor (> 1) or, with ``unit == "ms"``, milliseconds per
            step; slow_data: seconds per batch; hang: seconds (inf: until the drill ends the job);
            crash: the exit code (``unit == "kill"``: SIGKILL); gpu: the XID; slow_link: the rate in
            bits per second; others: unused.
        unit: ``""``, ``"ms"`` or ``"kill"``.
        detail: slow_gpu's phase; log's class; slow_link's rate as tc writes it (``40mbit``).
        onset_step: first affected step (optimizer steps completed on the rank), or -1.
        onset_s: seconds after the rank's process group started, or -1 (then ``onset_step``).
        node: the node it targets (torch elastic's node rank), -1: a rank fault.
    """

    kind: DrillKind
    rank: int
    severity: float = math.nan
    unit: str = ""
    detail: str = ""
    onset_step: int = 0
    onset_s: float = -1.0
    node: int = -1

    @property
    def target(self) -> str:
        """``2`` (a rank) or ``node1`` (a node)."""
        return f"node{self.node}" if self.node >= 0 else str(self.rank)

    @property
    def spec(self) -> str:
        """The canonical spec string (parses back to the same fault)."""
        parts = [self.kind.value, self.target]
        if self.kind in (DrillKind.LOG, DrillKind.SLOW_LINK):
            parts.append(self.detail)
        elif self.kind is DrillKind.CRASH and self.unit == "kill":
            parts.append("kill")
        elif self.kind is DrillKind.HANG and math.isinf(self.severity):
            pass
        elif not math.isnan(self.severity):
            parts.append(f"{self.severity:g}{'ms' if self.unit == 'ms' else ''}")
        if self.kind is DrillKind.SLOW_GPU and self.detail != "forward":
            parts.append(self.detail)
        onset = f"@{self.onset_s:g}s" if self.onset_s >= 0 else (f"@{self.onset_step}" if self.onset_step else "")
        return ":".join(parts) + onset

    @property
    def fatal(self) -> bool:
        return self.kind in FATAL

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["kind"] = self.kind.value
        d["spec"] = self.spec
        d["severity"] = None if math.isnan(self.severity) else ("inf" if math.isinf(self.severity) else self.severity)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DrillFault:
        sev = d.get("severity")
        severity = math.nan if sev is None else (math.inf if sev == "inf" else float(sev))
        return cls(
            DrillKind(d["kind"]),
            int(d["rank"]),
            severity,
            str(d.get("unit", "")),
            str(d.get("detail", "")),
            int(d.get("onset_step", 0)),
            float(d.get("onset_s", -1.0)),
            int(d.get("node", -1)),
        )


def _number(text: str, bad: Any, what: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise bad(f"{what} {text!r} is not a number") from None
    if not math.isfinite(v):
        raise bad(f"{what} {text!r} is not finite")
    return v


def parse_drill_fault(spec: str) -> DrillFault:
    """Parse ``KIND:TARGET[:SEVERITY[:PHASE]][@STEP|@SECONDSs]`` into a :class:`DrillFault`.

    TARGET is a rank (``2``) or a node (``node1``; for ``slow_link`` also ``1``).

    Raises:
        ConfigError: naming the spec, the bad part, what is allowed and an example (exit 2).
    """
    text = str(spec).strip()
    kind: DrillKind | None = None

    def bad(why: str) -> ConfigError:
        example = _EXAMPLES[kind] if kind else "slow_gpu:2:1.5@5"
        return ConfigError(
            f"fault {text!r}: {why}; the form is KIND:TARGET[:SEVERITY][@STEP or @SECONDSs] "
            f"(TARGET a rank, 2, or a node, node1), e.g. {example}"
        )

    body, onset_step, onset_s = text, 0, -1.0
    if "@" in text:
        body, _, at = text.rpartition("@")
        m = re.fullmatch(r"\s*(\d+)\s*", at)
        ms = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*s\s*", at)
        if m:
            onset_step = int(m.group(1))
        elif ms:
            onset_s = float(ms.group(1))
        else:
            raise bad(f"onset {at!r} after '@' is neither a step (@5) nor seconds (@20s)")
    fields = [f.strip() for f in body.split(":")]
    try:
        kind = DrillKind(fields[0].lower())
    except ValueError:
        raise bad(f"unknown kind {fields[0]!r} (kinds: {', '.join(KINDS)})") from None
    if len(fields) < 2 or not fields[1]:
        raise bad(f"{kind.value} needs a target: " + ("a node (node2)" if kind is DrillKind.SLOW_LINK else "a rank"))
    rank, node = -1, -1
    m_node = re.fullmatch(r"node0*(\d+)", fields[1].lower())
    if m_node:
        node = int(m_node.group(1))
    elif re.fullmatch(r"\d+", fields[1]):
        if kind is DrillKind.SLOW_LINK:
            node = int(fields[1])  # a link belongs to a node: 3 is node 3 (the simulator's grammar)
        else:
            rank = int(fields[1])
    else:
        raise bad(f"target {fields[1]!r} is neither a rank (an integer >= 0) nor a node (node1, node0001)")
    if node >= 0 and kind not in NODE_KINDS:
        raise bad(f"{kind.value} is one rank's doing: its target must be a rank, not {fields[1]!r}")
    rest = fields[2:]
    max_fields = (
        2
        if kind is DrillKind.SLOW_GPU
        else (0 if kind in (DrillKind.DESYNC, DrillKind.SIZE_MISMATCH, DrillKind.NAN) else 1)
    )
    if len(rest) > max_fields:
        raise bad(f"too many fields for {kind.value}")
    sev_text = rest[0] if rest else ""
    severity, unit, detail = math.nan, "", ""
    if kind is DrillKind.SLOW_GPU:
        detail = rest[1].lower() if len(rest) > 1 else "forward"
        if detail not in PHASES:
            raise bad(f"phase {detail!r} is not one of {', '.join(PHASES)}")
        if not sev_text:
            severity = 1.5
        elif sev_text.lower().endswith("ms"):
            severity, unit = _number(sev_text[:-2], bad, "milliseconds"), "ms"
            if severity <= 0:
                raise bad(f"{sev_text!r}: the added time must be > 0 ms")
        else:
            severity = _number(sev_text, bad, "factor")
            if severity <= 1:
                raise bad(f"factor {severity:g} must be > 1 (1.5 = steps take 50% longer), or milliseconds (40ms)")
    elif kind is DrillKind.SLOW_DATA:
        if not sev_text:
            severity = 0.2
        elif sev_text.lower().endswith("ms"):
            severity = _number(sev_text[:-2], bad, "milliseconds") / 1000.0
        else:
            severity = _number(sev_text, bad, "seconds")
        if severity <= 0:
            raise bad(f"{sev_text!r}: the added time must be > 0")
    elif kind is DrillKind.HANG:
        severity = _number(sev_text, bad, "seconds") if sev_text else math.inf
        if severity <= 0:
            raise bad(f"hang of {severity:g} s: must be > 0")
    elif kind is DrillKind.CRASH:
        if sev_text.lower() in ("kill", "sigkill"):
            severity, unit = 9.0, "kill"
        elif not sev_text:
            severity = 1.0
        elif re.fullmatch(r"\d+", sev_text) and 1 <= int(sev_text) <= 255:
            severity = float(sev_text)
        else:
            raise bad(f"exit code {sev_text!r} is not 1..255 or 'kill'")
    elif kind is DrillKind.LOG:
        detail = sev_text.lower() or "nccl_error"
        if detail not in LOG_CLASSES:
            raise bad(f"log class {detail!r} is not one of {', '.join(LOG_CLASSES)}")
    elif kind is DrillKind.GPU:
        if not sev_text:
            severity = 79.0
        elif re.fullmatch(r"\d+", sev_text) and int(sev_text) > 0:
            severity = float(sev_text)
        else:
            raise bad(f"XID {sev_text!r} is not a positive integer")
    elif kind is DrillKind.SLOW_LINK:
        detail = (sev_text or DEFAULT_RATE).lower()
        bps = rate_bps(detail)
        if bps is None:
            raise bad(
                f"rate {sev_text!r} is not a tc rate (a number with {', '.join(_RATE_UNITS)}, e.g. 40mbit); "
                "a real link is throttled to a rate, not by the simulator's factor"
            )
        severity = bps
    return DrillFault(kind, rank, severity, unit, detail, onset_step if onset_s < 0 else -1, onset_s, node)


def rate_bps(text: str) -> float | None:
    """Bits per second of a tc rate (``40mbit``, ``5mbps``), None when it is not one (or not > 0)."""
    m = re.fullmatch(r"(\d+(?:\.\d*)?)\s*([a-z]+)", text.strip().lower())
    if not m or m.group(2) not in _RATE_UNITS:
        return None
    v = float(m.group(1)) * _RATE_UNITS[m.group(2)]
    return v if v > 0 else None


def validate_targets(faults: list[DrillFault], world_size: int | None, nodes: int | None = None) -> None:
    """Every fault's rank must be a rank of a ``world_size``-rank job, every node target a node of a
    ``nodes``-node job (None: not known, not checked).

    Raises:
        ConfigError: naming the fault, its target and the ranks or nodes there are.
    """
    for f in faults:
        if f.node < 0 and world_size is not None and not 0 <= f.rank < world_size:
            raise ConfigError(
                f"fault {f.spec!r}: rank {f.rank} is not a rank of this {world_size}-rank job (0..{world_size - 1})"
            )
        if f.node >= 0 and nodes is not None and f.node >= nodes:
            allowed = "node0" if nodes == 1 else f"node0..node{nodes - 1}"
            raise ConfigError(f"fault {f.spec!r}: node {f.node} is not a node of this {nodes}-node job ({allowed})")
        if f.kind is DrillKind.SLOW_LINK and nodes is not None and nodes < 2:
            raise ConfigError(f"fault {f.spec!r}: a slow link needs a job of 2 nodes or more (this one has {nodes})")


def truth_records(truth_dir: Path, pattern: str = "*.jsonl") -> Iterator[dict[str, Any]]:
    """The ground-truth records the injected ranks (``rank<R>.jsonl``) and the drill itself
    (``link.jsonl``: when tc was applied) wrote so far; a line still being written is skipped."""
    for p in truth_dir.glob(pattern):
        try:
            lines = p.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                yield rec
