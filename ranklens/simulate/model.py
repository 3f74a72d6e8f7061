"""The simulator's model: faults (kinds, grammar), the job layout, the timing knobs and faults placed
on a layout. Shared by the engine (:mod:`ranklens.simulate.engine`) and the driver
(:mod:`ranklens.simulate.job`); it imports neither. The model is documented in :mod:`ranklens.simulate`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from ranklens.errors import ConfigError

__all__ = [
    "FAULT_DEFAULTS",
    "Fault",
    "FaultKind",
    "Layout",
    "ResolvedFault",
    "SimParams",
    "check_job",
    "host_name",
    "parse_fault",
]


class FaultKind(str, Enum):
    """Kinds of injectable faults (and the one non-fault, ``stage_imbalance``)."""

    SLOW_GPU = "slow_gpu"
    SLOW_NODE = "slow_node"
    SLOW_DATA = "slow_data"
    SLOW_LINK = "slow_link"
    STAGE_IMBALANCE = "stage_imbalance"
    CLOCK_SKEW = "clock_skew"


#: default severity per kind (None: the severity must be given)
FAULT_DEFAULTS: dict[FaultKind, float | None] = {
    FaultKind.SLOW_GPU: 1.2,
    FaultKind.SLOW_NODE: 1.2,
    FaultKind.SLOW_DATA: 0.1,
    FaultKind.SLOW_LINK: 2.0,
    FaultKind.STAGE_IMBALANCE: 1.3,
    FaultKind.CLOCK_SKEW: None,
}
_RANK_KINDS = {FaultKind.SLOW_GPU, FaultKind.SLOW_DATA}
_NODE_KINDS = {FaultKind.SLOW_NODE, FaultKind.SLOW_LINK, FaultKind.CLOCK_SKEW}
_FACTOR_KINDS = {FaultKind.SLOW_GPU, FaultKind.SLOW_NODE, FaultKind.SLOW_LINK, FaultKind.STAGE_IMBALANCE}
_UNITS = {FaultKind.SLOW_DATA: "seconds", FaultKind.CLOCK_SKEW: "ms"}
_PHASES = {
    FaultKind.SLOW_GPU: ["forward", "backward"],
    FaultKind.SLOW_NODE: ["forward", "backward"],
    FaultKind.STAGE_IMBALANCE: ["forward", "backward"],
    FaultKind.SLOW_DATA: ["data"],
    FaultKind.SLOW_LINK: [],
    FaultKind.CLOCK_SKEW: [],
}
_EXAMPLES = {
    FaultKind.SLOW_GPU: "slow_gpu:17:1.3@20",
    FaultKind.SLOW_NODE: "slow_node:node0002:1.25",
    FaultKind.SLOW_DATA: "slow_data:5:0.2@10",
    FaultKind.SLOW_LINK: "slow_link:node0001:3",
    FaultKind.STAGE_IMBALANCE: "stage_imbalance:1.3",
    FaultKind.CLOCK_SKEW: "clock_skew:node0003:-4.5",
}


def host_name(node: int) -> str:
    """The host name of node index ``node`` (``node0003``)."""
    return f"node{node:04d}"


@dataclass(frozen=True)
class Fault:
    """One injected fault. Build it with :func:`parse_fault` or directly.

    Attributes:
        kind: what is wrong.
        target: a rank (``"17"``) for slow_gpu/slow_data, a host (``"node0003"``) for
            slow_node/slow_link/clock_skew, ``""`` for stage_imbalance.
        severity: a factor (slow_gpu, slow_node, slow_link, stage_imbalance), seconds added to
            the data phase (slow_data) or a clock offset in milliseconds (clock_skew).
        onset_step: the first affected step (0: from the start).
    """

    kind: FaultKind
    target: str = ""
    severity: float = math.nan
    onset_step: int = 0

    @property
    def spec(self) -> str:
        """The canonical ``KIND[:TARGET]:SEVERITY[@STEP]`` string."""
        parts = [self.kind.value] + ([self.target] if self.target else []) + [f"{self.severity:g}"]
        return ":".join(parts) + (f"@{self.onset_step}" if self.onset_step else "")


def _node_index(text: str) -> int | None:
    m = re.fullmatch(r"(?:node)?0*(\d+)", text.strip())
    return int(m.group(1)) if m else None


def parse_fault(spec: str | Fault, *, onset_step: int | None = None) -> Fault:
    """Parse ``KIND[:TARGET][:SEVERITY][@STEP]`` (e.g. ``slow_gpu:17:1.3@20``) into a :class:`Fault`.

    Args:
        spec: the fault string (a :class:`Fault` is returned as is, onset applied when it has none).
        onset_step: onset for a spec without an ``@STEP`` suffix (default 0: from the start).

    Raises:
        ConfigError: naming the spec, the bad part and a valid example.
    """
    if isinstance(spec, Fault):
        if onset_step is not None and spec.onset_step == 0:
            return replace(spec, onset_step=onset_step)
        return spec
    text = str(spec).strip()
    kinds = ", ".join(k.value for k in FaultKind)

    def bad(why: str, kind: FaultKind | None = None) -> ConfigError:
        example = _EXAMPLES[kind] if kind else "slow_gpu:17:1.3@20"
        return ConfigError(f"fault {text!r}: {why}; the form is KIND[:TARGET][:SEVERITY][@STEP], e.g. {example}")

    onset = onset_step if onset_step is not None else 0
    if "@" in text:
        text_body, _, at = text.rpartition("@")
        try:
            onset = int(at)
        except ValueError:
            raise bad(f"onset {at!r} after '@' is not a step number") from None
    else:
        text_body = text
    if onset < 0:
        raise bad(f"onset step {onset} is negative")
    fields = text_body.split(":")
    try:
        kind = FaultKind(fields[0].strip().lower())
    except ValueError:
        raise bad(f"unknown kind {fields[0]!r} (kinds: {kinds})") from None
    rest = [f.strip() for f in fields[1:]]
    target = ""
    if kind in _RANK_KINDS or kind in _NODE_KINDS:
        if not rest or not rest[0]:
            what = "a rank" if kind in _RANK_KINDS else "a node (node0003 or 3)"
            raise bad(f"{kind.value} needs a target: {what}", kind)
        raw = rest.pop(0)
        if kind in _RANK_KINDS:
            if not re.fullmatch(r"\d+", raw):
                raise bad(f"target {raw!r} is not a rank (an integer >= 0)", kind)
            target = str(int(raw))
        else:
            node = _node_index(raw)
            if node is None:
                raise bad(f"target {raw!r} is not a node (node0003 or 3)", kind)
            target = host_name(node)
    if len(rest) > 1:
        raise bad(f"too many fields ({len(fields)})", kind)
    default = FAULT_DEFAULTS[kind]
    if rest:
        try:
            severity = float(rest[0])
        except ValueError:
            raise bad(f"severity {rest[0]!r} is not a number", kind) from None
        if not math.isfinite(severity):
            raise bad(f"severity {rest[0]!r} is not finite", kind)
    elif default is None:
        raise bad(f"{kind.value} needs a severity (the offset in milliseconds)", kind)
    else:
        severity = default
    if kind in _FACTOR_KINDS and severity <= 0:
        raise bad(f"factor {severity:g} must be > 0 (1.3 = 30% slower)", kind)
    if kind is FaultKind.SLOW_DATA and severity < 0:
        raise bad(f"seconds {severity:g} must be >= 0", kind)
    return Fault(kind, target, severity, onset)


@dataclass(frozen=True)
class Layout:
    """How ranks map to (pp, dp, tp) coordinates and nodes (Megatron order: tp fastest, then dp, then pp)."""

    dp: int
    pp: int = 1
    tp: int = 1
    ranks_per_node: int = 8

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def nodes(self) -> int:
        return -(-self.world_size // self.ranks_per_node)

    def rank(self, pp: int, dp: int, tp: int) -> int:
        """Global rank of coordinates (pp, dp, tp)."""
        return (pp * self.dp + dp) * self.tp + tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp, dp, tp) of a global rank."""
        return rank // (self.dp * self.tp), (rank // self.tp) % self.dp, rank % self.tp

    def host(self, rank: int) -> str:
        return host_name(rank // self.ranks_per_node)

    def node_ranks(self, node: int) -> list[int]:
        return list(range(node * self.ranks_per_node, min((node + 1) * self.ranks_per_node, self.world_size)))

    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "dp": self.dp,
            "pp": self.pp,
            "tp": self.tp,
            "ranks_per_node": self.ranks_per_node,
            "nodes": self.nodes,
            "order": "rank = (pp * dp_size + dp) * tp_size + tp (tp fastest, then dp, then pp)",
        }


@dataclass(frozen=True)
class SimParams:
    """Knobs of the timing model (see the module docstring). Sizes in bytes, bandwidths in bytes/s."""

    tp_collectives: int = 2  # K: tensor-parallel all_reduces per stage per microbatch, in forward and in backward
    microbatches: int = 1  # M: GPipe microbatches per step
    noise: float = 0.02  # sigma of the lognormal jitter on compute and data times
    data_frac: float = 0.03
    optimizer_frac: float = 0.05
    tp_nbytes: int = 32 << 20
    p2p_nbytes: int = 32 << 20
    dp_nbytes: int = 256 << 20
    dtype: str = "bfloat16"
    intra_bw_Bps: float = 150e9
    inter_bw_Bps: float = 20e9
    intra_latency_ns: float = 8_000.0
    inter_latency_ns: float = 20_000.0
    link_jitter: float = 0.05  # sigma of the lognormal jitter on transfer times
    leave_jitter_ns: float = 2_000.0  # members leave a collective within this of each other
    step_gap_ns: float = 50_000.0  # host overhead between steps
    samples_per_step: int = 8  # per data-parallel replica
    tokens_per_sample: int = 4096

    def validate(self) -> None:
        if self.tp_collectives < 1:
            raise ConfigError(f"tp_collectives={self.tp_collectives} must be >= 1")
        if self.microbatches < 1:
            raise ConfigError(f"microbatches={self.microbatches} must be >= 1")
        if not 0 <= self.noise < 1:
            raise ConfigError(f"noise={self.noise} must be in [0, 1) (0.02 = 2% jitter)")
        if not (0 <= self.data_frac < 0.5 and 0 <= self.optimizer_frac < 0.5):
            raise ConfigError("data_frac and optimizer_frac must be in [0, 0.5)")
        if min(self.intra_bw_Bps, self.inter_bw_Bps) <= 0:
            raise ConfigError("bandwidths must be > 0")


@dataclass(frozen=True)
class ResolvedFault:
    """A fault placed on a layout: its ranks and nodes (what the engine and the truth use)."""

    fault: Fault
    ranks: tuple[int, ...]
    nodes: tuple[int, ...]

    @property
    def kind(self) -> FaultKind:
        return self.fault.kind

    @property
    def severity(self) -> float:
        return self.fault.severity

    @property
    def onset_step(self) -> int:
        return self.fault.onset_step


def _layout(ranks: int, dp: int | None, pp: int, tp: int, ranks_per_node: int) -> Layout:
    for name, v in (("ranks", ranks), ("pp", pp), ("tp", tp), ("ranks_per_node", ranks_per_node)):
        if not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name}={v!r} must be an integer >= 1")
    if dp is None:
        if ranks % (pp * tp):
            raise ConfigError(
                f"ranks={ranks} is not divisible by pp*tp = {pp * tp} (pp={pp}, tp={tp}); "
                f"choose ranks as a multiple of {pp * tp} or other pp/tp sizes"
            )
        dp = ranks // (pp * tp)
    if not isinstance(dp, int) or dp < 1:
        raise ConfigError(f"dp={dp!r} must be an integer >= 1")
    if dp * pp * tp != ranks:
        raise ConfigError(
            f"dp*pp*tp = {dp}*{pp}*{tp} = {dp * pp * tp} is not ranks={ranks}; omit dp to derive it (ranks / (pp*tp))"
        )
    return Layout(dp=dp, pp=pp, tp=tp, ranks_per_node=ranks_per_node)


def _resolve(f: Fault, layout: Layout, steps: int) -> ResolvedFault:
    if not 0 <= f.onset_step < steps:
        raise ConfigError(f"fault {f.spec!r}: onset step {f.onset_step} is not in 0..{steps - 1} (the job's steps)")
    if f.kind in _RANK_KINDS:
        rank = int(f.target)
        if not 0 <= rank < layout.world_size:
            raise ConfigError(f"fault {f.spec!r}: rank {rank} is not a rank of the job (0..{layout.world_size - 1})")
        return ResolvedFault(f, (rank,), (rank // layout.ranks_per_node,))
    if f.kind in _NODE_KINDS:
        node = _node_index(f.target)
        if node is None or not 0 <= node < layout.nodes:
            raise ConfigError(
                f"fault {f.spec!r}: node {f.target!r} is not a node of the job "
                f"({host_name(0)}..{host_name(layout.nodes - 1)})"
            )
        return ResolvedFault(f, tuple(layout.node_ranks(node)), (node,))
    # stage imbalance: the last pipeline stage
    if layout.pp < 2:
        raise ConfigError(f"fault {f.spec!r}: stage_imbalance needs pipeline parallelism (pp >= 2), got pp={layout.pp}")
    first = layout.rank(layout.pp - 1, 0, 0)
    ranks = tuple(range(first, layout.world_size))
    nodes = tuple(sorted({r // layout.ranks_per_node for r in ranks}))
    return ResolvedFault(f, ranks, nodes)


def check_job(
    *,
    ranks: int,
    steps: int,
    dp: int | None = None,
    pp: int = 1,
    tp: int = 1,
    faults: Iterable[str | Fault] = (),
    ranks_per_node: int = 8,
    onset_step: int | None = None,
) -> tuple[Layout, list[ResolvedFault]]:
    """Validate a job's sizes and faults without generating anything (the checks :func:`simulate` runs).

    Returns:
        The layout and the faults placed on it.

    Raises:
        ConfigError: naming the bad value and how to fix it.
    """
    if not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"steps={steps!r} must be an integer >= 1")
    layout = _layout(ranks, dp, pp, tp, ranks_per_node)
    return layout, [_resolve(parse_fault(f, onset_step=onset_step), layout, steps) for f in faults]
