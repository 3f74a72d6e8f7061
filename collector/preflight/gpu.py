"""GPU checks: NVML (count, driver, ECC, remapped rows / retired pages, XIDs, temperature, clock
event reasons, PCIe link, NVLink, persistence mode, leftover processes) and a short CUDA matmul burn
per device (TFLOPS, compared with the fleet's median by the coordinator).

NVML is opened once per run (the module and the device handles live in ``ctx.cache``; the runner
shuts NVML down). Without pynvml, a driver or a GPU every check answers ``skipped: no GPU (why)``,
never a pass, unless the node must have GPUs (``gpus_expected`` > 0): then ``gpu.count`` fails. A
query a GPU does not support (``NVML_ERROR_NOT_SUPPORTED``) skips that check on that GPU; a GPU that
answers ``NVML_ERROR_GPU_IS_LOST`` fails the first check that meets it, the later ones skip it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ranklens.collector.nvml import HARDWARE_XIDS
from ranklens.collector.preflight.api import CheckResult, Context, Status, check

__all__: list[str] = []

GIB = 1 << 30

# What the well-known XIDs mean (NVIDIA's XID catalogue,
# https://docs.nvidia.com/deploy/xid-errors/index.html), in words a person on call can act on.
XID_MEANING = {
    13: "graphics engine exception, often an application's illegal memory access",
    31: "GPU memory page fault, often an application's bad address",
    43: "GPU stopped processing, a faulting channel was reset",
    45: "preemptive cleanup after an earlier error",
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failed",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error, reset the GPU",
    95: "uncontained ECC error, reset the GPU",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}
# "NVRM: Xid (PCI:0000:3b:00): 79, pid=..., GPU has fallen off the bus."
_XID_LINE = re.compile(r"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f]+):([0-9A-Fa-f]+):([0-9A-Fa-f]+)(?:\.[0-9A-Fa-f]+)?\): (\d+)")

# clock event (throttle) reason bits, NVML's values (nvmlClocksEventReason*)
_REASONS_FAIL = {0x8: "HW slowdown", 0x40: "HW thermal slowdown", 0x80: "HW power brake slowdown"}
_REASONS_WARN = {0x20: "SW thermal slowdown", 0x4: "SW power cap", 0x200: "board limit", 0x400: "reliability"}
_REASONS_OK = {0x1: "GPU idle", 0x2: "applications clocks setting", 0x10: "sync boost", 0x100: "display clock setting"}


@dataclass
class _Gpu:
    index: int
    handle: Any
    uuid: str = ""
    name: str = ""
    open_error: Exception | None = None  # NVML could not open it (handle or uuid failed)
    lost_by: str = ""  # the check that found it lost (and failed); later checks skip it

    @property
    def subject(self) -> str:
        return f"gpu{self.index}"

    @property
    def label(self) -> str:
        return f"gpu{self.index} ({self.uuid})" if self.uuid else f"gpu{self.index}"


@dataclass
class _Nvml:
    nv: Any  # the module (pynvml or a fake); None when NVML cannot be used
    reason: str = ""  # why there is no GPU to check
    gpus: list[_Gpu] = field(default_factory=list)
    count_error: str = ""  # NVML started but could not count the GPUs


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _open(ctx: Context) -> _Nvml:
    """NVML and this node's GPUs, opened once per run (cached in ``ctx.cache``)."""
    st: _Nvml | None = ctx.cache.get("gpu.nvml")
    if st is not None and (st.nv is None or "nvml_started" in ctx.cache):
        return st
    st = None  # none yet, or the runner shut NVML down after an earlier run with this context
    nv: Any = ctx.nvml
    if nv is None:
        try:
            import pynvml

            nv = pynvml
        except ImportError:
            st = _Nvml(None, "pynvml missing: pip install nvidia-ml-py")
    if st is None:
        try:
            nv.nvmlInit()
        except Exception as e:  # NVMLError (no driver, no library) or an OSError: no NVML here
            st = _Nvml(None, f"NVML init failed: {e}")
        else:
            ctx.cache["nvml_started"] = nv
            st = _Nvml(nv)
            try:
                n = int(nv.nvmlDeviceGetCount())
            except nv.NVMLError as e:
                st.count_error = str(e)
                n = 0
            for i in range(n):
                g = _Gpu(i, None)
                try:
                    g.handle = nv.nvmlDeviceGetHandleByIndex(i)
                    g.uuid = _text(nv.nvmlDeviceGetUUID(g.handle))
                    g.name = _text(nv.nvmlDeviceGetName(g.handle))
                except nv.NVMLError as e:
                    g.open_error = e
                st.gpus.append(g)
            if st.count_error:
                st.reason = f"NVML could not count the GPUs: {st.count_error}"
            elif not st.gpus:
                st.reason = "NVML found none"
    ctx.cache["gpu.nvml"] = st
    return st


def _no_gpu(ctx: Context, name: str, st: _Nvml) -> CheckResult:
    return ctx.result(name, Status.SKIP, f"skipped: no GPU ({st.reason})")


def _nvml_error(ctx: Context, name: str, what: str, g: _Gpu, e: Any) -> CheckResult:
    """A result for an NVML error reading ``what`` on GPU ``g``: lost → fail, unsupported → skip."""
    nv = _open(ctx).nv
    code = getattr(e, "value", None)
    if code == nv.NVML_ERROR_GPU_IS_LOST:
        g.lost_by = name
        return ctx.result(
            name,
            Status.FAIL,
            f"{g.label}: the GPU is lost (NVML: {e}) reading {what}",
            subject=g.subject,
            threshold="the GPU answers NVML",
            fix=f"the GPU fell off the bus or hung: drain the node, reset it (`nvidia-smi -r -i {g.index}`) or "
            "reboot; the kernel log (`dmesg | grep -i xid`, Xid 79) tells why",
        )
    if code in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_FUNCTION_NOT_FOUND, nv.NVML_ERROR_NO_PERMISSION):
        return ctx.result(name, Status.SKIP, f"skipped: {g.label} does not report {what} ({e})", subject=g.subject)
    return ctx.result(
        name,
        Status.ERROR,
        f"{g.label}: reading {what} through NVML failed: {e}",
        subject=g.subject,
        fix=f"run `nvidia-smi -q -i {g.index}`; an NVML that fails here often means a driver in trouble",
    )


def _each_gpu(
    ctx: Context, name: str, what: str, fn: Callable[[Any, _Gpu], CheckResult | list[CheckResult]]
) -> list[CheckResult]:
    """Run ``fn(nv, gpu)`` on every GPU; NVML errors become skip/fail/error results (see module doc)."""
    st = _open(ctx)
    if st.reason:
        return [_no_gpu(ctx, name, st)]
    out: list[CheckResult] = []
    for g in st.gpus:
        if g.lost_by:
            out.append(
                ctx.result(name, Status.SKIP, f"skipped: {g.label} is lost (see {g.lost_by})", subject=g.subject)
            )
            continue
        if g.open_error is not None:
            out.append(_nvml_error(ctx, name, "its handle", g, g.open_error))
            continue
        try:
            got = fn(st.nv, g)
        except st.nv.NVMLError as e:
            out.append(_nvml_error(ctx, name, what, g, e))
            continue
        out.extend(got if isinstance(got, list) else [got])
    return out


def _call(nv: Any, names: tuple[str, ...], *args: Any) -> Any:
    """The first of ``names`` this pynvml and driver have (newer name first), called with ``args``."""
    err: Any = nv.NVMLError(nv.NVML_ERROR_FUNCTION_NOT_FOUND)
    for n in names:
        fn = getattr(nv, n, None)
        if fn is None:
            continue
        try:
            return fn(*args)
        except nv.NVMLError as e:
            if e.value != nv.NVML_ERROR_FUNCTION_NOT_FOUND:
                raise
            err = e
    raise err


# --- presence and software --------------------------------------------------------------------
@check("gpu.count", "NVML starts and shows the expected number of GPUs (--gpus; default: at least one)")
def count(ctx: Context) -> list[CheckResult]:
    st = _open(ctx)
    exp = ctx.gpus_expected
    if st.nv is None:
        if exp > 0:
            return [
                ctx.result(
                    "gpu.count",
                    Status.FAIL,
                    f"{exp} GPU(s) expected but NVML cannot be used: {st.reason}",
                    value=0,
                    threshold=f"== {exp} GPUs",
                    fix="install and load the NVIDIA driver (`nvidia-smi` must list the GPUs) and nvidia-ml-py "
                    "(`pip install nvidia-ml-py`) in the job's environment",
                )
            ]
        return [_no_gpu(ctx, "gpu.count", st)]
    if st.count_error:
        return [
            ctx.result(
                "gpu.count",
                Status.FAIL,
                f"NVML started but could not count the GPUs: {st.count_error}",
                threshold=f"== {exp} GPUs" if exp >= 0 else ">= 1 GPU",
                fix="the driver is in trouble: check `nvidia-smi` and the kernel log (`dmesg | grep -i nvrm`); reboot",
            )
        ]
    n = len(st.gpus)
    ctx.facts["gpu_count"] = n
    ctx.facts["gpu_models"] = sorted({g.name for g in st.gpus if g.name})
    ok = n == exp if exp >= 0 else n >= 1
    models = ", ".join(f"{sum(g.name == m for g in st.gpus)} x {m}" for m in ctx.facts["gpu_models"])
    if ok:
        fix = ""
    elif n < max(exp, 1):
        fix = (
            "a GPU is missing: `nvidia-smi -L`, the kernel log (`dmesg | grep -i xid`: Xid 79 = fell off the bus), "
            "the container's device list and CUDA_VISIBLE_DEVICES; reboot or drain the node"
        )
    else:
        fix = f"more GPUs than the {exp} expected: check --gpus against the node's allocation"
    out = [
        ctx.result(
            "gpu.count",
            Status.PASS if ok else Status.FAIL,
            f"{n} GPU(s) through NVML" + (f" ({models})" if models else "") + (f", {exp} expected" if exp >= 0 else ""),
            value=n,
            threshold=f"== {exp} GPUs" if exp >= 0 else ">= 1 GPU",
            fix=fix,
        )
    ]
    for g in st.gpus:
        if g.open_error is not None:
            r = _nvml_error(ctx, "gpu.count", "its handle", g, g.open_error)
            if r.status is not Status.FAIL:
                r = ctx.result(
                    "gpu.count",
                    Status.FAIL,
                    f"{g.label}: NVML cannot open the GPU: {g.open_error}",
                    subject=g.subject,
                    threshold="every GPU opens",
                    fix=f"`nvidia-smi -q -i {g.index}`; a GPU NVML cannot open will not run the job: drain the node",
                )
            out.append(r)
    return out


@check("gpu.driver", "the NVIDIA driver's version (and its CUDA version), compared across the fleet")
def driver(ctx: Context) -> list[CheckResult]:
    st = _open(ctx)
    if st.nv is None:
        return [_no_gpu(ctx, "gpu.driver", st)]
    nv = st.nv
    try:
        version = _text(nv.nvmlSystemGetDriverVersion())
    except nv.NVMLError as e:
        return [
            ctx.result(
                "gpu.driver",
                Status.ERROR,
                f"NVML could not read the driver version: {e}",
                fix="check `nvidia-smi`; the driver may be half loaded",
            )
        ]
    sw = ctx.facts.setdefault("software", {})
    sw["nvidia_driver"] = version
    msg = f"NVIDIA driver {version}"
    try:
        cuda = int(_call(nv, ("nvmlSystemGetCudaDriverVersion",)))
    except nv.NVMLError:
        pass
    else:
        sw["cuda_driver"] = f"{cuda // 1000}.{cuda % 1000 // 10}"
        msg += f", CUDA {sw['cuda_driver']} (driver API)"
    return [ctx.result("gpu.driver", Status.PASS, msg, threshold="the same on every node (fleet versions)")]


# --- memory errors ----------------------------------------------------------------------------
@check(
    "gpu.ecc_uncorrected",
    "uncorrected ECC errors, volatile (since the driver loaded) and aggregate (the GPU's life); any → fail",
)
def ecc_uncorrected(ctx: Context) -> list[CheckResult]:
    vmax = ctx.limit("ecc_uncorrected_max", 0)
    amax = ctx.limit("ecc_uncorrected_aggregate_max", 0)

    def one(nv: Any, g: _Gpu) -> CheckResult:
        unc = nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        vol = int(nv.nvmlDeviceGetTotalEccErrors(g.handle, unc, nv.NVML_VOLATILE_ECC))
        agg = int(nv.nvmlDeviceGetTotalEccErrors(g.handle, unc, nv.NVML_AGGREGATE_ECC))
        if vol > vmax:
            fix = (
                f"uncorrected memory errors since the driver loaded: drain the node and reset the GPU "
                f"(`nvidia-smi -r -i {g.index}`, which also applies pending row remaps); RMA it if they come back"
            )
        elif agg > amax:
            fix = (
                "the GPU had uncorrected memory errors earlier in its life: check `nvidia-smi -q -d "
                f"ROW_REMAPPER,PAGE_RETIREMENT -i {g.index}`; if they were repaired and none are new, raise "
                "the threshold ecc_uncorrected_aggregate_max for this GPU"
            )
        else:
            fix = ""
        return ctx.result(
            "gpu.ecc_uncorrected",
            Status.FAIL if fix else Status.PASS,
            f"{g.label}: {vol} uncorrected ECC error(s) since the driver loaded, {agg} in the GPU's life",
            subject=g.subject,
            value=max(vol, agg),
            threshold=f"volatile <= {vmax:g} and aggregate <= {amax:g}",
            fix=fix,
        )

    return _each_gpu(ctx, "gpu.ecc_uncorrected", "uncorrected ECC counters (ECC off?)", one)


@check("gpu.ecc_corrected", "corrected (single-bit) ECC errors over the GPU's life; > 1000 → warn")
def ecc_corrected(ctx: Context) -> list[CheckResult]:
    limit = ctx.limit("ecc_corrected_warn", 1000)

    def one(nv: Any, g: _Gpu) -> CheckResult:
        agg = int(nv.nvmlDeviceGetTotalEccErrors(g.handle, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_AGGREGATE_ECC))
        ok = agg <= limit
        return ctx.result(
            "gpu.ecc_corrected",
            Status.PASS if ok else Status.WARN,
            f"{g.label}: {agg} corrected ECC error(s) in the GPU's life",
            subject=g.subject,
            value=agg,
            threshold=f"<= {limit:g} (aggregate)",
            fix=""
            if ok
            else "the GPU's memory corrects many errors: watch gpu.row_remap and gpu.ecc_uncorrected, plan an RMA "
            "if the count keeps growing",
        )

    return _each_gpu(ctx, "gpu.ecc_corrected", "corrected ECC counters (ECC off?)", one)


@check(
    "gpu.row_remap",
    "remapped rows (Ampere and later): a pending remap or a remap failure → fail, > 8 rows remapped for "
    "uncorrectable errors → warn; retired pages on older GPUs: pending → fail, > 10 → warn, >= 60 → fail",
)
def row_remap(ctx: Context) -> list[CheckResult]:
    unc_warn = ctx.limit("row_remap_uncorrectable_warn", 8)
    pages_warn = ctx.limit("retired_pages_warn", 10)
    pages_fail = ctx.limit("retired_pages_fail", 60)  # NVIDIA's RMA guidance for page retirement
    name = "gpu.row_remap"

    def one(nv: Any, g: _Gpu) -> CheckResult:
        try:
            corr, unc, pending, failure = nv.nvmlDeviceGetRemappedRows(g.handle)
        except nv.NVMLError as e:
            if e.value not in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_FUNCTION_NOT_FOUND):
                raise
            return _retired_pages(nv, g)
        found = f"{g.label}: {corr} row(s) remapped for correctable, {unc} for uncorrectable errors"
        threshold = f"no pending remap, no remap failure, <= {unc_warn:g} uncorrectable remaps"
        if failure:
            return ctx.result(
                name,
                Status.FAIL,
                f"{found}; row remapping FAILED (a bank has no spare row left)",
                subject=g.subject,
                value=unc,
                threshold=threshold,
                fix="the GPU's memory can no longer be repaired: drain the node and RMA the GPU",
            )
        if pending:
            return ctx.result(
                name,
                Status.FAIL,
                f"{found}; a remap is PENDING (the faulty row is in use until the GPU resets)",
                subject=g.subject,
                value=unc,
                threshold=threshold,
                fix=f"reset the GPU to apply it: `nvidia-smi -r -i {g.index}` (no process on it) or reboot the node",
            )
        ok = unc <= unc_warn
        return ctx.result(
            name,
            Status.PASS if ok else Status.WARN,
            f"{found}; none pending",
            subject=g.subject,
            value=unc,
            threshold=threshold,
            fix="" if ok else "many rows repaired after uncorrectable errors: the memory is degrading, plan an RMA",
        )

    def _retired_pages(nv: Any, g: _Gpu) -> CheckResult:
        try:
            sbe = len(
                nv.nvmlDeviceGetRetiredPages(g.handle, nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
            )
            dbe = len(nv.nvmlDeviceGetRetiredPages(g.handle, nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR))
        except nv.NVMLError as e:
            if e.value not in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_FUNCTION_NOT_FOUND):
                raise
            return ctx.result(
                name,
                Status.SKIP,
                f"skipped: {g.label} reports neither remapped rows nor retired pages",
                subject=g.subject,
            )
        try:
            pending = int(nv.nvmlDeviceGetRetiredPagesPendingStatus(g.handle))
        except nv.NVMLError:
            pending = 0
        total = sbe + dbe
        found = f"{g.label}: {total} page(s) retired ({sbe} for single-bit, {dbe} for double-bit errors)"
        threshold = f"none pending, <= {pages_warn:g} retired (fail >= {pages_fail:g})"
        if pending:
            status, found = Status.FAIL, found + "; a retirement is PENDING"
            fix = f"reset the GPU to retire the page: `nvidia-smi -r -i {g.index}` or reboot the node"
        elif total >= pages_fail:
            status, fix = Status.FAIL, "the GPU has retired about all the pages it can: drain the node and RMA it"
        elif total > pages_warn:
            status, fix = Status.WARN, "many pages retired: the memory is degrading, plan an RMA"
        else:
            status, fix = Status.PASS, ""
        return ctx.result(name, status, found, subject=g.subject, value=total, threshold=threshold, fix=fix)

    return _each_gpu(ctx, name, "remapped rows", one)


# --- XIDs -------------------------------------------------------------------------------------
def _nvml_xids(nv: Any, gpus: list[_Gpu], wait_s: float) -> tuple[dict[int, list[int]], list[int], str]:
    """XID critical errors NVML delivers within ``wait_s``: by GPU index, unplaced, and a note."""
    by_gpu: dict[int, list[int]] = {}
    unplaced: list[int] = []
    try:
        es = nv.nvmlEventSetCreate()
    except nv.NVMLError as e:
        return by_gpu, unplaced, f"no NVML event set ({e})"
    note = ""
    try:
        by_uuid = {}
        for g in gpus:
            if g.handle is None or g.open_error is not None or g.lost_by:
                continue
            try:
                want = int(nv.nvmlDeviceGetSupportedEventTypes(g.handle)) & nv.nvmlEventTypeXidCriticalError
                if want:
                    nv.nvmlDeviceRegisterEvents(g.handle, want, es)
                    by_uuid[g.uuid] = g.index
            except nv.NVMLError:
                continue
        if not by_uuid:
            return by_gpu, unplaced, "NVML delivers no XID events on these GPUs"
        deadline = time.monotonic() + wait_s
        for _ in range(1000):  # bounded: an XID storm cannot stall the check
            left_ms = max(0, int((deadline - time.monotonic()) * 1000))
            try:
                data = nv.nvmlEventSetWait_v2(es, left_ms)
            except nv.NVMLError as e:
                if e.value != nv.NVML_ERROR_TIMEOUT:
                    note = f"reading NVML events failed ({e})"
                break
            if not int(data.eventType) & nv.nvmlEventTypeXidCriticalError:
                continue
            try:
                index: int | None = by_uuid.get(_text(nv.nvmlDeviceGetUUID(data.device)))
            except nv.NVMLError:
                index = None
            if index is None:
                unplaced.append(int(data.eventData))
            else:
                by_gpu.setdefault(index, []).append(int(data.eventData))
    finally:
        try:
            nv.nvmlEventSetFree(es)
        except nv.NVMLError:
            pass
    return by_gpu, unplaced, note or f"NVML events over {wait_s:g} s"


def _read_kmsg(max_s: float = 0.5) -> tuple[list[str] | None, str]:
    """The NVRM Xid lines of the kernel log from /dev/kmsg, read without blocking."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        return None, f"/dev/kmsg: {e.strerror or e}"
    lines: list[str] = []
    t_end = time.monotonic() + max_s
    try:
        for _ in range(1_000_000):
            try:
                rec = os.read(fd, 8192)
            except BlockingIOError:  # the end of the buffer
                break
            except BrokenPipeError:  # a record was overwritten while reading: carry on with the next
                continue
            if not rec or time.monotonic() > t_end:
                break
            if b"NVRM: Xid" in rec:
                lines.append(rec.decode(errors="replace").partition(";")[2].splitlines()[0])
    except OSError as e:
        return None, f"/dev/kmsg: {e.strerror or e}"
    finally:
        os.close(fd)
    return lines, "/dev/kmsg"


def _read_dmesg() -> tuple[list[str] | None, str]:
    exe = shutil.which("dmesg")
    if exe is None:
        return None, "no dmesg"
    try:
        p = subprocess.run([exe], capture_output=True, text=True, errors="replace", timeout=2.0, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"dmesg: {e}"
    if p.returncode != 0:
        return None, f"dmesg: {p.stderr.strip() or f'exit status {p.returncode}'}"
    return [ln for ln in p.stdout.splitlines() if "NVRM: Xid" in ln], "dmesg"


def _kernel_log(nv: Any) -> tuple[list[str] | None, str]:
    """(lines, source) or (None, why not). A fake NVML brings its own log: the real one is the real GPUs'."""
    fake = getattr(nv, "kernel_log", None)
    if isinstance(fake, list):
        return [ln for ln in fake if "NVRM: Xid" in ln], "the fake machine's kernel log"
    lines, why = _read_kmsg()
    if lines is not None:
        return lines, why
    lines, why2 = _read_dmesg()
    return (lines, why2) if lines is not None else (None, f"{why}; {why2}")


def _describe(xids: list[int]) -> str:
    parts = []
    for x in sorted(set(xids)):
        n = xids.count(x)
        parts.append(f"Xid {x}" + (f" ({XID_MEANING[x]})" if x in XID_MEANING else "") + (f" x{n}" if n > 1 else ""))
    return ", ".join(parts)


@check(
    "gpu.xid",
    "XID errors: NVML's critical-error events (waiting 0.2 s) and the kernel log's NVRM Xid lines since boot; "
    "any → fail",
)
def xid(ctx: Context) -> list[CheckResult]:
    name = "gpu.xid"
    st = _open(ctx)
    if st.reason:
        return [_no_gpu(ctx, name, st)]
    nv = st.nv
    by_gpu, unplaced, nvml_note = _nvml_xids(nv, st.gpus, ctx.limit("xid_wait_s", 0.2))
    sources = {i: ["NVML"] for i in by_gpu}
    lines, log_src = _kernel_log(nv)
    ignored = 0
    if lines is not None:
        pci: dict[tuple[int, int, int], int] = {}
        for g in st.gpus:
            if g.handle is None or g.open_error is not None:
                continue
            try:
                info = nv.nvmlDeviceGetPciInfo(g.handle)
                pci[(int(info.domain), int(info.bus), int(info.device))] = g.index
            except nv.NVMLError:
                continue
        all_placed = len(pci) == len(st.gpus)
        for ln in lines:
            m = _XID_LINE.search(ln)
            if not m:
                continue
            where = (int(m.group(1), 16), int(m.group(2), 16), int(m.group(3), 16))
            x = int(m.group(4))
            if where in pci:
                by_gpu.setdefault(pci[where], []).append(x)
                if "kernel log" not in sources.setdefault(pci[where], []):
                    sources[pci[where]].append("kernel log")
            elif all_placed:
                ignored += 1  # a GPU this node does not show us (another container's)
            else:
                unplaced.append(x)
        log_note = f"kernel log since boot ({log_src})"
    else:
        log_note = f"kernel log not readable ({log_src}): only XIDs during the check are seen"
    seen = f"{nvml_note}; {log_note}" + (f"; {ignored} Xid line(s) of GPUs not visible here ignored" if ignored else "")
    threshold = "no Xid since boot"

    def fix(xids: list[int], index: int | None) -> str:
        reset = f"`nvidia-smi -r -i {index}`" if index is not None else "`nvidia-smi -r`"
        if any(x in HARDWARE_XIDS for x in xids):
            return f"a hardware error: drain the node, reset the GPU ({reset}) or reboot; RMA it if it recurs"
        return (
            "an application or driver error since boot: read `dmesg | grep -i xid`; reboot (or reset the GPU, "
            f"{reset}) to clear it and check the GPU passes again"
        )

    out: list[CheckResult] = []
    for g in st.gpus:
        got = by_gpu.get(g.index, [])
        if got:
            out.append(
                ctx.result(
                    name,
                    Status.FAIL,
                    f"{g.label}: {_describe(got)}; from {' and '.join(sources.get(g.index, ['NVML']))}",
                    subject=g.subject,
                    value=len(got),
                    threshold=threshold,
                    fix=fix(got, g.index),
                )
            )
        elif g.lost_by or g.open_error is not None:
            out.append(
                ctx.result(name, Status.SKIP, f"skipped: {g.label} is lost; no Xid logged for it", subject=g.subject)
            )
        else:
            out.append(
                ctx.result(
                    name, Status.PASS, f"{g.label}: no Xid; {seen}", subject=g.subject, value=0, threshold=threshold
                )
            )
    if unplaced:
        out.append(
            ctx.result(
                name,
                Status.FAIL,
                f"{_describe(unplaced)} on a GPU NVML cannot place; {seen}",
                value=len(unplaced),
                threshold=threshold,
                fix=fix(unplaced, None),
            )
        )
    return out


# --- clocks, temperature, links ---------------------------------------------------------------
@check("gpu.temperature", "GPU temperature before the job; > 85 C → warn, > 95 C → fail")
def temperature(ctx: Context) -> list[CheckResult]:
    warn, fail = ctx.limit("temp_warn_c", 85), ctx.limit("temp_fail_c", 95)

    def one(nv: Any, g: _Gpu) -> CheckResult:
        t = int(nv.nvmlDeviceGetTemperature(g.handle, nv.NVML_TEMPERATURE_GPU))
        status = Status.FAIL if t > fail else Status.WARN if t > warn else Status.PASS
        return ctx.result(
            "gpu.temperature",
            status,
            f"{g.label}: {t} C",
            subject=g.subject,
            value=t,
            unit="C",
            threshold=f"<= {warn:g} C (fail > {fail:g} C)",
            fix=""
            if status is Status.PASS
            else "the GPU is hot before the job starts: check fans, airflow and cooling "
            f"(`nvidia-smi -q -d TEMPERATURE,PERFORMANCE -i {g.index}`) and what else runs on it",
        )

    return _each_gpu(ctx, "gpu.temperature", "its temperature", one)


@check(
    "gpu.throttle",
    "clock event (throttle) reasons: HW slowdown, HW thermal, HW power brake → fail; SW thermal, SW power cap, "
    "board limit, reliability → warn; idle, application clocks, sync boost → fine",
)
def throttle(ctx: Context) -> list[CheckResult]:
    def one(nv: Any, g: _Gpu) -> CheckResult:
        reasons = int(
            _call(nv, ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"), g.handle)
        )
        bad = [n for b, n in _REASONS_FAIL.items() if reasons & b]
        marginal = [n for b, n in _REASONS_WARN.items() if reasons & b]
        fine = [n for b, n in _REASONS_OK.items() if reasons & b]
        known = sum(_REASONS_FAIL) + sum(_REASONS_WARN) + sum(_REASONS_OK)
        other = reasons & ~known
        try:
            clock = f", SM clock {int(nv.nvmlDeviceGetClockInfo(g.handle, nv.NVML_CLOCK_SM))} MHz"
        except nv.NVMLError:
            clock = ""
        named = bad + marginal + fine + ([f"unknown bits 0x{other:x}"] if other else [])
        msg = f"{g.label}: clock event reasons 0x{reasons:x} ({', '.join(named) or 'none'}){clock}"
        if bad:
            status = Status.FAIL
            fix = (
                "the hardware slows the GPU (overheating, a power supply or power-brake signal): check cooling and "
                f"PSUs, `nvidia-smi -q -d PERFORMANCE -i {g.index}`; drain the node if it stays"
            )
        elif marginal:
            status = Status.WARN
            fix = (
                "the driver caps the clocks before the job starts: check the temperature and the power limit "
                f"(`nvidia-smi -q -d POWER,TEMPERATURE -i {g.index}`; a lowered limit: `nvidia-smi -pl`)"
            )
        else:
            status, fix = Status.PASS, ""
        return ctx.result(
            "gpu.throttle",
            status,
            msg,
            subject=g.subject,
            value=reasons,
            threshold="no HW slowdown/thermal/power brake (fail), no SW thermal/power cap (warn)",
            fix=fix,
        )

    return _each_gpu(ctx, "gpu.throttle", "clock event reasons", one)


@check(
    "gpu.pcie_link",
    "PCIe link width and generation against the maximum: narrower → fail; a lower generation → warn when the "
    "GPU is busy (idle GPUs lower it to save power: pass)",
)
def pcie_link(ctx: Context) -> list[CheckResult]:
    busy_pct = ctx.limit("pcie_busy_util_pct", 10)

    def one(nv: Any, g: _Gpu) -> CheckResult:
        cw, mw = int(nv.nvmlDeviceGetCurrPcieLinkWidth(g.handle)), int(nv.nvmlDeviceGetMaxPcieLinkWidth(g.handle))
        cg, mg = (
            int(nv.nvmlDeviceGetCurrPcieLinkGeneration(g.handle)),
            int(nv.nvmlDeviceGetMaxPcieLinkGeneration(g.handle)),
        )
        msg = f"{g.label}: PCIe x{cw} of x{mw}, gen {cg} of {mg}"
        threshold = f"width == x{mw}; gen == {mg} when busy (util >= {busy_pct:g} %)"
        if cw < mw:
            return ctx.result(
                "gpu.pcie_link",
                Status.FAIL,
                msg,
                subject=g.subject,
                value=cw,
                unit="lanes",
                threshold=threshold,
                fix="the link trained narrow (host<->GPU and GPUDirect bandwidth cut): reseat the GPU or riser, "
                "check the slot and the BIOS PCIe settings; drain the node meanwhile",
            )
        status, fix = Status.PASS, ""
        if cg < mg:
            try:
                util = int(nv.nvmlDeviceGetUtilizationRates(g.handle).gpu)
            except nv.NVMLError:
                util = 0
            if util >= busy_pct:
                status = Status.WARN
                msg += f" while {util} % busy"
                fix = "the link runs below its generation under load: reseat the GPU, check the BIOS PCIe speed setting"
            else:
                msg += " (idle: GPUs lower the link speed when idle)"
        return ctx.result(
            "gpu.pcie_link", status, msg, subject=g.subject, value=cw, unit="lanes", threshold=threshold, fix=fix
        )

    return _each_gpu(ctx, "gpu.pcie_link", "its PCIe link", one)


@check(
    "gpu.nvlink",
    "NVLink state per link: a link down while others are up (on this GPU or the node's others) → fail; "
    "every link of every GPU down → warn; no NVLink → skip",
)
def nvlink(ctx: Context) -> list[CheckResult]:
    name = "gpu.nvlink"
    states: dict[int, dict[int, int]] = {}

    def read(nv: Any, g: _Gpu) -> list[CheckResult]:
        got: dict[int, int] = {}
        for link in range(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))):
            try:
                got[link] = int(nv.nvmlDeviceGetNvLinkState(g.handle, link))
            except nv.NVMLError as e:
                if e.value == nv.NVML_ERROR_GPU_IS_LOST:
                    raise
        states[g.index] = got  # {} : no NVLink on this GPU
        return []

    out = _each_gpu(ctx, name, "NVLink state", read)
    any_up = any(v for got in states.values() for v in got.values())
    all_down_ok = ctx.limit("nvlink_all_inactive_ok", 0) > 0
    for g in _open(ctx).gpus:
        if g.index not in states:
            continue
        got = states[g.index]
        up = [k for k, v in got.items() if v]
        down = [k for k, v in got.items() if not v]
        threshold = "every link active"
        if not got:
            out.append(ctx.result(name, Status.SKIP, f"skipped: {g.label} has no NVLink", subject=g.subject))
        elif not down:
            out.append(
                ctx.result(
                    name,
                    Status.PASS,
                    f"{g.label}: {len(up)} NVLink(s) active",
                    subject=g.subject,
                    value=len(up),
                    threshold=threshold,
                )
            )
        elif up or any_up:
            out.append(
                ctx.result(
                    name,
                    Status.FAIL,
                    f"{g.label}: NVLink(s) {', '.join(map(str, down))} inactive, {len(up)} active"
                    + ("" if up else " (other GPUs' links are up)"),
                    subject=g.subject,
                    value=len(up),
                    threshold=threshold,
                    fix=f"`nvidia-smi nvlink -s -i {g.index}`; reset the GPU or reboot; if the link stays down the "
                    "GPU, bridge or NVSwitch baseboard needs service: drain the node",
                )
            )
        else:
            out.append(
                ctx.result(
                    name,
                    Status.PASS if all_down_ok else Status.WARN,
                    f"{g.label}: all {len(down)} NVLink(s) inactive, as on every GPU here",
                    subject=g.subject,
                    value=0,
                    threshold=threshold + ("" if not all_down_ok else " (all inactive accepted)"),
                    fix=""
                    if all_down_ok
                    else "on NVSwitch systems (HGX/DGX) start the fabric manager "
                    "(`systemctl start nvidia-fabricmanager`); PCIe GPUs without an NVLink bridge show this: "
                    "set the threshold nvlink_all_inactive_ok=1",
                )
            )
    return out


# --- node state -------------------------------------------------------------------------------
@check("gpu.persistence_mode", "persistence mode on (the driver keeps the GPUs initialised); off → warn")
def persistence_mode(ctx: Context) -> list[CheckResult]:
    def one(nv: Any, g: _Gpu) -> CheckResult:
        on = int(nv.nvmlDeviceGetPersistenceMode(g.handle)) == nv.NVML_FEATURE_ENABLED
        return ctx.result(
            "gpu.persistence_mode",
            Status.PASS if on else Status.WARN,
            f"{g.label}: persistence mode {'on' if on else 'off'}",
            subject=g.subject,
            threshold="enabled",
            fix=""
            if on
            else "enable it: `sudo nvidia-smi -pm 1` (or run nvidia-persistenced): without it every CUDA start "
            "re-initialises the GPU (slow, and settings such as clocks are lost)",
        )

    return _each_gpu(ctx, "gpu.persistence_mode", "persistence mode", one)


@check("gpu.processes", "compute processes already on the GPU before the job starts; any → warn")
def processes(ctx: Context) -> list[CheckResult]:
    me = os.getpid()

    def one(nv: Any, g: _Gpu) -> CheckResult:
        procs = [p for p in nv.nvmlDeviceGetComputeRunningProcesses(g.handle) if int(p.pid) != me]
        if not procs:
            return ctx.result(
                "gpu.processes",
                Status.PASS,
                f"{g.label}: no compute process",
                subject=g.subject,
                value=0,
                threshold="no compute process before the job",
            )
        shown = []
        for p in procs[:8]:
            used = getattr(p, "usedGpuMemory", None)
            shown.append(f"pid {int(p.pid)} ({used / GIB:.1f} GiB)" if used is not None else f"pid {int(p.pid)}")
        more = f" and {len(procs) - 8} more" if len(procs) > 8 else ""
        return ctx.result(
            "gpu.processes",
            Status.WARN,
            f"{g.label}: {len(procs)} compute process(es) already running: {', '.join(shown)}{more}",
            subject=g.subject,
            value=len(procs),
            threshold="no compute process before the job",
            fix="another process holds the GPU (memory and compute shared with the job): find it with `nvidia-smi` "
            "and stop it (a leftover of an earlier job?)",
        )

    return _each_gpu(ctx, "gpu.processes", "its processes", one)


# --- compute ----------------------------------------------------------------------------------
def _burn(torch: Any, device: int, seconds: float) -> tuple[float, str, int, int, float, bool]:
    """(TFLOPS, dtype, n, iterations, seconds, finite) of ``seconds`` of n x n matmuls on ``device``."""
    n = 8192
    dev = torch.device("cuda", device)
    with torch.cuda.device(dev):
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        gen = torch.Generator(device=dev).manual_seed(0)
        a = torch.randn(n, n, device=dev, dtype=dtype, generator=gen)
        b = torch.randn(n, n, device=dev, dtype=dtype, generator=gen)
        c = torch.empty(n, n, device=dev, dtype=dtype)
        t_warm = time.perf_counter() + min(0.25, seconds / 4)  # clocks ramp up from idle, cuBLAS picks kernels
        while time.perf_counter() < t_warm:
            torch.matmul(a, b, out=c)
            torch.cuda.synchronize(dev)
        iters, t0 = 0, time.perf_counter()
        t_end = t0 + seconds
        while True:
            for _ in range(4):
                torch.matmul(a, b, out=c)
            torch.cuda.synchronize(dev)
            iters += 4
            if time.perf_counter() >= t_end:
                break
        dt = time.perf_counter() - t0
        finite = bool(torch.isfinite(c).all().item())
        del a, b, c
        torch.cuda.empty_cache()
    return 2.0 * n**3 * iters / dt / 1e12, str(dtype).removeprefix("torch."), n, iters, dt, finite


def _bare_uuid(uuid: str) -> str:
    """NVML's ``GPU-8b8c...`` and CUDA's ``8b8c...`` alike."""
    return uuid.strip().lower().removeprefix("gpu-")


@check(
    "gpu.compute_burn", "bf16/fp16 matmul (torch) per GPU for the burn time; TFLOPS compared with the fleet's median"
)
def compute_burn(ctx: Context) -> list[CheckResult]:
    name = "gpu.compute_burn"
    try:
        import torch
    except ImportError:
        return [ctx.result(name, Status.SKIP, "skipped: no GPU (CUDA not available: torch is not installed)")]
    if not torch.cuda.is_available():
        return [ctx.result(name, Status.SKIP, "skipped: no GPU (CUDA not available)")]
    st = _open(ctx)
    by_uuid = {_bare_uuid(g.uuid): g for g in st.gpus if g.uuid}
    facts = ctx.facts.setdefault("gpu_tflops", {})
    out = []
    for i in range(torch.cuda.device_count()):
        label, subject = f"gpu{i}", f"gpu{i}"
        try:
            props = torch.cuda.get_device_properties(i)
            g = by_uuid.get(_bare_uuid(str(props.uuid))) if getattr(props, "uuid", None) is not None else None
            if g is not None:  # name it as NVML does (CUDA_VISIBLE_DEVICES and CUDA's order renumber GPUs)
                label, subject = f"{g.label} {props.name}", g.subject
            tflops, dtype, n, iters, dt, finite = _burn(torch, i, max(0.05, ctx.burn_s))
        except Exception as e:  # a CUDA error on one GPU is that GPU's failure, not the check's
            out.append(
                ctx.result(
                    name,
                    Status.FAIL,
                    f"{label}: the matmul burn failed: {type(e).__name__}: {e}",
                    subject=subject,
                    threshold="runs and gives finite results",
                    fix="CUDA cannot compute on this GPU: see gpu.xid and the kernel log; reset the GPU or reboot, "
                    "drain the node if it stays",
                )
            )
            continue
        if not finite:
            out.append(
                ctx.result(
                    name,
                    Status.FAIL,
                    f"{label}: the matmul gave non-finite values (random inputs cannot overflow)",
                    subject=subject,
                    value=round(tflops, 2),
                    unit="TFLOPS",
                    threshold="finite results",
                    fix="the GPU computes wrong results: drain the node, run NVIDIA's diagnostics (`dcgmi diag -r 3`)",
                )
            )
            continue
        facts[subject] = round(tflops, 2)
        out.append(
            ctx.result(
                name,
                Status.PASS,
                f"{label}: {tflops:.1f} TFLOPS ({dtype} {n}x{n} matmul, {iters} in {dt:.2f} s)",
                subject=subject,
                value=round(tflops, 2),
                unit="TFLOPS",
                threshold="compared with the fleet's median (fleet compute)",
            )
        )
    return out
