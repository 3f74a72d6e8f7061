"""Environment checks: the variables and limits a job inherits from this node (NCCL_* names and
values, the socket interfaces gloo and NCCL are told to use, CUDA_VISIBLE_DEVICES, open-file and
locked-memory limits, whether this node's name resolves to an address other nodes can reach)."""

from __future__ import annotations

import difflib
import os
import resource
import socket
from pathlib import Path

from ranklens.collector.preflight.api import CheckResult, Context, Status, check

__all__ = ["NCCL_VARIABLES"]

# NCCL's documented environment variables (docs.nvidia.com/deeplearning/nccl, "Environment
# Variables", 2.18-2.27) and a few long-standing undocumented ones. A set name that is not here
# but is one edit away from one is most likely a typo, which NCCL ignores without a word.
NCCL_VARIABLES = frozenset(
    [
        "NCCL_ALGO",
        "NCCL_ALLOC_P2P_NET_LL_BUFFERS",
        "NCCL_BUFFSIZE",
        "NCCL_CGA_CLUSTER_SIZE",
        "NCCL_CHECKS_DISABLE",
        "NCCL_CHECK_POINTERS",
        "NCCL_COLLNET_ENABLE",
        "NCCL_COLLNET_NODE_THRESHOLD",
        "NCCL_COMM_BLOCKING",
        "NCCL_COMM_ID",
        "NCCL_CONF_FILE",
        "NCCL_CROSS_NIC",
        "NCCL_CTA_POLICY",
        "NCCL_CUMEM_ENABLE",
        "NCCL_CUMEM_HOST_ENABLE",
        "NCCL_DEBUG",
        "NCCL_DEBUG_FILE",
        "NCCL_DEBUG_SUBSYS",
        "NCCL_DMABUF_ENABLE",
        "NCCL_GDRCOPY_ENABLE",
        "NCCL_GDRCOPY_FLUSH_ENABLE",
        "NCCL_GDRCOPY_SYNC_ENABLE",
        "NCCL_GRAPH_MIXING_SUPPORT",
        "NCCL_GRAPH_REGISTER",
        "NCCL_HOSTID",
        "NCCL_IB_ADAPTIVE_ROUTING",
        "NCCL_IB_ADDR_FAMILY",
        "NCCL_IB_ADDR_RANGE",
        "NCCL_IB_AR_THRESHOLD",
        "NCCL_IB_CUDA_SUPPORT",
        "NCCL_IB_DISABLE",
        "NCCL_IB_ECE_ENABLE",
        "NCCL_IB_FIFO_TC",
        "NCCL_IB_GID_INDEX",
        "NCCL_IB_HCA",
        "NCCL_IB_MERGE_NICS",
        "NCCL_IB_MERGE_VFS",
        "NCCL_IB_PCI_RELAXED_ORDERING",
        "NCCL_IB_QPS_PER_CONNECTION",
        "NCCL_IB_RETRY_CNT",
        "NCCL_IB_RETURN_ASYNC_EVENTS",
        "NCCL_IB_ROCE_VERSION_NUM",
        "NCCL_IB_SL",
        "NCCL_IB_SPLIT_DATA_ON_QPS",
        "NCCL_IB_TC",
        "NCCL_IB_TIMEOUT",
        "NCCL_IB_USE_INLINE",
        "NCCL_IGNORE_CPU_AFFINITY",
        "NCCL_IGNORE_DISABLED_P2P",
        "NCCL_LAUNCH_MODE",
        "NCCL_LEGACY_CUDA_REGISTER",
        "NCCL_LL128_BUFFSIZE",
        "NCCL_LL_BUFFSIZE",
        "NCCL_LL_THRESHOLD",
        "NCCL_LOCAL_REGISTER",
        "NCCL_MAX_CTAS",
        "NCCL_MAX_NCHANNELS",
        "NCCL_MAX_NRINGS",
        "NCCL_MAX_P2P_NCHANNELS",
        "NCCL_MIN_CTAS",
        "NCCL_MIN_NCHANNELS",
        "NCCL_MIN_NRINGS",
        "NCCL_MNNVL_ENABLE",
        "NCCL_NCHANNELS_PER_NET_PEER",
        "NCCL_NET",
        "NCCL_NET_DISABLE_INTRA",
        "NCCL_NET_FORCE_FLUSH",
        "NCCL_NET_GDR_LEVEL",
        "NCCL_NET_GDR_READ",
        "NCCL_NET_OVERHEAD",
        "NCCL_NET_PLUGIN",
        "NCCL_NET_SHARED_BUFFERS",
        "NCCL_NET_SHARED_COMMS",
        "NCCL_NSOCKS_PERTHREAD",
        "NCCL_NTHREADS",
        "NCCL_NVB_DISABLE",
        "NCCL_NVLS_CHUNKSIZE",
        "NCCL_NVLS_ENABLE",
        "NCCL_NVLS_NCHANNELS",
        "NCCL_NVLSTREE_MAX_CHUNKSIZE",
        "NCCL_OOB_NET_ENABLE",
        "NCCL_OOB_NET_IFNAME",
        "NCCL_P2P_DIRECT_DISABLE",
        "NCCL_P2P_DISABLE",
        "NCCL_P2P_LEVEL",
        "NCCL_P2P_LL_THRESHOLD",
        "NCCL_P2P_NET_CHUNKSIZE",
        "NCCL_P2P_NVL_CHUNKSIZE",
        "NCCL_P2P_PCI_CHUNKSIZE",
        "NCCL_P2P_PXN_LEVEL",
        "NCCL_P2P_READ_ENABLE",
        "NCCL_P2P_USE_CUDA_MEMCPY",
        "NCCL_PAT_ENABLE",
        "NCCL_PROFILER_PLUGIN",
        "NCCL_PROGRESS_APPENDOP_FREQ",
        "NCCL_PROTO",
        "NCCL_PROXY_APPEND_BATCH_SIZE",
        "NCCL_PROXY_DUMP_SIGNAL",
        "NCCL_PXN_DISABLE",
        "NCCL_RAS_ADDR",
        "NCCL_RAS_ENABLE",
        "NCCL_RAS_TIMEOUT_FACTOR",
        "NCCL_RUNTIME_CONNECT",
        "NCCL_SET_STACK_SIZE",
        "NCCL_SET_THREAD_NAME",
        "NCCL_SHM_DISABLE",
        "NCCL_SHM_LOCALITY",
        "NCCL_SHM_MEMCPY_MODE",
        "NCCL_SHM_USE_CUDA_MEMCPY",
        "NCCL_SINGLE_RING_THRESHOLD",
        "NCCL_SOCKET_FAMILY",
        "NCCL_SOCKET_IFNAME",
        "NCCL_SOCKET_NTHREADS",
        "NCCL_TOPO_DUMP_FILE",
        "NCCL_TOPO_DUMP_FILE_RANK",
        "NCCL_TOPO_FILE",
        "NCCL_TREE_THRESHOLD",
        "NCCL_TUNER_CONFIG_FILE",
        "NCCL_TUNER_PLUGIN",
        "NCCL_UID_STAGGER_RATE",
        "NCCL_UID_STAGGER_THRESHOLD",
        "NCCL_WARN_ENABLE_DEBUG_INFO",
        "NCCL_WIN_ENABLE",
        "NCCL_WORK_FIFO_BYTES",
        "NCCL_WORK_FIFO_DEPTH",
    ]
)

# PyTorch's own NCCL settings that were renamed TORCH_NCCL_* (the old names are deprecated, and
# ignored by recent releases)
TORCH_RENAMED = {
    "NCCL_ASYNC_ERROR_HANDLING": "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "NCCL_BLOCKING_WAIT": "TORCH_NCCL_BLOCKING_WAIT",
    "NCCL_DESYNC_DEBUG": "TORCH_NCCL_DESYNC_DEBUG",
    "NCCL_ENABLE_TIMING": "TORCH_NCCL_ENABLE_TIMING",
    "NCCL_ENABLE_MONITORING": "TORCH_NCCL_ENABLE_MONITORING",
    "NCCL_HEARTBEAT_TIMEOUT_SEC": "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC",
    "NCCL_TRACE_BUFFER_SIZE": "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "NCCL_AVOID_RECORD_STREAMS": "TORCH_NCCL_AVOID_RECORD_STREAMS",
}

# set to 1, these cost bandwidth on every collective (each is a debugging switch)
SLOW_SWITCHES = ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE", "NCCL_NVLS_ENABLE=0", "NCCL_CUMEM_ENABLE=0")


def _env(ctx: Context) -> dict[str, str]:
    return dict(ctx.cache.get("environ") or os.environ)


@check(
    "env.nccl_vars",
    "NCCL_* variables: a name one edit from a real one (a typo NCCL ignores), a deprecated PyTorch name, "
    "NCCL_DEBUG=INFO/TRACE (log volume) or a debugging switch left on → warn",
)
def nccl_vars(ctx: Context) -> list[CheckResult]:
    env = _env(ctx)
    names = sorted(k for k in env if k.startswith("NCCL_"))
    problems: list[str] = []
    fixes: list[str] = []
    for k in names:
        if k in TORCH_RENAMED:
            problems.append(f"{k} is PyTorch's old name")
            fixes.append(f"rename {k} to {TORCH_RENAMED[k]}")
        elif k not in NCCL_VARIABLES:
            close = difflib.get_close_matches(k, NCCL_VARIABLES, n=1, cutoff=0.85)
            if close:
                problems.append(f"{k} is not an NCCL variable (did you mean {close[0]}?)")
                fixes.append(f"rename {k} to {close[0]}")
    debug = env.get("NCCL_DEBUG", "").upper()
    if debug in ("INFO", "TRACE"):
        problems.append(f"NCCL_DEBUG={debug} logs every connection and (TRACE) every call")
        fixes.append("use NCCL_DEBUG=WARN for production runs")
    for sw in SLOW_SWITCHES:
        k, _, bad = sw.partition("=")
        if k in env and env[k].strip() == (bad or "1"):
            problems.append(f"{k}={env[k]} (a debugging switch that costs bandwidth)")
            fixes.append(f"unset {k} unless the job needs it")
    status = Status.WARN if problems else Status.PASS
    shown = ", ".join(names[:6]) + (" ..." if len(names) > 6 else "")
    return [
        ctx.result(
            "env.nccl_vars",
            status,
            "; ".join(problems) if problems else (f"{len(names)} NCCL_* set ({shown})" if names else "no NCCL_* set"),
            value=len(problems),
            threshold="no typos, deprecated names or debugging switches",
            fix="; ".join(fixes),
        )
    ]


def _interfaces() -> list[str]:
    try:
        return sorted(p.name for p in Path("/sys/class/net").iterdir())
    except OSError:
        return [name for _, name in socket.if_nameindex()]


def _ifname_matches(spec: str, interfaces: list[str]) -> tuple[list[str], list[str]]:
    """NCCL/gloo interface spec → (interfaces it selects, the spec's entries that match nothing).

    NCCL's syntax: comma-separated prefixes; ``=`` before the list: exact names; ``^``: exclude.
    gloo takes one exact name (or a comma list in recent PyTorch)."""
    spec = spec.strip()
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=")
    spec = spec.lstrip("=")
    entries = [e for e in spec.split(",") if e]
    unmatched = []
    selected: set[str] = set()
    for e in entries:
        hits = [i for i in interfaces if (i == e if exact else i.startswith(e))]
        if not hits:
            unmatched.append(e)
        selected.update(hits)
    if exclude:
        return [i for i in interfaces if i not in selected and i != "lo"], []
    return sorted(selected), unmatched


@check(
    "env.socket_ifname",
    "NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME / TP_SOCKET_IFNAME name interfaces this node has; "
    "none matches → fail (the job cannot bootstrap), some entries match nothing → warn",
)
def socket_ifname(ctx: Context) -> list[CheckResult]:
    env = _env(ctx)
    interfaces = _interfaces()
    out = []
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME"):
        if var not in env:
            continue
        selected, unmatched = _ifname_matches(env[var], interfaces)
        if not selected:
            status, msg = Status.FAIL, f"{var}={env[var]!r} matches no interface of this node"
        elif unmatched:
            status, msg = (
                Status.WARN,
                f"{var}={env[var]!r}: {', '.join(unmatched)} match nothing (uses {', '.join(selected)})",
            )
        else:
            status, msg = Status.PASS, f"{var}={env[var]!r} selects {', '.join(selected)}"
        out.append(
            ctx.result(
                "env.socket_ifname",
                status,
                msg,
                subject=var,
                threshold="matches an interface",
                fix="" if status is Status.PASS else f"this node has: {', '.join(interfaces)}; fix {var}",
            )
        )
    if not out:
        return [
            ctx.result("env.socket_ifname", Status.PASS, "no *_SOCKET_IFNAME set (the libraries pick an interface)")
        ]
    return out


@check(
    "env.cuda_visible_devices",
    "CUDA_VISIBLE_DEVICES parses (indices, GPU-/MIG- UUIDs), has no duplicates and shows as many GPUs as "
    "--gpus; empty (hides every GPU) or fewer than expected → fail",
)
def cuda_visible_devices(ctx: Context) -> list[CheckResult]:
    env = _env(ctx)
    if "CUDA_VISIBLE_DEVICES" not in env:
        return [ctx.result("env.cuda_visible_devices", Status.PASS, "CUDA_VISIBLE_DEVICES not set (every GPU visible)")]
    raw = env["CUDA_VISIBLE_DEVICES"]
    items = [x.strip() for x in raw.split(",") if x.strip()]
    bad = [x for x in items if not (x.isdigit() or x.startswith(("GPU-", "MIG-")))]
    dups = sorted({x for x in items if items.count(x) > 1})
    status, msg, fix = Status.PASS, f"CUDA_VISIBLE_DEVICES={raw!r}: {len(items)} GPU(s)", ""
    if not items:
        status, msg = Status.FAIL, "CUDA_VISIBLE_DEVICES is set but empty: every GPU is hidden"
        fix = "unset it or list the GPUs"
    elif bad or dups:
        status = Status.FAIL
        msg = f"CUDA_VISIBLE_DEVICES={raw!r}: " + "; ".join(
            ([f"not an index or UUID: {', '.join(bad)}"] if bad else [])
            + ([f"repeated: {', '.join(dups)}"] if dups else [])
        )
        fix = "CUDA stops at the first bad entry: list each GPU once, as an index or its UUID"
    elif ctx.gpus_expected > 0 and len(items) < ctx.gpus_expected:
        status = Status.FAIL
        msg += f", fewer than the {ctx.gpus_expected} expected"
        fix = "the job would see fewer GPUs than it plans ranks for"
    return [
        ctx.result(
            "env.cuda_visible_devices", status, msg, value=len(items), threshold="parses, no duplicates", fix=fix
        )
    ]


def _limit_text(v: int) -> str:
    return "unlimited" if v == resource.RLIM_INFINITY else str(v)


@check("env.ulimit_nofile", "open-file limit (soft); < 65536 → warn (NCCL, gloo and dataloader workers each hold many)")
def ulimit_nofile(ctx: Context) -> list[CheckResult]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = int(ctx.limit("nofile_min", 65536))
    ok = soft == resource.RLIM_INFINITY or soft >= want
    return [
        ctx.result(
            "env.ulimit_nofile",
            Status.PASS if ok else Status.WARN,
            f"open files: soft {_limit_text(soft)}, hard {_limit_text(hard)}",
            value=float("inf") if soft == resource.RLIM_INFINITY else soft,
            threshold=f">= {want}",
            fix=""
            if ok
            else f"raise it (ulimit -n {max(want, hard if hard != resource.RLIM_INFINITY else want)}; "
            "limits.conf / the container runtime's --ulimit nofile)",
        )
    ]


def _rdma_devices() -> list[str]:
    d = Path("/sys/class/infiniband")
    try:
        return sorted(p.name for p in d.iterdir())
    except OSError:
        return []


@check(
    "env.ulimit_memlock", "locked-memory limit where RDMA devices exist; not unlimited → warn (skipped without RDMA)"
)
def ulimit_memlock(ctx: Context) -> list[CheckResult]:
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    devs = _rdma_devices()
    if not devs:
        return [
            ctx.result(
                "env.ulimit_memlock",
                Status.SKIP,
                f"skipped: no RDMA device (locked memory {_limit_text(soft)}; only RDMA needs it unlimited)",
            )
        ]
    ok = soft == resource.RLIM_INFINITY
    return [
        ctx.result(
            "env.ulimit_memlock",
            Status.PASS if ok else Status.WARN,
            f"locked memory {_limit_text(soft)} with RDMA device(s) {', '.join(devs)}",
            threshold="unlimited",
            fix="" if ok else "ulimit -l unlimited (InfiniBand/RoCE pin their buffers; NCCL falls back or fails)",
        )
    ]


@check(
    "env.hostname",
    "this node's name resolves, and not to a loopback address (other nodes would dial themselves); "
    "unresolvable → fail, loopback → warn",
)
def hostname(ctx: Context) -> list[CheckResult]:
    name = socket.gethostname()
    try:
        infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    except OSError as e:
        return [
            ctx.result(
                "env.hostname",
                Status.FAIL,
                f"{name!r} does not resolve: {e}",
                threshold="resolves",
                fix="add it to DNS or /etc/hosts: rendezvous and gloo look the node up by name",
            )
        ]
    addrs = sorted({str(i[4][0]) for i in infos})
    loop = all(a.startswith("127.") or a == "::1" for a in addrs)
    pinned = bool(_env(ctx).get("GLOO_SOCKET_IFNAME") or _env(ctx).get("NCCL_SOCKET_IFNAME"))
    status = Status.WARN if loop and not pinned else Status.PASS
    return [
        ctx.result(
            "env.hostname",
            status,
            f"{name!r} resolves to {', '.join(addrs)}",
            threshold="not only loopback (unless *_SOCKET_IFNAME is set)",
            fix=""
            if status is Status.PASS
            else "map the name to the node's network address in /etc/hosts, or set "
            "GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME: gloo binds to what the hostname resolves to",
        )
    ]
