"""The one definition of ranklens' tables, rendered as DDL for every store.

Each table is a list of typed columns. From it come: the Arrow schema of embedded parts, the
``file(...)`` structure the embedded engine reads them with, ``CREATE TABLE`` statements for one
ClickHouse server and for a cluster (``ReplicatedMergeTree`` + ``Distributed``), and the
validation of the open ingest format. Types are limited to what ClickHouse 18.16 (Debian's
server, our minimum) and current releases both accept: no ``DateTime64``, ``Map``, ``Nullable`` or
``LowCardinality``. Times are ``Int64`` nanoseconds since the Unix epoch (``*_ns``); "unknown" is a
default value (``-1``, ``''``, ``nan``), never NULL.

Every table ends with ``ingest_id``: the identity of the batch a row was shipped in (the collector
sets it per spool segment, a content hash), which makes shipping idempotent: a segment the
collector is not sure it delivered is looked up by id before it is sent again.

Bump :data:`SCHEMA_VERSION` whenever a table or column changes: stores refuse a mismatch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "INGEST_ID",
    "ROLLUPS",
    "SCHEMA_VERSION",
    "TABLES",
    "Column",
    "Rollup",
    "Table",
    "render_cluster_ddl",
    "render_server_ddl",
    "table",
]

SCHEMA_VERSION = 11  # 7: the cpu table (host CPU contention, issue 21); 8: the preflight table (issue 16);
# 9: the drills table (issue 14); 10: trace_events' pg and seq (a trace's collectives joined to the ledger, issue 17);
# 11: collectives.host and the collective_arrivals rollup on servers (issue 19)

_SCALARS = {"Int32", "Int64", "UInt8", "UInt32", "UInt64", "Float64", "String"}


@dataclass(frozen=True)
class Column:
    """One column: name (units in the name), ClickHouse type, default for absent input, doc."""

    name: str
    type: str
    doc: str = ""
    required: bool = False
    default: Any = None

    def __post_init__(self) -> None:
        inner = self.type[6:-1] if self.type.startswith("Array(") else self.type
        if inner not in _SCALARS:
            raise ValueError(f"column {self.name}: unsupported type {self.type}")

    @property
    def is_array(self) -> bool:
        return self.type.startswith("Array(")

    @property
    def scalar_type(self) -> str:
        return self.type[6:-1] if self.is_array else self.type

    def default_value(self) -> Any:
        if self.default is not None:
            return self.default
        if self.is_array:
            return []
        if self.type == "String":
            return ""
        if self.type == "Float64":
            return math.nan
        return 0


@dataclass(frozen=True)
class Table:
    """A table: its columns, sort key, shard key (cluster) and engine."""

    name: str
    columns: tuple[Column, ...]
    order_by: tuple[str, ...]
    shard_key: str = "cityHash64(job_id)"
    engine: str = "MergeTree()"
    replicated_engine: str = "ReplicatedMergeTree('/clickhouse/tables/{{shard}}/{db}/{table}', '{{replica}}')"
    doc: str = ""
    _by_name: dict[str, Column] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._by_name.update({c.name: c for c in self.columns})
        for key in self.order_by:
            if key not in self._by_name:
                raise ValueError(f"table {self.name}: order key {key} is not a column")

    @property
    def column_names(self) -> list[str]:
        return [c.name for c in self.columns]

    def column(self, name: str) -> Column:
        return self._by_name[name]

    def has_column(self, name: str) -> bool:
        return name in self._by_name

    def structure(self) -> str:
        """The ``name Type, ...`` structure string (``file()`` table function, ``CREATE``)."""
        return ", ".join(f"{c.name} {c.type}" for c in self.columns)


def _c(name: str, type_: str, doc: str = "", *, required: bool = False, default: Any = None) -> Column:
    return Column(name, type_, doc, required, default)


def _job(*, rank: bool = True) -> list[Column]:
    cols = [
        _c("job_id", "String", "job identifier (launcher run id)", required=True),
        _c("attempt", "Int32", "restart attempt of the job, 0 first"),
    ]
    if rank:
        cols.append(_c("rank", "Int32", "global rank", required=True))
    return cols


def _gpu(ts_doc: str) -> list[Column]:
    """The leading columns of the GPU tables: which GPU, when, and the job and rank using it."""
    return [
        _c("host", "String", "node", required=True),
        _c("gpu_index", "Int32", "GPU index", required=True),
        _c("gpu_uuid", "String", "GPU UUID"),
        _c("ts_ns", "Int64", ts_doc, required=True),
        _c("job_id", "String", "job using the GPU, '' unknown"),
        _c("rank", "Int32", "rank using the GPU, -1 unknown", default=-1),
    ]


TABLES: dict[str, Table] = {}


INGEST_ID = "ingest_id"


def _table(name: str, cols: list[Column], order_by: tuple[str, ...], doc: str, **kw: Any) -> None:
    cols = [*cols, _c(INGEST_ID, "UInt64", "the batch (spool segment) the row was shipped in; 0 untracked")]
    TABLES[name] = Table(name, tuple(cols), order_by, doc=doc, **kw)


_table(
    "collectives",
    [
        *_job(),
        _c("pg", "String", "process group name, the same on every member", required=True),
        _c("seq", "Int64", "sequence number of this call within pg (p2p: within the pair)", required=True),
        _c("op", "String", "all_reduce, broadcast, send, ...", required=True),
        _c("nbytes", "Int64", "bytes of the local input"),
        _c("dtype", "String", "element type"),
        _c("peer", "Int32", "p2p peer global rank, -1 for collectives", default=-1),
        _c("step", "Int64", "training step the call belongs to, -1 unknown", default=-1),
        _c("enter_ns", "Int64", "arrival: when this rank reached the collective", required=True),
        _c("start_ns", "Int64", "when the transfer started (0 unknown)"),
        _c(
            "end_ns",
            "Int64",
            "when the call completed on this rank (0 not completed, -1 ended at an unknown time)",
        ),
        _c("clock", "String", "cpu or cuda: what enter/start/end were measured on", default="cpu"),
        _c("async_op", "UInt8", "1 when issued with async_op=True"),
        _c(
            "host",
            "String",
            "node the rank ran on ('' unknown: written before schema 11, or by a flight-recorder dump)",
        ),
    ],
    ("job_id", "attempt", "pg", "seq", "rank"),
    "one row per rank x collective call (the arrival ledger)",
    # a collective's members on one shard: the analyzers' GROUP BY pg, seq (blame, clocks, links)
    # merges no partial states across shards; measured in docs/cluster.md (issue 19)
    shard_key="cityHash64(job_id, pg, seq)",
)
_table(
    "phases",
    [
        *_job(),
        _c("step", "Int64", "training step", required=True),
        _c("phase", "String", "data, forward, backward, optimizer or a custom name", required=True),
        _c("start_ns", "Int64", "phase start", required=True),
        _c("end_ns", "Int64", "phase end", required=True),
    ],
    ("job_id", "attempt", "rank", "step"),
    "one row per rank x step x phase",
    shard_key="cityHash64(job_id, rank)",
)
_table(
    "steps",
    [
        *_job(),
        _c("step", "Int64", "training step", required=True),
        _c("start_ns", "Int64", "step start", required=True),
        _c("end_ns", "Int64", "step end", required=True),
        _c("samples", "Int64", "samples in the step, -1 unknown", default=-1),
        _c("tokens", "Int64", "tokens in the step, -1 unknown", default=-1),
        _c("loss", "Float64", "loss, nan unknown"),
        _c("grad_norm", "Float64", "gradient norm, nan unknown"),
        _c(
            "source",
            "String",
            "where the step boundary came from: explicit (rlt.step, a trainer callback) or inferred "
            "(optimizer steps of an unmodified script)",
            default="explicit",
        ),
    ],
    ("job_id", "attempt", "rank", "step"),
    "one row per rank x step",
    shard_key="cityHash64(job_id, rank)",
)
_table(
    "process_groups",
    [
        *_job(rank=False),
        _c("pg", "String", "process group name, the same on every member", required=True),
        _c("name", "String", "description (group_desc) of the group"),
        _c("backend", "String", "gloo, nccl, ..."),
        _c("ranks", "Array(Int32)", "global ranks of the members", required=True),
        _c("created_ns", "Int64", "when it was registered"),
    ],
    ("job_id", "attempt", "pg"),
    "one row per process group (duplicates from several members are harmless)",
)
_table(
    "ranks",
    [
        *_job(),
        _c("world_size", "Int32", "world size"),
        _c("host", "String", "host (node) name"),
        _c("local_rank", "Int32", "rank on its node", default=-1),
        _c("pid", "Int32", "process id"),
        _c("gpu_index", "Int32", "GPU index, -1 none", default=-1),
        _c("gpu_uuid", "String", "GPU UUID"),
        _c("pp", "Int32", "pipeline stage coordinate, -1 unknown", default=-1),
        _c("tp", "Int32", "tensor-parallel coordinate, -1 unknown", default=-1),
        _c("dp", "Int32", "data-parallel coordinate, -1 unknown", default=-1),
        _c("started_ns", "Int64", "when tracing started in this rank"),
    ],
    ("job_id", "attempt", "rank"),
    "one row per rank of a job attempt",
    shard_key="cityHash64(job_id, rank)",
)
_table(
    "gpu_samples",
    [
        *_gpu("sample time"),
        _c("util_pct", "Float64", "GPU utilization %"),
        _c("mem_used_bytes", "Int64", "memory used"),
        _c("mem_total_bytes", "Int64", "memory total"),
        _c("power_w", "Float64", "power draw"),
        _c("temp_c", "Float64", "temperature"),
        _c("sm_clock_mhz", "Float64", "SM clock"),
        _c("mem_clock_mhz", "Float64", "memory clock"),
        _c("throttle_reasons", "UInt64", "NVML clocks-event reasons bitmask"),
        _c("ecc_corrected", "Int64", "volatile corrected ECC errors"),
        _c("ecc_uncorrected", "Int64", "volatile uncorrected ECC errors"),
        _c("pcie_replay", "Int64", "PCIe replay counter"),
        _c("nvlink_errors", "Int64", "NVLink error counters, summed"),
        _c("pcie_tx_bytes_per_s", "Float64", "PCIe transmit throughput, nan unknown"),
        _c("pcie_rx_bytes_per_s", "Float64", "PCIe receive throughput, nan unknown"),
        _c("nvlink_tx_bytes_per_s", "Float64", "NVLink transmit throughput (all links), nan unknown"),
        _c("nvlink_rx_bytes_per_s", "Float64", "NVLink receive throughput (all links), nan unknown"),
        _c("ecc_corrected_aggregate", "Int64", "lifetime corrected ECC errors, -1 unknown", default=-1),
        _c("ecc_uncorrected_aggregate", "Int64", "lifetime uncorrected ECC errors, -1 unknown", default=-1),
        _c("retired_pages_sbe", "Int64", "pages retired for repeated single-bit errors, -1 unknown", default=-1),
        _c("retired_pages_dbe", "Int64", "pages retired for double-bit errors, -1 unknown", default=-1),
        _c("remapped_rows_correctable", "Int64", "rows remapped for correctable errors, -1 unknown", default=-1),
        _c("remapped_rows_uncorrectable", "Int64", "rows remapped for uncorrectable errors, -1 unknown", default=-1),
    ],
    ("host", "gpu_index", "ts_ns"),
    "one row per GPU x sample time",
    shard_key="cityHash64(host)",
)
_table(
    "gpu_events",
    [
        *_gpu("event time"),
        _c("kind", "String", "xid, ecc_sbe, ecc_dbe, row_remap, ...", required=True),
        _c("code", "Int64", "XID code or counter value"),
        _c("message", "String", "text"),
    ],
    ("host", "gpu_index", "ts_ns"),
    "one row per discrete GPU event",
    shard_key="cityHash64(host)",
)
_table(
    "log_events",
    [
        *_job(rank=False),
        _c("host", "String", "node"),
        _c("rank", "Int32", "rank that wrote the line, -1 unknown", default=-1),
        _c("ts_ns", "Int64", "time of the line", required=True),
        _c("stream", "String", "stdout, stderr, kernel, file"),
        _c("source", "String", "file the line came from"),
        _c("rule", "String", "rule that kept the line"),
        _c("klass", "String", "class: nccl_error, oom, xid, traceback, ...", required=True),
        _c("severity", "String", "info, warning, error, critical"),
        _c("message", "String", "the line (a traceback: all of it)", required=True),
        _c("repeat_count", "Int32", "collapsed repeats", default=1),
        _c("context", "Array(String)", "lines before it"),
    ],
    ("job_id", "attempt", "ts_ns"),
    "one row per log line kept by the source filter",
)
_table(
    "heartbeats",
    [
        *_job(),
        _c("ts_ns", "Int64", "heartbeat time", required=True),
        _c("pid", "Int32", "process id"),
        _c("host", "String", "host (node) name"),
        _c("pid_ns", "Int64", "inode of the rank's pid namespace (which pids `pid` is one of), 0 unknown"),
        _c("step", "Int64", "last step started", default=-1),
        _c("phase", "String", "phase in progress ('' none)"),
        _c("phase_start_ns", "Int64", "when the phase in progress started (0 none)"),
        _c("last_progress_ns", "Int64", "last collective completion or step end on this rank (0 none yet)"),
        _c("pgs", "Array(String)", "process groups this rank used (parallel to the next two)"),
        _c("pg_entered", "Array(Int64)", "per pg: seq of the last collective entered"),
        _c("pg_completed", "Array(Int64)", "per pg: highest seq completed"),
        _c("pending_pgs", "Array(String)", "collectives in flight on this rank: pg (parallel arrays)"),
        _c("pending_seqs", "Array(Int64)", "in flight: seq"),
        _c("pending_ops", "Array(String)", "in flight: op"),
        _c("pending_nbytes", "Array(Int64)", "in flight: bytes"),
        _c("pending_enter_ns", "Array(Int64)", "in flight: arrival time"),
        _c(
            "exited",
            "UInt8",
            "1 on the last heartbeat of a rank that shut tracing down cleanly; 2 written by the node's "
            "collector when the rank's process is gone without that",
        ),
    ],
    ("job_id", "attempt", "rank", "ts_ns"),
    "one row per rank x heartbeat interval",
    shard_key="cityHash64(job_id, rank)",
)
_table(
    "cpu",
    [
        *_job(),
        _c("host", "String", "host (node) name"),
        _c("ts_ns", "Int64", "sample time", required=True),
        _c("cpu_ns", "Int64", "training thread: cumulative time on a CPU (schedstat)", required=True),
        _c(
            "run_delay_ns",
            "Int64",
            "training thread: cumulative time runnable but waiting for a CPU (run-queue delay, schedstat)",
            required=True,
        ),
        _c("proc_cpu_ns", "Int64", "all threads of the rank's process: cumulative time on a CPU", default=-1),
        _c("proc_run_delay_ns", "Int64", "all threads: cumulative run-queue delay", default=-1),
        _c("threads", "Int32", "threads of the process at the sample", default=-1),
    ],
    ("job_id", "attempt", "rank", "ts_ns"),
    "one row per rank x scheduler sample (how much CPU the host gave the rank)",
    shard_key="cityHash64(job_id, rank)",
)
_table(
    "trace_events",
    [
        *_job(),
        _c("ts_ns", "Int64", "event start", required=True),
        _c("dur_ns", "Int64", "event duration"),
        _c("cat", "String", "kernel, gpu_memcpy, cpu_op, cuda_runtime, user_annotation, ...", required=True),
        _c("name", "String", "kernel / op / annotation name", required=True),
        _c("pid", "String", "trace process (GPU device for kernels)"),
        _c("tid", "String", "trace thread (CUDA stream for kernels)"),
        _c("device", "Int32", "GPU index, -1 none", default=-1),
        _c("stream", "Int64", "CUDA stream, -1 none", default=-1),
        _c("correlation", "Int64", "CPU launch <-> GPU kernel correlation id, -1 none", default=-1),
        _c("external_id", "Int64", "profiler external id, -1 none", default=-1),
        _c("collective", "String", "NCCL collective of a communication kernel ('' none)"),
        _c("in_nelems", "Int64", "NCCL input elements, -1 unknown", default=-1),
        _c("group_size", "Int32", "NCCL group size, -1 unknown", default=-1),
        _c("pg", "String", "process group of a collective (its name, as in the ledger's `pg`; '' none)"),
        _c(
            "seq",
            "Int64",
            "the collective's sequence number in its group (the ledger's `seq`; torch 2.5+ traces), -1 unknown",
            default=-1,
        ),
        _c("source", "String", "file the event came from"),
    ],
    ("job_id", "attempt", "rank", "ts_ns"),
    "one row per complete event (ph X) of a torch.profiler / Kineto trace",
    shard_key="cityHash64(job_id, rank)",
)
_table(
    "findings",
    [
        _c("id", "String", "stable identity: the same ongoing problem keeps its id", required=True),
        *_job(rank=False),
        _c("kind", "String", "straggler, hang, slow_link, ...", required=True),
        _c("severity", "String", "info, warning, critical", required=True),
        _c("confidence", "Float64", "0..1"),
        _c("title", "String", "one line a person reads"),
        _c("suspect_ranks", "Array(Int32)", "suspected ranks"),
        _c("suspect_hosts", "Array(String)", "suspected nodes"),
        _c("suspect_gpus", "Array(String)", "suspected GPUs (host:index)"),
        _c("suspect_links", "Array(String)", "suspected links (a<->b)"),
        _c("first_seen_step", "Int64", "first step showing it", default=-1),
        _c("last_seen_step", "Int64", "last step showing it", default=-1),
        _c("first_seen_ns", "Int64", "time of first_seen_step"),
        _c("last_seen_ns", "Int64", "time of last_seen_step"),
        _c("impact_s", "Float64", "wall seconds the job lost"),
        _c("impact_gpu_s", "Float64", "rank-seconds (GPU-seconds) lost"),
        _c("step_time_pct", "Float64", "share of step time lost, %"),
        _c("evidence", "String", "JSON: numbers and the SQL that reproduces them"),
        _c("state", "String", "open or resolved", default="open"),
        _c("detector", "String", "detector that decided"),
        _c("updated_ns", "Int64", "version: the newest row of an id wins", required=True),
    ],
    ("job_id", "id"),
    "one row per finding version (read the newest per id)",
    engine="ReplacingMergeTree(updated_ns)",
    replicated_engine=(
        "ReplicatedReplacingMergeTree('/clickhouse/tables/{{shard}}/{db}/{table}', '{{replica}}', updated_ns)"
    ),
)
_table(
    "actions",
    [
        _c("finding_id", "String", "finding acted on", required=True),
        *_job(rank=False),
        _c("action", "String", "notify, restart_rank, replace_node, restart_job", required=True),
        _c("target", "String", "endpoint, hook or resource"),
        _c("idempotency_key", "String", "same key, same action"),
        _c("attempt_no", "Int32", "delivery attempt, 1 first", default=1),
        _c("outcome", "String", "sent, acknowledged, failed, dry_run, ..."),
        _c("detail", "String", "status code, error"),
        _c("ts_ns", "Int64", "when", required=True),
    ],
    ("job_id", "finding_id", "ts_ns"),
    "one row per hook delivery attempt",
)
_table(
    "drops",
    [
        _c("ts_ns", "Int64", "snapshot time", required=True),
        _c("host", "String", "node"),
        _c("job_id", "String", "job, '' for node-wide"),
        _c("rank", "Int32", "rank, -1 for node-wide", default=-1),
        _c("component", "String", "tracer, collector, log_filter, ...", required=True),
        _c("what", "String", "what was dropped or filtered", required=True),
        _c("count", "Int64", "how many since the last snapshot", required=True),
    ],
    ("component", "ts_ns"),
    "one row per drop-counter snapshot",
)


_table(
    "preflight",
    [
        _c("run_id", "String", "one `ranklens preflight` run (every node of it)", required=True),
        _c("job_id", "String", "the job it was run for (--job-id), '' none"),
        _c("ts_ns", "Int64", "when the run started", required=True),
        _c("host", "String", "node checked", required=True),
        _c("check_name", "String", "check (group.what, e.g. gpu.ecc_uncorrected)", required=True),
        _c("subject", "String", "what on the node (gpu3, a mount, an env variable), '' the node"),
        _c("status", "String", "pass, warn, fail, skip, error", required=True),
        _c("verdict", "String", "the node's verdict in this run: pass, warn, fail"),
        _c("message", "String", "what was found"),
        _c("value", "Float64", "the measured number (nan: none)"),
        _c("unit", "String", "unit of value"),
        _c("threshold", "String", "the limit, in words"),
        _c("fix", "String", "what to do about a warn or fail"),
        _c("duration_s", "Float64", "seconds the check took"),
    ],
    ("host", "ts_ns", "check_name"),
    "one row per pre-flight check result (node x check x subject) of a run",
    shard_key="cityHash64(host)",
)


_table(
    "drills",
    [
        _c("drill_id", "String", "one drill (one job with its faults)", required=True),
        _c("ts_ns", "Int64", "when the drill started", required=True),
        _c("suite", "String", "the suite it ran in, '' none"),
        _c("name", "String", "the drill's name in its suite"),
        _c("job_id", "String", "the job the faults were injected into"),
        _c("fault", "String", "the fault, as given (KIND:RANK[:SEVERITY][@ONSET])", required=True),
        _c("kind", "String", "slow_gpu, slow_data, hang, crash, desync, log, gpu, nan", required=True),
        _c("rank", "Int32", "the rank it was injected into", default=-1),
        _c("applied", "UInt8", "1: it took effect"),
        _c("onset_ns", "Int64", "when it took effect (0: never)"),
        _c("detected", "UInt8", "1: a finding named its rank"),
        _c("ttd_s", "Float64", "seconds from onset to the first live pass showing it (nan: none)"),
        _c("resumed_s", "Float64", "with --recover: seconds from onset to training resumed (nan: none)"),
        _c("kind_ok", "UInt8", "1: the finding's kind is the fault's"),
        _c("culprit_ok", "UInt8", "1: the finding named the fault's rank"),
        _c("finding_id", "String", "the finding that detected it"),
        _c("finding_kind", "String", "its kind"),
        _c("false_findings", "Int32", "findings of the drill nothing injected explains"),
        _c("passed", "UInt8", "1: the whole drill passed (every fault, no false finding)"),
        _c("exit_code", "Int32", "the command's exit code (-N: signal N)", default=0),
        _c("job_failed", "String", "why the job failed by itself, '' it did not"),
        _c("version", "String", "ranklens version"),
        _c("command", "String", "the command"),
    ],
    ("ts_ns", "drill_id", "fault"),
    "one row per fault of a drill (`ranklens drill`), to compare detection over releases",
    shard_key="cityHash64(drill_id)",
)


# -- rollups (issue 19): materialised views into AggregatingMergeTree, on servers ---------------
#
# A rollup is filled by a materialised view as rows are inserted into its source table, so it holds
# one row per key and insert block instead of one per rank. Only servers have them (the embedded
# store keeps Parquet parts, no views): the analyzers use a rollup when the store has it and read
# the raw table otherwise, with the same results.
#
# Resend-safe: the collector may discard part of a batch from the raw table and send the batch
# again (docs/collector.md); the view then saw those rows twice, and a deletion cannot reach them.
# min, max and argMax do not change when a row is seen twice; count and sum do, so the rollup keeps
# both ``rows`` (count) and ``ranks`` (distinct ranks; a rank enters a collective once): where they
# differ the analyzers read the raw table instead.


@dataclass(frozen=True)
class Rollup:
    """A rollup table: ``keys`` (columns of ``source``, grouped by), ``aggregates`` (each ``(column,
    state expression over the source's columns, AggregateFunction type)``) and a ``day`` column
    (days since the epoch of the arrivals, the last key: what a current server partitions and
    expires the rollup by)."""

    name: str
    source: str
    keys: tuple[str, ...]
    aggregates: tuple[tuple[str, str, str], ...]
    time_column: str  # the source's ns column ``day`` is taken from
    doc: str
    shard_key: str

    @property
    def order_by(self) -> tuple[str, ...]:
        return (*self.keys, "day")

    def structure(self) -> str:
        src = TABLES[self.source]
        cols = [f"{k} {src.column(k).type}" for k in self.keys] + ["day UInt32"]
        return ", ".join(cols + [f"{c} {t}" for c, _e, t in self.aggregates])

    def select(self, source: str) -> str:
        """The rollup's rows from ``source`` (a table, or a subquery with the source's columns): the
        materialised view's query, and a backfill's."""
        keys = ", ".join(self.keys)
        day = f"toUInt32(intDiv({self.time_column}, 86400000000000))"
        states = ", ".join(f"{e} AS {c}" for c, e, _t in self.aggregates)
        return f"SELECT {keys}, {day} AS day, {states} FROM {source} GROUP BY {keys}, day"


ROLLUPS: dict[str, Rollup] = {
    "collective_arrivals": Rollup(
        "collective_arrivals",
        "collectives",
        ("job_id", "attempt", "pg", "seq", "step", "host"),
        (
            ("rows", "countState()", "AggregateFunction(count)"),
            ("ranks", "uniqExactState(rank)", "AggregateFunction(uniqExact, Int32)"),
            ("first_enter_ns", "minState(enter_ns)", "AggregateFunction(min, Int64)"),
            ("last_enter_ns", "maxState(enter_ns)", "AggregateFunction(max, Int64)"),
            # the last arriver; at equal arrivals the lowest rank (as the raw query decides)
            (
                "last_rank",
                "argMaxState(rank, (enter_ns, toInt64(-rank)))",
                "AggregateFunction(argMax, Int32, Tuple(Int64, Int64))",
            ),
            # the sum of arrivals in whole seconds and the rest: each exact in Int64 (ns at 10,000 ranks would not be)
            ("enter_s_sum", "sumState(toInt64(intDiv(enter_ns, 1000000000)))", "AggregateFunction(sum, Int64)"),
            ("enter_rest_ns_sum", "sumState(toInt64(enter_ns % 1000000000))", "AggregateFunction(sum, Int64)"),
        ),
        "enter_ns",
        "per collective, step and host: arrivals (first, last, last arriver, sum, count); blame reads it",
        "cityHash64(job_id, pg, seq)",
    ),
    # the ledger's extent per rank and step: a jobs list without a scan of every collective
    "rank_steps": Rollup(
        "rank_steps",
        "collectives",
        ("job_id", "attempt", "rank", "step"),
        (
            ("rows", "countState()", "AggregateFunction(count)"),
            ("first_enter_ns", "minState(enter_ns)", "AggregateFunction(min, Int64)"),
            ("last_ns", "maxState(greatest(end_ns, enter_ns))", "AggregateFunction(max, Int64)"),
        ),
        "enter_ns",
        "per rank and step: the ledger's first arrival and last completion; the jobs list reads it",
        "cityHash64(job_id, rank)",
    ),
}


def rollup(name: str) -> Rollup:
    """The rollup called ``name``."""
    return ROLLUPS[name]


def table(name: str) -> Table:
    """The table called ``name``; a clear error for an unknown one."""
    try:
        return TABLES[name]
    except KeyError:
        from ranklens.errors import ConfigError

        raise ConfigError(f"unknown table {name!r}; ranklens tables are: {', '.join(TABLES)}") from None


META_TABLE = "ranklens_meta"


def render_server_ddl(database: str = "ranklens") -> str:
    """``CREATE`` statements for one ClickHouse server (18.16 or newer)."""
    out = [
        f"-- ranklens schema version {SCHEMA_VERSION}, one ClickHouse server (>= 18.16).",
        "-- Generated by `ranklens schema --target server`; do not edit by hand.",
        f"CREATE DATABASE IF NOT EXISTS {database};",
        f"CREATE TABLE IF NOT EXISTS {database}.{META_TABLE} (key String, value String, "
        "updated_ns Int64) ENGINE = ReplacingMergeTree(updated_ns) ORDER BY key;",
    ]
    for t in TABLES.values():
        out.append(f"-- {t.doc}")
        out.append(
            f"CREATE TABLE IF NOT EXISTS {database}.{t.name} ({t.structure()}) "
            f"ENGINE = {t.engine} ORDER BY ({', '.join(t.order_by)});"
        )
    for r in ROLLUPS.values():
        out += _rollup_ddl(
            database, r, f"({r.structure()}) ENGINE = AggregatingMergeTree() ORDER BY ({', '.join(r.order_by)})"
        )
    return "\n".join(out) + "\n"


def _rollup_ddl(database: str, r: Rollup, body: str, oc: str = "", local: str = "") -> list[str]:
    """A rollup's table (``body``: its columns and engine; ``local``: the suffix of a cluster's
    local tables) and its materialised view, filled from the source table (on a cluster: from the
    local source table, on the server a row is stored on)."""
    on = f" {oc}" if oc else ""
    return [
        f"-- rollup: {r.doc}",
        f"CREATE TABLE IF NOT EXISTS {database}.{r.name}{local}{on} {body};",
        f"CREATE MATERIALIZED VIEW IF NOT EXISTS {database}.{r.name}_mv{on} TO {database}.{r.name}{local} AS "
        f"{r.select(f'{database}.{r.source}{local}')};",
    ]


def render_cluster_ddl(database: str = "ranklens", cluster: str = "ranklens") -> str:
    """``CREATE`` statements for a cluster: replicated local tables plus Distributed tables.

    ``{shard}`` and ``{replica}`` are the usual server macros. Queries and inserts go to the
    Distributed tables, which carry the plain table names, so analyzer SQL is unchanged.
    """
    header = [
        f"-- ranklens schema version {SCHEMA_VERSION}, ClickHouse cluster '{cluster}' (>= 18.16).",
        "-- Generated by `ranklens schema --target cluster`; do not edit by hand.",
    ]
    return _cluster_ddl(
        database,
        cluster,
        header,
        lambda t, engine: f"({t.structure()}) ENGINE = {engine} ORDER BY ({', '.join(t.order_by)})",
        lambda r, engine: f"({r.structure()}) ENGINE = {engine} ORDER BY ({', '.join(r.order_by)})",
    )


def _cluster_ddl(
    database: str,
    cluster: str,
    header: list[str],
    body: Callable[[Table, str], str],
    rollup_body: Callable[[Rollup, str], str],
) -> str:
    """A cluster's DDL: ``header``, the database and the meta table on every server, then per table
    its replicated local table (columns and engine clauses from ``body(table, engine)``) and the
    Distributed table over it under the plain name."""
    oc = f"ON CLUSTER '{cluster}'"
    out = [
        *header,
        "-- Needs the {shard} and {replica} macros and ZooKeeper/Keeper on every server.",
        f"CREATE DATABASE IF NOT EXISTS {database} {oc};",
        f"CREATE TABLE IF NOT EXISTS {database}.{META_TABLE} {oc} (key String, value String, "
        f"updated_ns Int64) ENGINE = ReplicatedReplacingMergeTree("
        f"'/clickhouse/tables/{{shard}}/{database}/{META_TABLE}', '{{replica}}', updated_ns) "
        "ORDER BY key;",
    ]
    for t in TABLES.values():
        engine = t.replicated_engine.format(db=database, table=t.name)
        out.append(f"-- {t.doc}")
        out.append(f"CREATE TABLE IF NOT EXISTS {database}.{t.name}_local {oc} {body(t, engine)};")
        out.append(
            f"CREATE TABLE IF NOT EXISTS {database}.{t.name} {oc} AS {database}.{t.name}_local "
            f"ENGINE = Distributed('{cluster}', '{database}', '{t.name}_local', {t.shard_key});"
        )
    for r in ROLLUPS.values():
        engine = f"ReplicatedAggregatingMergeTree('/clickhouse/tables/{{shard}}/{database}/{r.name}', '{{replica}}')"
        out += _rollup_ddl(database, r, rollup_body(r, engine), oc, "_local")
        out.append(
            f"CREATE TABLE IF NOT EXISTS {database}.{r.name} {oc} AS {database}.{r.name}_local "
            f"ENGINE = Distributed('{cluster}', '{database}', '{r.name}_local', {r.shard_key});"
        )
    return "\n".join(out) + "\n"


# -- schema for weeks: the DDL a current server gets (issue 19) -------------------------------
#
# A server at or above CURRENT_SERVER gets day partitions, a TTL (whole parts dropped), codecs,
# LowCardinality strings and a DateTime64(9) column ``ts`` for Grafana; below it (18.16, Debian's,
# the floor) the DDL above, unchanged. One conservative gate instead of one per feature: CODEC
# (19.1), T64 (19.7), TTL (19.6), LowCardinality without a setting (19.x), DateTime64 (20.1),
# fromUnixTimestamp64Nano (20.5) and ttl_only_drop_parts (20.x) are all in 21.8, an LTS release.
# Existing tables keep the DDL they were created with: CREATE ... IF NOT EXISTS never alters them.

FLOOR_SERVER = (18, 16)
CURRENT_SERVER = (21, 8)

# the column a table is partitioned, expired and given ``ts`` by; absent: no partition, no TTL
# (findings: a ReplacingMergeTree replaces versions only within a partition; process_groups and
# ranks: their time may be 0, unknown, and they are small)
TIME_COLUMN: dict[str, str] = {
    "collectives": "enter_ns",
    "phases": "start_ns",
    "steps": "start_ns",
    "gpu_samples": "ts_ns",
    "gpu_events": "ts_ns",
    "log_events": "ts_ns",
    "heartbeats": "ts_ns",
    "cpu": "ts_ns",
    "trace_events": "ts_ns",
    "actions": "ts_ns",
    "drops": "ts_ns",
    "preflight": "ts_ns",
    "drills": "ts_ns",
}

# days a row is kept on a current server (0: forever); the raw ledger and samples for weeks,
# the small tables a person reads back for longer
DEFAULT_RETENTION_DAYS: dict[str, int] = {
    "collectives": 14,
    "phases": 30,
    "steps": 90,
    "gpu_samples": 30,
    "gpu_events": 180,
    "log_events": 30,
    "heartbeats": 14,
    "cpu": 30,
    "trace_events": 14,
    "actions": 365,
    "drops": 30,
    "preflight": 180,
    "drills": 0,
    "collective_arrivals": 180,  # the rollups (ROLLUPS): months of blame after the raw ledger is gone
    "rank_steps": 180,
}

# strings with few distinct values (dictionary-encoded on a current server)
LOW_CARDINALITY = frozenset(
    {
        "job_id", "pg", "op", "dtype", "clock", "host", "phase", "kind", "gpu_uuid", "backend",
        "stream", "rule", "klass", "severity", "cat", "collective", "state", "detector", "action",
        "outcome", "component", "what", "status", "verdict", "check_name", "unit", "suite",
    }
)  # fmt: skip

GRAFANA_TS = "ts"


def parse_server_version(text: str) -> tuple[int, int]:
    """``version()``'s answer (``'18.16.1'``, ``'24.3.2.23'``) as ``(major, minor)``."""
    parts = text.strip().split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        from ranklens.errors import ConfigError

        raise ConfigError(f"server version {text!r}: expected MAJOR.MINOR[.PATCH...], e.g. 18.16 or 24.3") from None


def is_current_server(version: tuple[int, int] | None) -> bool:
    """Whether a server of ``version`` gets the schema for weeks (None: the floor)."""
    return version is not None and tuple(version) >= CURRENT_SERVER


def parse_retention(items: list[str] | tuple[str, ...]) -> dict[str, int]:
    """``TABLE=DAYS`` items as retention overrides; a clear error for a bad one (0: keep forever)."""
    from ranklens.errors import ConfigError

    out: dict[str, int] = {}
    for item in items:
        name, sep, days = item.partition("=")
        if not sep or (name not in TIME_COLUMN and name not in ROLLUPS):
            raise ConfigError(
                f"retention {item!r}: expected TABLE=DAYS with TABLE one of {', '.join([*TIME_COLUMN, *ROLLUPS])} "
                "(the others have no time to expire by)"
            )
        if not days.strip().isdigit():
            raise ConfigError(f"retention {item!r}: DAYS must be a whole number >= 0 (0: keep forever)")
        out[name] = int(days)
    return out


def _current_column(t: Table, c: Column) -> str:
    type_ = c.type
    if c.name in LOW_CARDINALITY and type_ == "String":
        type_ = "LowCardinality(String)"
    codec = ""
    if c.type == "Int64" and c.name.endswith("_ns"):
        codec = " CODEC(T64, ZSTD)"  # docs/capacity.md: the ns timestamps
    elif c.type == "Int64" and c.name in ("seq", "step"):
        codec = " CODEC(Delta, ZSTD)"
    return f"{c.name} {type_}{codec}"


def _current_body(t: Table, engine: str, retention: dict[str, int]) -> str:
    """Columns and engine clauses of ``t`` for a current server."""
    cols = [_current_column(t, c) for c in t.columns]
    time_col = TIME_COLUMN.get(t.name)
    tail = ""
    if time_col:
        cols.append(f"{GRAFANA_TS} DateTime64(9) MATERIALIZED fromUnixTimestamp64Nano({time_col})")
        day = f"toDateTime(intDiv({time_col}, 1000000000))"
        tail += f" PARTITION BY toYYYYMMDD({day})"
    tail += f" ORDER BY ({', '.join(t.order_by)})"
    days = retention.get(t.name, 0) if time_col else 0
    if days:
        tail += f" TTL {day} + INTERVAL {days} DAY SETTINGS ttl_only_drop_parts = 1"
    return f"({', '.join(cols)}) ENGINE = {engine}{tail}"


def _current_rollup_body(r: Rollup, engine: str, retention: dict[str, int]) -> str:
    """Columns and engine clauses of rollup ``r`` for a current server: LowCardinality keys,
    partitions by ``day`` and a TTL of ``retention[r.name]`` days (whole parts dropped)."""
    src = TABLES[r.source]
    cols = [_current_column(src, src.column(k)).split(" CODEC")[0] for k in r.keys] + ["day UInt32"]
    cols += [f"{c} {t}" for c, _e, t in r.aggregates]
    tail = f" PARTITION BY day ORDER BY ({', '.join(r.order_by)})"
    days = retention.get(r.name, 0)
    if days:
        tail += f" TTL toDateTime(day * 86400) + INTERVAL {days} DAY SETTINGS ttl_only_drop_parts = 1"
    return f"({', '.join(cols)}) ENGINE = {engine}{tail}"


def render_current_server_ddl(
    database: str = "ranklens", retention: dict[str, int] | None = None, version: tuple[int, int] = CURRENT_SERVER
) -> str:
    """``CREATE`` statements for one current ClickHouse server (>= :data:`CURRENT_SERVER`)."""
    keep = {**DEFAULT_RETENTION_DAYS, **(retention or {})}
    out = [
        f"-- ranklens schema version {SCHEMA_VERSION}, one ClickHouse server (>= "
        f"{CURRENT_SERVER[0]}.{CURRENT_SERVER[1]}): day partitions, TTL, codecs, LowCardinality.",
        f"-- Generated by `ranklens schema --target server --server-version {version[0]}.{version[1]}`; "
        "do not edit by hand.",
        f"CREATE DATABASE IF NOT EXISTS {database};",
        f"CREATE TABLE IF NOT EXISTS {database}.{META_TABLE} (key String, value String, "
        "updated_ns Int64) ENGINE = ReplacingMergeTree(updated_ns) ORDER BY key;",
    ]
    for t in TABLES.values():
        out.append(f"-- {t.doc}")
        out.append(f"CREATE TABLE IF NOT EXISTS {database}.{t.name} {_current_body(t, t.engine, keep)};")
    for r in ROLLUPS.values():
        out += _rollup_ddl(database, r, _current_rollup_body(r, "AggregatingMergeTree()", keep))
    return "\n".join(out) + "\n"


def render_current_cluster_ddl(
    database: str = "ranklens",
    cluster: str = "ranklens",
    retention: dict[str, int] | None = None,
    version: tuple[int, int] = CURRENT_SERVER,
) -> str:
    """``CREATE`` statements for a cluster of current servers: the replicated local tables with day
    partitions, TTL, codecs and LowCardinality (as :func:`render_current_server_ddl`), and the
    Distributed tables over them with the floor's shard keys (:func:`render_cluster_ddl`). A whole
    day's part is dropped on each replica by its own TTL merge; ``ts`` is computed where a row is
    stored (each shard's local table computes its MATERIALIZED column)."""
    keep = {**DEFAULT_RETENTION_DAYS, **(retention or {})}
    header = [
        f"-- ranklens schema version {SCHEMA_VERSION}, ClickHouse cluster '{cluster}' (>= "
        f"{CURRENT_SERVER[0]}.{CURRENT_SERVER[1]}): day partitions, TTL, codecs, LowCardinality.",
        f"-- Generated by `ranklens schema --target cluster --server-version {version[0]}.{version[1]}`; "
        "do not edit by hand.",
    ]
    return _cluster_ddl(
        database,
        cluster,
        header,
        lambda t, engine: _current_body(t, engine, keep),
        lambda r, engine: _current_rollup_body(r, engine, keep),
    )


def render_ddl_for(
    database: str = "ranklens", version: tuple[int, int] | None = None, retention: dict[str, int] | None = None
) -> str:
    """The server DDL for a server of ``version``: the floor below :data:`CURRENT_SERVER`."""
    if is_current_server(version):
        assert version is not None
        return render_current_server_ddl(database, retention, version)
    return render_server_ddl(database)


def render_cluster_ddl_for(
    database: str = "ranklens",
    cluster: str = "ranklens",
    version: tuple[int, int] | None = None,
    retention: dict[str, int] | None = None,
) -> str:
    """The cluster DDL for servers of ``version``: the floor below :data:`CURRENT_SERVER`."""
    if is_current_server(version):
        assert version is not None
        return render_current_cluster_ddl(database, cluster, retention, version)
    return render_cluster_ddl(database, cluster)
