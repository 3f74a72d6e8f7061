"""The log filter's rule set: built-in rules for distributed-training failures, plus user rules.

A :class:`LogRule` is one regular expression with the class (``klass``) and severity of the lines it
keeps. The highest ``priority`` rule that matches a line decides its class; a rule with
``action="drop"`` that wins throws the line away (counted), which is how a user silences a noisy
line that a built-in rule would keep.

Patterns are written in the common subset of Python ``re``, RE2 and Hyperscan (no look-around,
no back-references, no inline flags: use ``ignore_case``) because the fast path searches whole
buffers with one of those engines and then confirms each candidate line with Python ``re``.
Patterns are line-oriented: ``.`` never crosses a line.

The built-in classes are those of the labelled real log lines in ``shared/data/logs`` (issue 4):
``nccl_error``, ``nccl_timeout``, ``cuda_oom``, ``cuda_error``, ``gpu_xid``, ``nan_loss``,
``rank_failure``, ``network``, ``storage``, ``dataloader``, plus ``traceback`` for a Python or C++
traceback that no more specific rule classifies.

User rules come from a TOML (or, with PyYAML installed, YAML) file::

    [filter]
    context_lines = 3           # lines kept before each event
    builtin = true              # start from the built-in rules
    disable = ["nccl_warn"]     # built-in rules to switch off

    [[rules]]
    name = "app_fatal"
    class = "app_fatal"
    pattern = "FATAL: "
    severity = "critical"       # info, warning, error, critical
    priority = 90               # higher wins; built-ins use 10..90
    ignore_case = false

    [[rules]]
    name = "quiet_plugin_warning"
    pattern = "NCCL WARN NET/Plugin"
    action = "drop"
    priority = 100
"""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from ranklens.collector._scan import bracket_end
from ranklens.errors import ConfigError
from ranklens.formats.severity import Severity

__all__ = [
    "BUILTIN_RULES",
    "CLASSES",
    "SEARCH_HINTS",
    "Action",
    "LogRule",
    "RuleSet",
    "Severity",
    "load_rules",
    "pattern_to_ere",
]

_E = TypeVar("_E", bound=enum.Enum)


class Action(str, enum.Enum):
    """What a winning rule does with the line."""

    KEEP = "keep"
    DROP = "drop"


CLASSES = (
    "nccl_error",
    "nccl_timeout",
    "cuda_oom",
    "cuda_error",
    "gpu_xid",
    "nan_loss",
    "rank_failure",
    "network",
    "storage",
    "dataloader",
    "traceback",
)

_BLOCKS = ("", "traceback", "header")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass(frozen=True)
class LogRule:
    """One classification rule.

    Args:
        name: unique, ``[A-Za-z0-9_.-]``; stored in ``log_events.rule``.
        klass: the class of the lines it keeps (``log_events.klass``).
        pattern: a regular expression (see the module docstring for the allowed subset).
        severity: severity of the kept line.
        priority: the highest matching rule decides; ties go to the earlier rule.
        ignore_case: match case-insensitively.
        action: keep (default) or drop the line.
        block: ``"traceback"`` when the line starts a Python traceback that is kept whole;
            ``"header"`` when the line introduces what follows it (the event takes the class of
            the traceback or trailer after it, and this rule's class only when none follows).
    """

    name: str
    klass: str
    pattern: str
    severity: Severity = Severity.ERROR
    priority: int = 50
    ignore_case: bool = False
    action: Action = Action.KEEP
    block: str = ""

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise ConfigError(f"rule name {self.name!r} must be 1-64 characters of A-Z a-z 0-9 _ . -")
        if self.action is Action.KEEP and not _NAME_RE.match(self.klass):
            raise ConfigError(f"rule {self.name}: class {self.klass!r} must be 1-64 characters of A-Z a-z 0-9 _ . -")
        if self.block not in _BLOCKS:
            raise ConfigError(f"rule {self.name}: block={self.block!r}; allowed: '', 'traceback' or 'header'")
        if not self.pattern:
            raise ConfigError(f"rule {self.name}: empty pattern")
        if "(?" in self.pattern.replace("(?:", ""):
            raise ConfigError(
                f"rule {self.name}: pattern {self.pattern!r} uses an inline flag or look-around; "
                "use ignore_case = true and plain groups (?:...) so every search engine accepts it"
            )
        if "\n" in self.pattern or "\\n" in self.pattern:
            raise ConfigError(f"rule {self.name}: patterns are per line; {self.pattern!r} mentions a newline")
        if not _defer_compile:
            self._compile()

    def _compile(self) -> re.Pattern[str]:
        try:
            rx = re.compile(self.pattern, re.IGNORECASE if self.ignore_case else 0)
        except re.error as e:
            raise ConfigError(
                f"rule {self.name}: pattern {self.pattern!r} is not a valid regular expression: {e}"
            ) from None
        if rx.groupindex:
            raise ConfigError(f"rule {self.name}: named groups are not supported; use (?:...)")
        self.__dict__["_regex"] = rx  # frozen: cached in the instance, as functools.cached_property does
        return rx

    @property
    def regex(self) -> re.Pattern[str]:
        """The pattern compiled by Python ``re`` (what confirms a candidate line)."""
        rx = self.__dict__.get("_regex")
        return rx if rx is not None else self._compile()

    @property
    def generic(self) -> bool:
        """A rule whose lines take the class of what follows them (tracebacks, C++ exception
        headers, "... terminated with the following error:" headers)."""
        return self.block != "" or self.klass == "traceback"


def _r(
    name: str,
    klass: str,
    pattern: str,
    severity: str = "error",
    priority: int = 50,
    *,
    ci: bool = False,
    block: str = "",
) -> LogRule:
    return LogRule(name, klass, pattern, Severity(severity), priority, ci, Action.KEEP, block)


# Rules are written per failure *family* (what a component prints when that kind of thing goes
# wrong), not per example line: checked on the tuning lines (tests/data/logs) and on a written
# held-out set (tests/data/logs_heldout, see its README).
#
# Priorities: a line that matches several rules takes the class of the highest one. The order
# encodes the borderline choices documented with the labelled data: an NCCL "WARN Cuda failure"
# line is nccl_error (NCCL printed it) although it names a CUDA error; "CUDA error: out of memory"
# is cuda_oom, not cuda_error; a watchdog line is classified by the cause it names; a c10d store
# failure met while setting up NCCL is network.
# The built-in patterns are compiled by Python ``re`` when a line first needs one, not at import
# (49 compiles are ~6 ms of a one-shot `ranklens logs classify`, issue 18); a user's rule is
# compiled, and so checked, when it is made. tests/collector/test_logfilter.py compiles them all.
_defer_compile = True
BUILTIN_RULES: tuple[LogRule, ...] = (
    # --- GPU / kernel driver (dmesg) -------------------------------------------------------
    _r(
        "xid_hw",
        "gpu_xid",
        r"NVRM: Xid \([^)]*\): (?:48|61|62|63|64|74|79|92|94|95|119|120|136|140|143|144|145|146|149|150|154)\b",
        "critical",
        92,
    ),
    _r("xid", "gpu_xid", r"NVRM: Xid \(", "error", 91),
    _r("sxid", "gpu_xid", r"\bSXid\b", "error", 91),
    _r("gpu_off_bus", "gpu_xid", r"fallen off the bus", "critical", 91),
    _r("rm_init_failed", "gpu_xid", r"RmInitAdapter failed|rm_init_adapter failed", "critical", 91),
    _r("nvrm_gpu_header", "gpu_xid", r"NVRM: GPU at PCI:", "warning", 90),
    _r("nvrm_gpu_serial", "gpu_xid", r"GPU Board Serial Number", "warning", 90),
    _r("nvrm_probe", "gpu_xid", r"NVRM: The NVIDIA (?:GPU|probe routine)", "error", 90),
    _r("nvrm_error", "gpu_xid", r"NVRM: .*(?:[Ee]rror|[Ff]ail|[Tt]imeout|needs to be reset)", "error", 89),
    # the probe-failure block: no usable BAR, a BIOS misconfiguration, an unsupported GPU, no device
    _r(
        "nvrm_probe_failure",
        "gpu_xid",
        r"NVRM: .*(?:is invalid|misconfigured|is not supported by|None of the NVIDIA devices|No NVIDIA)|"
        r"NVRM: BAR[0-9] is 0M|nvidia: probe of [0-9a-f:.]+ failed",
        "error",
        89,
    ),
    _r(
        "pcie_aer",
        "gpu_xid",
        r"PCIe Bus Error|AER: (?:Corrected|Uncorrected|Multiple)|AER: .*(?:[Ee]rror|severity=)",
        "warning",
        89,
    ),
    # --- out of memory ---------------------------------------------------------------------
    _r(
        "cuda_oom",
        "cuda_oom",
        r"(?:CUDA|HIP|GPU|XPU|MPS) out of memory|OutOfMemoryError|RESOURCE_EXHAUSTED: Out of memory",
        "error",
        88,
    ),
    _r(
        "cuda_oom_error",
        "cuda_oom",
        r"CUDA error: out of memory|CUDA_ERROR_OUT_OF_MEMORY|cudaErrorMemoryAllocation|"
        r"(?:cudaMalloc|cuMemAlloc|cuMemCreate)[A-Za-z_]*.*out of memory",
        "error",
        88,
    ),
    # --- NCCL's own warnings (before CUDA: "NCCL WARN Cuda failure" is an NCCL line) --------
    _r("nccl_warn", "nccl_error", r"NCCL WARN |\.(?:cc|cu|h|cpp):[0-9]+ WARN ", "warning", 85),
    # --- dataloader, storage ---------------------------------------------------------------
    _r("dataloader_worker", "dataloader", r"DataLoader worker \(pid|in DataLoader worker process [0-9]", "error", 80),
    _r(
        "dataloader_shm",
        "dataloader",
        r"[Uu]nexpected [a-z -]+ encountered in worker|insufficient shared memory \(shm\)",
        "error",
        80,
    ),
    _r("dataloader_timeout", "dataloader", r"DataLoader timed out after", "error", 80),
    # workers share tensors through shared memory and file descriptors: running out of either
    _r(
        "dataloader_shm_fd",
        "dataloader",
        r"unable to (?:open|mmap|write to|allocate) shared memory|shared memory object|"
        r"Communication with the workers is no longer possible|Too many open files",
        "error",
        78,
    ),
    _r(
        "storage_full",
        "storage",
        r"No space left on device|Disk quota exceeded|StorageFull|\[Errno (?:28|122)\]",
        "error",
        75,
    ),
    _r(
        "storage_io",
        "storage",
        r"Input/output error|\bI/O error\b|Stale file handle|Read-only file system|\[Errno (?:5|30|116)\]",
        "error",
        75,
    ),
    _r(
        "storage_fs",
        "storage",
        r"(?:EXT4-fs|XFS|BTRFS|F2FS)(?: \([^)]*\))?:? .*(?:error|corrupt|[Ss]hutting down)|"
        r"nfs: server .* not responding|Lustre.*(?:evicted|[Ee]rror|timed out|was lost)|blk_update_request: .*error|"
        r"\bnvme[0-9]+n?[0-9]*: .*(?:[Tt]imeout|I/O error|[Ff]ailed|resetting controller)|"
        r"\[sd[a-z]+\] .*(?:[Ee]rror|FAILED)",
        "error",
        75,
    ),
    _r(
        "checkpoint_write",
        "storage",
        r"PytorchStream(?:Writer|Reader) failed|file write failed|fsync failed|"
        r"enforce fail at [^ ]*inline_container\.cc|The file might be corrupted|"
        r"unexpected EOF, expected [0-9]+ more bytes|"
        r"failed finding central directory",
        "error",
        75,
    ),
    # --- NCCL watchdog timeouts ------------------------------------------------------------
    _r("nccl_watchdog_timeout", "nccl_timeout", r"Watchdog caught collective operation timeout", "critical", 72),
    _r(
        "nccl_timeout",
        "nccl_timeout",
        r"detected by watchdog|Some NCCL operations have failed or timed out|"
        r"To avoid data inconsistency, we are taking the entire process down|watchdog got stuck for|"
        r"timed out in blocking wait|ran for [0-9]+ milliseconds before timing out|"
        r"Stack trace of the failed collective not found|Timeout at NCCL work|"
        r"Heartbeat monitor timed out|dump signal due to a collective timeout|flight recorder dump signal|"
        r"WorkNCCL\(.*\) timed out|collective timeout|dump debug info|ProcessGroup abort timed out",
        "error",
        72,
    ),
    # --- CUDA runtime errors ---------------------------------------------------------------
    _r(
        "cuda_error",
        "cuda_error",
        r"CUDA (?:driver )?(?:error|Error|ERROR)(?:: | \()|cuda runtime error|CUDA_ERROR_[A-Z_]+|Triton Error \[CUDA\]|"
        r"illegal (?:memory access|instruction|address) was encountered|misaligned address|"
        r"unspecified launch failure|device-side assert triggered|launch timed out and was terminated|"
        r"uncorrectable (?:ECC|NVLink) error",
        "error",
        70,
    ),
    _r(
        "cuda_lib_error",
        "cuda_error",
        r"CUBLAS_STATUS_(?:EXECUTION_FAILED|INTERNAL_ERROR|ALLOC_FAILED|NOT_INITIALIZED|ARCH_MISMATCH|"
        r"MAPPING_ERROR|INVALID_VALUE|NOT_SUPPORTED)|CUDNN_STATUS_(?:EXECUTION_FAILED|INTERNAL_ERROR|"
        r"NOT_INITIALIZED|ALLOC_FAILED|BAD_PARAM|ARCH_MISMATCH|MAPPING_ERROR|NOT_SUPPORTED)|cuDNN error: ",
        "error",
        70,
    ),
    _r(
        "cuda_device",
        "cuda_error",
        r"Unable to determine the device handle for GPU|no CUDA-capable device is detected|"
        r"CUDA driver version is insufficient|Found no NVIDIA driver|Unexpected error from cudaGetDeviceCount|"
        r"Failed to initialize NVML|NVML_ERROR_[A-Z_]+|Driver/library version mismatch|"
        r"\.cuh?:[0-9]+: .*Assertion .* failed|\.cuh?:[0-9]+: .*block: \[",
        "error",
        70,
    ),
    _r(
        "cuda_check",
        "cuda_error",
        r"c10_cuda_check_implementation|finishedGPUExecutionInternal|"
        r"CUDA kernel errors might be asynchronously reported|Search for .cudaError[A-Za-z]+. in ",
        "error",
        69,
    ),
    # --- divergence ------------------------------------------------------------------------
    _r(
        "nan_overflow_skip",
        "nan_loss",
        r"OVERFLOW! Rank [0-9]+ Skipping step|Gradient overflow\. +Skipping step|[Gg]rad overflow on iteration|"
        r"loss scale overflow|Minimum loss scale reached|loss is probably exploding",
        "warning",
        65,
    ),
    _r(
        "nan_loss",
        "nan_loss",
        r"(?:loss|grad[ _]norm)['\"]?(?: *[:=] *| +)['\"]?[-+]?(?:nan|inf)\b|loss is (?:nan|inf)\b|"
        r"found (?:nan|inf) in|nan or inf found in|returned nan values|nan (?:detected|encountered)|"
        r"encountered (?:a )?nan\b|number of nan iterations: *[1-9]|"
        r"is non-finite|(?:: *|(?:detected|encountered|found|got|caught) +(?:an? +)?)non-finite (?:loss|grad)|"
        r"non-finite (?:loss|grad)[a-z]* (?:detected|encountered|found|at step|in step|on rank)",
        "error",
        65,
        ci=True,
    ),
    # --- NCCL errors -----------------------------------------------------------------------
    _r(
        "nccl_error",
        "nccl_error",
        r"NCCL (?:error|Error|ERROR)\b|nccl(?:Internal|System|Remote|UnhandledCuda)Error|ncclInvalid(?:Usage|Argument)|"
        r"unhandled (?:system|cuda) error|NCCL failure|NCCL communicator was aborted|checkForNCCLErrors|"
        r"Connection closed by remote peer|segfault at .* in libnccl|Got completion from peer .*error|"
        r"remote process exited or there was a network error|\[Service thread\] (?:Connection closed|Error)",
        "error",
        60,
    ),
    # a socket failure that NCCL itself logged (even at INFO, e.g. its connect retries) is NCCL's
    _r(
        "nccl_socket",
        "nccl_error",
        r"NCCL INFO .*(?:Connection (?:refused|reset|closed|timed out)|No route to host|Network is unreachable|"
        r"Broken pipe)",
        "error",
        60,
    ),
    # the NCCL return-code trail "file.cc:123 -> 2": any non-zero result of an NCCL call site
    _r("nccl_retcode", "nccl_error", r"[A-Za-z0-9_]\.(?:cc|cu|h|hpp|cpp|c):[0-9]+ -> [1-9]", "error", 60),
    # --- host networking / c10d store (above the elastic rules: a store timeout names its cause) ---
    _r(
        "c10d_store",
        "network",
        r"client socket has timed out after|server socket has (?:timed out|failed)|RendezvousConnectionError|"
        r"connection to the C10d store has failed|DistNetworkError|DistStoreError|store->[a-z]+\(.*got error|"
        r"\[c10d\] .*(?:\bfailed\b|timed out|[Cc]onnection (?:reset|closed|refused))|"
        r"(?:recvValue|sendBytes|recvBytes) failed|Socket Timeout|waiting for clients\. [0-9]+/[0-9]+ clients joined",
        "error",
        57,
    ),
    _r(
        "gloo_transport",
        "network",
        r"gloo/transport/[a-z]+/[A-Za-z_]+\.cc:[0-9]+\]|pair closure|gloo::(?:IoException|TimeoutException)",
        "error",
        57,
    ),
    # --- launcher / elastic / scheduler --------------------------------------------------------
    _r(
        "elastic_failure",
        "rank_failure",
        r"ChildFailedError|failed \(exitcode: -?[0-9]+\) local_rank: [0-9]+|death signal|"
        r"Rendezvous(?:Closed|Timeout)Error|Root Cause \(first observed failure\)|"
        r"Signal [0-9]+ \(SIG[A-Z]+\) received by PID|exitcode *: -?[0-9]+ \(pid: [0-9]+\)|"
        r"SignalException|Worker group FAILED|will restart worker group|Error waiting on exit barrier|"
        r"Process(?:Raised|Exited)Exception",
        "error",
        55,
    ),
    _r(
        "elastic_kill",
        "rank_failure",
        r"Sending process [0-9]+ closing signal SIG[A-Z]+|Closing process [0-9]+ via signal SIG[A-Z]+|"
        r"Killing subprocess [0-9]+",
        "warning",
        55,
    ),
    # above c10d_store: "failed to send a keep-alive heartbeat ... of type RendezvousConnectionError"
    # is the agent losing the rendezvous (rank_failure), whatever error it names
    _r(
        "elastic_heartbeat",
        "rank_failure",
        r"(?:fail|error).*keep-?alive heartbeat|keep-?alive heartbeat.*(?:fail|error)",
        "error",
        58,
        ci=True,
    ),
    _r(
        "scheduler_kill",
        "rank_failure",
        r"(?:srun|slurmstepd|sbatch|salloc): error: |(?:exits|exited) with (?:exit|return) code:? =? ?-?[1-9]|"
        r"Exited with exit code [1-9]|[Oo]ut of memory: Kill(?:ed)? process|invoked oom-killer|oom_kill event|"
        r"OOM Killed|exited on signal [0-9]+|returned a non-zero exit code|job has been aborted|Job step aborted",
        "error",
        55,
    ),
    _r(
        "process_crash",
        "rank_failure",
        r"Fatal Python error|Segmentation fault|segfault at |[Pp]rocess [0-9]+ terminated with (?:signal|exit code)|"
        r"Aborted \(core dumped\)|\*\*\* Process received signal \*\*\*|\] Signal(?: code)?: |Failing at address: 0x",
        "error",
        50,
    ),
    _r(
        "spawn_header",
        "rank_failure",
        r"[Pp]rocess [0-9]+ terminated with the following error",
        "error",
        50,
        block="header",
    ),
    _r(
        "socket_error",
        "network",
        r"Connection closed by peer|Connection reset by peer|Connection refused|Connection timed out|"
        r"connect\(\) timed out|No route to host|Network is unreachable|Temporary failure in name resolution|"
        r"Broken pipe|Timed out waiting [0-9]+ms for (?:send|recv) operation|NIC Link is Down|: Link down\b|"
        r"socket\.(?:gaierror|timeout)|Connection(?:Reset|Aborted|Refused)Error|"
        r"requests\.exceptions\.(?:ConnectionError|ConnectTimeout|ReadTimeout)",
        "error",
        45,
    ),
    # RDMA work completions that failed (verbs status names, the mlx5 driver's CQE report): the fabric
    # dropped a transfer after its retries (NCCL's own "Got completion from peer" is nccl_error)
    _r(
        "ib_completion",
        "network",
        r"(?:transport|RNR) retry counter exceeded|IBV_WC_[A-Z_]*_ERR\b|\bWC error: [0-9]+|"
        r"error_cqe.*(?:syndrome|[Ee]rror)",
        "error",
        45,
    ),
    # NIC drivers reporting a fatal state, a hang or a timeout (dmesg)
    _r(
        "nic_driver",
        "network",
        r"\b(?:mlx5_core|mlx4_core|bnxt_en|ice|i40e|ixgbe|ena|efa)\b.*(?:error state|[Ff]atal|syndrome|"
        r"health compromised|Unit Hang|TX timeout|timed out)",
        "error",
        45,
    ),
    # --- fallbacks: generic NCCL backend errors and tracebacks -------------------------------
    _r("nccl_backend", "nccl_error", r"DistBackendError|watchdog thread terminated with exception", "error", 40),
    # an error-level glog line of ProcessGroupNCCL that names no cause above comes from its
    # watchdog / timeout / debug-dump path; one of the c10d store or sockets is a network failure
    _r(
        "pg_nccl_error_log",
        "nccl_timeout",
        r"\[[EF](?:[0-9]{4} [0-9:.]+(?: +[0-9]+)?)? ProcessGroupNCCL\.cpp:[0-9]+\]",
        "error",
        35,
    ),
    _r(
        "c10d_error_log",
        "network",
        r"\[[EF](?:[0-9]{4} [0-9:.]+(?: +[0-9]+)?)? "
        r"(?:TCPStore|TCPStoreBackend|TCPStoreLibUvBackend|socket)\.cpp:[0-9]+\]",
        "error",
        35,
    ),
    _r("traceback", "traceback", r"Traceback \(most recent call last\):", "error", 10, block="traceback"),
    # above nccl_backend: "terminate called ... 'c10::DistBackendError'" is a header, its what() decides
    _r("cpp_exception", "traceback", r"terminate called after throwing an instance of", "error", 41),
    _r("c10_exception", "traceback", r"Exception raised from .* \(most recent call first\)", "error", 10),
)
_defer_compile = False

# What the fast path searches for instead of a built-in pattern whose required start is in many
# benign lines: each hint is the part after the pattern's top-level ``.*``, so it matches
# wherever the pattern does (``prefix.*(?:hint)`` contains a match of the hint), and Python
# ``re`` still confirms the pattern itself. "NCCL INFO " starts a fifth of a training log's lines;
# searching for what must follow it instead is ~15 % of the search (issue 18). Keyed by the
# pattern, so a user's rule of another pattern under a built-in name gets none.
SEARCH_HINTS: dict[str, str] = {
    r.pattern: r.pattern.split(".*(?:", 1)[1][:-1] for r in BUILTIN_RULES if r.name in ("nccl_socket",)
}


@dataclass(frozen=True)
class RuleSet:
    """An ordered set of rules plus the filter settings that come with them.

    Args:
        rules: the rules; names must be unique.
        context_lines: lines kept before each event (0..20).
    """

    rules: tuple[LogRule, ...]
    context_lines: int = 3

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for r in self.rules:
            if r.name in seen:
                raise ConfigError(f"rule name {r.name!r} is used twice; rule names must be unique")
            seen.add(r.name)
        if not 0 <= self.context_lines <= 20:
            raise ConfigError(f"context_lines={self.context_lines}: allowed 0..20")
        if not self.rules:
            raise ConfigError("the rule set is empty: keep the built-in rules or add [[rules]]")

    @classmethod
    def builtin(cls, *, context_lines: int = 3) -> RuleSet:
        """The built-in rules."""
        return cls(BUILTIN_RULES, context_lines=context_lines)

    def with_rules(self, extra: Iterable[LogRule], *, disable: Sequence[str] = ()) -> RuleSet:
        """A copy with ``extra`` rules added (a rule of the same name replaces the old one)."""
        extra = list(extra)
        names = {r.name for r in self.rules}
        unknown = [n for n in disable if n not in names]
        if unknown:
            raise ConfigError(f"cannot disable unknown rule(s) {unknown}; rules are: {', '.join(sorted(names))}")
        replaced = {r.name for r in extra}
        kept = [r for r in self.rules if r.name not in replaced and r.name not in disable]
        return replace(self, rules=tuple(kept + extra))

    @property
    def classes(self) -> list[str]:
        """Classes a kept line can get, in rule order."""
        out: list[str] = []
        for r in self.rules:
            if r.action is Action.KEEP and r.klass not in out:
                out.append(r.klass)
        return out


def _choice(kind: type[_E], d: Mapping[str, Any], key: str, default: str, where: str) -> _E:
    """``d[key]`` (``default`` when missing) as a member of the string enum ``kind``."""
    raw = str(d.get(key, default))
    try:
        return kind(raw)
    except ValueError:
        allowed = ", ".join(m.value for m in kind)
        raise ConfigError(f"{where}: {key}={raw!r}; allowed: {allowed}") from None


def _rule_from_mapping(d: Mapping[str, Any], where: str) -> LogRule:
    allowed = {"name", "class", "klass", "pattern", "severity", "priority", "ignore_case", "action", "block"}
    unknown = set(d) - allowed
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    for key in ("name", "pattern"):
        if not isinstance(d.get(key), str):
            raise ConfigError(f"{where}: {key!r} is required and must be a string")
    action = _choice(Action, d, "action", "keep", where)
    klass = d.get("class", d.get("klass", "dropped" if action is Action.DROP else None))
    if not isinstance(klass, str):
        raise ConfigError(f"{where}: 'class' is required for a keep rule and must be a string")
    severity = _choice(Severity, d, "severity", "error", where)
    priority = d.get("priority", 50)
    if isinstance(priority, bool) or not isinstance(priority, int) or not -1000 <= priority <= 1000:
        raise ConfigError(f"{where}: priority={priority!r} must be an integer in -1000..1000")
    ignore_case = d.get("ignore_case", False)
    if not isinstance(ignore_case, bool):
        raise ConfigError(f"{where}: ignore_case={ignore_case!r} must be true or false")
    block = d.get("block", "")
    if not isinstance(block, str):
        raise ConfigError(f"{where}: block={block!r} must be a string")
    try:
        return LogRule(str(d["name"]), klass, str(d["pattern"]), severity, priority, ignore_case, action, block)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a TOML (``.toml``) or YAML (``.yaml``/``.yml``, needs PyYAML) file into a dict."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e.strerror}") from None
    if p.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"{p}: YAML config needs PyYAML (pip install pyyaml), or write it as TOML") from None
        try:
            data = yaml.safe_load(raw) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from None
    else:
        import tomllib

        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{p}: not valid TOML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a table/mapping at the top level")
    return data


def rules_from_config(data: Mapping[str, Any], where: str = "config") -> RuleSet:
    """Build a :class:`RuleSet` from a parsed config (``[filter]`` and ``[[rules]]``)."""
    filt = data.get("filter", {}) or {}
    if not isinstance(filt, Mapping):
        raise ConfigError(f"{where}: [filter] must be a table")
    unknown = set(filt) - {"context_lines", "builtin", "disable"}
    if unknown:
        raise ConfigError(
            f"{where}: [filter] has unknown key(s) {sorted(unknown)}; allowed: builtin, context_lines, disable"
        )
    ctx = filt.get("context_lines", 3)
    if isinstance(ctx, bool) or not isinstance(ctx, int):
        raise ConfigError(f"{where}: [filter] context_lines={ctx!r} must be an integer 0..20")
    builtin = filt.get("builtin", True)
    if not isinstance(builtin, bool):
        raise ConfigError(f"{where}: [filter] builtin={builtin!r} must be true or false")
    disable = filt.get("disable", [])
    if not isinstance(disable, list) or not all(isinstance(n, str) for n in disable):
        raise ConfigError(f"{where}: [filter] disable must be a list of rule names")
    raw_rules = data.get("rules", []) or []
    if not isinstance(raw_rules, list):
        raise ConfigError(f"{where}: rules must be an array of tables ([[rules]])")
    extra = [_rule_from_mapping(d, f"{where}: rules[{i}]") for i, d in enumerate(raw_rules) if isinstance(d, Mapping)]
    if len(extra) != len(raw_rules):
        raise ConfigError(f"{where}: every [[rules]] entry must be a table")
    if disable and not builtin:
        raise ConfigError(f"{where}: [filter] disable needs builtin = true")
    try:
        if builtin:
            return RuleSet(BUILTIN_RULES, context_lines=ctx).with_rules(extra, disable=disable)
        return RuleSet(tuple(extra), context_lines=ctx)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def load_rules(path: str | Path | None = None, *, context_lines: int | None = None) -> RuleSet:
    """The built-in rules, extended and adjusted by the user rule file at ``path`` (if any).

    Raises:
        ConfigError: unreadable file, bad syntax, an unknown key, or an invalid rule (the message
            names the file, the rule and the fix).
    """
    if path is None:
        rs = RuleSet.builtin()
    else:
        rs = rules_from_config(read_config_file(path), str(path))
    if context_lines is not None:
        rs = replace(rs, context_lines=context_lines)
    return rs


_ERE_ESCAPES = {"d": "[0-9]", "s": "[[:space:]]", "w": "[[:alnum:]_]", "D": "[^0-9]", "S": "[^[:space:]]"}


def pattern_to_ere(pattern: str, *, ignore_case: bool = False) -> str:
    """Translate a rule pattern to POSIX ERE for ``grep -E`` (benchmarks and cross-checks).

    Handles the subset the rules use: ``(?:``, ``\\d \\s \\w``, escapes, bracket expressions, and
    ``ignore_case`` by turning letters outside brackets into ``[xX]``.
    """
    out: list[str] = []
    i = 0
    n = len(pattern)
    while i < n:
        ch = pattern[i]
        if ch == "\\" and i + 1 < n:
            nxt = pattern[i + 1]
            if nxt in _ERE_ESCAPES:
                out.append(_ERE_ESCAPES[nxt])
            elif nxt == "b":
                out.append(r"\b")
            elif nxt.isalnum():
                raise ValueError(f"escape \\{nxt} has no ERE equivalent")
            elif nxt in "-'\"":
                out.append(nxt)
            else:
                out.append("\\" + nxt)
            i += 2
        elif pattern.startswith("(?:", i):
            out.append("(")
            i += 3
        elif ch == "[":
            j = bracket_end(pattern, i)
            body = pattern[i + 1 : j].replace("\\d", "0-9").replace("\\", "")
            if ignore_case:
                body = "".join(c + c.swapcase() if c.isalpha() and c.swapcase() not in body else c for c in body)
            out.append("[" + body + "]")
            i = j + 1
        elif ignore_case and ch.isalpha():
            out.append(f"[{ch.lower()}{ch.upper()}]")
            i += 1
        else:
            out.append(ch)
            i += 1
    return "".join(out)
