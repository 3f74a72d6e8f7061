"""The simulator's driver: run the engine chunk by chunk into a store and/or Parquet files, and
return the ground truth (the model is documented in :mod:`ranklens.simulate`)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ranklens.errors import ConfigError
from ranklens.simulate.engine import Engine
from ranklens.simulate.model import (
    _PHASES,
    _UNITS,
    Fault,
    FaultKind,
    Layout,
    ResolvedFault,
    SimParams,
    check_job,
    host_name,
)
from ranklens.simulate.telemetry import telemetry_tables

if TYPE_CHECKING:
    import pyarrow as pa

    from ranklens.store.api import Store

__all__ = ["SimResult", "simulate"]

SIM_TABLES = ("ranks", "process_groups", "collectives", "phases", "steps")
DEFAULT_CHUNK_ROWS = 1_000_000  # collective rows per store write (bounds memory)


@dataclass(frozen=True)
class SimResult:
    """What :func:`simulate` produced.

    Attributes:
        job_id: the simulated job's id (attempt 0).
        truth: the ground truth (JSON-ready dict; see the module docstring).
        rows: rows generated per table.
        seconds: wall time of the simulation, writes included.
        files: the files written under ``out_dir``.
        first_ns, last_ns: the first step's start and the last step's end (epoch ns, true clock).
    """

    job_id: str
    truth: dict[str, Any]
    rows: dict[str, int]
    seconds: float
    files: tuple[str, ...] = field(default=())
    first_ns: int = 0
    last_ns: int = 0

    @property
    def ranks(self) -> int:
        """World size."""
        return int(self.truth["ranks"])

    @property
    def hang_rank(self) -> int | None:
        """The rank that hangs after the last step (``simulate(hang_rank=...)``), or None."""
        return self.truth.get("hang_rank")

    def host(self, rank: int) -> str:
        """The host of ``rank`` (``node0003``)."""
        return host_name(int(rank) // int(self.truth["layout"]["ranks_per_node"]))

    def write_truth(self, path: str | Path) -> Path:
        """Write the ground truth as JSON to ``path``; return the path."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.truth, indent=2) + "\n")
        return p


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
    telemetry: bool = False,
    hang_rank: int | None = None,
    gpu_sample_s: float = 5.0,
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
        telemetry: also write what the nodes report beside the ledger (heartbeats, GPU samples
            and events, log lines: :mod:`ranklens.simulate.telemetry`), as the dashboards show.
        hang_rank: with telemetry: after the last step this rank never enters the next world
            collective while every other rank waits in it (the truth names it in ``hang_rank``
            and ``culprit_ranks``).
        gpu_sample_s: with telemetry: seconds between GPU samples.

    Returns:
        A :class:`SimResult` (job id, truth, rows per table, seconds).

    Raises:
        ConfigError: bad sizes or faults (the message says which and how to fix it).
    """
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
    if hang_rank is not None and not telemetry:
        raise ConfigError("hang_rank needs telemetry=True: a hang shows in the heartbeats, not in the ledger")
    if hang_rank is not None and not 0 <= hang_rank < layout.world_size:
        raise ConfigError(f"hang_rank={hang_rank} is not a rank of the job (0..{layout.world_size - 1})")
    if telemetry and not gpu_sample_s > 0:
        raise ConfigError(f"gpu_sample_s={gpu_sample_s!r} must be > 0")
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
        if telemetry:
            extra = telemetry_tables(
                job_id=job_id,
                layout=layout,
                faults=resolved,
                groups=engine.group_last_seqs(steps),
                steps=steps,
                first_ns=engine.step_start_ns(0),
                last_ns=engine.start_ns + int(engine.t.max()),
                step_start_ns=engine.step_start_ns,
                hang_rank=hang_rank,
                gpu_sample_s=gpu_sample_s,
                seed=seed,
            )
            if store is not None:
                store.write_many(extra)
            if sink is not None:
                sink.write(extra)
            for name, data in extra.items():
                rows[name] = data.num_rows
    finally:
        if sink is not None:
            files = sink.close()
    truth = _truth(job_id, layout, steps, seed, step_ms, params, resolved, start_ns, engine.step_start_ns)
    if hang_rank is not None:
        truth["hang_rank"] = int(hang_rank)
        truth["culprit_ranks"] = sorted({*truth["culprit_ranks"], int(hang_rank)})
        truth["healthy"] = False
    truth["rows"] = dict(rows)
    result = SimResult(
        job_id,
        truth,
        rows,
        time.perf_counter() - t_begin,
        tuple(files),
        first_ns=engine.step_start_ns(0),
        last_ns=engine.start_ns + int(engine.t.max()),
    )
    if sink is not None:
        files.append(str(result.write_truth(sink.dir / "truth.json")))
        result = replace(result, files=tuple(files))
    return result
