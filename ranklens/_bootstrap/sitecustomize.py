"""ranklens' zero-code bootstrap, put on PYTHONPATH by ``ranklens run``.

It imports nothing heavy. It installs an import hook that waits for
``torch.distributed.distributed_c10d`` to be imported and then wraps ``init_process_group`` so that
``ranklens.tracing.init()`` runs right after the process group exists. The hook is installed only
in training ranks (``RANK`` or ``LOCAL_RANK`` set, as torchrun, torch elastic, Slurm wrappers and
Kubernetes operators do; or a multiprocessing spawn child, as ``torch.multiprocessing.spawn``
ranks are), so every other Python process under ``ranklens run`` (the torchrun launcher, pip, a
compiler's worker pool, ...) is left alone. It then runs the ``sitecustomize``
module it shadows, if there is one, in every process. ``RANKLENS_DISABLE=1`` turns it off.
"""

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_TARGET = "torch.distributed.distributed_c10d"
_HERE = os.path.dirname(os.path.abspath(__file__))


def _patch_c10d(mod):
    orig = mod.init_process_group
    if getattr(orig, "__ranklens_wrapped__", None):
        return

    @functools.wraps(orig)
    def init_process_group(*args, **kwargs):
        try:
            _attempt_store(args, kwargs)
        except Exception:  # as torch would have done it
            pass
        result = orig(*args, **kwargs)
        drill = None
        if os.environ.get("RANKLENS_DRILL"):  # `ranklens drill`: faults injected into this rank
            try:
                import ranklens.drill.inject

                drill = ranklens.drill.inject
                drill.before_init()
            except Exception:
                drill = None
        try:
            import ranklens.tracing as rlt

            rlt.init()
        except Exception:  # tracing never breaks training
            import logging

            logging.getLogger("ranklens.tracing").exception("ranklens: automatic tracing failed to start")
        if drill is not None:
            drill.after_init()
        return result

    init_process_group.__ranklens_wrapped__ = orig  # type: ignore[attr-defined]
    mod.init_process_group = init_process_group


def _attempt_store(args, kwargs):
    """A restarted attempt of a torch elastic job gets a key space of its own in the agent's store.

    torch elastic keeps its store (same MASTER_PORT) across restarts of the worker group, so the
    restarted ranks find the previous attempt's keys: gloo then connects to the dead workers' ports
    ("Gloo connectFullMesh failed ... Connection refused") and the in-place restart never comes up.
    For attempts after the first, when the script leaves the store to torch (no ``store``, the
    ``env://`` init method), the process group is made on the agent's store under the prefix
    ``/ranklens/attempt_<n>/``. One node only (every rank sees the same restart count there);
    ``RANKLENS_ELASTIC_STORE=0`` leaves it to torch."""
    env = os.environ
    if env.get("RANKLENS_ELASTIC_STORE", "1").lower() in ("0", "false", "no"):
        return
    attempt = int(env.get("TORCHELASTIC_RESTART_COUNT") or 0)
    if attempt == 0 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    if len(args) > 1 or kwargs.get("store") is not None or kwargs.get("init_method") not in (None, "env://"):
        return
    if not (env.get("MASTER_ADDR") and env.get("MASTER_PORT") and env.get("RANK") and env.get("WORLD_SIZE")):
        return
    if env.get("LOCAL_WORLD_SIZE") != env.get("WORLD_SIZE"):
        # several nodes: each agent counts its own restarts (a membership change restarts without
        # counting), so their counts may differ and ranks with different prefixes would never meet
        return
    import torch.distributed as dist

    timeout = kwargs.get("timeout") or dist.constants.default_pg_timeout
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timeout)
    kwargs["store"] = dist.PrefixStore(f"/ranklens/attempt_{attempt}/", store)
    kwargs.pop("init_method", None)
    if kwargs.get("rank", -1) is None or kwargs.get("rank", -1) < 0:
        kwargs["rank"] = int(env["RANK"])
    if kwargs.get("world_size", -1) is None or kwargs.get("world_size", -1) < 0:
        kwargs["world_size"] = int(env["WORLD_SIZE"])


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        try:
            _patch_c10d(module)
        except Exception:
            pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


def _chain_shadowed_sitecustomize():
    rest = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None and os.path.dirname(spec.origin or "") != _HERE:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


def _is_training_rank() -> bool:
    # torchrun / torch elastic / launchers set RANK or LOCAL_RANK; the ranks that
    # torch.multiprocessing.spawn starts have neither, but are multiprocessing spawn children
    return bool(os.environ.get("RANK") or os.environ.get("LOCAL_RANK")) or "--multiprocessing-fork" in sys.argv


if os.environ.get("RANKLENS_DISABLE", "").lower() not in ("1", "true", "yes") and _is_training_rank():
    # torch's flight-recorder ring is where the arrival ledger comes from (tracing/_ledger.py); torch
    # sizes it once, before the first process group exists, and some versions default it to 0. A
    # size the user chose (0 included) stands.
    if not os.environ.get("TORCH_FR_BUFFER_SIZE") and not os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE"):
        os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"
    if _TARGET in sys.modules:
        _patch_c10d(sys.modules[_TARGET])
    else:
        sys.meta_path.insert(0, _Finder())
try:
    _chain_shadowed_sitecustomize()
except Exception as e:  # their sitecustomize failing must look like it would without us
    print(f"ranklens: the shadowed sitecustomize raised {e!r}", file=sys.stderr)
