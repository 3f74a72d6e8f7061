"""Storage checks: the checkpoint path (exists, free space, write speed with fsync), the mounts the
job needs (readable and writable), /tmp's free space and the size of /dev/shm (dataloader workers
and NCCL share memory through it; containers default to 64 MiB)."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

from ranklens.collector.preflight.api import CheckResult, Context, Status, check

__all__: list[str] = []

GIB = 1 << 30
MIB = 1 << 20


def _no_path(ctx: Context, name: str) -> list[CheckResult]:
    return [ctx.result(name, Status.SKIP, "skipped: no --checkpoint-path given")]


def _missing(ctx: Context, name: str, path: str) -> CheckResult:
    return ctx.result(
        name,
        Status.FAIL,
        f"checkpoint path {path} does not exist",
        subject=path,
        fix="create it, or mount the checkpoint volume on this node "
        "(a missing mount writes checkpoints to the root disk)",
    )


def _after_missing(ctx: Context, name: str, path: str) -> CheckResult:
    # one cause, one failure: storage.checkpoint_path fails for a missing path, the others say so
    return ctx.result(name, Status.SKIP, f"skipped: {path} does not exist (see storage.checkpoint_path)", subject=path)


@check("storage.checkpoint_path", "the checkpoint directory exists, is a directory and is writable")
def checkpoint_path(ctx: Context) -> list[CheckResult]:
    p = ctx.checkpoint_path
    if not p:
        return _no_path(ctx, "storage.checkpoint_path")
    path = Path(p)
    if not path.exists():
        return [_missing(ctx, "storage.checkpoint_path", p)]
    if not path.is_dir():
        return [ctx.result("storage.checkpoint_path", Status.FAIL, f"{p} is not a directory", subject=p)]
    if not os.access(path, os.W_OK | os.X_OK):
        return [
            ctx.result(
                "storage.checkpoint_path",
                Status.FAIL,
                f"{p} is not writable by uid {os.geteuid()}",
                subject=p,
                fix="fix the directory's owner or mode for the job's user",
            )
        ]
    return [ctx.result("storage.checkpoint_path", Status.PASS, f"{p} is a writable directory", subject=p)]


@check("storage.checkpoint_space", "free space on the checkpoint path's file system; < 50 GiB → warn, < 5 GiB → fail")
def checkpoint_space(ctx: Context) -> list[CheckResult]:
    p = ctx.checkpoint_path
    if not p:
        return _no_path(ctx, "storage.checkpoint_space")
    if not Path(p).is_dir():
        return [_after_missing(ctx, "storage.checkpoint_space", p)]
    free = shutil.disk_usage(p).free / GIB
    warn, fail = ctx.limit("checkpoint_warn_gib", 50.0), ctx.limit("checkpoint_fail_gib", 5.0)
    status = Status.FAIL if free < fail else Status.WARN if free < warn else Status.PASS
    return [
        ctx.result(
            "storage.checkpoint_space",
            status,
            f"{free:.1f} GiB free at {p}",
            subject=p,
            value=round(free, 2),
            unit="GiB",
            threshold=f">= {warn:g} GiB (fail < {fail:g} GiB)",
            fix="" if status is Status.PASS else "free space or point --checkpoint-path at a larger volume",
        )
    ]


@check("storage.checkpoint_write", "write 64 MiB to the checkpoint path with fsync; < 100 MB/s → warn, < 10 → fail")
def checkpoint_write(ctx: Context) -> list[CheckResult]:
    p = ctx.checkpoint_path
    if not p:
        return _no_path(ctx, "storage.checkpoint_write")
    if not Path(p).is_dir():
        return [_after_missing(ctx, "storage.checkpoint_write", p)]
    nbytes = int(ctx.limit("checkpoint_write_mib", 64)) * MIB
    target = Path(p) / f".ranklens-preflight-{uuid.uuid4().hex}"
    chunk = os.urandom(4 * MIB)  # incompressible: a compressing file system must not flatter the figure
    try:
        t0 = time.perf_counter()
        with open(target, "wb", buffering=0) as f:
            done = 0
            while done < nbytes:
                f.write(chunk)
                done += len(chunk)
            os.fsync(f.fileno())
        dt = time.perf_counter() - t0
    except OSError as e:
        return [
            ctx.result(
                "storage.checkpoint_write", Status.FAIL, f"cannot write to {p}: {e}", subject=p, fix="see the error"
            )
        ]
    finally:
        target.unlink(missing_ok=True)
    mbps = done / dt / 1e6
    warn, fail = ctx.limit("checkpoint_write_warn_mbps", 100.0), ctx.limit("checkpoint_write_fail_mbps", 10.0)
    status = Status.FAIL if mbps < fail else Status.WARN if mbps < warn else Status.PASS
    return [
        ctx.result(
            "storage.checkpoint_write",
            status,
            f"{mbps:.0f} MB/s ({done // MIB} MiB with fsync in {dt:.2f} s)",
            subject=p,
            value=round(mbps, 1),
            unit="MB/s",
            threshold=f">= {warn:g} MB/s (fail < {fail:g})",
            fix=""
            if status is Status.PASS
            else "a slow checkpoint volume stalls every rank at each save: check the mount",
        )
    ]


@check("storage.mounts", "each --mount is a mounted directory, readable and writable")
def mounts(ctx: Context) -> list[CheckResult]:
    if not ctx.mounts:
        return [ctx.result("storage.mounts", Status.SKIP, "skipped: no --mount given")]
    out = []
    for m in ctx.mounts:
        p = Path(m)
        if not p.is_dir():
            out.append(
                ctx.result(
                    "storage.mounts", Status.FAIL, f"{m} does not exist", subject=m, fix="mount the volume on this node"
                )
            )
            continue
        probe = p / f".ranklens-preflight-{uuid.uuid4().hex}"
        try:
            os.listdir(p)
            probe.write_bytes(b"ranklens")
            ok = probe.read_bytes() == b"ranklens"
        except OSError as e:
            out.append(ctx.result("storage.mounts", Status.FAIL, f"{m}: {e}", subject=m, fix="check the mount's mode"))
            continue
        finally:
            probe.unlink(missing_ok=True)
        note = "" if os.path.ismount(m) else " (not a mount point itself)"
        out.append(
            ctx.result(
                "storage.mounts",
                Status.PASS if ok else Status.FAIL,
                f"{m} readable and writable{note}" if ok else f"{m}: read back differs",
                subject=m,
            )
        )
    return out


@check("storage.tmp_space", "free space in the temporary directory; < 5 GiB → warn, < 0.5 GiB → fail")
def tmp_space(ctx: Context) -> list[CheckResult]:
    import tempfile

    d = tempfile.gettempdir()
    free = shutil.disk_usage(d).free / GIB
    warn, fail = ctx.limit("tmp_warn_gib", 5.0), ctx.limit("tmp_fail_gib", 0.5)
    status = Status.FAIL if free < fail else Status.WARN if free < warn else Status.PASS
    return [
        ctx.result(
            "storage.tmp_space",
            status,
            f"{free:.1f} GiB free in {d}",
            subject=d,
            value=round(free, 2),
            unit="GiB",
            threshold=f">= {warn:g} GiB (fail < {fail:g})",
            fix="" if status is Status.PASS else "compile caches, core dumps and the ranklens spool live here: free it",
        )
    ]


@check("storage.shm", "size of /dev/shm; < 1 GiB → warn (containers default to 64 MiB), < 64 MiB → fail")
def shm(ctx: Context) -> list[CheckResult]:
    if not Path("/dev/shm").is_dir():
        return [ctx.result("storage.shm", Status.FAIL, "/dev/shm does not exist", fix="mount a tmpfs on /dev/shm")]
    total = shutil.disk_usage("/dev/shm").total / GIB
    warn, fail = ctx.limit("shm_warn_gib", 1.0), ctx.limit("shm_fail_gib", 0.0625)
    status = Status.FAIL if total < fail else Status.WARN if total < warn else Status.PASS
    return [
        ctx.result(
            "storage.shm",
            status,
            f"/dev/shm is {total:.2f} GiB",
            value=round(total, 3),
            unit="GiB",
            threshold=f">= {warn:g} GiB (fail < {fail:g})",
            fix=""
            if status is Status.PASS
            else "dataloader workers fail with 'bus error': docker --shm-size, "
            "or a memory-backed emptyDir on Kubernetes",
        )
    ]
