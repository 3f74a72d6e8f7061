"""Software checks: what the job will run with on this node (Python, PyTorch, its CUDA and NCCL,
torch.distributed's backends, ranklens). Each version also goes into the node's facts, where
``fleet.software_consistency`` compares them across nodes: a job whose nodes disagree on torch or
NCCL fails in ways no single node shows."""

from __future__ import annotations

import platform
import sys
from typing import Any

from ranklens.collector.preflight.api import CheckResult, Context, Status, check

__all__: list[str] = []


def _software(ctx: Context) -> dict[str, Any]:
    sw: dict[str, Any] = ctx.facts.setdefault("software", {})
    return sw


def _torch(ctx: Context) -> Any:
    if "torch" not in ctx.cache:
        try:
            import torch

            ctx.cache["torch"] = torch
        except Exception as e:
            ctx.cache["torch"] = None
            ctx.cache["torch_error"] = f"{type(e).__name__}: {e}"
    return ctx.cache["torch"]


@check("software.python", "the Python interpreter; older than 3.9 → fail (ranklens and current PyTorch need 3.9+)")
def python(ctx: Context) -> list[CheckResult]:
    v = platform.python_version()
    _software(ctx)["python"] = v
    ok = sys.version_info >= (3, 9)
    return [
        ctx.result(
            "software.python",
            Status.PASS if ok else Status.FAIL,
            f"Python {v} ({sys.executable})",
            threshold=">= 3.9",
            fix="" if ok else "use the job's Python 3.9+ environment",
        )
    ]


@check("software.torch", "PyTorch imports; not importable → fail")
def torch_version(ctx: Context) -> list[CheckResult]:
    torch = _torch(ctx)
    if torch is None:
        return [
            ctx.result(
                "software.torch",
                Status.FAIL,
                f"torch does not import: {ctx.cache.get('torch_error')}",
                threshold="imports",
                fix="install the job's PyTorch in this environment",
            )
        ]
    _software(ctx)["torch"] = str(torch.__version__)
    return [ctx.result("software.torch", Status.PASS, f"torch {torch.__version__}", threshold="imports")]


@check(
    "software.torch_cuda",
    "PyTorch's CUDA, cuDNN and NCCL versions, and whether CUDA initialises; skipped on a CPU build, "
    "CUDA build that cannot initialise while NVML sees GPUs → fail",
)
def torch_cuda(ctx: Context) -> list[CheckResult]:
    torch = _torch(ctx)
    if torch is None:
        return [ctx.result("software.torch_cuda", Status.SKIP, "skipped: torch does not import")]
    cuda = getattr(torch.version, "cuda", None)
    if not cuda:
        return [ctx.result("software.torch_cuda", Status.SKIP, "skipped: no GPU (torch is a CPU build)")]
    sw = _software(ctx)
    sw["torch_cuda"] = str(cuda)
    try:
        sw["cudnn"] = str(torch.backends.cudnn.version())
    except Exception:
        pass
    try:
        nccl = torch.cuda.nccl.version()
        sw["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except Exception:
        pass
    try:
        ok = bool(torch.cuda.is_available())
        n = torch.cuda.device_count() if ok else 0
    except Exception as e:
        ok, n = False, 0
        sw["cuda_error"] = str(e)
    detail = f"torch CUDA {cuda}, NCCL {sw.get('nccl', '?')}, cuDNN {sw.get('cudnn', '?')}"
    if ok:
        return [ctx.result("software.torch_cuda", Status.PASS, f"{detail}; {n} device(s)", value=n)]
    gpus_seen = ctx.facts.get("gpu_count", 0) or max(ctx.gpus_expected, 0)
    status = Status.FAIL if gpus_seen else Status.SKIP
    msg = f"{detail}; CUDA does not initialise" if gpus_seen else f"skipped: no GPU ({detail}, no device)"
    return [
        ctx.result(
            "software.torch_cuda",
            status,
            msg,
            threshold="CUDA initialises where GPUs are present",
            fix=""
            if status is Status.SKIP
            else "driver older than torch's CUDA? check `nvidia-smi` and torch.version.cuda",
        )
    ]


@check("software.distributed", "torch.distributed is built in, with gloo (and NCCL on a CUDA build); missing → fail")
def distributed(ctx: Context) -> list[CheckResult]:
    torch = _torch(ctx)
    if torch is None:
        return [ctx.result("software.distributed", Status.SKIP, "skipped: torch does not import")]
    import torch.distributed as dist

    if not dist.is_available():
        return [
            ctx.result(
                "software.distributed",
                Status.FAIL,
                "torch.distributed is not built into this torch",
                fix="install a PyTorch build with distributed support",
            )
        ]
    backends = [b for b, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available())) if ok]
    _software(ctx)["backends"] = ",".join(backends)
    missing = ["gloo"] if "gloo" not in backends else []
    if getattr(torch.version, "cuda", None) and "nccl" not in backends:
        missing.append("nccl")
    return [
        ctx.result(
            "software.distributed",
            Status.FAIL if missing else Status.PASS,
            f"backends: {', '.join(backends) or 'none'}" + (f"; missing {', '.join(missing)}" if missing else ""),
            threshold="gloo (and nccl on a CUDA build)",
            fix="install a PyTorch build with these backends" if missing else "",
        )
    ]


@check("software.ranklens", "the ranklens version on this node (compared across nodes)")
def ranklens_version(ctx: Context) -> list[CheckResult]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("ranklens")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        v = "unknown (not installed)"
    _software(ctx)["ranklens"] = v
    return [ctx.result("software.ranklens", Status.PASS, f"ranklens {v}")]
