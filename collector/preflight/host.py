"""Host checks: CPUs, load, steal, memory, OOM kills since boot, the CPU frequency governor, and a
short CPU matmul burn (GFLOPS, compared with the fleet's median by the coordinator)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time
from pathlib import Path

from ranklens.collector.preflight.api import CheckResult, Context, Status, check

__all__: list[str] = []

GIB = 1 << 30


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts:
            out[key] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    return out


@check("host.cpus", "CPUs this process may use (affinity) against the CPUs online; fewer usable than online → warn")
def cpus(ctx: Context) -> list[CheckResult]:
    online = os.cpu_count() or 0
    usable = len(os.sched_getaffinity(0))
    ctx.facts["cpus"] = usable
    try:  # nodes with one boot id share a machine (namespaces, containers): fleet.compute needs to know
        ctx.facts["boot_id"] = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        pass
    status = Status.PASS if usable >= online else Status.WARN
    return [
        ctx.result(
            "host.cpus",
            status,
            f"{usable} of {online} online CPUs usable",
            value=usable,
            threshold=f"== {online} (online)",
            fix="" if status is Status.PASS else "the job's cgroup or affinity mask hides CPUs: check cpuset / taskset",
        )
    ]


@check("host.load", "1-minute load per usable CPU before the job starts; > 0.5 → warn (something else runs here)")
def load(ctx: Context) -> list[CheckResult]:
    one = os.getloadavg()[0]
    per_cpu = one / max(1, len(os.sched_getaffinity(0)))
    limit = ctx.limit("load_per_cpu", 0.5)
    ok = per_cpu <= limit
    return [
        ctx.result(
            "host.load",
            Status.PASS if ok else Status.WARN,
            f"load {one:.2f} ({per_cpu:.2f} per CPU)",
            value=round(per_cpu, 3),
            threshold=f"<= {limit:g} per CPU",
            fix="" if ok else "another workload is running on this node: find it with `top` before starting the job",
        )
    ]


def _cpu_times() -> list[int]:
    return [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]


@check("host.cpu_steal", "CPU time stolen by the hypervisor over 0.3 s; > 5 % → warn, > 20 % → fail")
def cpu_steal(ctx: Context) -> list[CheckResult]:
    a = _cpu_times()
    time.sleep(0.3)
    b = _cpu_times()
    d = [y - x for x, y in zip(a, b)]
    total = sum(d[:8]) or 1  # user nice system idle iowait irq softirq steal
    steal = 100.0 * (d[7] if len(d) > 7 else 0) / total
    warn, fail = ctx.limit("steal_warn_pct", 5.0), ctx.limit("steal_fail_pct", 20.0)
    status = Status.FAIL if steal > fail else Status.WARN if steal > warn else Status.PASS
    return [
        ctx.result(
            "host.cpu_steal",
            status,
            f"{steal:.1f} % of CPU time stolen by the hypervisor",
            value=round(steal, 2),
            unit="%",
            threshold=f"<= {warn:g} % (fail > {fail:g} %)",
            fix="" if status is Status.PASS else "the VM's host is oversubscribed: move the job off this instance",
        )
    ]


@check("host.memory", "available host memory; < 10 % of total or < 4 GiB → warn, < 1 GiB → fail")
def memory(ctx: Context) -> list[CheckResult]:
    m = _meminfo()
    avail, total = m.get("MemAvailable", 0), m.get("MemTotal", 0) or 1
    gib = avail / GIB
    warn = ctx.limit("memory_warn_gib", 4.0)
    fail = ctx.limit("memory_fail_gib", 1.0)
    status = Status.FAIL if gib < fail else Status.WARN if gib < warn or avail < 0.1 * total else Status.PASS
    return [
        ctx.result(
            "host.memory",
            status,
            f"{gib:.1f} GiB of {total / GIB:.1f} GiB available",
            value=round(gib, 2),
            unit="GiB",
            threshold=f">= {warn:g} GiB and >= 10 % (fail < {fail:g} GiB)",
            fix="" if status is Status.PASS else "free memory (leftover processes? page cache pinned by tmpfs?)",
        )
    ]


@check("host.oom_kills", "kernel OOM kills since boot (/proc/vmstat oom_kill); any → warn")
def oom_kills(ctx: Context) -> list[CheckResult]:
    n = -1
    for line in Path("/proc/vmstat").read_text().splitlines():
        if line.startswith("oom_kill "):
            n = int(line.split()[1])
    if n < 0:
        return [ctx.result("host.oom_kills", Status.SKIP, "skipped: this kernel does not count OOM kills")]
    status = Status.PASS if n == 0 else Status.WARN
    return [
        ctx.result(
            "host.oom_kills",
            status,
            f"{n} OOM kill(s) since boot",
            value=n,
            threshold="== 0",
            fix="" if n == 0 else "see `dmesg | grep -i 'killed process'`: the node ran out of memory before",
        )
    ]


@check(
    "host.cpu_governor", "CPU frequency governor; anything but 'performance' → warn (skipped on VMs without cpufreq)"
)
def cpu_governor(ctx: Context) -> list[CheckResult]:
    files = sorted(Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cpufreq/scaling_governor"))
    if not files:
        return [ctx.result("host.cpu_governor", Status.SKIP, "skipped: no cpufreq on this node (a VM?)")]
    govs = {f.read_text().strip() for f in files}
    ok = govs == {"performance"}
    return [
        ctx.result(
            "host.cpu_governor",
            Status.PASS if ok else Status.WARN,
            f"governor(s): {', '.join(sorted(govs))}",
            threshold="performance",
            fix="" if ok else "cpupower frequency-set -g performance (input pipelines and NCCL proxies run on CPUs)",
        )
    ]


@check("host.cpu_burn", "float32 matmul (numpy) for the burn time; GFLOPS compared with the fleet's median")
def cpu_burn(ctx: Context) -> list[CheckResult]:
    import numpy as np

    n = 256
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = a.T.copy()
    a @ b  # warm-up
    t_end = time.perf_counter() + max(0.05, ctx.burn_s)
    t0 = time.perf_counter()
    iters = 0
    while time.perf_counter() < t_end:
        a @ b
        iters += 1
    dt = time.perf_counter() - t0
    gflops = 2.0 * n**3 * iters / dt / 1e9
    ctx.facts["cpu_gflops"] = round(gflops, 2)
    return [
        ctx.result(
            "host.cpu_burn",
            Status.PASS,
            f"{gflops:.1f} GFLOPS (float32 {n}x{n} matmul, {iters} in {dt:.2f} s)",
            value=round(gflops, 2),
            unit="GFLOPS",
            threshold="compared with the fleet's median (fleet.compute)",
        )
    ]


class _Timex(ctypes.Structure):
    # the head of struct timex (linux/timex.h); the kernel writes the rest into the padding
    _fields_ = [
        ("modes", ctypes.c_uint),
        ("offset", ctypes.c_long),
        ("freq", ctypes.c_long),
        ("maxerror", ctypes.c_long),
        ("esterror", ctypes.c_long),
        ("status", ctypes.c_int),
        ("_rest", ctypes.c_char * 256),
    ]


TIME_ERROR = 5  # adjtimex's answer when the clock is not synchronised
STA_UNSYNC = 0x0040


@check(
    "host.clock_sync",
    "the kernel's clock discipline (adjtimex, read only): not synchronised by NTP/PTP → warn "
    "(cross-node timelines and the fleet's clock offset depend on it)",
)
def clock_sync(ctx: Context) -> list[CheckResult]:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        tx = _Timex()
        state = libc.adjtimex(ctypes.byref(tx))
    except (OSError, AttributeError) as e:
        return [ctx.result("host.clock_sync", Status.SKIP, f"skipped: adjtimex not available ({e})")]
    if state < 0:
        return [ctx.result("host.clock_sync", Status.SKIP, f"skipped: adjtimex failed (errno {ctypes.get_errno()})")]
    unsync = state == TIME_ERROR or bool(tx.status & STA_UNSYNC)
    max_ms = tx.maxerror / 1000.0
    return [
        ctx.result(
            "host.clock_sync",
            Status.WARN if unsync else Status.PASS,
            ("clock not synchronised" if unsync else "clock synchronised") + f" (max error {max_ms:.0f} ms)",
            value=round(max_ms, 3),
            unit="ms",
            threshold="synchronised (NTP/chrony/PTP)",
            fix="enable chrony or systemd-timesyncd (or PTP) on this node" if unsync else "",
        )
    ]


@check("host.swap", "swap in use; > 1 GiB → warn (a training process paged out stalls every rank)")
def swap(ctx: Context) -> list[CheckResult]:
    m = _meminfo()
    total, free = m.get("SwapTotal", 0), m.get("SwapFree", 0)
    used = (total - free) / GIB
    limit = ctx.limit("swap_used_warn_gib", 1.0)
    ok = used <= limit
    return [
        ctx.result(
            "host.swap",
            Status.PASS if ok else Status.WARN,
            f"{used:.1f} GiB of {total / GIB:.1f} GiB swap in use" if total else "no swap configured",
            value=round(used, 3),
            unit="GiB",
            threshold=f"<= {limit:g} GiB used",
            fix=""
            if ok
            else "the node is short of memory or was: find the swapped processes (smem, /proc/*/status VmSwap)",
        )
    ]
