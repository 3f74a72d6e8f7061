"""GPU health from NVML: periodic samples (``gpu_samples``) and discrete events (``gpu_events``).

:class:`GpuSampler` reads, per GPU: utilization, memory, power, temperature, SM and memory clocks,
clock-event (throttle) reasons, PCIe throughput and replay counter, ECC counters (volatile and
aggregate, corrected and uncorrected), retired pages / remapped rows, and NVLink throughput and
error counters where supported. XID errors (NVML's event set) and *increases* of the ECC,
retired-page and remapped-row counters are events, not last-value gauges.

The NVML boundary is one object with pynvml's functions (``nvml=``): the real ``pynvml`` module
(nvidia-ml-py) by default, :class:`~ranklens.collector.fake_nvml.FakeNvml` in tests. A field a
device does not support (``NVML_ERROR_NOT_SUPPORTED``) is left at its "unknown" value and not
asked again. Without the library, a driver or a GPU, :meth:`GpuSampler.start` logs that once and
returns False; the rest of the collector carries on.

Each GPU is tied to the rank using it: the process with the most memory on it (NVML's running
processes) whose environment has ``RANK`` (and ``RANKLENS_JOB_ID`` or ``TORCHELASTIC_RUN_ID``), a
process whose ``CUDA_VISIBLE_DEVICES``/``LOCAL_RANK`` point at this GPU winning ties.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ranklens.config import ENV_JOB_ID, node_name

__all__ = ["GpuReading", "GpuSampler", "RankResolver", "read_proc_environ"]

log = logging.getLogger("ranklens.collector.nvml")

UINT_MAX = 0xFFFFFFFF
_UNKNOWN_INT = -1

# XIDs that mean the hardware (not the application) failed; see NVIDIA's XID catalogue
HARDWARE_XIDS = frozenset(
    {48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 136, 140, 143, 144, 145, 146, 149, 150, 154}
)


def read_proc_environ(pid: int) -> dict[str, str] | None:
    """The environment of process ``pid`` from /proc (None when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    out: dict[str, str] = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            out[k.decode(errors="replace")] = v.decode(errors="replace")
    return out


class RankResolver:
    """Maps a GPU to (job_id, rank) from the processes running on it.

    Args:
        environ_reader: pid -> environment (default: /proc/<pid>/environ).
        static: fixed mapping ``{gpu_index: (job_id, rank)}`` that wins over discovery.
    """

    def __init__(
        self,
        environ_reader: Callable[[int], Mapping[str, str] | None] = read_proc_environ,
        static: Mapping[int, tuple[str, int]] | None = None,
    ) -> None:
        self.environ_reader = environ_reader
        self.static = dict(static or {})
        self._env: dict[int, Mapping[str, str] | None] = {}

    def resolve(self, index: int, uuid: str, procs: list[tuple[int, int]]) -> tuple[str, int]:
        """(job_id, rank) for GPU ``index``; ('', -1) when unknown. ``procs``: (pid, used bytes)."""
        if index in self.static:
            return self.static[index]
        best: tuple[int, int, str, int] | None = None
        for pid, used in procs:
            if pid not in self._env:
                self._env[pid] = self.environ_reader(pid)
            env = self._env[pid]
            if not env or "RANK" not in env:
                continue
            try:
                rank = int(env["RANK"])
            except ValueError:
                continue
            job = env.get(ENV_JOB_ID) or env.get("TORCHELASTIC_RUN_ID") or ""
            score = (1 if _visible_device(env) in (str(index), uuid) else 0, used or 0, job, rank)
            if best is None or score[:2] > best[:2]:
                best = score
        live = {p for p, _ in procs}
        for pid in [p for p in self._env if p not in live]:
            if len(self._env) > 4096:
                del self._env[pid]
        return (best[2], best[3]) if best else ("", -1)


def _visible_device(env: Mapping[str, str]) -> str:
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if not cvd:
        return ""
    devs = [d.strip() for d in cvd.split(",") if d.strip()]
    try:
        local = int(env.get("LOCAL_RANK", "0"))
    except ValueError:
        local = 0
    if len(devs) == 1:
        return devs[0]
    return devs[local] if 0 <= local < len(devs) else ""


@dataclass
class GpuReading:
    """One sampling pass.

    ``samples`` are ``gpu_samples`` rows, ``events`` ``gpu_events`` rows; ``extras[i]`` holds what
    the ``gpu_samples`` table has no column for yet (PCIe/NVLink throughput, aggregate ECC,
    retired pages, remapped rows), keyed like the Prometheus gauges.
    """

    ts_ns: int
    samples: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    extras: list[dict[str, float]] = field(default_factory=list)


@dataclass
class _Gpu:
    index: int
    handle: Any
    uuid: str
    unsupported: set[str] = field(default_factory=set)
    warned: set[str] = field(default_factory=set)
    last: dict[str, float] = field(default_factory=dict)  # previous counters, for events and rates
    lost: bool = False
    job_id: str = ""
    rank: int = -1


class GpuSampler:
    """Samples every GPU of this node through NVML.

    Args:
        nvml: the NVML module (default: ``import pynvml``); a FakeNvml in tests.
        host: node name (default: this host's name).
        clock: ns clock for sample times.
        resolver: GPU -> rank mapping (default: from /proc environments).
    """

    def __init__(
        self,
        nvml: Any | None = None,
        *,
        host: str | None = None,
        clock: Callable[[], int] = time.time_ns,
        resolver: RankResolver | None = None,
    ) -> None:
        self._nvml: Any = nvml
        self.host = host or node_name()
        self.clock = clock
        self.resolver = resolver or RankResolver()
        self.available = False
        self.reason = ""
        self._gpus: list[_Gpu] = []
        self._events: Any = None
        self._started = False

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> bool:
        """Initialise NVML and find the GPUs. False (logged once) when there is no GPU to read."""
        if self._started:
            return self.available
        self._started = True
        if self._nvml is None:
            try:
                import pynvml
            except ImportError:
                return self._unavailable("nvidia-ml-py is not installed (pip install nvidia-ml-py)")
            self._nvml = pynvml
        nv = self._nvml
        try:
            nv.nvmlInit()
        except nv.NVMLError as e:
            return self._unavailable(f"NVML cannot start: {e} (no NVIDIA driver or GPU on this node?)")
        except OSError as e:  # pragma: no cover - ctypes loading problems
            return self._unavailable(f"NVML cannot be loaded: {e}")
        try:
            n = nv.nvmlDeviceGetCount()
            for i in range(n):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                self._gpus.append(_Gpu(i, h, _text(nv.nvmlDeviceGetUUID(h))))
        except nv.NVMLError as e:
            self._shutdown()
            return self._unavailable(f"NVML cannot list the GPUs: {e}")
        if not self._gpus:
            self._shutdown()
            return self._unavailable("NVML found no GPU on this node")
        self._register_events()
        self.available = True
        log.info("ranklens collector: sampling %d GPU(s) through NVML", len(self._gpus))
        return True

    def _unavailable(self, why: str) -> bool:
        self.reason = why
        self.available = False
        log.warning("ranklens collector: GPU metrics off: %s; everything else carries on", why)
        return False

    def _register_events(self) -> None:
        nv = self._nvml
        try:
            es = nv.nvmlEventSetCreate()
        except nv.NVMLError as e:
            log.info("ranklens collector: no NVML event set (%s): XIDs are not read from NVML", e)
            return
        registered = 0
        for g in self._gpus:
            try:
                supported = nv.nvmlDeviceGetSupportedEventTypes(g.handle)
                want = supported & nv.nvmlEventTypeXidCriticalError
                if want:
                    nv.nvmlDeviceRegisterEvents(g.handle, want, es)
                    registered += 1
            except nv.NVMLError as e:
                log.info("ranklens collector: GPU %d: no XID events from NVML (%s)", g.index, e)
        if registered:
            self._events = es
        else:
            nv.nvmlEventSetFree(es)

    def _shutdown(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception:
            pass

    def close(self) -> None:
        """Free the event set and shut NVML down."""
        if self.available:
            if self._events is not None:
                try:
                    self._nvml.nvmlEventSetFree(self._events)
                except self._nvml.NVMLError:
                    pass
                self._events = None
            self._shutdown()
        self.available = False

    # --- sampling -------------------------------------------------------------------------

    def sample(self) -> GpuReading:
        """Read every GPU once (and drain pending XID events). Never raises for NVML errors."""
        now = self.clock()
        reading = GpuReading(now)
        if not self.available:
            return reading
        for g in self._gpus:
            row, extra, events = self._sample_gpu(g, now)
            reading.samples.append(row)
            reading.extras.append(extra)
            reading.events.extend(events)
        reading.events.extend(self._drain_xids(now))
        return reading

    def _get(self, g: _Gpu, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        """One NVML read; None when unsupported (then never asked again) or failing."""
        if name in g.unsupported or g.lost:
            return None
        nv = self._nvml
        try:
            return fn(g.handle, *args)
        except nv.NVMLError as e:
            if e.value in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_FUNCTION_NOT_FOUND):
                g.unsupported.add(name)
            elif e.value == nv.NVML_ERROR_GPU_IS_LOST:
                g.lost = True
            elif name not in g.warned:
                g.warned.add(name)
                log.warning("ranklens collector: GPU %d: %s failed: %s", g.index, name, e)
            return None

    def _sample_gpu(self, g: _Gpu, now: int) -> tuple[dict[str, Any], dict[str, float], list[dict[str, Any]]]:
        nv = self._nvml
        was_lost = g.lost
        util = self._get(g, "utilization", nv.nvmlDeviceGetUtilizationRates)
        mem = self._get(g, "memory", nv.nvmlDeviceGetMemoryInfo)
        power = self._get(g, "power", nv.nvmlDeviceGetPowerUsage)
        temp = self._get(g, "temperature", nv.nvmlDeviceGetTemperature, nv.NVML_TEMPERATURE_GPU)
        sm = self._get(g, "sm_clock", nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_SM)
        memclk = self._get(g, "mem_clock", nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_MEM)
        reasons_fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
        reasons = self._get(g, "clocks_event_reasons", reasons_fn) if reasons_fn else None
        if reasons is None and "clocks_event_reasons" in g.unsupported:
            reasons = self._get(g, "throttle_reasons", nv.nvmlDeviceGetCurrentClocksThrottleReasons)
        replay = self._get(g, "pcie_replay", nv.nvmlDeviceGetPcieReplayCounter)
        ecc = {}
        for key, et, ct in (
            ("ecc_corrected", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC),
            ("ecc_uncorrected", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC),
            ("ecc_corrected_aggregate", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_AGGREGATE_ECC),
            ("ecc_uncorrected_aggregate", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_AGGREGATE_ECC),
        ):
            ecc[key] = self._get(g, key, nv.nvmlDeviceGetTotalEccErrors, et, ct)
        extra: dict[str, float] = {}
        if reasons is None:  # the row's column stores 0; /metrics leaves the reasons out instead
            extra["clocks_event_reasons_unknown"] = 1.0
        for key, counter in (
            ("pcie_tx_bytes_per_second", nv.NVML_PCIE_UTIL_TX_BYTES),
            ("pcie_rx_bytes_per_second", nv.NVML_PCIE_UTIL_RX_BYTES),
        ):
            v = self._get(g, key, nv.nvmlDeviceGetPcieThroughput, counter)
            if v is not None:
                extra[key] = float(v) * 1024.0  # NVML answers KB/s
        nvlink_errors = self._nvlink(g, now, extra)
        remap = self._get(g, "remapped_rows", nv.nvmlDeviceGetRemappedRows)
        retired_sbe = self._get(
            g,
            "retired_pages_sbe",
            nv.nvmlDeviceGetRetiredPages,
            nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
        )
        retired_dbe = self._get(
            g, "retired_pages_dbe", nv.nvmlDeviceGetRetiredPages, nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
        )
        procs_raw = self._get(g, "processes", nv.nvmlDeviceGetComputeRunningProcesses) or []
        procs = [(int(p.pid), int(p.usedGpuMemory or 0)) for p in procs_raw]
        job_id, rank = self.resolver.resolve(g.index, g.uuid, procs)
        g.job_id, g.rank = job_id, rank

        for key in ("ecc_corrected_aggregate", "ecc_uncorrected_aggregate"):
            if ecc[key] is not None:
                extra[key] = float(ecc[key])
        if remap is not None:
            extra["remapped_rows_correctable"] = float(remap[0])
            extra["remapped_rows_uncorrectable"] = float(remap[1])
            extra["remap_pending"] = float(bool(remap[2]))
            extra["remap_failure"] = float(bool(remap[3]))
        if retired_sbe is not None:
            extra["retired_pages_sbe"] = float(len(retired_sbe))
        if retired_dbe is not None:
            extra["retired_pages_dbe"] = float(len(retired_dbe))

        row = {
            **self._which(g, now, job_id, rank),
            "util_pct": float(util.gpu) if util is not None else math.nan,
            "mem_used_bytes": int(mem.used) if mem is not None else _UNKNOWN_INT,
            "mem_total_bytes": int(mem.total) if mem is not None else _UNKNOWN_INT,
            "power_w": power / 1000.0 if power is not None else math.nan,
            "temp_c": float(temp) if temp is not None else math.nan,
            "sm_clock_mhz": float(sm) if sm is not None else math.nan,
            "mem_clock_mhz": float(memclk) if memclk is not None else math.nan,
            "throttle_reasons": int(reasons) if reasons is not None else 0,
            "ecc_corrected": int(ecc["ecc_corrected"]) if ecc["ecc_corrected"] is not None else _UNKNOWN_INT,
            "ecc_uncorrected": int(ecc["ecc_uncorrected"]) if ecc["ecc_uncorrected"] is not None else _UNKNOWN_INT,
            "pcie_replay": int(replay) if replay is not None else _UNKNOWN_INT,
            "nvlink_errors": nvlink_errors,
            "pcie_tx_bytes_per_s": extra.get("pcie_tx_bytes_per_second", math.nan),
            "pcie_rx_bytes_per_s": extra.get("pcie_rx_bytes_per_second", math.nan),
            "nvlink_tx_bytes_per_s": extra.get("nvlink_tx_bytes_per_second", math.nan),
            "nvlink_rx_bytes_per_s": extra.get("nvlink_rx_bytes_per_second", math.nan),
        }
        for key in (
            "ecc_corrected_aggregate",
            "ecc_uncorrected_aggregate",
            "retired_pages_sbe",
            "retired_pages_dbe",
            "remapped_rows_correctable",
            "remapped_rows_uncorrectable",
        ):
            row[key] = int(extra[key]) if key in extra else _UNKNOWN_INT
        events = self._counter_events(g, now, row, extra, job_id, rank)
        if g.lost and not was_lost:
            events.append(self._event(g, now, job_id, rank, "gpu_lost", 0, "NVML: GPU is lost (fallen off the bus?)"))
        return row, extra, events

    def _nvlink(self, g: _Gpu, now: int, extra: dict[str, float]) -> int:
        """NVLink error counters (summed) and throughput (bytes/s from the cumulative counters)."""
        nv = self._nvml
        ids = [
            (nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, UINT_MAX),
            (nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, UINT_MAX),
            nv.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL,
            nv.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL,
            nv.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL,
            nv.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL,
        ]
        values = self._get(g, "nvlink", nv.nvmlDeviceGetFieldValues, ids)
        if values is None:
            return _UNKNOWN_INT
        got = [int(v.value.ullVal) if v.nvmlReturn == nv.NVML_SUCCESS else None for v in values]
        if all(v is None for v in got):
            g.unsupported.add("nvlink")  # no NVLink on this GPU
            return _UNKNOWN_INT
        for key, v in (("nvlink_tx", got[0]), ("nvlink_rx", got[1])):
            if v is None:
                continue
            prev, prev_t = g.last.get(key), g.last.get(key + "_t")
            if prev is not None and prev_t is not None and now > prev_t and v >= prev:
                extra[f"{key}_bytes_per_second"] = (v - prev) * 1024.0 / ((now - prev_t) / 1e9)  # KiB counters
            g.last[key], g.last[key + "_t"] = float(v), float(now)
        errs = [v for v in got[2:] if v is not None]
        return int(sum(errs)) if errs else _UNKNOWN_INT

    def _which(self, g: _Gpu, now: int, job_id: str, rank: int) -> dict[str, Any]:
        """The columns that say which GPU, when and for whom: the first of a sample's and an event's."""
        return {
            "host": self.host,
            "gpu_index": g.index,
            "gpu_uuid": g.uuid,
            "ts_ns": now,
            "job_id": job_id,
            "rank": rank,
        }

    def _event(self, g: _Gpu, now: int, job_id: str, rank: int, kind: str, code: int, message: str) -> dict[str, Any]:
        return {**self._which(g, now, job_id, rank), "kind": kind, "code": code, "message": message}

    def _counter_events(
        self, g: _Gpu, now: int, row: dict[str, Any], extra: dict[str, float], job_id: str, rank: int
    ) -> list[dict[str, Any]]:
        """Counters that grew since the last sample become events (the first sample sets a baseline)."""
        out = []
        watched = {
            "ecc_sbe": (row["ecc_corrected"], "corrected (single-bit) ECC errors"),
            "ecc_dbe": (row["ecc_uncorrected"], "uncorrected (double-bit) ECC errors"),
            "row_remap": (
                extra.get("remapped_rows_correctable", -1) + extra.get("remapped_rows_uncorrectable", 0),
                "remapped rows",
            ),
            "row_remap_failure": (extra.get("remap_failure", -1), "row remapping failure"),
            "page_retirement": (
                extra.get("retired_pages_sbe", -1) + extra.get("retired_pages_dbe", 0),
                "retired pages",
            ),
        }
        for kind, (value, what) in watched.items():
            if value is None or value < 0:
                continue
            prev = g.last.get(kind)
            if prev is not None and value > prev:
                out.append(
                    self._event(
                        g, now, job_id, rank, kind, int(value), f"{what}: +{int(value - prev)} (now {int(value)})"
                    )
                )
            g.last[kind] = float(value)
        return out

    def _drain_xids(self, now: int) -> list[dict[str, Any]]:
        if self._events is None:
            return []
        nv = self._nvml
        by_uuid = {g.uuid: g for g in self._gpus}
        out = []
        for _ in range(1000):  # bounded: an XID storm cannot stall the sampler
            try:
                data = nv.nvmlEventSetWait_v2(self._events, 0)
            except nv.NVMLError as e:
                if e.value != nv.NVML_ERROR_TIMEOUT:
                    log.warning("ranklens collector: reading NVML events failed: %s", e)
                break
            try:
                uuid = _text(nv.nvmlDeviceGetUUID(data.device))
            except nv.NVMLError:
                uuid = ""
            g = by_uuid.get(uuid)
            if g is None:
                continue
            xid = int(data.eventData)
            hw = "hardware" if xid in HARDWARE_XIDS else "application or driver"
            out.append(self._event(g, now, g.job_id, g.rank, "xid", xid, f"Xid {xid} ({hw} error) reported by NVML"))
        return out

    @property
    def gpu_count(self) -> int:
        return len(self._gpus)


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
