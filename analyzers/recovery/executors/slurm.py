"""Drain the suspect node and requeue the job through Slurm: the ``slurm`` executor.

What each level does (``scontrol`` as the Slurm administrator runs it):

- ``replace_node``: every suspect node is drained (``scontrol update nodename=N state=drain
  reason=...``): Slurm lets the jobs on it finish or be requeued and starts none there until an
  administrator resumes it; the node goes into the ``blacklist`` file when one is configured (one
  name a line, or JSON for a ``.json`` path: what a prolog or ``sbatch --exclude`` consumes); then
  the job is requeued (``scontrol requeue <id>``), so it starts again from its last checkpoint on
  nodes that are not drained. A node already drained or down is left as it is (its reason is kept).
- ``restart_job``: the job is requeued.
- ``restart_rank``: ``skipped``: Slurm cannot restart one rank in place (the ``torchrun`` executor
  can).

The Slurm job comes from the finding's job id: ``ranklens run`` inside a Slurm job names it
``slurm-<SLURM_JOB_ID>`` (``-r<n>`` after the n-th requeue), as deploy/slurm/train.sbatch does. A
finding of another job (``run-...``) is ``skipped``: the executor never guesses a job from a node.
Suspect nodes come from the finding's suspects, else from the ``ranks`` table (the hosts of the
suspect ranks); Slurm names nodes by their short host name, so ``node7.cluster.local`` is ``node7``.

Every ``scontrol`` call is bounded by ``timeout_s``; a missing ``scontrol``, a refused call or a
timeout is a ``failed`` result with scontrol's own message, never an exception. Dry runs (the
policy's default) only say what would be done.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ranklens.analyzers.recovery.api import Decision, Level
from ranklens.analyzers.recovery.executors.api import ExecContext, ExecResult, ExecutorSpec, Option
from ranklens.config import slurm_job_of
from ranklens.formats.blacklist import read_blacklist, write_blacklist

__all__ = ["REASON_FIELDS", "SlurmExecutor", "add_to_blacklist"]

#: placeholders the ``reason`` template may use
REASON_FIELDS = ("kind", "finding_id", "job_id", "attempt", "level", "title")
#: Slurm keeps a node's reason in a fixed field; longer reasons are cut here, not by Slurm
MAX_REASON = 200


@dataclass(frozen=True)
class _Call:
    ok: bool
    out: str


def _short(host: str) -> str:
    return host.split(".", 1)[0]


def add_to_blacklist(path: str, nodes: Sequence[str], reasons: Mapping[str, str]) -> list[str]:
    """Add ``nodes`` to the blacklist file at ``path`` (created when missing) and return the whole
    list. One node name a line (``sbatch --exclude=$(paste -sd, FILE)``), or for a ``.json`` path
    ``{"nodes": [...], "reasons": {...}}`` as ``ranklens preflight --blacklist`` writes it. The file
    is replaced atomically, so a prolog reading it never sees half of it."""
    have, why, extra = read_blacklist(path)
    for n in nodes:
        if n not in have:
            have.append(n)
        if n in reasons:
            why[n] = reasons[n]
    write_blacklist(path, have, why, extra)
    return have


class SlurmExecutor:
    OPTIONS: ClassVar[Mapping[str, Option]] = {
        "scontrol": Option("string", "scontrol", help="the scontrol binary (a name on PATH or a path)"),
        "drain": Option("boolean", True, help="replace_node drains the suspect nodes"),
        "requeue": Option("boolean", True, help="replace_node and restart_job requeue the job"),
        "reason": Option(
            "string",
            "ranklens {kind} {finding_id}",
            placeholders=REASON_FIELDS,
            help="the drain reason sinfo -R shows",
        ),
        "blacklist": Option("string", "", help="a file the drained nodes are added to ('' none)"),
        "timeout_s": Option("number", 30.0, lo=1, hi=600, help="the longest one scontrol call may take"),
    }

    def __init__(self, spec: ExecutorSpec) -> None:
        self.spec = spec
        o = spec.options
        self.scontrol = str(o.get("scontrol", "scontrol"))
        self.drain = bool(o.get("drain", True))
        self.requeue = bool(o.get("requeue", True))
        self.reason = str(o.get("reason", "ranklens {kind} {finding_id}"))
        self.blacklist = str(o.get("blacklist", ""))
        self.timeout_s = float(o.get("timeout_s", 30.0))

    # -- what a decision means -------------------------------------------------------------------

    def _plan(self, d: Decision, ctx: ExecContext | None) -> tuple[str | None, list[str], str]:
        """(Slurm job id, nodes to drain, why nothing is to be done: '' when something is)."""
        f = d.finding
        if d.level is Level.RESTART_RANK:
            return None, [], "Slurm cannot restart one rank in place (the torchrun executor can)"
        if d.level is Level.NOTIFY:
            return None, [], "notify needs no Slurm action"
        job = slurm_job_of(f.job_id)
        nodes: list[str] = []
        if d.level is Level.REPLACE_NODE and self.drain:
            nodes = self._nodes(d, ctx)
        if job is None and not nodes:
            return None, [], f"job {f.job_id} is not a Slurm job (its id is not slurm-<SLURM_JOB_ID>)"
        if d.level is Level.REPLACE_NODE and self.drain and not nodes and ctx is not None:
            return job, [], "the finding names no node and the store knows no host of its ranks"
        if not nodes and not (self.requeue and job) and not (d.level is Level.REPLACE_NODE and self.drain):
            return job, [], "nothing to do: requeue = false"
        return job, nodes, ""

    def _nodes(self, d: Decision, ctx: ExecContext | None) -> list[str]:
        f = d.finding
        hosts = [s.node for s in f.suspects if s.node]
        if not hosts and ctx is not None and ctx.store is not None:
            ranks = {s.rank for s in f.suspects if s.rank >= 0} or {int(r) for r in f.evidence.get("ranks", [])}
            if ranks:
                from ranklens.analyzers.ranks import rank_hosts

                try:
                    by_rank = rank_hosts(ctx.store, f.job_id, f.attempt)
                except Exception:  # the store is a boundary: no hosts, the decision says so
                    by_rank = {}
                hosts = [by_rank[r] for r in sorted(ranks) if r in by_rank]
        out: list[str] = []
        for h in hosts:
            if _short(h) not in out:
                out.append(_short(h))
        return out

    def _reason(self, d: Decision) -> str:
        f = d.finding
        text = self.reason.format(
            kind=f.kind, finding_id=f.id, job_id=f.job_id, attempt=f.attempt, level=d.level.value, title=f.title
        )
        return " ".join(text.split())[:MAX_REASON] or "ranklens"

    def describe(self, d: Decision) -> str:
        job, nodes, why = self._plan(d, None)
        if why:
            return f"do nothing: {why}"
        parts = []
        if d.level is Level.REPLACE_NODE and self.drain:
            parts.append(
                f"drain {', '.join(nodes) if nodes else 'the suspect nodes'} (reason {self._reason(d)!r})"
                + (f", add them to {self.blacklist}" if self.blacklist else "")
            )
        if self.requeue and job:
            parts.append(f"requeue Slurm job {job}")
        return "; ".join(parts)

    # -- doing it --------------------------------------------------------------------------------

    def _scontrol(self, *args: str) -> _Call:
        exe = shutil.which(self.scontrol)
        if exe is None:
            return _Call(
                False,
                f"{self.scontrol} not found (PATH={os.environ.get('PATH', '')}): install Slurm's "
                "client (slurm-client) or set `scontrol` in the [[executor]] table",
            )
        try:
            p = subprocess.run(
                [exe, *args], capture_output=True, text=True, timeout=self.timeout_s, stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired:
            return _Call(False, f"scontrol {' '.join(args)} took longer than {self.timeout_s:g} s")
        except OSError as e:
            return _Call(False, f"cannot run {exe}: {e}")
        out = (p.stdout + p.stderr).strip()
        if p.returncode != 0:
            return _Call(False, f"scontrol {' '.join(args)} failed (exit {p.returncode}): {out or 'no message'}")
        return _Call(True, out)

    def _node_state(self, node: str) -> tuple[str, str] | str:
        """(state, reason) of a Slurm node, or why it could not be read."""
        c = self._scontrol("show", "node", node, "--oneliner")
        if not c.ok:
            return c.out
        fields = dict(kv.split("=", 1) for kv in c.out.split() if "=" in kv)
        reason = c.out.split(" Reason=", 1)[1].strip() if " Reason=" in c.out else ""
        return fields.get("State", "?"), reason

    def execute(self, d: Decision, ctx: ExecContext) -> ExecResult:
        job, nodes, why = self._plan(d, ctx)
        if why:
            return ExecResult("skipped", why)
        reason = self._reason(d)
        drained: list[str] = []
        notes: list[str] = []
        failed: list[str] = []
        for node in nodes:
            st = self._node_state(node)
            if isinstance(st, str):
                failed.append(f"node {node}: {st}")
                continue
            state, old_reason = st
            flags = {x.rstrip("*~#$@!%") for x in state.upper().split("+")}
            if flags & {"DRAIN", "DRAINED", "DRAINING", "DOWN"}:
                notes.append(f"node {node} is already {state.lower()} ({old_reason or 'no reason'}): left as it is")
                drained.append(node)
                continue
            c = self._scontrol("update", f"nodename={node}", "state=drain", f"reason={reason}")
            if not c.ok:
                failed.append(f"node {node}: {c.out}")
                continue
            drained.append(node)
        data: dict[str, Any] = {"drained": drained, "job": job}
        if drained and self.blacklist:
            try:
                data["blacklist"] = add_to_blacklist(self.blacklist, drained, {n: reason for n in drained})
            except (OSError, ValueError) as e:
                failed.append(f"blacklist {self.blacklist}: {e}")
        requeued = False
        if self.requeue and job and (drained or not nodes):
            c = self._scontrol("requeue", job)
            if c.ok:
                requeued = True
            else:
                failed.append(f"job {job}: {c.out}")
        elif self.requeue and job:
            notes.append(f"job {job} not requeued: no node was drained")
        data["requeued"] = requeued
        done = [f"drained {', '.join(drained)} (reason {reason!r})"] if drained else []
        if requeued:
            done.append(f"requeued Slurm job {job}")
        detail = "; ".join(done + failed + notes)
        if failed:
            return ExecResult("failed", detail, data)
        return ExecResult("acknowledged", detail, data)
