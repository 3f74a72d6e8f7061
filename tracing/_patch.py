"""Wrapping torch.distributed's collective and p2p functions to feed the arrival ledger.

Which collectives there were comes from torch's flight-recorder ring (``_ledger``): it holds every
c10d collective whatever API issued it (FSDP2, DTensor's functional collectives, DDP's reducer,
coalesced groups), so this list of names is not what makes the ledger complete. The wrappers add
what the ring lacks: the completion time on gloo, and p2p (gloo's ring does not record p2p; NCCL's
has no peer). On a group the ring covers a wrapped collective files a claim that the ledger numbers
with the ring's ``(pg, seq)``; elsewhere (no ring: ``TORCH_FR_BUFFER_SIZE=0``, ``RANKLENS_FR_LEDGER=0``,
backends other than gloo/NCCL) it takes a seq of its own, as before.

Each wrapper records arrival (enter) before calling torch, and completion either when the call
returns (sync) or when its Work's future completes (``async_op=True``, ``isend``/``irecv``), so a
late ``wait()`` does not stretch the measured time. Recording errors are counted, never raised;
torch's own exceptions pass through untouched.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import threading
from typing import Any

from ranklens.config import ENV_FR_LEDGER

__all__ = ["patch", "unpatch"]

log = logging.getLogger("ranklens.tracing")

# op name -> (name of the argument holding this rank's input, p2p direction or None)
_OPS: dict[str, tuple[str | None, str | None]] = {
    "all_reduce": ("tensor", None),
    "broadcast": ("tensor", None),
    "reduce": ("tensor", None),
    "all_gather": ("tensor", None),
    "all_gather_into_tensor": ("input_tensor", None),
    "reduce_scatter": ("input_list", None),
    "reduce_scatter_tensor": ("input", None),
    "all_to_all": ("input_tensor_list", None),
    "all_to_all_single": ("input", None),
    "all_gather_single": ("input_tensor", None),
    "reduce_scatter_single": ("input", None),
    "all_reduce_coalesced": ("tensors", None),
    "gather": ("tensor", None),
    "scatter": ("tensor", None),
    "barrier": (None, None),
    "send": ("tensor", "send"),
    "recv": ("tensor", "recv"),
    "isend": ("tensor", "send"),
    "irecv": ("tensor", "recv"),
}


_originals: dict[tuple[Any, str], Any] = {}
# torch implements some ops with others (send -> isend): record only the outermost call.
_inside = threading.local()


_DTYPES: dict[Any, str] = {}


def _is_cuda(x: Any) -> bool:
    if isinstance(x, (list, tuple)):
        return bool(x) and _is_cuda(x[0])
    return bool(getattr(x, "is_cuda", False))


def _nbytes(x: Any) -> tuple[int, str]:
    if x is None:
        return 0, ""
    if isinstance(x, (list, tuple)):
        total, dtype = 0, ""
        for t in x:
            n, dtype = _nbytes(t)
            total += n
        return total, dtype
    try:
        dt = x.dtype
        name = _DTYPES.get(dt)
        if name is None:
            name = _DTYPES[dt] = str(dt).removeprefix("torch.")
        return x.numel() * x.element_size(), name
    except Exception:
        return 0, ""


def _wrap(tracer: Any, name: str, fn: Any, c10d: Any) -> Any:
    arg_name, p2p = _OPS[name]
    sig = inspect.signature(fn)
    dist = c10d
    # inspect.Signature.bind costs microseconds per call: resolve arguments by position instead
    index = {n: i for i, n in enumerate(sig.parameters)}
    defaults = {n: p.default for n, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}
    world: list[Any] = []  # the default group's (name, group), resolved once

    def arg(args: tuple[Any, ...], kwargs: dict[str, Any], key: str) -> Any:
        if key in kwargs:
            return kwargs[key]
        i = index.get(key)
        if i is not None and i < len(args):
            return args[i]
        return defaults.get(key)

    def pg_info(group: Any) -> tuple[str, Any]:
        if group is None and world:
            return world[0]
        g = group if group is not None else dist._get_default_group()
        cached = tracer._pg_names.get(id(g))
        if cached is None:
            pg = dist._get_process_group_name(g)
            cached = (pg, g)
            tracer._pg_names[id(g)] = cached
            _register_group(tracer, dist, g, pg)
        if group is None:
            world.append(cached)
        return cached

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        row = None
        claim = None
        cuda_start = None
        if getattr(_inside, "depth", 0):
            return fn(*args, **kwargs)
        if tracer.enabled:
            try:
                group = arg(args, kwargs, "group")
                if group is None or not dist._rank_not_in_group(group):
                    pg, g = pg_info(group)
                    tensor = arg(args, kwargs, arg_name) if arg_name else None
                    nbytes, dtype = _nbytes(tensor)
                    async_op = bool(arg(args, kwargs, "async_op")) or name in ("isend", "irecv")
                    peer = -1
                    if p2p is not None:
                        peer_arg = arg(args, kwargs, "dst" if p2p == "send" else "src")
                        if peer_arg is None:  # given as a rank within the group
                            group_peer = arg(args, kwargs, "group_dst" if p2p == "send" else "group_src")
                            if group_peer is not None:
                                peer_arg = dist.get_global_rank(g, int(group_peer))
                        peer = int(peer_arg) if peer_arg is not None else -1
                        me = tracer.rank
                        src, dst = (me, peer) if p2p == "send" else (peer, me)
                        pg = f"{pg}/p2p:{src}->{dst}"
                    ledger = tracer.ledger
                    if p2p is None and ledger is not None and ledger.covers(pg, g, dist):
                        claim = ledger.entered(pg, name, nbytes, dtype, async_op)
                        row = claim.row
                    else:
                        row = tracer.collective_entered(pg, tracer.next_seq(pg), name, nbytes, dtype, peer, async_op)
                    if _is_cuda(tensor):
                        # arrival = when the compute stream reaches the collective (a CUDA event)
                        cuda_start = tracer.cuda_timer().begin()
            except Exception:
                tracer.count_drop(f"collectives:{name}:record_error")
                row = None
        _inside.depth = 1
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            if row is not None:
                try:
                    tracer.collective_failed(row)
                except Exception:
                    pass
            raise
        finally:
            _inside.depth = 0
            if claim is not None:
                claim.t1 = tracer.clock()  # the ring's entry of this call was created before this
        if row is not None:
            try:
                if cuda_start is not None and not (result is not None and hasattr(result, "is_completed")):
                    # a sync op: the compute stream waits for it, so an event after it marks completion
                    tracer.cuda_timer().end(cuda_start, row)
                elif result is not None and hasattr(result, "is_completed"):
                    try:
                        fut = result.get_future()
                    except RuntimeError:  # e.g. gloo p2p: "Work::getFuture not implemented"
                        tracer.watch(result, row)
                    else:
                        fut.add_done_callback(lambda _f, r=row: tracer.collective_completed(r))
                else:
                    tracer.collective_completed(row)
            except Exception:
                tracer.count_drop(f"collectives:{name}:completion_error")
        return result

    wrapper.__ranklens_wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def _register_group(tracer: Any, dist: Any, g: Any, pg: str) -> None:
    try:
        ranks = [int(r) for r in dist.get_process_group_ranks(g)]
        try:
            backend = str(dist.get_backend(g))
        except Exception:
            backend = ""
        tracer.add(
            "process_groups",
            {
                "job_id": tracer.job_id,
                "attempt": tracer.attempt,
                "pg": pg,
                "name": str(getattr(g, "group_desc", "") or ""),
                "backend": backend,
                "ranks": ranks,
                "created_ns": tracer.clock(),
            },
        )
    except Exception:
        tracer.count_drop("process_groups:record_error")


def _wrap_new_group(tracer: Any, fn: Any, c10d: Any) -> Any:
    @functools.wraps(fn)
    def new_group(*args: Any, **kwargs: Any) -> Any:
        g = fn(*args, **kwargs)
        try:
            if g is not None and tracer.enabled and not c10d._rank_not_in_group(g):
                pg = c10d._get_process_group_name(g)
                tracer._pg_names[id(g)] = (pg, g)
                _register_group(tracer, c10d, g, pg)
        except Exception:
            tracer.count_drop("process_groups:record_error")
        return g

    new_group.__ranklens_wrapped__ = fn  # type: ignore[attr-defined]
    return new_group


# DeviceMesh dimension names -> the coordinate they give (several data-parallel dimensions, e.g.
# HSDP's replicate x shard, are flattened into one dp index).
_MESH_ROLES = {
    "pp": ("pp", "pipe", "pipeline", "stage", "pipeline_parallel"),
    "tp": ("tp", "tensor", "model", "mp", "tensor_parallel"),
    "dp": ("dp", "data", "dp_replicate", "dp_shard", "fsdp", "ddp", "hsdp", "replicate", "shard", "data_parallel"),
}


def mesh_coords(mesh: Any, world_size: int) -> dict[str, int] | None:
    """This rank's (pp, tp, dp) from a DeviceMesh over the whole job, by dimension name; None for a
    mesh without names, a sub-mesh, or a rank outside it."""
    names = getattr(mesh, "mesh_dim_names", None)
    if not names or getattr(mesh, "_root_mesh", None) is not None or int(mesh.size()) != int(world_size):
        return None
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    out: dict[str, int] = {}
    dp = None
    for name, c, n in zip(names, coord, tuple(mesh.shape)):
        role = next((r for r, aliases in _MESH_ROLES.items() if str(name).lower() in aliases), None)
        if role == "dp":
            dp = int(c) if dp is None else dp * int(n) + int(c)
        elif role is not None and role not in out:
            out[role] = int(c)
    if dp is not None:
        out["dp"] = dp
    return out or None


def _wrap_mesh_init(tracer: Any, init: Any) -> Any:
    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        try:
            if tracer.enabled:
                coords = mesh_coords(self, tracer.world_size)
                if coords:
                    tracer.set_coords(coords)
        except Exception:
            tracer.count_drop("ranks:mesh_coords_error")

    __init__.__ranklens_wrapped__ = init  # type: ignore[attr-defined]
    return __init__


def patch(tracer: Any) -> None:
    """Install wrappers on ``torch.distributed`` and ``torch.distributed.distributed_c10d``, and on
    ``DeviceMesh`` (its dimension names give the rank's pp/tp/dp coordinates); start reading
    torch's flight-recorder ring into the ledger (``tracer.ledger``) unless ``RANKLENS_FR_LEDGER=0``
    or torch records no ring here."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if tracer.ledger is None and os.environ.get(ENV_FR_LEDGER, "1").strip().lower() not in ("0", "false", "no"):
        from ranklens.tracing._ledger import Ledger

        tracer.ledger = Ledger.create(tracer)

    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - old torch
        DeviceMesh = None  # type: ignore[misc, assignment]  # no device mesh in this torch
    if DeviceMesh is not None:
        init = getattr(DeviceMesh.__init__, "__ranklens_wrapped__", DeviceMesh.__init__)
        _originals.setdefault((DeviceMesh, "__init__"), init)
        DeviceMesh.__init__ = _wrap_mesh_init(tracer, init)  # type: ignore[method-assign]

    for name in [*_OPS, "new_group"]:
        orig = getattr(c10d, name, None)
        if orig is None:
            continue
        orig = getattr(orig, "__ranklens_wrapped__", orig)
        wrapped = _wrap_new_group(tracer, orig, c10d) if name == "new_group" else _wrap(tracer, name, orig, c10d)
        for mod in (dist, c10d):
            if getattr(mod, name, None) is not None:
                _originals.setdefault(
                    (mod, name), getattr(getattr(mod, name), "__ranklens_wrapped__", getattr(mod, name))
                )
                setattr(mod, name, wrapped)


def unpatch() -> None:
    for (mod, name), orig in _originals.items():
        setattr(mod, name, orig)
    _originals.clear()
