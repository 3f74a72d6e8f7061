"""In-process capture inside each training rank: steps, phases and every collective.

Light by design: imports only the standard library and torch (and only when used). Typical use::

    import ranklens.tracing as rlt

    dist.init_process_group("gloo")
    rlt.init()                                  # after init_process_group
    model = DDP(model); rlt.instrument_ddp(model)
    for i, batch in enumerate(loader):
        with rlt.step(i):
            with rlt.phase("forward"):
                loss = model(batch)
            ...
    rlt.shutdown()

Everything is a no-op until :func:`init` is called, and stays one when ``RANKLENS_DISABLE=1``.
Records go to a local spool (``RANKLENS_SPOOL``, default ``/tmp/ranklens-spool``) that
``ranklens collect`` ships to the store.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import time
import uuid
from typing import Any

from ranklens._guard import require_installed_name
from ranklens.config import DEFAULT_SPOOL_DIR as DEFAULT_SPOOL
from ranklens.config import (
    ENV_ATTEMPT,
    ENV_AUTOSTEP,
    ENV_DDP,
    ENV_DISABLE,
    ENV_FR_INTERVAL_S,
    ENV_FR_STUCK_S,
    ENV_JOB_ID,
    ENV_PROFILE_EVERY,
    ENV_SIGTERM_FLUSH,
    ENV_SPOOL,
    env_float,
    env_int,
)
from ranklens.tracing.tracer import Tracer

require_installed_name(__name__, "ranklens.tracing")  # not `import tracing` from the repository root

__all__ = ["Tracer", "allreduce_hook", "get_tracer", "init", "instrument_ddp", "phase", "shutdown", "step"]

log = logging.getLogger("ranklens.tracing")


_tracer: Tracer | None = None


def get_tracer() -> Tracer | None:
    """The active tracer of this process, or None."""
    return _tracer


def _agree_on_job_id(dist: Any) -> str:
    """A job id shared by all ranks: env, torchelastic's run id, or one rank 0 puts in the store."""
    for var in (ENV_JOB_ID, "TORCHELASTIC_RUN_ID"):
        v = os.environ.get(var)
        if v and v != "none":
            from ranklens.formats.spool import clean_text

            return clean_text(v)  # non-UTF-8 bytes in the variable: U+FFFD, never a lone surrogate
    if dist is not None and dist.is_initialized():
        try:
            store = dist.distributed_c10d._get_default_store()
            if dist.get_rank() == 0:
                store.set("ranklens/job_id", f"job-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}")
            return store.get("ranklens/job_id").decode()
        except Exception:
            log.exception("ranklens: could not agree on a job id through the store")
    return f"local-{socket.gethostname()}-{os.getpid()}"


def _default_store(dist: Any) -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def init(
    *,
    job_id: str | None = None,
    attempt: int | None = None,
    spool_dir: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    flush_interval_s: float = 0.5,
    patch_distributed: bool = True,
    ddp: bool = True,
    fr_stuck_s: float | None = None,
    fr_interval_s: float | None = None,
    profile_every: int | None = None,
    profile_steps: int = 1,
    profile_trigger: str | None = None,
    profile_signal: int | None = None,
    otel_provider: Any = None,
    dataloader: bool = True,
    autostep: bool = True,
    pp: int | None = None,
    tp: int | None = None,
    dp: int | None = None,
) -> Tracer | None:
    """Start tracing this rank. Call after ``torch.distributed.init_process_group``.

    Args:
        job_id: shared by all ranks; default ``$RANKLENS_JOB_ID``, ``$TORCHELASTIC_RUN_ID``, or
            agreed through the default process group's store.
        attempt: restart attempt; default ``$RANKLENS_ATTEMPT`` or ``$TORCHELASTIC_RESTART_COUNT``.
        spool_dir: local spool root; default ``$RANKLENS_SPOOL`` or ``/tmp/ranklens-spool``.
        rank, world_size: default from torch.distributed (or ``$RANK``/``$WORLD_SIZE``).
        patch_distributed: wrap torch.distributed's collectives to record the arrival ledger.
        ddp: trace DDP's gradient-bucket all-reduces automatically (a communication hook is
            registered at each DDP model's first forward unless the user registered their own);
            ``RANKLENS_DDP=0`` turns it off.
        fr_stuck_s: dump torch's flight-recorder buffer when a collective has been in flight this
            long (default ``$RANKLENS_FR_STUCK_S`` or 30; 0 turns it off). It is also dumped when a
            collective fails. Dumps go to ``<spool>/<job>/<attempt>/fr/``.
        fr_interval_s: also dump it every this many seconds (default ``$RANKLENS_FR_INTERVAL_S``
            or 0: off).
        profile_every: run a torch.profiler window every this many steps (default
            ``$RANKLENS_PROFILE_EVERY`` or 0: only on demand); ``profile_steps`` steps per window.
        profile_trigger: a file whose appearance starts a window (default
            ``<spool>/<job>/<attempt>/profile-now``: ``touch`` it to profile every rank's next step).
        profile_signal: a signal number that starts a window (e.g. ``signal.SIGUSR2``; default none).
            Traces go to ``<spool>/<job>/<attempt>/kineto/`` and the collector ingests them.
        pp, tp, dp: this rank's pipeline-stage, tensor- and data-parallel coordinates, when the
            training code knows them; ranks of the same pipeline stage are compared as peers.
        dataloader: time every DataLoader ``next()`` as a ``data`` phase (automatic input-wait timing).
        autostep: infer steps (from optimizer steps) and the data/forward/backward/optimizer phases
            of a script that marks none (``RANKLENS_AUTOSTEP=0`` turns it off); the script's own
            :func:`step` / :func:`phase` markers win over it. Inferred steps are stored with
            ``source = 'inferred'``.
        otel_provider: an OpenTelemetry ``TracerProvider`` to emit a ``train step`` span per step
            (phases as children; flushed, never shut down, by ranklens). Without it, spans are
            exported only when the standard OTEL_* variables ask for it (``OTEL_TRACES_EXPORTER``,
            ``OTEL_EXPORTER_OTLP_ENDPOINT``). Per-rank OTLP metrics (step time, collective wait
            time) follow ``OTEL_METRICS_EXPORTER`` / the OTLP endpoint variables; see
            docs/opentelemetry.md.

    Returns:
        The tracer, or None when disabled by ``RANKLENS_DISABLE=1`` or when setup failed (the
        failure is logged; tracing never raises into the training script).

    Collectives issued before the first ``init`` of a process (DDP's parameter broadcast) are the
    job's. ``init`` again after :func:`shutdown` (a new job id in the same processes) records the
    collectives issued from then on only: none of the previous job's.
    """
    global _tracer
    if os.environ.get(ENV_DISABLE, "").lower() in ("1", "true", "yes"):
        return None
    if _tracer is not None and _tracer.enabled:
        return _tracer
    try:
        try:
            import torch.distributed as dist
        except ImportError:
            dist = None  # type: ignore[assignment]
        initialized = dist is not None and dist.is_available() and dist.is_initialized()
        if rank is None:
            rank = dist.get_rank() if initialized else int(os.environ.get("RANK", "0"))
        if world_size is None:
            world_size = dist.get_world_size() if initialized else int(os.environ.get("WORLD_SIZE", "1"))
        if attempt is None:
            attempt = int(os.environ.get(ENV_ATTEMPT) or os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
        tracer = Tracer(
            job_id=job_id or _agree_on_job_id(dist if initialized else None),
            attempt=attempt,
            rank=rank,
            world_size=world_size,
            local_rank=int(os.environ.get("LOCAL_RANK", "-1")),
            coords={"pp": pp, "tp": tp, "dp": dp},
            spool_dir=spool_dir or os.environ.get(ENV_SPOOL) or DEFAULT_SPOOL,
            flush_interval_s=flush_interval_s,
            fr_stuck_s=fr_stuck_s if fr_stuck_s is not None else env_float(ENV_FR_STUCK_S, 30.0, minimum=0),
            fr_interval_s=(
                fr_interval_s if fr_interval_s is not None else env_float(ENV_FR_INTERVAL_S, 0.0, minimum=0)
            ),
            store=_default_store(dist) if initialized else None,
        )
        from ranklens.tracing.otel import StepSpans
        from ranklens.tracing.profiler import ProfilerWindows

        tracer.spans = StepSpans.create(
            otel_provider, job_id=tracer.job_id, attempt=attempt, rank=rank, world_size=world_size
        )

        job_dir = os.path.dirname(tracer.kineto_dir)
        tracer.profiler = ProfilerWindows(
            tracer.kineto_dir,
            rank,
            every=profile_every if profile_every is not None else env_int(ENV_PROFILE_EVERY, 0, minimum=0),
            active_steps=profile_steps,
            trigger_file=profile_trigger or os.path.join(job_dir, "profile-now"),
            signum=profile_signal,
            check_every=1,
        )
        if patch_distributed and dist is not None and dist.is_available():
            from ranklens.tracing import _patch

            _patch.patch(tracer)
            if initialized:  # the world group is a member of every job
                import torch.distributed.distributed_c10d as c10d

                g = c10d._get_default_group()
                pg = c10d._get_process_group_name(g)
                tracer._pg_names[id(g)] = (pg, g)
                _patch._register_group(tracer, c10d, g, pg)
            if ddp and os.environ.get(ENV_DDP, "1").lower() not in ("0", "false", "no"):
                from ranklens.tracing import _ddp

                _ddp.patch_ddp(tracer)
        if dataloader:
            try:
                from ranklens.tracing import _dataloader

                _dataloader.patch_dataloader(tracer)
            except Exception:
                log.exception("ranklens: could not instrument DataLoader; input waits are not timed")
        if autostep and os.environ.get(ENV_AUTOSTEP, "1").lower() not in ("0", "false", "no"):
            try:
                from ranklens.tracing._autostep import AutoStep

                tracer.autostep = AutoStep(tracer).install()
            except Exception:
                tracer.autostep = None
                log.exception("ranklens: could not install step inference; unmarked steps stay unknown")
        _tracer = tracer
        # once per process however often init() runs (the fork hook is the tracer module's own,
        # registered once at import with weak references: issue 13)
        atexit.unregister(shutdown)
        atexit.register(shutdown)
        if os.environ.get(ENV_SIGTERM_FLUSH, "1").lower() not in ("0", "false", "no"):
            from ranklens.tracing import _sigterm

            # a launcher's SIGTERM (torch elastic tearing the group down, Slurm, Kubernetes) ends
            # the rank after its last rows are written, not before
            _sigterm.install(flush=tracer.flush, shutdown=lambda: shutdown(2.0))
        return tracer
    except Exception:
        log.exception("ranklens: tracing could not start; training continues untraced")
        return None


def shutdown(timeout_s: float = 5.0) -> None:
    """Flush and stop tracing (also runs at interpreter exit)."""
    global _tracer
    t = _tracer
    if t is None:
        return
    try:
        if t.autostep is not None:
            t.autostep.close()  # the last inferred step, before the final flush
        t.shutdown(timeout_s)
        from ranklens.tracing import _dataloader, _ddp, _patch

        _patch.unpatch()
        _ddp.unpatch_ddp()
        _dataloader.unpatch_dataloader()
    except Exception:
        log.exception("ranklens: shutdown failed")
    from ranklens.tracing._fr_ring import mark_job_ended

    mark_job_ended()  # the next init's ring reader starts after what this job left in torch's ring
    _tracer = None


def step(n: int, **info: Any) -> contextlib.AbstractContextManager[None]:
    """``with step(n):`` times training step ``n`` (a no-op when tracing is off)."""
    t = _tracer
    return t.step(n, **info) if t is not None and t.enabled else contextlib.nullcontext()


class phase(contextlib.ContextDecorator):  # used like a function: rl.phase("forward")
    """Times a phase of the current step, as ``with phase("forward"):`` or as a decorator
    ``@phase("forward")``. The tracer is looked up when the phase starts, so a decorator applied
    before :func:`init` still records; a no-op while tracing is off."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._cms: list[contextlib.AbstractContextManager[None]] = []

    def __enter__(self) -> None:
        t = _tracer
        cm = t.phase(self.name) if t is not None and t.enabled else contextlib.nullcontext()
        self._cms.append(cm)  # a stack: the same decorated function may recurse
        cm.__enter__()

    def __exit__(self, *exc: Any) -> bool:
        return bool(self._cms.pop().__exit__(*exc))


def allreduce_hook(process_group, bucket):
    """A DDP communication hook: DDP's averaging all-reduce, routed through the traced
    ``all_reduce`` so every gradient bucket lands in the arrival ledger.

    (No annotations on purpose: DDP rejects string annotations, and this module uses
    ``from __future__ import annotations``.)"""
    import torch.distributed as dist

    group = process_group if process_group is not None else dist.group.WORLD
    buf = bucket.buffer()
    tracer = _tracer
    if tracer is not None:  # NaN/Inf on this rank, seen before the all-reduce spreads it (no GPU sync)
        tracer.nonfinite.bucket(buf, bucket.index())
    # divided before, as torch's own all-reduce hook does: on the calling thread, while earlier
    # buckets are in flight, not in the completion callback after the wait
    buf.div_(dist.get_world_size(group))
    work = dist.all_reduce(buf, group=group, async_op=True)
    return work.get_future().then(_first)


def _first(fut):
    return fut.value()[0]


def instrument_ddp(model: Any, process_group: Any = None) -> Any:
    """Register :func:`allreduce_hook` on a ``DistributedDataParallel`` model; returns it.

    Not needed after :func:`init` (which instruments DDP models automatically); calling it
    anyway is harmless. Never raises: a model that already has a hook is left as it is."""
    if getattr(model, "_ranklens_user_hook", False):
        return model
    try:
        model.register_comm_hook(process_group or model.process_group, allreduce_hook)
    except Exception:
        log.exception("ranklens: could not register the DDP hook; DDP all-reduces go untraced")
    return model
