"""In-place restart through torch elastic: the ``torchrun`` executor.

torchrun's elastic agent restarts its whole worker group when one worker fails, as long as the job
has restarts left (``--max-restarts``); the launcher, its rendezvous and ranklens' spool stay, the
workers start again as the next attempt (``TORCHELASTIC_RESTART_COUNT``, which the tracer records as
``attempt``) and resume from the script's last checkpoint. So ``restart_rank`` and ``restart_job``
both come down to ending one worker of the group — for a hang, the stuck rank itself:

1. the rank's process comes from its newest heartbeat (``pid``, ``host``); a process on another
   node is ``skipped`` (the executor acts on the node it runs on: run it where the launcher runs);
   a pid that is no longer that rank of that attempt (its environment's job id, ``RANK`` and restart
   count), or lives in another pid namespace, is never signalled;
2. before the restart, the rank's Python stacks: the tracer writes them with every flight-recorder
   dump (``<spool>/<job>/<attempt>/stacks/stacks_rank_<r>.json``); the executor waits up to
   ``stacks_wait_s`` for that file and puts the innermost frames of its main thread in the result
   (the engine attaches them to the finding), so the cause survives the restart; when none came (a
   rank spinning in C with the GIL held cannot run the tracer's dump thread, an untraced process),
   torch's worker server answers ``dump_traceback`` where the script runs under torch elastic's
   ``worker_main`` (``$TORCH_WORKER_SERVER_SOCKET``: ``stacks_rank_<r>.torch.json``), else ``py-spy
   dump`` reads the stacks from outside the process where py-spy is installed
   (``stacks_rank_<r>.pyspy.json``), each beside the tracer's dump and in its format;
3. ``signal`` (SIGKILL by default: a rank stuck in C++ may never handle a SIGTERM) to that process.

A rank already gone is ``skipped`` (torch elastic handles a dead worker by itself). ``replace_node``
is ``skipped``: torchrun cannot move a rank to another node.
"""

from __future__ import annotations

import json
import linecache
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from ranklens.analyzers.recovery.api import Decision, Level
from ranklens.analyzers.recovery.executors.api import SIGNALS, ExecContext, ExecResult, ExecutorSpec, Option
from ranklens.formats.stacks import parse_faulthandler, read_stack_dump
from ranklens.store.api import sql_escape as _esc

__all__ = ["TorchrunExecutor", "find_tool", "innermost_frames"]

#: the longest a ``py-spy dump`` of one rank may take
PY_SPY_TIMEOUT_S = 10.0
#: the longest torch's worker server may take to answer ``dump_traceback``
WORKER_SERVER_TIMEOUT_S = 5.0
#: torch elastic's variable: the unix socket of a rank's worker server (control_plane.worker_main)
TORCH_WORKER_SERVER_SOCKET = "TORCH_WORKER_SERVER_SOCKET"


def _short(host: str) -> str:
    return host.split(".", 1)[0]


def _is_rank(env: dict[str, str], job_id: str, rank: int, attempt: int) -> bool:
    """Whether a process's environment is rank ``rank`` of ``job_id``'s attempt ``attempt`` (the
    torchrun agent, another rank, or a later attempt's worker that reused the pid are not)."""
    from ranklens.config import ENV_ATTEMPT, ENV_JOB_ID

    if env.get(ENV_JOB_ID) != job_id or env.get("RANK") != str(rank):
        return False
    restart = env.get("TORCHELASTIC_RESTART_COUNT") or env.get(ENV_ATTEMPT) or "0"
    return restart == str(attempt)


def innermost_frames(dump: dict[str, Any], *, frames: int = 5) -> list[str]:
    """``file:line function: code`` of the main thread's innermost frames in a stack dump (as
    :func:`~ranklens.formats.stacks.read_stack_dump` returns it), innermost first."""
    main = next((t for t in dump["threads"] if t["main"]), None)
    if main is None:
        return []
    return [
        f"{fr.get('file', '?')}:{fr.get('line', '?')} {fr.get('func', '?')}: {fr.get('code', '')}"
        for fr in reversed(main["frames"][-frames:])
    ]


class TorchrunExecutor:
    OPTIONS: ClassVar[Mapping[str, Option]] = {
        "signal": Option("string", "SIGKILL", choices=SIGNALS, help="what ends the stuck rank"),
        "stacks_wait_s": Option("number", 10.0, lo=0, hi=600, help="how long to wait for its stack dump"),
        "py_spy": Option(
            "string", "py-spy", help="py-spy (name or path) when the tracer's dump did not come; '' never"
        ),
    }

    def __init__(self, spec: ExecutorSpec) -> None:
        self.spec = spec
        name = str(spec.options.get("signal", "SIGKILL")).upper()
        self.signal_name = name if name in SIGNALS else "SIGKILL"
        self.signal = getattr(signal, self.signal_name)
        self.stacks_wait_s = float(spec.options.get("stacks_wait_s", 10.0))
        self.py_spy = str(spec.options.get("py_spy", "py-spy"))

    def _ranks(self, d: Decision) -> list[int] | str:
        if d.level is Level.REPLACE_NODE:
            return (
                "torchrun restarts workers in place and cannot move a rank to another node "
                "(use a Slurm or Kubernetes hook)"
            )
        if d.target.startswith("rank:"):
            return [int(r) for r in d.target[5:].split(",") if r.strip().lstrip("-").isdigit()]
        named = sorted({s.rank for s in d.finding.suspects if s.rank >= 0})
        return named[:1]  # restart_job: ending one worker restarts the whole group

    def describe(self, d: Decision) -> str:
        ranks = self._ranks(d)
        if isinstance(ranks, str):
            return f"do nothing: {ranks}"
        who = ", ".join(map(str, ranks)) if ranks else "a rank"
        return (
            f"send {self.signal_name} to rank {who} of job {d.finding.job_id}: torch elastic restarts the worker group"
        )

    def execute(self, d: Decision, ctx: ExecContext) -> ExecResult:
        from ranklens.collector.nvml import read_proc_environ
        from ranklens.formats.process import pid_namespace

        ranks = self._ranks(d)
        if isinstance(ranks, str):
            return ExecResult("skipped", ranks)
        f = d.finding
        if ctx.store is None:
            return ExecResult("failed", "no store: the ranks' processes are found from their heartbeats")
        if not ranks:  # a job-level finding without suspects: any rank of the attempt
            ranks = [-1]
        rows = ctx.store.query(
            "SELECT rank, argMax(pid, ts_ns) AS pid, argMax(host, ts_ns) AS host, argMax(pid_ns, ts_ns) AS pid_ns "
            "FROM heartbeats "
            f"WHERE job_id = '{_esc(f.job_id)}' AND attempt = {int(f.attempt)} GROUP BY rank ORDER BY rank"
        ).to_pylist()
        by_rank = {int(r["rank"]): r for r in rows}
        if ranks == [-1]:
            ranks = sorted(by_rank)[:1]
        done: list[dict[str, Any]] = []
        notes: list[str] = []
        failed: list[str] = []
        for rank in ranks:
            hb = by_rank.get(rank)
            if hb is None:
                notes.append(f"rank {rank}: no heartbeat of attempt {f.attempt}")
                continue
            pid, host = int(hb["pid"]), str(hb["host"])
            if _short(host) != _short(ctx.host):
                notes.append(f"rank {rank} runs on {host}, not here ({ctx.host})")
                continue
            if int(hb.get("pid_ns") or 0) and pid_namespace() and int(hb["pid_ns"]) != pid_namespace():
                notes.append(f"rank {rank}'s pid {pid} is in another pid namespace (a container): not signalled")
                continue
            env = read_proc_environ(pid)
            if env is None:
                notes.append(f"rank {rank} (pid {pid}) has already exited")
                continue
            if not _is_rank(env, f.job_id, rank, f.attempt):
                notes.append(f"pid {pid} is no longer rank {rank} of job {f.job_id} attempt {f.attempt}: left alone")
                continue
            stacks = self._stacks(ctx, f.job_id, f.attempt, rank, pid, f.first_seen_ns, env)
            try:
                os.kill(pid, self.signal)
            except ProcessLookupError:
                notes.append(f"rank {rank} (pid {pid}) exited meanwhile")
                continue
            except PermissionError as e:
                failed.append(f"cannot signal rank {rank} (pid {pid}): {e}")
                continue
            done.append({"rank": rank, "pid": pid, "host": host, "signal": self.signal_name, **stacks})
        if failed and not done:
            return ExecResult("failed", "; ".join(failed + notes))
        notes = failed + notes
        if not done:
            return ExecResult("skipped", "; ".join(notes) or "no rank to restart")
        detail = (
            f"{self.signal_name} to "
            + ", ".join(f"rank {x['rank']} (pid {x['pid']} on {x['host']})" for x in done)
            + f": torch elastic restarts the worker group as attempt {f.attempt + 1} if it has restarts left"
        )
        for x in done:
            if x.get("innermost"):
                how = f" ({x['source']})" if x.get("source") else ""
                detail += f"; rank {x['rank']}'s stack before it{how}: {x['innermost'][0]} (all of it: {x['stacks']})"
            elif "stacks" in x:
                detail += f"; no stack dump of rank {x['rank']} within {self.stacks_wait_s:g} s"
        if notes:
            detail += "; " + "; ".join(notes)
        return ExecResult("acknowledged", detail, {"signalled": done})

    def _stacks(
        self,
        ctx: ExecContext,
        job_id: str,
        attempt: int,
        rank: int,
        pid: int,
        since_ns: int,
        env: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """The rank's stack dump written for this hang (by this process, not before the finding's
        onset: a periodic dump from earlier would show the wrong moment), waited for up to
        ``stacks_wait_s``."""
        if not ctx.spool_dir:
            return {}
        path = Path(ctx.spool_dir, job_id, str(attempt), "stacks", f"stacks_rank_{rank}.json")
        deadline = time.monotonic() + self.stacks_wait_s
        while True:
            dump = read_stack_dump(path)
            if dump is not None and dump["pid"] == pid and dump["ts_ns"] >= since_ns - 1_000_000_000:
                return {"stacks": str(path), "innermost": innermost_frames(dump)}
            if time.monotonic() >= deadline:
                socket_path = (env or {}).get(TORCH_WORKER_SERVER_SOCKET, "")
                if socket_path:
                    got = self._worker_server(
                        socket_path, path.with_name(f"stacks_rank_{rank}.torch.json"), rank, pid, ctx
                    )
                    if got.get("innermost"):
                        return got
                return self._py_spy(path.with_name(f"stacks_rank_{rank}.pyspy.json"), rank, pid, ctx)
            ctx.sleep(0.2)

    def _worker_server(self, socket_path: str, path: Path, rank: int, pid: int, ctx: ExecContext) -> dict[str, Any]:
        """The rank's stacks from torch's worker server (a script under
        ``torch.distributed.elastic.control_plane.worker_main`` serves ``dump_traceback`` on the unix
        socket ``$TORCH_WORKER_SERVER_SOCKET``; the handler behind torch's debug server's ``/stacks``)."""
        import http.client
        import socket

        class _Unix(http.client.HTTPConnection):
            def connect(self) -> None:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.settimeout(self.timeout)
                self.sock.connect(socket_path)

        conn = _Unix("localhost", timeout=WORKER_SERVER_TIMEOUT_S)
        try:
            conn.request("POST", "/handler/dump_traceback")
            resp = conn.getresponse()
            text = resp.read().decode("utf-8", "replace") if resp.status == 200 else ""
        except (OSError, http.client.HTTPException):
            text = ""
        finally:
            conn.close()
        threads = parse_faulthandler(text)
        if not threads:
            return {"stacks": None}
        return self._write_dump(path, rank, pid, ctx, threads, "torch worker server dump_traceback", "torch")

    def _write_dump(
        self, path: Path, rank: int, pid: int, ctx: ExecContext, threads: list[dict[str, Any]], how: str, source: str
    ) -> dict[str, Any]:
        doc = {
            "rank": rank,
            "pid": pid,
            "ts_ns": ctx.clock_ns(),
            "reason": f"{how}: no tracer dump within {self.stacks_wait_s:g} s",
            "threads": threads,
        }
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(doc))
            where: str | None = str(path)
        except OSError:
            where = None  # the frames still go on the finding
        return {"stacks": where, "innermost": innermost_frames(doc), "source": source}

    def _py_spy(self, path: Path, rank: int, pid: int, ctx: ExecContext) -> dict[str, Any]:
        """The rank's stacks read by ``py-spy dump`` (no tracer dump came), written to ``path`` in
        the tracer's dump format; ``{"stacks": None}`` when py-spy is missing or fails."""
        exe = find_tool(self.py_spy) if self.py_spy else None
        if exe is None:
            return {"stacks": None}
        try:
            p = subprocess.run(
                [exe, "dump", "--pid", str(pid), "--json"],
                capture_output=True,
                text=True,
                timeout=PY_SPY_TIMEOUT_S,
                stdin=subprocess.DEVNULL,
            )
            threads = json.loads(p.stdout) if p.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired, ValueError):
            threads = None
        if not isinstance(threads, list) or not threads:
            return {"stacks": None}
        parsed = [_from_py_spy(t, pid) for t in threads if isinstance(t, dict)]
        return self._write_dump(path, rank, pid, ctx, parsed, "py-spy dump", "py-spy")


def find_tool(name: str) -> str | None:
    """``name`` on PATH, else beside this interpreter (a virtual environment's bin/, whose tools are
    not on PATH when ranklens runs as ``.venv/bin/ranklens``)."""
    return shutil.which(name) or shutil.which(name, path=os.path.dirname(sys.executable))


def _from_py_spy(t: dict[str, Any], pid: int) -> dict[str, Any]:
    """One thread of ``py-spy dump --json`` (frames innermost first, no source) as the tracer's dump
    has it (frames innermost last, with the line's code)."""
    frames = [
        {
            "file": str(fr.get("filename", "?")),
            "line": int(fr.get("line") or 0),
            "func": str(fr.get("name", "?")),
            "code": linecache.getline(str(fr.get("filename", "")), int(fr.get("line") or 0)).strip(),
        }
        for fr in reversed(t.get("frames") or [])
        if isinstance(fr, dict)
    ]
    main = t.get("thread_name") == "MainThread" or t.get("os_thread_id") == pid
    return {"thread": str(t.get("thread_name") or t.get("thread_id", "?")), "main": bool(main), "frames": frames}
