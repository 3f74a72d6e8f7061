"""``ranklens drill``: run a training command with faults injected, watch the findings live, score.

The command runs as under ``ranklens run`` (the bootstrap traces every rank, a shipper moves the
spool into the store while it runs) with ``$RANKLENS_DRILL`` naming the plan, so each rank injects
its faults (:mod:`ranklens.drill.inject`). Around it the drill does what a node's collector would:
it filters the command's output at the source into ``log_events`` and, for GPU faults on a machine
without GPUs, samples a fake NVML (one GPU per local rank, the XID raised when the rank reports the
fault's onset) into ``gpu_events``. A live analysis pass (the loop of ``analyze --follow``) runs every
``interval_s``; the first pass that shows a finding is its detection time.

The drill ends when the command ends; a hang, crash or desync ends it (the process group is
stopped) once it was detected, or ``detect_timeout_s`` after its onset. One last pass analyses
everything shipped. The result is scored (:mod:`ranklens.drill.score`) and stored in ``drills``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ranklens.collector import Shipper
from ranklens.config import ENV_FR_STUCK_S, ENV_HOST, node_name
from ranklens.drill.faults import DrillFault, DrillKind, truth_records, validate_targets
from ranklens.drill.inject import ENV_DRILL
from ranklens.drill.score import FaultScore, Onset, Seen, Target, costless, score
from ranklens.errors import ConfigError
from ranklens.launch import traced_env
from ranklens.store.api import Store

__all__ = ["DrillResult", "job_shape", "nodes_of", "run_drill", "world_size_of"]


@dataclass
class DrillResult:
    drill_id: str
    name: str
    job_id: str
    command: list[str]
    scores: list[FaultScore]
    false_findings: list[Seen]
    exit_code: int | None
    stopped_by_drill: bool
    job_failed: str  # why the job failed by itself ("" it did not)
    wall_s: float
    log_path: str
    findings_seen: int = 0
    rows: dict[str, int] = field(default_factory=dict)
    costless_findings: list[Seen] = field(default_factory=list)  # warnings that cost the job ~nothing
    recovering: bool = False  # run with a recovery policy: fatal faults must end in training resumed

    @property
    def passed(self) -> bool:
        ok = not self.job_failed and not self.false_findings and all(s.ok for s in self.scores)
        if ok and self.recovering:
            fatal = [s for s in self.scores if s.fault.fatal and s.applied]
            ok = all(s.resumed_s is not None for s in fatal) and (not fatal or self.exit_code == 0)
        return ok

    def to_json(self) -> dict[str, Any]:
        return {
            "drill_id": self.drill_id,
            "name": self.name,
            "job_id": self.job_id,
            "command": self.command,
            "passed": self.passed,
            "faults": [s.to_json() for s in self.scores],
            "false_findings": [
                {"id": s.id, "kind": s.kind, "ranks": list(s.ranks), "title": s.title} for s in self.false_findings
            ],
            "costless_findings": [
                {"id": s.id, "kind": s.kind, "ranks": list(s.ranks), "title": s.title} for s in self.costless_findings
            ],
            "exit_code": self.exit_code,
            "stopped_by_drill": self.stopped_by_drill,
            "job_failed": self.job_failed,
            "wall_s": round(self.wall_s, 2),
            "findings_seen": self.findings_seen,
            "recovering": self.recovering,
            "log": self.log_path,
        }


def world_size_of(command: Sequence[str]) -> int | None:
    """The world size a torchrun-style command asks for (``--nproc-per-node N`` times ``--nnodes M``),
    or None when the command does not say."""
    nproc, nnodes = None, 1
    args = list(command)
    for i, a in enumerate(args):
        for name in ("--nproc-per-node", "--nproc_per_node", "--nnodes"):
            val = None
            if a == name and i + 1 < len(args):
                val = args[i + 1]
            elif a.startswith(name + "="):
                val = a.split("=", 1)[1]
            if val is None:
                continue
            if not re.fullmatch(r"\d+", val):
                return None  # "gpu", "auto", "1:4": not known here
            if name == "--nnodes":
                nnodes = int(val)
            else:
                nproc = int(val)
    return nproc * nnodes if nproc else None


def nodes_of(command: Sequence[str]) -> int | None:
    """The nodes a torchrun command asks for: its ``--nnodes N`` (1 without one), None when the
    command is not torchrun or the number is not fixed (``1:4``)."""
    from ranklens.drill.network import torchrun_prefix

    if torchrun_prefix(command) is None:
        return None
    args = list(command)
    for i, a in enumerate(args):
        val = args[i + 1] if a == "--nnodes" and i + 1 < len(args) else None
        val = a.split("=", 1)[1] if a.startswith("--nnodes=") else val
        if val is not None:
            return int(val) if re.fullmatch(r"\d+", val) else None
    return 1


def job_shape(
    command: Sequence[str], faults: Sequence[DrillFault], world_size: int | None = None
) -> tuple[int | None, int | None]:
    """(world size, nodes) of a drill's job, None where not known: on the network bed (a slow_link
    fault) the bed's nodes (the command's ``--nnodes``, default 3) times its ``--nproc-per-node``.

    Raises:
        ConfigError: a slow_link drill whose command is not torchrun, or has no fixed node count.
    """
    from ranklens.drill.network import needs_bed, node_count

    if not needs_bed(faults):
        return world_size or world_size_of(command), nodes_of(command)
    nodes = node_count(command)
    per_node = world_size_of(command)
    if world_size is None and per_node is not None:
        world_size = per_node * nodes // max(1, nodes_of(command) or 1)
    return world_size, nodes


def _node_targets(ready: dict[int, dict[str, Any]]) -> dict[int, Target]:
    """Node index -> its ranks and host, from the ranks' ``ready`` records."""
    ranks: dict[int, set[int]] = {}
    hosts: dict[int, set[str]] = {}
    for r, rec in ready.items():
        k = int(rec.get("node", 0))
        ranks.setdefault(k, set()).add(int(r))
        if rec.get("host"):
            hosts.setdefault(k, set()).add(str(rec["host"]))
    return {k: Target(frozenset(v), frozenset(hosts.get(k, ()))) for k, v in ranks.items()}


class _Output:
    """The command's output: to a file, filtered at the source into log events, optionally echoed."""

    def __init__(self, path: Path, echo: IO[bytes] | None) -> None:
        from ranklens.collector.logfilter import LogFilter

        self.path = path
        self.file = open(path, "wb")
        self.filter = LogFilter().stream(source=str(path), stream="stdout")
        self.echo = echo
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.pipe: IO[bytes] | None = None

    def pump(self, pipe: IO[bytes]) -> None:
        def run() -> None:
            for chunk in iter(lambda: pipe.read1(65536) if hasattr(pipe, "read1") else pipe.read(65536), b""):
                with self.lock:
                    self.file.write(chunk)
                    self.file.flush()
                    self.filter.feed(chunk)
                if self.echo is not None:
                    self.echo.write(chunk)
                    self.echo.flush()

        self.pipe = pipe
        self.thread = threading.Thread(target=run, name="ranklens-drill-output", daemon=True)
        self.thread.start()

    def take(self, *, eof: bool = False) -> list[Any]:
        """The log events of what was written since the last call (``eof``: the output ended)."""
        with self.lock:
            self.filter.feed(b"", idle=not eof, eof=eof)
            return self.filter.flush()

    def close(self) -> None:
        if self.thread is not None:
            self.thread.join(timeout=10)
        if self.pipe is not None and (self.thread is None or not self.thread.is_alive()):
            self.pipe.close()
        self.file.close()


class _FakeGpus:
    """One fake GPU per local rank, sampled like the collector samples NVML; raises each GPU fault's
    XID on its rank's GPU when the rank reports the onset."""

    def __init__(self, count: int, job_id: str) -> None:
        from ranklens.collector.fake_nvml import FakeGpu, FakeNvml
        from ranklens.collector.nvml import GpuSampler, RankResolver

        self.nvml = FakeNvml([FakeGpu(uuid=f"GPU-ranklens-drill-{i:02d}") for i in range(count)])
        self.sampler = GpuSampler(self.nvml, resolver=RankResolver())
        self.sampler.start()
        self.raised: set[int] = set()

    def update(self, ready: dict[int, dict[str, Any]], onsets: dict[int, Onset], faults: list[DrillFault]) -> None:
        for rec in ready.values():
            i = int(rec.get("local_rank", 0))
            if 0 <= i < len(self.nvml.gpus) and not self.nvml.gpus[i].processes:
                self.nvml.gpus[i].processes = [(int(rec["pid"]), 1 << 30)]
        for i, f in enumerate(faults):
            if f.kind is DrillKind.GPU and i in onsets and i not in self.raised:
                # the rank's GPU; a node fault: every GPU of the node's ranks
                owners = [ready[f.rank]] if f.node < 0 and f.rank in ready else []
                owners += [r for r in ready.values() if f.node >= 0 and int(r.get("node", 0)) == f.node]
                for owner in owners:
                    self.nvml.inject_xid(int(owner.get("local_rank", 0)), int(f.severity))
                if owners:
                    self.raised.add(i)

    def close(self) -> None:
        self.sampler.close()

    def sample(self, store: Store) -> int:
        r = self.sampler.sample()
        n = 0
        if r.samples:
            n += store.write("gpu_samples", r.samples)
        if r.events:
            n += store.write("gpu_events", r.events)
        return n


def _read_truth(truth: Path) -> tuple[dict[int, dict[str, Any]], dict[int, Onset]]:
    ready: dict[int, dict[str, Any]] = {}
    onsets: dict[int, Onset] = {}
    for rec in truth_records(truth):  # rank<R>.jsonl, and link.jsonl: the slow links' onsets
        if rec.get("event") == "ready":
            ready[int(rec["rank"])] = rec
        elif rec.get("event") == "onset":
            onsets.setdefault(int(rec["fault"]), Onset(int(rec["ts_ns"]), int(rec.get("step", -1))))
    return ready, onsets


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
    """SIGTERM the command's process group, then SIGKILL what is left."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    try:  # ranks that outlived their launcher
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_drill(
    store: Store,
    command: Sequence[str],
    faults: list[DrillFault],
    *,
    name: str = "",
    world_size: int | None = None,
    timeout_s: float = 600.0,
    detect_timeout_s: float = 60.0,
    interval_s: float = 1.0,
    echo: IO[bytes] | None = None,
    log: Callable[[str], None] = lambda s: None,
    save: bool = True,
    policy: Any = None,
    outbox_dir: str = "",
    job_id: str = "",
    require_fault: bool = True,
    on_pass: Callable[[Path], None] | None = None,
) -> DrillResult:
    """Run ``command`` with ``faults`` injected; returns the scored result (stored in ``drills``).

    With ``policy`` (a recovery policy with executors, e.g. torchrun in-place restarts), findings are
    acted on as under ``ranklens run --recover``: a hang, crash or desync does not end the drill, the
    job is followed into its next attempt and each fault's *fault -> training resumed* time is measured.

    ``job_id`` names the job (default: the drill's id); ``require_fault=False`` runs a drill with no
    fault (every finding is then a false alarm: the healthy demo); ``on_pass`` is called with the
    job's log file after every live pass (progress).

    Raises:
        ConfigError: no command, no fault, a rank outside the world (exit 2).
    """
    from ranklens.drill.network import LinkBed, needs_bed

    if not command:
        raise ConfigError(
            "ranklens drill needs a command after --, e.g. ranklens drill --fault hang:1@5 -- torchrun ..."
        )
    if not faults and require_fault:
        raise ConfigError("ranklens drill needs at least one --fault (or --suite)")
    on_bed = needs_bed(faults)
    world, nodes = job_shape(command, faults, world_size)
    validate_targets(faults, world, nodes)
    args = dict(
        name=name, world=world, timeout_s=timeout_s, detect_timeout_s=detect_timeout_s, interval_s=interval_s,
        echo=echo, log=log, save=save, policy=policy, outbox_dir=outbox_dir, job_id=job_id, on_pass=on_pass,
    )  # fmt: skip
    if not on_bed:
        return _run(store, list(command), faults, None, **args)
    assert nodes is not None  # the bed's size is always known (job_shape)
    with LinkBed(nodes, log=log) as bed:  # removed on every way out, signals included
        return _run(store, list(command), faults, bed, **args)


def _run(
    store: Store,
    command: list[str],
    faults: list[DrillFault],
    bed: Any,
    *,
    name: str,
    world: int | None,
    timeout_s: float,
    detect_timeout_s: float,
    interval_s: float,
    echo: IO[bytes] | None,
    log: Callable[[str], None],
    save: bool,
    policy: Any,
    outbox_dir: str,
    job_id: str,
    on_pass: Callable[[Path], None] | None,
) -> DrillResult:
    from ranklens.drill.network import Throttler, agent_commands
    from ranklens.drill.store import save_drill
    from ranklens.recover import RecoverySupervisor, recovery_times

    drill_id = job_id or f"drill-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    job_id = drill_id
    work = Path(tempfile.mkdtemp(prefix="ranklens-drill-"))
    spool, truth = work / "spool", work / "truth"
    spool.mkdir()
    truth.mkdir()
    plan = work / "plan.json"
    plan.write_text(json.dumps({"truth_dir": str(truth), "faults": [f.to_json() for f in faults]}))
    # "{drill_dir}" in the command: this drill's own directory (a checkpoint that survives a restart)
    command = [a.replace("{drill_dir}", str(work)) for a in command]
    env = traced_env(dict(os.environ), job_id=job_id, spool_dir=str(spool))
    if policy is not None:  # stacks dumped before the restart (as under `ranklens run --recover`)
        env.setdefault(ENV_FR_STUCK_S, "5")
    env[ENV_DRILL] = str(plan)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # what to start: the command, or on the network bed one torchrun agent per node (its own output)
    launches: list[tuple[list[str], dict[str, str], str, _Output]] = []
    if bed is None:
        launches.append((command, env, node_name(), _Output(work / "job.log", echo)))
    else:
        for k, argv in enumerate(agent_commands(command, bed)):
            host = bed.hostname(k)
            node_env = {**env, **bed.env(k), ENV_HOST: host}
            launches.append((argv, node_env, host, _Output(work / f"job-{host}.log", echo)))
    outs = [(o, host) for _, _, host, o in launches]
    gpus = _FakeGpus(max(world or 1, 8), job_id) if any(f.kind is DrillKind.GPU for f in faults) else None
    logs = ", ".join(str(o.path) for o, _ in outs)
    log(f"drill {drill_id}: {', '.join(f.spec for f in faults)}; job log{'s' if len(outs) > 1 else ''} {logs}")

    # a policy that does nothing (dry run, no executor) cannot bring a stopped job back: the drill
    # then ends a hang, crash or desync job once it is detected, as without a policy
    acting = policy is not None and not policy.dry_run and bool(policy.executors)
    if policy is not None and not acting:
        log("drill: the recovery policy is a dry run or has no [[executor]]: decisions are recorded, nothing is done")
    sup = RecoverySupervisor(store, job_id, policy, outbox_dir=outbox_dir, spool_dir=str(spool), log=log)
    shipper = Shipper(spool, store)
    loop = shipper.start(interval_s=0.5)
    throttle = Throttler(bed, faults, truth, log=log).start() if bed is not None else None
    start = time.monotonic()
    procs: list[subprocess.Popen[bytes]] = []

    def stop_all() -> None:
        for p in procs:
            if p.poll() is None:
                _stop(p)

    def cleanup() -> None:
        sup.stop()
        if gpus is not None:
            gpus.close()
        if throttle is not None:
            throttle.stop()

    for argv, e, _host, o in launches:
        try:
            proc = subprocess.Popen(
                argv, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
            )
        except OSError as err:
            stop_all()
            loop.close(timeout_s=0)
            cleanup()
            raise ConfigError(f"cannot start {argv[0]!r}: {err.strerror}") from None
        procs.append(proc)
        assert proc.stdout is not None
        o.pump(proc.stdout)
    stopped, deadline_hit = False, ""
    world_checked = world is not None

    def running() -> bool:
        return any(p.poll() is None for p in procs)

    def one_pass() -> None:
        # the job's output belongs to the attempt running now (torch elastic restarts the group)
        attempt = sup.attempt or 0
        rows = [ev.to_row(job_id=job_id, attempt=attempt, host=host) for o, host in outs for ev in o.take()]
        if rows:
            store.write("log_events", rows)
        ready, onsets = _read_truth(truth)
        if gpus is not None:
            gpus.update(ready, onsets, faults)
            gpus.sample(store)
        sup.one_pass()

    def seen() -> list[Seen]:
        return [
            Seen(
                f.id,
                f.kind,
                tuple(s.rank for s in f.suspects),
                f.title,
                first,
                f.first_seen_ns,
                dict(f.evidence),
                f.severity.value,
                float(f.step_time_pct),
                tuple(sorted({x for s in f.suspects for x in (s.node, *s.link) if x and x != "network"})),
                int(f.first_seen_step),
            )
            for f, first in sup.found.values()
        ]

    said = ""
    try:
        while running():
            time.sleep(interval_s)
            try:
                one_pass()
                said = ""
            except Exception as e:  # the store hiccupped: the next pass tries again (said once)
                if type(e).__name__ != said:
                    log(f"drill: analysis pass failed (retrying): {type(e).__name__}: {e}")
                    said = type(e).__name__
                continue
            if on_pass is not None:
                on_pass(outs[0][0].path)
            ready, onsets = _read_truth(truth)
            if not world_checked and ready:
                w = int(next(iter(ready.values())).get("world_size", 0))
                if w:
                    world_checked = True
                    try:
                        validate_targets(faults, w)
                    except ConfigError:
                        stop_all()
                        raise
            if time.monotonic() - start > timeout_s:
                deadline_hit = f"the drill's timeout ({timeout_s:.0f} s) passed"
                break
            fatal = [(i, f) for i, f in enumerate(faults) if f.fatal and i in onsets]
            if fatal:
                interim, _ = score(faults, onsets, seen(), _node_targets(ready))
                pending = [
                    i
                    for i, f in fatal
                    if not interim[i].detected and time.time_ns() - onsets[i].ts_ns < detect_timeout_s * 1e9
                ]
                missed = [i for i, f in fatal if not interim[i].detected and i not in pending]
                if not acting and not pending:
                    break  # every fatal fault seen (or out of time): the job will not recover by itself
                if acting and missed:
                    break  # recovering, but a fatal fault went unseen: nothing will restart the job
        if running():
            stopped = True
            stop_all()
    except BaseException:
        cleanup()
        raise
    finally:
        stop_all()
        loop.close(timeout_s=120)  # the last shipping pass
        for o, _ in outs:
            o.close()
    try:
        one_pass()  # what the ranks and the log said last
        attempt = sup.attempt or 0
        rows = [ev.to_row(job_id=job_id, attempt=attempt, host=host) for o, host in outs for ev in o.take(eof=True)]
        if rows:
            store.write("log_events", rows)
            one_pass()
    except Exception as e:
        log(f"drill: final analysis pass failed: {type(e).__name__}: {e}")
    finally:
        cleanup()
    ready, onsets = _read_truth(truth)
    scores, false = score(faults, onsets, seen(), _node_targets(ready))
    false, quiet = costless(false)
    if acting:
        times = {t.finding_id: t for t in recovery_times(store, job_id)}
        for sc in scores:
            t = times.get(sc.finding.id) if sc.finding else None
            if t is not None and sc.onset is not None:
                sc.acted_s = max(0.0, (t.action_ns - sc.onset.ts_ns) / 1e9)
                if t.resumed_ns is not None:
                    sc.resumed_s = max(0.0, (t.resumed_ns - sc.onset.ts_ns) / 1e9)
            if sc.fault.fatal and sc.applied and sc.resumed_s is None and sc.ok:
                sc.note = "detected, but training did not resume" if t else "detected, but nothing was done about it"
    # the job's exit code: the first agent that failed, else 0 (None: still running, never here)
    codes = [p.returncode for p in procs]
    code = next((c for c in codes if c not in (0, None)), codes[0] if codes else None)
    job_failed = ""
    fatal_applied = any(s.applied and s.fault.fatal for s in scores)
    if deadline_hit:
        job_failed = deadline_hit
    elif not stopped and code not in (0, None) and not fatal_applied:
        first = min((o.ts_ns for o in onsets.values()), default=None)
        job_failed = (
            f"the job exited with code {code} "
            + ("before any fault took effect" if first is None else "with no fatal fault injected")
            + f": it failed by itself (see {logs}); not scored as a detection"
        )
    result = DrillResult(
        drill_id=drill_id,
        name=name,
        job_id=job_id,
        command=list(command),
        scores=scores,
        false_findings=false,
        costless_findings=quiet,
        exit_code=code,
        stopped_by_drill=stopped,
        job_failed=job_failed,
        wall_s=time.monotonic() - start,
        log_path=str(outs[0][0].path),
        findings_seen=len(sup.found),
        rows=dict(shipper.totals),
        recovering=acting,
    )
    if save:
        save_drill(store, result)
    return result
