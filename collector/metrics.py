"""Prometheus metrics of the collector, on a registry of its own, and the ``/metrics`` endpoint.

Names follow Prometheus conventions (base units, ``_total`` for counters, the unit last:
``_bytes``, ``_seconds``, ``_celsius``, ``_watts``, ``_ratio``). All metrics live on the
:class:`~prometheus_client.CollectorRegistry` passed in (a fresh one by default), never on the
global registry, so several agents (or tests) in one process do not collide. The registry also
carries the collector process's own ``process_*`` series and ``python_info``
(prometheus-client's ``ProcessCollector`` and ``PlatformCollector``).

GPU gauges are produced at scrape time from the latest NVML reading (a custom collector), so a GPU
that disappears stops being exported instead of freezing at its last value. Their labels are the
GPU's only, ``node``, ``gpu`` (index) and ``uuid``: never ``job_id``, ``rank`` or ``attempt``, so a
GPU keeps its series whatever job runs on it (issue 19). NVML's clocks-event (throttle) reasons
bitmask is one 0/1 gauge per reason (``ranklens_gpu_clocks_event_reason{reason}``,
:data:`CLOCKS_EVENT_REASONS`), so PromQL selects a reason by label instead of decoding bits.

Which rank uses which GPU is one series per live rank of the node,
``ranklens_rank_info{job_id, attempt, rank, node, gpu, uuid} 1`` (``uuid`` empty where the GPU is not
known, e.g. CPU ranks), removed when the rank ends (its last heartbeat, or the liveness watcher's
``exited = 2``), when a newer attempt of its job arrives, or when another job's rank takes its GPU;
GPU series join it on ``uuid``::

    ranklens_gpu_utilization_ratio * on (uuid) group_left (job_id, rank) ranklens_rank_info{uuid!=""}

Training metrics (from the rows the collector ships for the ranks of its node) are bounded: per
job, per-node aggregates (``ranklens_node_*``: live ranks, min/median/max of the ranks' last step
time, step and heartbeat extremes, summed steps and time blocked in collectives) and the ``top_k``
slowest and most silent ranks (``ranklens_rank_step_duration_seconds``,
``ranklens_rank_heartbeat_timestamp_seconds``). So a collector serves O(jobs x k) of them whatever
the number of ranks and attempts; every rank's every step is in the store. The endpoint that serves
them is :class:`ranklens._metrics_http.MetricsServer` (no ``_created`` series); the registry carries
``ranklens_build_info{version, python, schema_version}`` itself.
"""

from __future__ import annotations

import heapq
import math
import statistics
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ranklens._metrics_http import BuildInfo
from ranklens.collector.logfilter import FilterStats
from ranklens.collector.shipper import ShipResult
from ranklens.config import node_name
from ranklens.errors import ConfigError

__all__ = ["CLOCKS_EVENT_REASONS", "DEFAULT_TOP_K", "RANK_FORGET_S", "CollectorMetrics"]

NS = "ranklens"

# NVML's clocks-event reasons (nvmlClocksEventReason*, formerly nvmlClocksThrottleReason*): the
# `reason` label (NVML's name in snake_case) and the bit NVML sets for it
CLOCKS_EVENT_REASONS: tuple[tuple[str, int], ...] = (
    ("gpu_idle", 0x1),
    ("applications_clocks_setting", 0x2),
    ("sw_power_cap", 0x4),
    ("hw_slowdown", 0x8),
    ("sync_boost", 0x10),
    ("sw_thermal_slowdown", 0x20),
    ("hw_thermal_slowdown", 0x40),
    ("hw_power_brake_slowdown", 0x80),
    ("display_clock_setting", 0x100),
)


class _GpuCollector(Collector):
    """Exposes the latest GPU reading."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._samples: list[Mapping[str, Any]] = []
        self._extras: list[Mapping[str, float]] = []
        self._ts = 0.0

    def update(self, samples: Sequence[Mapping[str, Any]], extras: Sequence[Mapping[str, float]]) -> None:
        with self._lock:
            self._samples = list(samples)
            self._extras = list(extras) + [{}] * (len(samples) - len(extras))
            self._ts = time.time()

    def collect(self) -> Iterator[Any]:
        with self._lock:
            samples, extras = self._samples, self._extras
        labels = ["node", "gpu", "uuid"]  # never job_id/rank: join ranklens_rank_info on uuid for those

        def fam(kind: str, name: str, doc: str, extra_labels: Sequence[str] = ()) -> Any:
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            return cls(f"{NS}_gpu_{name}", doc, labels=[*labels, *extra_labels])

        g_util = fam("gauge", "utilization_ratio", "GPU utilization (0-1) over NVML's last sample period")
        g_mem = fam("gauge", "memory_used_bytes", "GPU memory in use")
        g_memt = fam("gauge", "memory_total_bytes", "GPU memory in total")
        g_pow = fam("gauge", "power_watts", "GPU power draw")
        g_temp = fam("gauge", "temperature_celsius", "GPU temperature")
        g_clk = fam("gauge", "clock_hertz", "GPU clock", ["clock"])
        g_thr = fam(
            "gauge",
            "clocks_event_reason",
            "1 while NVML reports this clocks-event (throttle) reason for the GPU, else 0",
            ["reason"],
        )
        c_ecc = fam("counter", "ecc_errors", "volatile ECC error count", ["type"])
        c_replay = fam("counter", "pcie_replay", "PCIe replay counter")
        c_nvl = fam("counter", "nvlink_errors", "NVLink CRC/replay/recovery error counters, summed")
        g_pcie = fam("gauge", "pcie_throughput_bytes_per_second", "PCIe throughput", ["direction"])
        g_nvl = fam("gauge", "nvlink_throughput_bytes_per_second", "NVLink data throughput", ["direction"])
        g_rows = fam("gauge", "remapped_rows", "remapped memory rows", ["type"])
        for s, x in zip(samples, extras):
            lv = [str(s["host"]), str(s["gpu_index"]), str(s["gpu_uuid"])]
            _add(g_util, lv, s["util_pct"] / 100.0)
            _add(g_mem, lv, s["mem_used_bytes"], int_unknown=True)
            _add(g_memt, lv, s["mem_total_bytes"], int_unknown=True)
            _add(g_pow, lv, s["power_w"])
            _add(g_temp, lv, s["temp_c"])
            _add(g_clk, [*lv, "sm"], s["sm_clock_mhz"] * 1e6)
            _add(g_clk, [*lv, "memory"], s["mem_clock_mhz"] * 1e6)
            if not x.get("clocks_event_reasons_unknown"):  # a GPU that reports no reasons exports none
                bits = int(s["throttle_reasons"])
                for reason, bit in CLOCKS_EVENT_REASONS:
                    g_thr.add_metric([*lv, reason], 1.0 if bits & bit else 0.0)
            _add(c_ecc, [*lv, "corrected"], s["ecc_corrected"], int_unknown=True)
            _add(c_ecc, [*lv, "uncorrected"], s["ecc_uncorrected"], int_unknown=True)
            _add(c_replay, lv, s["pcie_replay"], int_unknown=True)
            _add(c_nvl, lv, s["nvlink_errors"], int_unknown=True)
            for d in ("tx", "rx"):
                _add(g_pcie, [*lv, d], x.get(f"pcie_{d}_bytes_per_second", math.nan))
                _add(g_nvl, [*lv, d], x.get(f"nvlink_{d}_bytes_per_second", math.nan))
            _add(g_rows, [*lv, "correctable"], x.get("remapped_rows_correctable", math.nan))
            _add(g_rows, [*lv, "uncorrectable"], x.get("remapped_rows_uncorrectable", math.nan))
        yield from (g_util, g_mem, g_memt, g_pow, g_temp, g_clk, g_thr, c_ecc, c_replay, c_nvl, g_pcie, g_nvl, g_rows)


_STATE_ROWS = ("steps", "collectives", "heartbeats", "ranks")


@dataclass
class _Rank:
    """What the collector knows of one live rank (of a job's newest attempt on this node)."""

    seen: float
    node: str = ""
    gpu: int = -1
    uuid: str = ""
    started_ns: int = 0
    step: float = -1.0
    step_s: float = math.nan
    hb: float = math.nan


@dataclass
class _Totals:
    """A job's counters on this node: every step and collective its ranks' rows brought, whatever
    became of the ranks since (so the counters only grow)."""

    seen: float
    steps: float = 0.0
    coll_s: float = 0.0
    colls: float = 0.0


class _RankCollector(Collector):
    """Training metrics from the rows the collector ships (the ranks of this node), bounded: one
    ``ranklens_rank_info`` series per live rank, per job a few per-node aggregates, and the ``top_k``
    slowest ranks; never a series per rank and attempt that outlives the rank.

    A rank is live from its first row until its last heartbeat says it ended (``exited`` 1: shut
    down, 2: gone, written by :mod:`.liveness`), a newer attempt of its job arrives, another job's
    rank takes its GPU, or it is not heard from for :data:`RANK_FORGET_S`."""

    def __init__(self, *, node: str, top_k: int) -> None:
        self.node = node
        self.top_k = top_k
        self._lock = threading.Lock()
        self._ranks: dict[tuple[str, int, int], _Rank] = {}
        self._ended: dict[tuple[str, int, int], float] = {}  # late rows must not bring these back
        self._attempt: dict[str, int] = {}  # job -> newest attempt seen
        self._totals: dict[str, _Totals] = {}
        self._gpu_of: dict[tuple[str, int], tuple[str, int, str]] = {}  # NVML: (job, rank) -> (node, gpu, uuid)

    def _live(self, key: tuple[str, int, int], now: float) -> _Rank | None:
        """The state of a rank a row names; None for a rank that ended or an older attempt."""
        job, attempt, _ = key
        newest = self._attempt.get(job)
        if newest is None or attempt > newest:
            self._attempt[job] = attempt
            if newest is not None:  # a new attempt: the old one's ranks are over
                for k in [k for k in self._ranks if k[0] == job and k[1] < attempt]:
                    del self._ranks[k]
                for k in [k for k in self._ended if k[0] == job and k[1] < attempt]:
                    del self._ended[k]
        elif attempt < newest or key in self._ended:
            return None
        st = self._ranks.get(key)
        if st is None:
            st = self._ranks[key] = _Rank(seen=now)
        st.seen = now
        return st

    def observe(self, table_name: str, data: Any) -> None:
        if table_name not in _STATE_ROWS or data.num_rows == 0:
            return
        import pyarrow.compute as pc

        now = time.time()
        keys = list(
            zip(
                data.column("job_id").to_pylist(),
                (a or 0 for a in data.column("attempt").to_pylist()),
                data.column("rank").to_pylist(),
            )
        )
        with self._lock:
            totals = {j: self._job_totals(j, now) for j in {k[0] for k in keys}}
            if table_name == "steps":
                steps = data.column("step").to_pylist()
                dur = pc.subtract(data.column("end_ns"), data.column("start_ns")).to_pylist()
                for key, n, d in zip(keys, steps, dur):
                    totals[key[0]].steps += 1
                    st = self._live(key, now)
                    if st is not None and n >= st.step:
                        st.step, st.step_s = float(n), d / 1e9
            elif table_name == "collectives":
                end, enter = data.column("end_ns"), data.column("enter_ns")
                wait = pc.if_else(pc.greater(end, 0), pc.subtract(end, enter), 0).to_pylist()
                done = pc.greater(end, 0).to_pylist()
                for key, w, ok in zip(keys, wait, done):
                    if ok:
                        totals[key[0]].colls += 1
                        totals[key[0]].coll_s += max(0, w) / 1e9
                        self._live(key, now)
            elif table_name == "heartbeats":
                ts = data.column("ts_ns").to_pylist()
                hosts = data.column("host").to_pylist()
                exited = data.column("exited").to_pylist() if "exited" in data.column_names else [0] * len(ts)
                for key, t, host, ex in zip(keys, ts, hosts, exited):
                    st = self._live(key, now)
                    if st is None:
                        continue
                    if ex:  # the rank's last heartbeat: shut down, or gone (the liveness watcher's)
                        del self._ranks[key]
                        self._ended[key] = now
                        continue
                    st.hb = t / 1e9 if math.isnan(st.hb) else max(st.hb, t / 1e9)
                    st.node = st.node or host or ""
            else:  # ranks: where the rank runs
                cols = [c for c in ("host", "gpu_index", "gpu_uuid", "started_ns") if c in data.column_names]
                for key, row in zip(keys, data.select(cols).to_pylist()):
                    st = self._live(key, now)
                    if st is None:
                        continue
                    st.node = row.get("host") or st.node
                    if row.get("gpu_uuid"):
                        gpu = row.get("gpu_index")
                        st.gpu, st.uuid = int(gpu) if gpu is not None else -1, str(row["gpu_uuid"])
                    st.started_ns = max(st.started_ns, int(row.get("started_ns") or 0))

    def _job_totals(self, job: str, now: float) -> _Totals:
        t = self._totals.get(job)
        if t is None:
            t = self._totals[job] = _Totals(seen=now)
        t.seen = now
        return t

    def observe_gpus(self, samples: Sequence[Mapping[str, Any]]) -> None:
        """NVML's GPU -> (job_id, rank) mapping (from the processes on each GPU) of the latest reading."""
        gpu_of = {}
        for s in samples:
            if int(s.get("rank", -1)) >= 0:
                gpu_of[(str(s.get("job_id") or ""), int(s["rank"]))] = (
                    str(s["host"]), int(s["gpu_index"]), str(s["gpu_uuid"])
                )  # fmt: skip
        with self._lock:
            self._gpu_of = gpu_of

    def snapshot(self) -> tuple[list[tuple[tuple[str, str, int], _Rank]], dict[str, _Totals]]:
        """The live ranks (key: job_id, attempt as text ("" when only NVML knows the rank), rank) and
        the jobs' totals, after forgetting what has been silent too long."""
        now = time.time()
        with self._lock:
            for k in [k for k, st in self._ranks.items() if now - st.seen > RANK_FORGET_S]:
                del self._ranks[k]
            for k in [k for k, t in self._ended.items() if now - t > RANK_FORGET_S]:
                del self._ended[k]
            live_jobs = {k[0] for k in self._ranks}
            for j in [j for j, t in self._totals.items() if j not in live_jobs and now - t.seen > RANK_FORGET_S]:
                del self._totals[j]
                self._attempt.pop(j, None)
            ranks = [((j, str(a), r), replace(st)) for (j, a, r), st in self._ranks.items()]
            gpu_of = dict(self._gpu_of)
            totals = {j: replace(t) for j, t in self._totals.items()}
        known = {(j, r) for (j, _, r), _ in ranks}
        for (j, _a, r), st in ranks:
            if not st.uuid and (j, r) in gpu_of:  # the tracer did not say which GPU; NVML's processes do
                node, st.gpu, st.uuid = gpu_of[(j, r)]
                st.node = st.node or node
        # a rank only NVML knows (its process has RANK and a job id in its environment, but no rows
        # reached this collector): still one rank_info series, so GPU series join to it
        for (j, r), (node, gpu, uuid) in gpu_of.items():
            if (j, r) not in known:
                ranks.append(((j, "", r), _Rank(seen=now, node=node, gpu=gpu, uuid=uuid)))
        # one job (attempt) per GPU: a GPU that a newer rank took is not the older rank's any more
        # (NVML's processes now first, then the newest start)
        owner: dict[str, tuple[bool, int, float, str, str]] = {}
        for (j, a, r), st in ranks:
            if st.uuid:
                cand = (gpu_of.get((j, r), ("", -1, ""))[2] == st.uuid, st.started_ns, st.seen, j, a)
                owner[st.uuid] = max(owner.get(st.uuid, cand), cand)
        ranks = [((j, a, r), st) for (j, a, r), st in ranks if not st.uuid or owner[st.uuid][3:] == (j, a)]
        return ranks, totals

    def collect(self) -> Iterator[Any]:
        ranks, totals = self.snapshot()
        node = self.node
        info = GaugeMetricFamily(
            f"{NS}_rank_info",
            "1 per live rank of this node: where it runs (join GPU series on uuid)",
            labels=["job_id", "attempt", "rank", "node", "gpu", "uuid"],
        )
        n_ranks = GaugeMetricFamily(f"{NS}_node_ranks", "live ranks of the job on this node", labels=["node", "job_id"])
        stat = ["node", "job_id", "stat"]
        g_step = GaugeMetricFamily(
            f"{NS}_node_step_duration_seconds",
            "last step's duration over the job's ranks on this node (stat: min, median, max)",
            labels=stat,
        )
        g_last = GaugeMetricFamily(
            f"{NS}_node_last_step",
            "last completed step over the job's ranks on this node (stat: min, max)",
            labels=stat,
        )
        g_hb = GaugeMetricFamily(
            f"{NS}_node_heartbeat_timestamp_seconds",
            "newest heartbeat over the job's ranks on this node (stat: min is the most silent rank's, max)",
            labels=stat,
        )
        per_job = ["node", "job_id"]
        c_steps = CounterMetricFamily(
            f"{NS}_node_steps", "steps the job's ranks on this node completed", labels=per_job
        )
        c_wait = CounterMetricFamily(
            f"{NS}_node_collective_wait_seconds",
            "time the job's ranks on this node spent inside collectives (arrival to completion), summed: "
            "rate() / ranklens_node_ranks is their mean share of time blocked",
            labels=per_job,
        )
        c_colls = CounterMetricFamily(
            f"{NS}_node_collectives", "collectives the job's ranks on this node completed", labels=per_job
        )
        top = ["node", "job_id", "rank"]
        g_top = GaugeMetricFamily(
            f"{NS}_rank_step_duration_seconds",
            f"last step's duration of the job's slowest ranks on this node (the top {self.top_k})",
            labels=top,
        )
        g_silent = GaugeMetricFamily(
            f"{NS}_rank_heartbeat_timestamp_seconds",
            f"newest heartbeat of the job's most silent ranks on this node (the top {self.top_k})",
            labels=top,
        )
        by_job: dict[str, list[tuple[int, _Rank]]] = {}
        for (j, a, r), st in sorted(ranks, key=lambda x: (x[0][0], x[0][2])):
            gpu = str(st.gpu) if st.gpu >= 0 else ""
            info.add_metric([j, a, str(r), st.node or node, gpu, st.uuid], 1.0)
            if a:  # known from its rows (not only from NVML)
                by_job.setdefault(j, []).append((r, st))
        for j in sorted(set(by_job) | set(totals)):
            members = by_job.get(j, [])
            n_ranks.add_metric([node, j], float(len(members)))
            steps = [st.step_s for _, st in members if not math.isnan(st.step_s)]
            for name, v in _stats(steps, ("min", "median", "max")):
                g_step.add_metric([node, j, name], v)
            for name, v in _stats([st.step for _, st in members if st.step >= 0], ("min", "max")):
                g_last.add_metric([node, j, name], v)
            for name, v in _stats([st.hb for _, st in members if not math.isnan(st.hb)], ("min", "max")):
                g_hb.add_metric([node, j, name], v)
            t = totals.get(j)
            if t is not None:
                c_steps.add_metric([node, j], t.steps)
                c_wait.add_metric([node, j], t.coll_s)
                c_colls.add_metric([node, j], t.colls)
            timed = [(st.step_s, r, st) for r, st in members if not math.isnan(st.step_s)]
            for v, r, st in heapq.nlargest(self.top_k, timed, key=lambda x: (x[0], -x[1])):
                g_top.add_metric([st.node or node, j, str(r)], v)
            beats = [(st.hb, r, st) for r, st in members if not math.isnan(st.hb)]
            for v, r, st in heapq.nsmallest(self.top_k, beats, key=lambda x: (x[0], x[1])):
                g_silent.add_metric([st.node or node, j, str(r)], v)
        yield from (info, n_ranks, g_step, g_last, g_hb, c_steps, c_wait, c_colls, g_top, g_silent)


def _stats(values: list[float], names: Sequence[str]) -> Iterator[tuple[str, float]]:
    """(name, value) for the named statistics of ``values`` (nothing when there are none)."""
    if not values:
        return
    values = sorted(values)
    for name in names:
        if name == "min":
            yield name, values[0]
        elif name == "max":
            yield name, values[-1]
        else:
            yield name, statistics.median(values)


RANK_FORGET_S = 1800.0
DEFAULT_TOP_K = 3
MAX_TOP_K = 1000


def _add(family: Any, labels: list[str], value: float, *, int_unknown: bool = False) -> None:
    if value is None or (isinstance(value, float) and math.isnan(value)) or (int_unknown and value < 0):
        return
    family.add_metric(labels, float(value))


class CollectorMetrics:
    """The collector's metrics.

    Args:
        registry: where they live (default: a new :class:`CollectorRegistry`; never the global one).
        node: this node's name, the ``node`` label of the per-node series (default: this host's).
        top_k: per job, how many of this node's slowest (and most silent) ranks get a series of
            their own (0: none); everything else about the ranks is in per-node aggregates.

    Raises:
        ConfigError: ``top_k`` is not an integer in 0..1000.
    """

    def __init__(
        self, registry: CollectorRegistry | None = None, *, node: str | None = None, top_k: int = DEFAULT_TOP_K
    ) -> None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= MAX_TOP_K:
            raise ConfigError(f"collector metrics_top_k={top_k!r}: allowed 0..{MAX_TOP_K} (0: no per-rank series)")
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        p = f"{NS}_collector"
        self.log_lines_read = Counter(f"{p}_log_lines_read", "log lines read by the source filter", registry=r)
        self.log_read_bytes = Counter(f"{p}_log_read_bytes", "log bytes read by the source filter", registry=r)
        self.log_lines_kept = Counter(
            f"{p}_log_lines_kept", "log lines kept (in events, repeats included), per class", ["class"], registry=r
        )
        self.log_lines_dropped = Counter(f"{p}_log_lines_dropped", "log lines filtered out", registry=r)
        self.log_events = Counter(
            f"{p}_log_events", "log events (after collapsing repeats), per class", ["class"], registry=r
        )
        self.log_repeats_collapsed = Counter(
            f"{p}_log_repeats_collapsed", "log events folded into an earlier one", registry=r
        )
        self.log_lines_truncated = Counter(
            f"{p}_log_lines_truncated", "log lines longer than the line limit, cut there", registry=r
        )
        self.log_bytes_cut = Counter(f"{p}_log_bytes_cut", "bytes cut off over-long log lines (skipped)", registry=r)
        self.segments_written = Counter(
            f"{p}_segments_written", "segments the collector wrote to its spool", ["table"], registry=r
        )
        self.segments_shipped = Counter(f"{p}_segments_shipped", "spool segments acknowledged by the store", registry=r)
        self.segments_quarantined = Counter(
            f"{p}_segments_quarantined", "corrupt spool segments moved aside", registry=r
        )
        self.rows_shipped = Counter(f"{p}_rows_shipped", "rows written to the store", ["table"], registry=r)
        self.segments_already_stored = Counter(
            f"{p}_segments_already_stored",
            "segments in doubt (crash or lost acknowledgement) the store already had: deleted, not sent again",
            registry=r,
        )
        self.segments_partly_stored = Counter(
            f"{p}_segments_partly_stored",
            "segments in doubt the store had in part: those rows discarded, the segment sent again",
            registry=r,
        )
        self.segments_in_doubt = Gauge(
            f"{p}_segments_in_doubt", "segments whose delivery is being confirmed with the store", registry=r
        )
        self.spool_evicted_rows = Counter(
            f"{p}_spool_evicted_rows",
            "rows removed from the spool by its disk budget (store down too long), per table",
            ["table"],
            registry=r,
        )
        self.ranks_gone = Counter(
            f"{p}_ranks_gone",
            "ranks on this node whose process disappeared without shutting tracing down",
            registry=r,
        )
        self.store_errors = Counter(f"{p}_store_errors", "shipping passes the store refused", registry=r)
        self.write_errors = Counter(f"{p}_write_errors", "failures writing the local spool", ["component"], registry=r)
        self.last_ship_success = Gauge(
            f"{p}_last_ship_success_timestamp_seconds", "when a shipping pass last succeeded", registry=r
        )
        self.spool_segments_pending = Gauge(f"{p}_spool_segments_pending", "segments waiting to be shipped", registry=r)
        self.spool_bytes = Gauge(f"{p}_spool_bytes", "bytes of segments waiting to be shipped", registry=r)
        self.ship_lag = Gauge(f"{p}_ship_lag_seconds", "age of the oldest segment waiting to be shipped", registry=r)
        self.nvml_available = Gauge(f"{p}_nvml_available", "1 when GPUs are being sampled through NVML", registry=r)
        self.gpu_events = Counter(f"{NS}_gpu_events", "discrete GPU events (XID, ECC, row remap)", ["kind"], registry=r)
        self.log_files = Gauge(f"{p}_log_files", "log files being followed", registry=r)
        self._gpu = _GpuCollector()
        r.register(self._gpu)
        self._ranks = _RankCollector(node=node or node_name(), top_k=top_k)
        r.register(self._ranks)
        r.register(BuildInfo())  # ranklens_build_info on the registry itself (the endpoint adds no second)
        for own in (ProcessCollector, PlatformCollector):
            try:  # the process's own series: process_* (CPU, memory, fds, start time), python_info
                own(registry=r)
            except ValueError:  # a registry that has them already (prometheus-client's global one)
                pass

    def observe_filter(self, d: FilterStats) -> None:
        """Add a tailer commit's counters."""
        self.log_lines_read.inc(d.lines_read)
        self.log_read_bytes.inc(d.bytes_read)
        self.log_lines_dropped.inc(max(d.lines_dropped, 0))
        self.log_repeats_collapsed.inc(d.repeats_collapsed)
        self.log_lines_truncated.inc(d.lines_truncated)
        self.log_bytes_cut.inc(d.bytes_cut)
        for k, v in d.kept_by_class.items():
            self.log_lines_kept.labels(k).inc(v)
        for k, v in d.events_by_class.items():
            self.log_events.labels(k).inc(v)

    def observe_ship(self, r: ShipResult, *, now: float | None = None) -> None:
        """Count one shipping pass."""
        if r.error:
            self.store_errors.inc()
        else:
            self.last_ship_success.set(now if now is not None else time.time())
        self.segments_shipped.inc(r.segments)
        self.segments_quarantined.inc(r.quarantined)
        self.segments_already_stored.inc(r.already_stored)
        self.segments_partly_stored.inc(r.partial)
        for t, n in r.evicted.items():
            self.spool_evicted_rows.labels(t).inc(n)
        for t, n in r.rows.items():
            self.rows_shipped.labels(t).inc(n)

    def observe_rows(self, table_name: str, data: Any) -> None:
        """Per-rank metrics from a batch of rows on their way to the store (the shipper's hook)."""
        self._ranks.observe(table_name, data)

    def observe_gpus(self, samples: Sequence[Mapping[str, Any]], extras: Sequence[Mapping[str, float]]) -> None:
        """The latest GPU reading (what the GPU gauges show, and which rank uses which GPU)."""
        self._gpu.update(samples, extras)
        self._ranks.observe_gpus(samples)
