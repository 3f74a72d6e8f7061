"""An in-package fake of the NVML boundary (the ``pynvml`` module of nvidia-ml-py), for tests and
demos on machines without a GPU.

It offers the functions and constants :mod:`ranklens.collector.nvml` uses, with pynvml's names,
signatures, return shapes and error classes: :class:`NVMLError` carries the same ``value`` codes
(``NVML_ERROR_NOT_SUPPORTED`` = 3, ...), ``NVMLError(value)`` returns the matching subclass
(``NVMLError_NotSupported``, ``NVMLError_Timeout``, ...) and ``str()`` gives NVML's text. Values
of the constants are NVML's (``tests/collector/test_nvml.py`` checks them against the real module when it is
installed). Every call before ``nvmlInit`` raises ``NVML_ERROR_UNINITIALIZED``, as NVML does.

Devices are :class:`FakeGpu` objects whose fields tests change between samples; a field set to
``None`` answers ``NVML_ERROR_NOT_SUPPORTED``. :meth:`FakeNvml.inject_xid` queues an Xid event.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FakeGpu", "FakeNvml", "NVMLError", "fake_nvml"]

# --- constants (NVML's values) ---------------------------------------------------------------
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_INSUFFICIENT_POWER = 8
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IRQ_ISSUE = 11
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999

NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_PCIE_UTIL_TX_BYTES = 0
NVML_PCIE_UTIL_RX_BYTES = 1
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0
NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1
NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1
NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = 3
NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL = 38
NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL = 45
NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL = 52
NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL = 59
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = 138
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 139
nvmlEventTypeSingleBitEccError = 0x0000000000000001
nvmlEventTypeDoubleBitEccError = 0x0000000000000002
nvmlEventTypeXidCriticalError = 0x0000000000000008

_ERROR_TEXT = {
    NVML_ERROR_UNINITIALIZED: ("Uninitialized", "NVMLError_Uninitialized"),
    NVML_ERROR_INVALID_ARGUMENT: ("Invalid Argument", "NVMLError_InvalidArgument"),
    NVML_ERROR_NOT_SUPPORTED: ("Not Supported", "NVMLError_NotSupported"),
    NVML_ERROR_NO_PERMISSION: ("Insufficient Permissions", "NVMLError_NoPermission"),
    NVML_ERROR_ALREADY_INITIALIZED: ("Already Initialized", "NVMLError_AlreadyInitialized"),
    NVML_ERROR_NOT_FOUND: ("Not Found", "NVMLError_NotFound"),
    NVML_ERROR_INSUFFICIENT_SIZE: ("Insufficient Size", "NVMLError_InsufficientSize"),
    NVML_ERROR_INSUFFICIENT_POWER: ("Insufficient External Power", "NVMLError_InsufficientPower"),
    NVML_ERROR_DRIVER_NOT_LOADED: ("Driver Not Loaded", "NVMLError_DriverNotLoaded"),
    NVML_ERROR_TIMEOUT: ("Timeout", "NVMLError_Timeout"),
    NVML_ERROR_IRQ_ISSUE: ("Interrupt Request Issue", "NVMLError_IrqIssue"),
    NVML_ERROR_LIBRARY_NOT_FOUND: ("NVML Shared Library Not Found", "NVMLError_LibraryNotFound"),
    NVML_ERROR_FUNCTION_NOT_FOUND: ("Function Not Found", "NVMLError_FunctionNotFound"),
    NVML_ERROR_CORRUPTED_INFOROM: ("Corrupted infoROM", "NVMLError_CorruptedInforom"),
    NVML_ERROR_GPU_IS_LOST: ("GPU is lost", "NVMLError_GpuIsLost"),
    NVML_ERROR_UNKNOWN: ("Unknown Error", "NVMLError_Unknown"),
}


class NVMLError(Exception):
    """pynvml's error: ``NVMLError(value)`` is an instance of the subclass for ``value``."""

    _val_class: dict[int, type[NVMLError]] = {}

    def __new__(cls, value: int) -> NVMLError:
        if cls is NVMLError:
            cls = NVMLError._val_class.get(value, NVMLError)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __init__(self, value: int) -> None:
        self.value = value

    def __str__(self) -> str:
        return _ERROR_TEXT.get(self.value, (f"Unknown Error {self.value}", ""))[0]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NVMLError) and self.value == other.value

    def __hash__(self) -> int:
        return hash(self.value)


for _value, (_text, _name) in _ERROR_TEXT.items():
    _sub = type(_name, (NVMLError,), {"__doc__": f"NVML error {_value}: {_text}."})
    NVMLError._val_class[_value] = _sub
    globals()[_name] = _sub
NVMLError_NotSupported: type[NVMLError] = NVMLError._val_class[NVML_ERROR_NOT_SUPPORTED]
NVMLError_Timeout: type[NVMLError] = NVMLError._val_class[NVML_ERROR_TIMEOUT]


# --- return shapes ---------------------------------------------------------------------------
@dataclass
class c_nvmlUtilization_t:
    gpu: int
    memory: int


@dataclass
class c_nvmlMemory_t:
    total: int
    free: int
    used: int


@dataclass
class c_nvmlProcessInfo_t:
    pid: int
    usedGpuMemory: int


@dataclass
class c_nvmlEventData_t:
    device: Any
    eventType: int
    eventData: int
    gpuInstanceId: int = 0xFFFFFFFF
    computeInstanceId: int = 0xFFFFFFFF


@dataclass
class c_nvmlValue_t:
    ullVal: int = 0


@dataclass
class c_nvmlFieldValue_t:
    fieldId: int
    scopeId: int = 0
    timestamp: int = 0
    latencyUsec: int = 0
    valueType: int = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
    nvmlReturn: int = NVML_SUCCESS
    value: c_nvmlValue_t = field(default_factory=c_nvmlValue_t)


@dataclass
class FakeGpu:
    """One fake device. ``None`` in a field means the device does not support it."""

    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    util_pct: int | None = 0
    mem_used_bytes: int | None = 1 << 30
    mem_total_bytes: int | None = 80 << 30
    power_mw: int | None = 120_000
    temp_c: int | None = 35
    sm_clock_mhz: int | None = 1980
    mem_clock_mhz: int | None = 2619
    throttle_reasons: int | None = 0
    pcie_tx_kbps: int | None = 0
    pcie_rx_kbps: int | None = 0
    pcie_replay: int | None = 0
    ecc_volatile: dict[int, int] | None = field(default_factory=lambda: {0: 0, 1: 0})
    ecc_aggregate: dict[int, int] | None = field(default_factory=lambda: {0: 0, 1: 0})
    retired_pages: dict[int, list[int]] | None = None  # pre-Ampere only
    remapped_rows: tuple[int, int, int, int] | None = (0, 0, 0, 0)  # corr, unc, pending, failure
    nvlink_fields: dict[int, int] | None = None  # field id -> cumulative value; None: no NVLink
    processes: list[tuple[int, int]] = field(default_factory=list)  # (pid, used bytes)
    events_supported: int = (
        nvmlEventTypeXidCriticalError | nvmlEventTypeSingleBitEccError | nvmlEventTypeDoubleBitEccError
    )
    lost: bool = False  # every call answers NVML_ERROR_GPU_IS_LOST


class _Handle:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"<fake nvmlDevice_t {self.index}>"


class _EventSet:
    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.freed = False


class FakeNvml:
    """A stand-in for the ``pynvml`` module. Pass it wherever ranklens takes ``nvml=``.

    Args:
        gpus: the devices (default: none, like a node whose GPUs all fell off the bus).
        init_error: make ``nvmlInit`` fail with this NVML code (e.g. ``NVML_ERROR_DRIVER_NOT_LOADED``
            for a machine without the driver).
    """

    def __init__(self, gpus: list[FakeGpu] | None = None, *, init_error: int | None = None) -> None:
        self.gpus = list(gpus or [])
        self.init_error = init_error
        self.initialized = 0
        self.calls: dict[str, int] = {}
        self._events: deque[c_nvmlEventData_t] = deque()
        self._sets: list[_EventSet] = []
        self._lock = threading.Lock()
        g = globals()
        for name, value in g.items():
            if name.startswith(("NVML_", "nvmlEventType", "NVMLError")) or name.startswith("c_nvml"):
                setattr(self, name, value)

    # --- test controls ---------------------------------------------------------------------
    def inject_xid(self, index: int, xid: int) -> None:
        """Queue an Xid critical error on GPU ``index`` (seen by registered event sets)."""
        with self._lock:
            self._events.append(c_nvmlEventData_t(_Handle(index), nvmlEventTypeXidCriticalError, xid))

    # --- helpers ---------------------------------------------------------------------------
    def _call(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        if not self.initialized:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)

    def _gpu(self, handle: Any) -> FakeGpu:
        if not isinstance(handle, _Handle) or not 0 <= handle.index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.gpus[handle.index]
        if gpu.lost:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        return gpu

    @staticmethod
    def _need(value: Any) -> Any:
        if value is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return value

    # --- the pynvml surface ----------------------------------------------------------------
    def nvmlInit(self) -> None:
        self.calls["nvmlInit"] = self.calls.get("nvmlInit", 0) + 1
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.initialized += 1

    def nvmlShutdown(self) -> None:
        self._call("nvmlShutdown")
        self.initialized -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._call("nvmlSystemGetDriverVersion")
        return "550.54.15-fake"

    def nvmlDeviceGetCount(self) -> int:
        self._call("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._call("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(index)

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        self._call("nvmlDeviceGetUUID")
        return self._gpu(handle).uuid

    def nvmlDeviceGetName(self, handle: Any) -> str:
        self._call("nvmlDeviceGetName")
        return self._gpu(handle).name

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> c_nvmlUtilization_t:
        self._call("nvmlDeviceGetUtilizationRates")
        return c_nvmlUtilization_t(self._need(self._gpu(handle).util_pct), 0)

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: Any = None) -> c_nvmlMemory_t:
        self._call("nvmlDeviceGetMemoryInfo")
        g = self._gpu(handle)
        used, total = self._need(g.mem_used_bytes), self._need(g.mem_total_bytes)
        return c_nvmlMemory_t(total, total - used, used)

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        self._call("nvmlDeviceGetPowerUsage")
        return int(self._need(self._gpu(handle).power_mw))

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        self._call("nvmlDeviceGetTemperature")
        if sensor != NVML_TEMPERATURE_GPU:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return int(self._need(self._gpu(handle).temp_c))

    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int:
        self._call("nvmlDeviceGetClockInfo")
        g = self._gpu(handle)
        if type == NVML_CLOCK_SM:
            return int(self._need(g.sm_clock_mhz))
        if type == NVML_CLOCK_MEM:
            return int(self._need(g.mem_clock_mhz))
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        self._call("nvmlDeviceGetCurrentClocksEventReasons")
        return int(self._need(self._gpu(handle).throttle_reasons))

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any) -> int:
        self._call("nvmlDeviceGetCurrentClocksThrottleReasons")
        return int(self._need(self._gpu(handle).throttle_reasons))

    def nvmlDeviceGetPcieThroughput(self, device: Any, counter: int) -> int:
        self._call("nvmlDeviceGetPcieThroughput")
        g = self._gpu(device)
        if counter == NVML_PCIE_UTIL_TX_BYTES:
            return int(self._need(g.pcie_tx_kbps))
        if counter == NVML_PCIE_UTIL_RX_BYTES:
            return int(self._need(g.pcie_rx_kbps))
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetPcieReplayCounter(self, handle: Any) -> int:
        self._call("nvmlDeviceGetPcieReplayCounter")
        return int(self._need(self._gpu(handle).pcie_replay))

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int:
        self._call("nvmlDeviceGetTotalEccErrors")
        g = self._gpu(handle)
        counters = self._need(g.ecc_volatile if counterType == NVML_VOLATILE_ECC else g.ecc_aggregate)
        if errorType not in counters:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return int(counters[errorType])

    def nvmlDeviceGetRetiredPages(self, device: Any, sourceFilter: int) -> list[int]:
        self._call("nvmlDeviceGetRetiredPages")
        return list(self._need(self._gpu(device).retired_pages).get(sourceFilter, []))

    def nvmlDeviceGetRemappedRows(self, device: Any) -> tuple[int, int, int, int]:
        self._call("nvmlDeviceGetRemappedRows")
        corr, unc, pending, failure = self._need(self._gpu(device).remapped_rows)
        return corr, unc, pending, failure

    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: list[Any]) -> list[c_nvmlFieldValue_t]:
        self._call("nvmlDeviceGetFieldValues")
        g = self._gpu(handle)
        out = []
        for fid in fieldIds:
            field_id, scope = fid if isinstance(fid, tuple) else (fid, 0)
            fv = c_nvmlFieldValue_t(field_id, scope)
            if g.nvlink_fields is None or field_id not in g.nvlink_fields:
                fv.nvmlReturn = NVML_ERROR_NOT_SUPPORTED
            else:
                fv.value.ullVal = int(g.nvlink_fields[field_id])
            out.append(fv)
        return out

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[c_nvmlProcessInfo_t]:
        self._call("nvmlDeviceGetComputeRunningProcesses")
        return [c_nvmlProcessInfo_t(pid, used) for pid, used in self._gpu(handle).processes]

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        self._call("nvmlDeviceGetSupportedEventTypes")
        return self._gpu(handle).events_supported

    def nvmlEventSetCreate(self) -> _EventSet:
        self._call("nvmlEventSetCreate")
        s = _EventSet()
        self._sets.append(s)
        return s

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: _EventSet) -> None:
        self._call("nvmlDeviceRegisterEvents")
        g = self._gpu(handle)
        if eventTypes & ~g.events_supported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        eventSet.registered[handle.index] = eventTypes

    def nvmlEventSetWait_v2(self, eventSet: _EventSet, timeoutms: int) -> c_nvmlEventData_t:
        self._call("nvmlEventSetWait_v2")
        with self._lock:
            for i, ev in enumerate(self._events):
                if eventSet.registered.get(ev.device.index, 0) & ev.eventType:
                    del self._events[i]
                    return ev
        raise NVMLError(NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, eventSet: _EventSet) -> None:
        self._call("nvmlEventSetFree")
        eventSet.freed = True

    def nvmlErrorString(self, result: int) -> str:
        return _ERROR_TEXT.get(result, ("Unknown Error", ""))[0]


def fake_nvml(n_gpus: int = 2, **kw: Any) -> FakeNvml:
    """A fake with ``n_gpus`` healthy H100-like devices."""
    return FakeNvml(
        [FakeGpu(uuid=f"GPU-00000000-0000-0000-0000-{i:012d}") for i in range(n_gpus)],
        **kw,
    )
