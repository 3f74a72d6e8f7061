"""Prometheus metrics of the collector, on a registry of its own, and the ``/metrics`` endpoint.

Names follow Prometheus conventions (base units, ``_total`` for counters, the unit last:
``_bytes``, ``_seconds``, ``_celsius``, ``_watts``, ``_ratio``). All metrics live on the
:class:`~prometheus_client.CollectorRegistry` passed in (a fresh one by default), never on the
global registry, so several agents (or tests) in one process do not collide. The registry also
carries the collector process's own ``process_*`` series and ``python_info``
(prometheus-client's ``ProcessCollector`` and ``PlatformCollector``).

GPU gauges are produced at scrape time from the latest NVML reading (a custom collector), so a GPU
that disappears stops being exported instead of freezing at its last value. Their host label is
``node``, as in the findings' series. NVML's clocks-event (throttle) reasons bitmask is one 0/1
gauge per reason (``ranklens_gpu_clocks_event_reason{reason}``, :data:`CLOCKS_EVENT_REASONS`), so
PromQL selects a reason by label instead of decoding bits. Per-rank metrics (``ranklens_rank_*``:
last step's duration, time blocked in collectives, newest heartbeat) come from the rows the
collector ships for the ranks of its node. The endpoint that serves them is
:class:`ranklens._metrics_http.MetricsServer` (no ``_created`` series; ``ranklens_build_info``).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ranklens.collector.logfilter import FilterStats
from ranklens.collector.shipper import ShipResult

__all__ = ["CLOCKS_EVENT_REASONS", "CollectorMetrics"]

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
        labels = ["node", "gpu", "uuid", "job_id", "rank"]

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
            lv = [str(s["host"]), str(s["gpu_index"]), str(s["gpu_uuid"]), str(s["job_id"]), str(s["rank"])]
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


class _RankCollector(Collector):
    """Per-rank training metrics from the rows the collector ships (the ranks of this node):
    the last step's duration, steps, time blocked in collectives, and the newest heartbeat.
    A rank not heard from for :data:`RANK_FORGET_S` stops being exported."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (job_id, attempt, rank) -> state
        self._ranks: dict[tuple[str, int, int], dict[str, float]] = {}

    def _state(self, key: tuple[str, int, int]) -> dict[str, float]:
        st = self._ranks.get(key)
        if st is None:
            st = self._ranks[key] = {
                "step": -1.0, "step_s": math.nan, "steps": 0.0, "coll_s": 0.0, "colls": 0.0, "hb": math.nan,
            }  # fmt: skip
        st["seen"] = time.time()
        return st

    def observe(self, table_name: str, data: Any) -> None:
        if table_name not in ("steps", "collectives", "heartbeats") or data.num_rows == 0:
            return
        import pyarrow.compute as pc

        cols = {c: data.column(c).to_pylist() for c in ("job_id", "attempt", "rank")}
        if table_name == "steps":
            steps = data.column("step").to_pylist()
            dur = pc.subtract(data.column("end_ns"), data.column("start_ns")).to_pylist()
            with self._lock:
                for j, a, r, n, d in zip(cols["job_id"], cols["attempt"], cols["rank"], steps, dur):
                    st = self._state((j, a, r))
                    st["steps"] += 1
                    if n >= st["step"]:
                        st["step"], st["step_s"] = float(n), d / 1e9
        elif table_name == "collectives":
            end, enter = data.column("end_ns"), data.column("enter_ns")
            wait = pc.if_else(pc.greater(end, 0), pc.subtract(end, enter), 0).to_pylist()
            done = pc.greater(end, 0).to_pylist()
            with self._lock:
                for j, a, r, w, ok in zip(cols["job_id"], cols["attempt"], cols["rank"], wait, done):
                    if ok:
                        st = self._state((j, a, r))
                        st["colls"] += 1
                        st["coll_s"] += max(0, w) / 1e9
        else:
            ts = data.column("ts_ns").to_pylist()
            with self._lock:
                for j, a, r, t in zip(cols["job_id"], cols["attempt"], cols["rank"], ts):
                    st = self._state((j, a, r))
                    st["hb"] = t / 1e9 if math.isnan(st["hb"]) else max(st["hb"], t / 1e9)

    def collect(self) -> Iterator[Any]:
        labels = ["job_id", "attempt", "rank"]
        g_step = GaugeMetricFamily(
            f"{NS}_rank_step_duration_seconds", "duration of the rank's last step", labels=labels
        )
        g_last = GaugeMetricFamily(f"{NS}_rank_last_step", "the rank's last completed step", labels=labels)
        c_steps = CounterMetricFamily(f"{NS}_rank_steps", "steps the rank completed (as shipped)", labels=labels)
        c_wait = CounterMetricFamily(
            f"{NS}_rank_collective_wait_seconds",
            "time the rank spent inside collectives (arrival to completion): rate() is the share of time blocked",
            labels=labels,
        )
        c_colls = CounterMetricFamily(f"{NS}_rank_collectives", "collectives the rank completed", labels=labels)
        g_hb = GaugeMetricFamily(
            f"{NS}_rank_heartbeat_timestamp_seconds", "time of the rank's newest heartbeat", labels=labels
        )
        now = time.time()
        with self._lock:
            for key in [k for k, st in self._ranks.items() if now - st["seen"] > RANK_FORGET_S]:
                del self._ranks[key]
            items = [(k, dict(st)) for k, st in self._ranks.items()]
        for (j, a, r), st in items:
            lv = [str(j), str(a), str(r)]
            _add(g_step, lv, st["step_s"])
            if st["step"] >= 0:
                g_last.add_metric(lv, st["step"])
            c_steps.add_metric(lv, st["steps"])
            c_wait.add_metric(lv, st["coll_s"])
            c_colls.add_metric(lv, st["colls"])
            _add(g_hb, lv, st["hb"])
        yield from (g_step, g_last, c_steps, c_wait, c_colls, g_hb)


RANK_FORGET_S = 1800.0


def _add(family: Any, labels: list[str], value: float, *, int_unknown: bool = False) -> None:
    if value is None or (isinstance(value, float) and math.isnan(value)) or (int_unknown and value < 0):
        return
    family.add_metric(labels, float(value))


class CollectorMetrics:
    """The collector's metrics.

    Args:
        registry: where they live (default: a new :class:`CollectorRegistry`; never the global one).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
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
        self._ranks = _RankCollector()
        r.register(self._ranks)
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
        """The latest GPU reading (what the GPU gauges show)."""
        self._gpu.update(samples, extras)
