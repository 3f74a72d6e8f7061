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
:func:`from_spec` builds a fake from JSON (``$RANKLENS_FAKE_NVML`` of the pre-flight worker).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FakeGpu", "FakeNvml", "NVMLError", "fake_nvml", "from_spec"]

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
NVML_NVLINK_MAX_LINKS = 36
# clock event (throttle) reason bits; the *Throttle* names are pynvml's deprecated aliases
nvmlClocksEventReasonGpuIdle = 0x0000000000000001
nvmlClocksEventReasonApplicationsClocksSetting = 0x0000000000000002
nvmlClocksEventReasonSwPowerCap = 0x0000000000000004
nvmlClocksEventReasonHwSlowdown = 0x0000000000000008
nvmlClocksEventReasonSyncBoost = 0x0000000000000010
nvmlClocksEventReasonSwThermalSlowdown = 0x0000000000000020
nvmlClocksEventReasonHwThermalSlowdown = 0x0000000000000040
nvmlClocksEventReasonHwPowerBrakeSlowdown = 0x0000000000000080
nvmlClocksEventReasonDisplayClockSetting = 0x0000000000000100
nvmlClocksEventReasonNone = 0x0000000000000000
nvmlClocksThrottleReasonGpuIdle = nvmlClocksEventReasonGpuIdle
nvmlClocksThrottleReasonApplicationsClocksSetting = nvmlClocksEventReasonApplicationsClocksSetting
nvmlClocksThrottleReasonSwPowerCap = nvmlClocksEventReasonSwPowerCap
nvmlClocksThrottleReasonHwSlowdown = nvmlClocksEventReasonHwSlowdown
nvmlClocksThrottleReasonSyncBoost = nvmlClocksEventReasonSyncBoost
nvmlClocksThrottleReasonSwThermalSlowdown = nvmlClocksEventReasonSwThermalSlowdown
nvmlClocksThrottleReasonHwThermalSlowdown = nvmlClocksEventReasonHwThermalSlowdown
nvmlClocksThrottleReasonHwPowerBrakeSlowdown = nvmlClocksEventReasonHwPowerBrakeSlowdown
nvmlClocksThrottleReasonDisplayClockSetting = nvmlClocksEventReasonDisplayClockSetting
nvmlClocksThrottleReasonBoardLimit = 0x0000000000000200
nvmlClocksThrottleReasonReliability = 0x0000000000000400
nvmlClocksThrottleReasonNone = 0x0000000000000000

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
class c_nvmlPciInfo_t:
    busIdLegacy: str
    domain: int
    bus: int
    device: int
    pciDeviceId: int
    pciSubSystemId: int
    busId: str


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
    pcie_width: int | None = 16  # current link width (lanes)
    pcie_max_width: int | None = 16
    pcie_gen: int | None = 5  # current link generation
    pcie_max_gen: int | None = 5
    pci_bus_id: str = ""  # NVML's "00000000:BB:DD.0"; "": derived from the index (bus 0x18 + index)
    nvlink_states: list[int] | None = None  # per link: 1 active, 0 inactive; None: no NVLink
    persistence_mode: int | None = NVML_FEATURE_ENABLED
    retired_pages_pending: int | None = None  # pre-Ampere only (with retired_pages)


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

    def __init__(
        self,
        gpus: list[FakeGpu] | None = None,
        *,
        init_error: int | None = None,
        driver_version: str = "550.54.15-fake",
        cuda_driver_version: int | None = 12040,
        kernel_log: list[str] | None = None,
    ) -> None:
        self.gpus = list(gpus or [])
        self.init_error = init_error
        self.driver_version = driver_version
        self.cuda_driver_version = cuda_driver_version
        # Not NVML: the kernel log lines of this fake machine (``NVRM: Xid ...``), read by the
        # pre-flight XID check instead of the real log, which describes the real GPUs.
        self.kernel_log = list(kernel_log or [])
        self.initialized = 0
        self.calls: dict[str, int] = {}
        self._events: deque[c_nvmlEventData_t] = deque()
        self._sets: list[_EventSet] = []
        self._lock = threading.Lock()
        g = globals()
        for name, value in g.items():
            if name.startswith(("NVML_", "nvmlEventType", "nvmlClocks", "NVMLError")) or name.startswith("c_nvml"):
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
        return self.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._call("nvmlSystemGetCudaDriverVersion")
        return int(self._need(self.cuda_driver_version))

    def nvmlDeviceGetCount(self) -> int:
        self._call("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._call("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(index)

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        self._call("nvmlDeviceGetIndex")
        self._gpu(handle)
        return int(handle.index)

    def nvmlDeviceGetPciInfo(self, handle: Any) -> c_nvmlPciInfo_t:
        self._call("nvmlDeviceGetPciInfo")
        g = self._gpu(handle)
        bus_id = g.pci_bus_id or f"00000000:{0x18 + handle.index:02X}:00.0"
        dom, bus, dev = bus_id.split(".")[0].split(":")
        d, b, v = int(dom, 16), int(bus, 16), int(dev, 16)
        return c_nvmlPciInfo_t(f"{d:04X}:{b:02X}:{v:02X}.0", d, b, v, 0x233010DE, 0x16C110DE, bus_id)

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

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: Any) -> int:
        self._call("nvmlDeviceGetCurrPcieLinkGeneration")
        return int(self._need(self._gpu(handle).pcie_gen))

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: Any) -> int:
        self._call("nvmlDeviceGetMaxPcieLinkGeneration")
        return int(self._need(self._gpu(handle).pcie_max_gen))

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: Any) -> int:
        self._call("nvmlDeviceGetCurrPcieLinkWidth")
        return int(self._need(self._gpu(handle).pcie_width))

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: Any) -> int:
        self._call("nvmlDeviceGetMaxPcieLinkWidth")
        return int(self._need(self._gpu(handle).pcie_max_width))

    def nvmlDeviceGetNvLinkState(self, device: Any, link: int) -> int:
        self._call("nvmlDeviceGetNvLinkState")
        states = self._need(self._gpu(device).nvlink_states)
        if not 0 <= link < len(states):  # NVML: a link number this device does not have
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return int(states[link])

    def nvmlDeviceGetPersistenceMode(self, handle: Any) -> int:
        self._call("nvmlDeviceGetPersistenceMode")
        return int(self._need(self._gpu(handle).persistence_mode))

    def nvmlDeviceGetRetiredPagesPendingStatus(self, device: Any) -> int:
        self._call("nvmlDeviceGetRetiredPagesPendingStatus")
        return int(self._need(self._gpu(device).retired_pages_pending))

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


# --- from JSON ---------------------------------------------------------------------------------
_SPEC_KEYS = ("gpus", "xids", "init_error", "driver_version", "cuda_driver_version", "kernel_log")
_GPU_FIELDS = {f.name: str(f.type) for f in dataclasses.fields(FakeGpu)}
_INT_KEYED = ("ecc_volatile", "ecc_aggregate", "retired_pages", "nvlink_fields")


def from_spec(path_or_json: str) -> FakeNvml:
    """A fake built from a JSON spec: a file's path, or the JSON itself (text starting with ``{``).

    The spec: ``{"gpus": [{"uuid": "GPU-...", <FakeGpu field>: value, ...}] or N (N healthy GPUs,
    uuids ``GPU-fake-<i>``), "xids": [[gpu_index, xid], ...], "init_error": null, an NVML code or
    its name ("NVML_ERROR_DRIVER_NOT_LOADED"), "driver_version": str, "cuda_driver_version": int,
    "kernel_log": [line, ...]}``, every key optional. Dicts keyed by an NVML enum (``ecc_volatile``
    ...) take JSON's string keys (``{"1": 4}``).

    Raises:
        ValueError: a missing or unreadable file, bad JSON, an unknown key or field, a value of the
            wrong type (the message names the file and the field).
    """
    text = path_or_json.strip()
    where = "the inline fake NVML spec"
    if not text.startswith("{"):
        where = f"fake NVML spec file {path_or_json!r}"
        try:
            with open(path_or_json, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"{where}: cannot read it ({e.strerror or e}); give a JSON file or inline JSON") from e
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e})") from e
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: must be a JSON object with keys {', '.join(_SPEC_KEYS)}")
    unknown = sorted(set(spec) - set(_SPEC_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(_SPEC_KEYS)}")
    raw_gpus = spec.get("gpus", [])
    if isinstance(raw_gpus, int) and not isinstance(raw_gpus, bool):
        raw_gpus = [{} for _ in range(raw_gpus)]
    if not isinstance(raw_gpus, list):
        raise ValueError(f"{where}: 'gpus' must be a number or a list of objects, not {raw_gpus!r}")
    gpus = [_gpu_from_spec(where, i, g) for i, g in enumerate(raw_gpus)]
    fake = FakeNvml(
        gpus,
        init_error=_init_error(where, spec.get("init_error")),
        driver_version=str(spec.get("driver_version", "550.54.15-fake")),
        cuda_driver_version=_typed(where, "cuda_driver_version", spec.get("cuda_driver_version", 12040), "int | None"),
        kernel_log=[str(x) for x in _typed(where, "kernel_log", spec.get("kernel_log", []), "list")],
    )
    for item in _typed(where, "xids", spec.get("xids", []), "list"):
        if not (isinstance(item, list) and len(item) == 2 and all(_is_int(x) for x in item)):
            raise ValueError(f"{where}: 'xids' entries must be [gpu_index, xid], not {item!r}")
        if not 0 <= item[0] < len(gpus):
            raise ValueError(f"{where}: 'xids' entry {item!r} names GPU {item[0]}; the spec has {len(gpus)} GPU(s)")
        fake.inject_xid(item[0], item[1])
    return fake


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _init_error(where: str, v: Any) -> int | None:
    if v is None or _is_int(v):
        return v
    if isinstance(v, str) and v.startswith("NVML_ERROR_") and _is_int(globals().get(v)):
        return int(globals()[v])
    raise ValueError(f"{where}: 'init_error' must be null, an NVML error code or its name (NVML_ERROR_...), not {v!r}")


def _typed(where: str, name: str, v: Any, kind: str) -> Any:
    """``v`` checked against a FakeGpu annotation (or "list"), converted where JSON cannot say it."""
    if v is None:
        if kind.endswith("| None"):
            return None
        raise ValueError(f"{where}: {name!r} may not be null")
    base = kind.removesuffix(" | None")
    bad = ValueError(f"{where}: {name!r} must be {kind.replace('| None', 'or null')}, not {v!r}")
    if base == "int":
        if not _is_int(v):
            raise bad
        return v
    if base in ("str", "bool"):
        if type(v).__name__ != base:
            raise bad
        return v
    if base.startswith("dict["):
        if not isinstance(v, dict):
            raise bad
        try:
            return {int(k): (list(map(int, x)) if isinstance(x, list) else int(x)) for k, x in v.items()}
        except (TypeError, ValueError):
            raise bad from None
    if not isinstance(v, list):
        raise bad
    if base.startswith("tuple["):
        n = base.count("int")
        if len(v) != n or not all(_is_int(x) for x in v):
            raise bad
        return tuple(v)
    if base == "list[tuple[int, int]]":
        if not all(isinstance(x, list) and len(x) == 2 and all(_is_int(y) for y in x) for x in v):
            raise bad
        return [tuple(x) for x in v]
    if base == "list[int]" and not all(_is_int(x) for x in v):
        raise bad
    return list(v)


def _gpu_from_spec(where: str, index: int, raw: Any) -> FakeGpu:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: gpus[{index}] must be an object of FakeGpu fields, not {raw!r}")
    unknown = sorted(set(raw) - set(_GPU_FIELDS))
    if unknown:
        raise ValueError(
            f"{where}: gpus[{index}]: unknown field(s) {', '.join(map(repr, unknown))}; "
            f"allowed: {', '.join(_GPU_FIELDS)}"
        )
    kw = {k: _typed(where, f"gpus[{index}].{k}", v, _GPU_FIELDS[k]) for k, v in raw.items()}
    kw.setdefault("uuid", f"GPU-fake-{index}")
    return FakeGpu(**kw)
