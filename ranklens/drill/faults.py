"""The drill's faults: kinds, the ``KIND:TARGET[:SEVERITY[:PHASE]][@ONSET]`` grammar, validation.

The grammar is ``ranklens simulate``'s (``slow_gpu:2:1.5@5``), extended with the kinds a real job
can be broken with and an onset in seconds (``@20s``). Every fault targets one rank. What each
kind does inside the rank is :mod:`ranklens.drill.inject`; what finding detects it,
:mod:`ranklens.drill.score`.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

from ranklens.errors import ConfigError

__all__ = ["KINDS", "DrillFault", "DrillKind", "parse_drill_fault", "validate_targets"]


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


KINDS = tuple(k.value for k in DrillKind)
PHASES = ("forward", "backward", "optimizer")
LOG_CLASSES = ("nccl_error", "nccl_timeout", "cuda_oom", "xid")
# kinds that stop the job: the drill ends it once they are detected (or their deadline passed)
FATAL = {DrillKind.HANG, DrillKind.CRASH, DrillKind.DESYNC, DrillKind.SIZE_MISMATCH}

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
}


@dataclass(frozen=True)
class DrillFault:
    """One fault of a drill.

    Attributes:
        kind: what is broken.
        rank: the rank it is injected into.
        severity: slow_gpu: a step-time factor (> 1) or, with ``unit == "ms"``, milliseconds per
            step; slow_data: seconds per batch; hang: seconds (inf: until the drill ends the job);
            crash: the exit code (``unit == "kill"``: SIGKILL); gpu: the XID; others: unused.
        unit: ``""``, ``"ms"`` or ``"kill"``.
        phase: slow_gpu's phase; log's class (``detail``).
        onset_step: first affected step (optimizer steps completed on the rank), or -1.
        onset_s: seconds after the rank's process group started, or -1 (then ``onset_step``).
    """

    kind: DrillKind
    rank: int
    severity: float = math.nan
    unit: str = ""
    detail: str = ""
    onset_step: int = 0
    onset_s: float = -1.0

    @property
    def spec(self) -> str:
        """The canonical spec string (parses back to the same fault)."""
        parts = [self.kind.value, str(self.rank)]
        if self.kind is DrillKind.LOG:
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
    """Parse ``KIND:RANK[:SEVERITY[:PHASE]][@STEP|@SECONDSs]`` into a :class:`DrillFault`.

    Raises:
        ConfigError: naming the spec, the bad part, what is allowed and an example (exit 2).
    """
    text = str(spec).strip()
    kind: DrillKind | None = None

    def bad(why: str) -> ConfigError:
        example = _EXAMPLES[kind] if kind else "slow_gpu:2:1.5@5"
        return ConfigError(
            f"fault {text!r}: {why}; the form is KIND:RANK[:SEVERITY][@STEP or @SECONDSs], e.g. {example}"
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
        raise bad(f"{kind.value} needs a target rank")
    if not re.fullmatch(r"\d+", fields[1]):
        raise bad(f"target {fields[1]!r} is not a rank (an integer >= 0)")
    rank = int(fields[1])
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
    return DrillFault(kind, rank, severity, unit, detail, onset_step if onset_s < 0 else -1, onset_s)


def validate_targets(faults: list[DrillFault], world_size: int) -> None:
    """Every fault's rank must be a rank of a ``world_size``-rank job.

    Raises:
        ConfigError: naming the fault, its rank and the ranks there are.
    """
    for f in faults:
        if not 0 <= f.rank < world_size:
            raise ConfigError(
                f"fault {f.spec!r}: rank {f.rank} is not a rank of this {world_size}-rank job (0..{world_size - 1})"
            )
