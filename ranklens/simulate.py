"""Fault simulator: the records of a 3D-parallel training job, with injectable faults and ground truth.

:func:`simulate` generates, with numpy and pyarrow, what ``ranklens.tracing`` would record on a
data x pipeline x tensor parallel job of any size (tested to 10,240 ranks), streams it into a store
(``store.write_many`` once per chunk of steps, so memory stays bounded) and/or into Parquet files of
the open ingest format, and returns the ground truth an analyzer should find (issue 5, item 7).

Layout
    ``world = dp x pp x tp``, Megatron order: ``rank = pp_i*(dp*tp) + dp_i*tp + tp_i`` (tensor
    parallel fastest, then data parallel, then pipeline). ``ranks_per_node`` (8) consecutive ranks
    share a host ``node0000``, ``node0001``, ... Process groups (size-1 groups are not created):
    ``"0"`` the world, then the tensor-parallel groups ``tp_i`` (fixed pp_i, dp_i), the data-parallel
    groups ``dp_i`` (fixed pp_i, tp_i) and the pipeline groups ``pp_i`` (fixed dp_i, tp_i); ``pg`` is
    torch's numeric group name, ``name`` the description. P2P between neighbouring stages uses the
    tracer's convention ``pg = "<pp group>/p2p:<src>-><dst>"`` with its own ``seq`` per direction.

Timing model (per step; all ranks in parallel, causal; times in true ns, then clocks applied)
    1. ``data``: ``data_frac x step_ms`` x jitter (+ ``slow_data`` seconds).
    2. ``forward``, GPipe schedule (all forwards, then all backwards) over ``microbatches`` M: for
       each microbatch, stage p first receives its input from stage p-1 (a two-member exchange: the
       sender arrives when it finished computing, the receiver when it is free; both complete at
       ``max(arrivals) + transfer``), then runs K (``tp_collectives``) compute chunks each followed
       by a tensor-parallel ``all_reduce`` (every member arrives after its own chunk; the group
       completes at ``max(arrivals) + transfer``), then sends to stage p+1.
    3. ``backward``: the same in reverse stage order (gradients flow p+1 -> p), with chunks twice as
       long as forward's; then one data-parallel gradient ``all_reduce`` per (pp, tp) coordinate.
       The backward phase ends when that all-reduce completes.
    4. ``optimizer``: ``optimizer_frac x step_ms`` x jitter; the step ends; the next step starts a
       few tens of µs later. Phases partition the step exactly, and every phase is compute chunks
       plus the collectives in it, so ``phase time - time inside collectives`` is the compute time.
    The compute budget is sized so that a healthy step takes about ``step_ms``. Transfer time is
    ``latency*max(1, log2 n) + bus bytes / bandwidth`` (all_reduce bus bytes ``2(n-1)/n*nbytes``,
    p2p ``nbytes``) with NVLink bandwidth inside a node and network bandwidth across nodes, times a
    small lognormal jitter. Every member of a collective leaves it at the completion instant plus
    up to ``leave_jitter_ns`` (2 µs): the property clock alignment and blame rely on. Compute and
    data times get an iid lognormal jitter of sigma ``noise`` (mean 1).

Faults (``KIND[:TARGET][:SEVERITY][@ONSET_STEP]``, several at once, active from the onset step)
    ``slow_gpu:RANK[:FACTOR=1.2]``     that rank's forward + backward compute x FACTOR
    ``slow_node:NODE[:FACTOR=1.2]``    the same for every rank of the node
    ``slow_data:RANK[:SECONDS=0.1]``   that rank's data phase + SECONDS
    ``slow_link:NODE[:FACTOR=2]``      transfer time x FACTOR of every collective / p2p exchange
                                       with a member on NODE *that crosses nodes* (the node's network
                                       link; NVLink traffic inside the node is not affected)
    ``stage_imbalance[:FACTOR=1.3]``   the last pipeline stage's compute x FACTOR: by design, not a
                                       fault (ground truth: no faulty rank); needs pp >= 2
    ``clock_skew:NODE:MS``             every timestamp recorded by that node's ranks + MS ms (a clock
                                       offset, not a slowdown: no faulty rank)
    NODE is ``node0003`` or ``3``. Steps are numbered from 0; sequence numbers from 1.

Ground truth (:attr:`SimResult.truth`, :meth:`SimResult.write_truth`): the layout, every fault with
its targets as ranks and nodes, onset step (and its time), the phases it affects, and the union of
culprits an analyzer should name (``culprit_ranks``, ``culprit_nodes``; empty for a healthy job,
stage imbalance or clock skew), plus ``slow_link_nodes`` and ``clock_offsets_ms``.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ranklens.errors import ConfigError

if TYPE_CHECKING:
    import pyarrow as pa

    from ranklens.store.api import Store

__all__ = [
    "FAULT_DEFAULTS",
    "Fault",
    "FaultKind",
    "Layout",
    "ResolvedFault",
    "SimParams",
    "SimResult",
    "check_job",
    "host_name",
    "parse_fault",
    "simulate",
]

SIM_TABLES = ("ranks", "process_groups", "collectives", "phases", "steps")
DEFAULT_CHUNK_ROWS = 1_000_000  # collective rows per store write (bounds memory)


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


@dataclass(frozen=True)
class SimResult:
    """What :func:`simulate` produced.

    Attributes:
        job_id: the simulated job's id (attempt 0).
        truth: the ground truth (JSON-ready dict; see the module docstring).
        rows: rows generated per table.
        seconds: wall time of the simulation, writes included.
    """

    job_id: str
    truth: dict[str, Any]
    rows: dict[str, int]
    seconds: float
    files: tuple[str, ...] = field(default=())

    def write_truth(self, path: str | Path) -> Path:
        """Write the ground truth as JSON to ``path``; return the path."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.truth, indent=2) + "\n")
        return p


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


def _truth(
    job_id: str,
    layout: Layout,
    steps: int,
    seed: int,
    step_ms: float,
    params: SimParams,
    faults: list[ResolvedFault],
    start_ns: int,
    onset_ns: Callable[[int], int],
) -> dict[str, Any]:
    entries = []
    culprit_ranks: set[int] = set()
    culprit_nodes: set[int] = set()
    link_nodes: set[int] = set()
    offsets: dict[str, float] = {}
    for rf in faults:
        k = rf.kind
        c_ranks: list[int] = []
        c_nodes: list[int] = []
        if k in (FaultKind.SLOW_GPU, FaultKind.SLOW_DATA):
            c_ranks = list(rf.ranks)
        elif k is FaultKind.SLOW_NODE:
            c_ranks, c_nodes = list(rf.ranks), list(rf.nodes)
        elif k is FaultKind.SLOW_LINK:
            c_nodes = list(rf.nodes)
            link_nodes.update(rf.nodes)
        elif k is FaultKind.CLOCK_SKEW:
            for n in rf.nodes:
                offsets[host_name(n)] = offsets.get(host_name(n), 0.0) + rf.severity
        culprit_ranks.update(c_ranks)
        culprit_nodes.update(c_nodes)
        entries.append(
            {
                "spec": rf.fault.spec,
                "kind": k.value,
                "target": rf.fault.target,
                "severity": rf.severity,
                "unit": _UNITS.get(k, "factor"),
                "onset_step": rf.onset_step,
                "onset_ns": onset_ns(rf.onset_step),
                "is_fault": k not in (FaultKind.STAGE_IMBALANCE, FaultKind.CLOCK_SKEW),
                "ranks": list(rf.ranks),
                "nodes": [host_name(n) for n in rf.nodes],
                "phases": _PHASES[k],
                "culprit_ranks": c_ranks,
                "culprit_nodes": [host_name(n) for n in c_nodes],
            }
        )
    return {
        "job_id": job_id,
        "attempt": 0,
        "ranks": layout.world_size,
        "steps": steps,
        "first_step": 0,
        "seed": seed,
        "step_ms": step_ms,
        "start_ns": start_ns,
        "layout": layout.to_dict(),
        "params": asdict(params),
        "faults": entries,
        "healthy": not culprit_ranks and not culprit_nodes,
        "culprit_ranks": sorted(culprit_ranks),
        "culprit_nodes": [host_name(n) for n in sorted(culprit_nodes)],
        "slow_link_nodes": [host_name(n) for n in sorted(link_nodes)],
        "clock_offsets_ms": offsets,
    }


class _FileSink:
    """One Parquet file per table (``<table>.parquet``, a row group per chunk): the open ingest format."""

    def __init__(self, out_dir: Path) -> None:
        self.dir = out_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self._writers: dict[str, Any] = {}

    def write(self, batches: Mapping[str, pa.Table]) -> None:
        import pyarrow.parquet as pq

        from ranklens.records import arrow_schema

        for name, data in batches.items():
            w = self._writers.get(name)
            if w is None:
                w = self._writers[name] = pq.ParquetWriter(
                    self.dir / f"{name}.parquet", arrow_schema(name), compression="zstd"
                )
            w.write_table(data)

    def close(self) -> list[str]:
        for w in self._writers.values():
            w.close()
        return [str(self.dir / f"{name}.parquet") for name in self._writers]


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


def simulate(
    store: Store | None,
    *,
    ranks: int,
    steps: int,
    dp: int | None = None,
    pp: int = 1,
    tp: int = 1,
    faults: Iterable[str | Fault] = (),
    seed: int = 0,
    job_id: str | None = None,
    step_ms: float = 500.0,
    out_dir: str | Path | None = None,
    params: SimParams | None = None,
    ranks_per_node: int = 8,
    start_ns: int | None = None,
    onset_step: int | None = None,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    progress: Callable[[int, int], None] | None = None,
) -> SimResult:
    """Simulate a 3D-parallel job and write its records; return the ground truth.

    Args:
        store: where to write (``write_many`` per chunk of steps); None writes nothing there.
        ranks, steps: job size (steps are numbered 0..steps-1).
        dp, pp, tp: parallel sizes; ``dp`` defaults to ``ranks / (pp * tp)``.
        faults: fault specs (``"slow_gpu:17:1.3@20"``) or :class:`Fault` objects.
        seed: random seed; the same seed, job id and ``start_ns`` give identical records.
        job_id: default ``sim-<date>-<time>-<hex>``.
        step_ms: the healthy step time the compute budget is sized for.
        out_dir: also (or instead) write ``<table>.parquet`` files and ``truth.json`` there.
        params: timing model knobs (:class:`SimParams`).
        ranks_per_node: ranks per host.
        start_ns: epoch ns of the job's start (default: now minus the job's expected duration).
        onset_step: onset of faults given without ``@STEP`` (default 0).
        chunk_rows: about this many collective rows per write (memory bound).
        progress: called as ``progress(steps_done, steps)`` after each chunk.

    Returns:
        A :class:`SimResult` (job id, truth, rows per table, seconds).

    Raises:
        ConfigError: bad sizes or faults (the message says which and how to fix it).
    """
    from ranklens._simulate_engine import Engine

    t_begin = time.perf_counter()
    layout, resolved = check_job(
        ranks=ranks,
        steps=steps,
        dp=dp,
        pp=pp,
        tp=tp,
        faults=faults,
        ranks_per_node=ranks_per_node,
        onset_step=onset_step,
    )
    if not step_ms > 0:
        raise ConfigError(f"step_ms={step_ms!r} must be > 0")
    if chunk_rows < 1:
        raise ConfigError(f"chunk_rows={chunk_rows} must be >= 1")
    params = params or SimParams()
    params.validate()
    job_id = job_id or f"sim-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    if start_ns is None:
        start_ns = (time.time_ns() - int(steps * step_ms * 1e6)) // 1_000_000 * 1_000_000
    engine = Engine(layout, params, step_ms * 1e6, resolved, seed, job_id, start_ns)
    sink = _FileSink(Path(out_dir)) if out_dir is not None else None
    rows = dict.fromkeys(SIM_TABLES, 0)
    files: list[str] = []
    try:
        per_chunk = max(1, chunk_rows // max(1, engine.collective_rows_per_step))
        first = True
        for s0 in range(0, steps, per_chunk):
            s1 = min(steps, s0 + per_chunk)
            batches = engine.run(s0, s1)
            if first:
                batches = {**engine.static_tables(), **batches}
                first = False
            if store is not None:
                store.write_many(batches)
            if sink is not None:
                sink.write(batches)
            for name, data in batches.items():
                rows[name] += data.num_rows
            del batches
            if progress:
                progress(s1, steps)
    finally:
        if sink is not None:
            files = sink.close()
    truth = _truth(job_id, layout, steps, seed, step_ms, params, resolved, start_ns, engine.step_start_ns)
    truth["rows"] = dict(rows)
    result = SimResult(job_id, truth, rows, time.perf_counter() - t_begin, tuple(files))
    if sink is not None:
        files.append(str(result.write_truth(sink.dir / "truth.json")))
        result = replace(result, files=tuple(files))
    return result
