"""Findings of their own for errors that need no timing to be seen: a GPU that raised an XID, a rank
whose log says NCCL failed or CUDA ran out of memory.

Stragglers, slow links and hangs carry the GPU events and log errors around them as evidence
(:mod:`ranklens.analyzers.correlate`); an error that slowed or stopped nothing yet — an XID 79 a
second before the job dies, an OOM in one rank's log — was seen by nobody. Here each distinct
error becomes a finding:

- ``gpu_error``: per node, GPU and event kind (and XID code), the GPU events of the job of
  severity ``error`` or above (``critical`` for XIDs of failing hardware and double-bit ECC);
- ``log_error``: per log class, rank and node, the classified log lines of the job attempt of
  severity ``error`` or above (``nccl_error``, ``nccl_timeout``, ``cuda_oom``, ``gpu_xid``, ...);
- ``nan``: the rank(s) whose gradients were non-finite before DDP's all-reduce at the earliest step
  (the tracer's check, class ``nonfinite_grad``): the origin of a NaN loss, not its victims;
- ``crash``: the rank torchrun's failure summary names as the root cause (first observed failure),
  with its exit code: when one rank dies the launcher stops the others within a second, before
  any collective is stuck long enough for the live hang detector;
- ``size_mismatch`` / ``desync``: at the ledger's frontier (the last ``FRONTIER`` seqs of each
  process group), members that called the same collective with different input sizes or dtypes,
  or a different collective, at the same ``(pg, seq)``; the minority is blamed. Gloo aborts on a
  size mismatch within milliseconds (a peer dies with an ``EnforceNotMet``: the launcher's crash
  names that victim), NCCL hangs or corrupts; the ledger says which rank passed what.

One SQL statement per table (grouped in the store); the identity of a finding is its key (class,
rank, node; or GPU and code), so a line that repeats updates one finding instead of adding more.
"""

from __future__ import annotations

import re
from typing import Any

from ranklens.analyzers.correlate import gpu_event_severity
from ranklens.analyzers.findings import Finding, Suspect, finding_id
from ranklens.analyzers.ranks import rank_hosts
from ranklens.formats.severity import Severity
from ranklens.store.api import Store
from ranklens.store.api import sql_escape as _esc

__all__ = ["DETECTOR", "find_incidents"]

DETECTOR = "incidents"
# most findings per table: a job whose every rank logs the same error stays readable
MAX_PER_TABLE = 64


def find_incidents(store: Store, job_id: str, attempt: int = 0) -> list[Finding]:
    """``gpu_error`` and ``log_error`` findings of one job attempt, oldest first."""
    j = _esc(job_id)
    out: list[Finding] = []
    # gpu_events carry no attempt: a later attempt's are those from its first heartbeat to the next
    # attempt's (what came before belongs to the attempt it ended; the first attempt takes all before)
    starts = {
        int(r["attempt"]): int(r["t"])
        for r in store.query(
            f"SELECT attempt, min(ts_ns) AS t FROM heartbeats WHERE job_id = '{j}' GROUP BY attempt"
        ).to_pylist()
    }
    lo = starts[attempt] if attempt in starts and attempt > min(starts) else 0
    later = [t for a, t in starts.items() if a > attempt]
    hi = f" AND ts_ns < {min(later)}" if later else ""
    gpu = store.query(
        "SELECT host, gpu_index, rank, kind, code, min(ts_ns) AS first_ns, max(ts_ns) AS last_ns, count() AS n, "
        f"argMin(message, ts_ns) AS message FROM gpu_events WHERE job_id = '{j}' AND ts_ns >= {lo}{hi} "
        "GROUP BY host, gpu_index, rank, kind, code ORDER BY first_ns LIMIT 1000"
    ).to_pylist()
    for r in gpu:
        sev = gpu_event_severity(str(r["kind"]), int(r["code"]))
        if sev not in ("error", "critical"):
            continue
        what = f"XID {r['code']}" if r["kind"] == "xid" else str(r["kind"])
        who = f"rank {r['rank']}'s GPU" if int(r["rank"]) >= 0 else "GPU"
        msg = str(r["message"] or "").strip()
        title = f"{what} on {who} {r['host']}:{r['gpu_index']}" + (f": {msg}" if msg else "")
        if int(r["n"]) > 1:
            title += f" ({r['n']} times)"
        out.append(
            _finding(
                job_id,
                attempt,
                "gpu_error",
                f"gpu:{r['host']}:{r['gpu_index']}:{r['kind']}:{r['code']}",
                sev,
                title,
                Suspect(int(r["rank"]), str(r["host"]), f"{r['host']}:{r['gpu_index']}"),
                int(r["first_ns"]),
                int(r["last_ns"]),
                {"source": "gpu_events", "kind": r["kind"], "code": int(r["code"]), "count": int(r["n"])},
            )
        )
        if len(out) >= MAX_PER_TABLE:
            break

    def error_lines(until: str = "") -> list[dict[str, Any]]:
        return store.query(
            "SELECT klass, rank, host, min(ts_ns) AS first_ns, max(ts_ns) AS last_ns, sum(repeat_count) AS n, "
            "max(severity = 'critical') AS critical, argMin(message, ts_ns) AS message, argMin(source, ts_ns) AS src "
            f"FROM log_events WHERE job_id = '{j}' AND attempt = {int(attempt)} AND severity IN ('error', 'critical') "
            f"AND klass != '{NONFINITE}'{until} "
            "GROUP BY klass, rank, host ORDER BY first_ns LIMIT 1000"
        ).to_pylist()

    # the heartbeats are read only when there are error lines to judge (a live pass at 10k ranks
    # mostly has none, and the attempt's heartbeats are its largest scan here)
    logs = error_lines()
    if logs and (until := _before_clean_end(store, j, attempt)):
        logs = error_lines(until)
    out += _torchrun_crashes(store, job_id, attempt)
    out += _nonfinite(store, job_id, attempt)
    out += _ledger_mismatches(store, job_id, attempt)
    for r in logs[:MAX_PER_TABLE]:
        rank = int(r["rank"])
        first_line = str(r["message"] or "").strip().splitlines()
        # a traceback says what it is on its last line; other events on their first
        line = (first_line[-1] if "Traceback" in first_line[0] else first_line[0]) if first_line else ""
        who = f"rank {rank} ({r['host']})" if rank >= 0 else f"node {r['host'] or '?'}"
        title = f"{who} logged {r['klass']}: {line[:160]}"
        if int(r["n"]) > 1:
            title += f" ({r['n']} times)"
        out.append(
            _finding(
                job_id,
                attempt,
                "log_error",
                f"log:{r['klass']}:{rank}:{r['host']}",
                "critical" if r["critical"] else "error",
                title,
                Suspect(rank, str(r["host"])),
                int(r["first_ns"]),
                int(r["last_ns"]),
                {"source": "log_events", "class": r["klass"], "count": int(r["n"]), "log": r["src"]},
            )
        )
    return out


def _before_clean_end(store: Store, j: str, attempt: int) -> str:
    """A filter of log lines to those written before the attempt ended cleanly (every rank's last
    heartbeat says it shut tracing down: ``exited = 1``); '' while a rank runs or ended otherwise.
    What a launcher logs after that is its own shutdown, not the job's fault: torch elastic's agents
    race on the exit barrier when the agent that hosts the store leaves first (``recvValueWithTimeout
    failed``, ``Error waiting on exit barrier`` and its traceback, with the job's exit code 0)."""
    r = store.query(
        "SELECT uniqExact(rank) AS ranks, uniqExactIf(rank, exited = 1) AS clean, maxIf(ts_ns, exited = 1) AS end_ns "
        f"FROM heartbeats WHERE job_id = '{j}' AND attempt = {int(attempt)}"
    ).to_pylist()
    if not r or int(r[0]["ranks"]) == 0 or int(r[0]["clean"]) < int(r[0]["ranks"]):
        return ""
    return f" AND ts_ns <= {int(r[0]['end_ns'])}"


NONFINITE = "nonfinite_grad"  # the tracer's check before DDP's all-reduce (tracing/_nonfinite.py)
_STEP = re.compile(r"at step (-?\d+)")


def _nonfinite(store: Store, job_id: str, attempt: int) -> list[Finding]:
    """One ``nan`` finding per job attempt: the rank(s) whose gradients were non-finite *before*
    the all-reduce at the earliest step made them; every rank that had them only later got them
    from the all-reduce."""
    rows = store.query(
        "SELECT rank, host, ts_ns, message FROM log_events "
        f"WHERE job_id = '{_esc(job_id)}' AND attempt = {int(attempt)} AND klass = '{NONFINITE}' "
        "ORDER BY ts_ns LIMIT 10000"
    ).to_pylist()
    first: dict[int, tuple[int, int, str]] = {}  # rank -> (step, ts, host)
    for r in rows:
        m = _STEP.search(str(r["message"]))
        step = int(m.group(1)) if m else -1
        rank = int(r["rank"])
        if rank not in first or (step, int(r["ts_ns"])) < first[rank][:2]:
            first[rank] = (step, int(r["ts_ns"]), str(r["host"]))
    if not first:
        return []
    if all(v[0] >= 0 for v in first.values()):
        step0 = min(v[0] for v in first.values())
        culprits = sorted(r for r, v in first.items() if v[0] == step0)
    else:  # no steps: the earliest within half a second
        t0 = min(v[1] for v in first.values())
        step0 = -1
        culprits = sorted(r for r, v in first.items() if v[1] - t0 <= 500_000_000)
    later = sorted(set(first) - set(culprits))
    who = ", ".join(map(str, culprits))
    at = f" at step {step0}" if step0 >= 0 else ""
    plural = "s" if len(culprits) > 1 else ""
    title = f"rank{plural} {who} produced non-finite gradients (NaN/Inf){at}, before DDP's all-reduce"
    if later:
        later_steps = sorted({first[r][0] for r in later})
        title += f"; rank(s) {', '.join(map(str, later))} had them only after it (from step {later_steps[0]})"
    return [
        _finding(
            job_id,
            attempt,
            "nan",
            "nonfinite",
            "critical",
            title,
            Suspect(culprits[0], first[culprits[0]][2]),
            min(first[r][1] for r in culprits),
            max(v[1] for v in first.values()),
            {
                "source": "log_events",
                "class": NONFINITE,
                "step": step0,
                "culprits": culprits,
                "after_all_reduce": later,
                "action": "restart_job",
                "action_reason": "roll back to the last checkpoint with finite weights; check the culprit's batch",
            },
            extra=[Suspect(r, first[r][2]) for r in culprits[1:]],
        )
    ]


FRONTIER = 8  # seqs of each group, back from its newest, compared across members
# collectives whose every member passes an input of the same size and dtype (all_gather's list form
# and all_to_all may be uneven, gather/scatter differ at the root: not compared)
_EQUAL_INPUTS = frozenset(
    {
        "all_reduce",
        "allreduce",
        "allreduce_coalesced",
        "broadcast",
        "reduce",
        "all_gather_into_tensor",
        "_allgather_base",
        "allgather_into_tensor_coalesced",
        "reduce_scatter_tensor",
        "_reduce_scatter_base",
        "reduce_scatter_tensor_coalesced",
    }
)


def _ledger_mismatches(store: Store, job_id: str, attempt: int) -> list[Finding]:
    """``size_mismatch`` and ``desync`` findings from the arrival ledger (see the module doc)."""
    where = f"job_id = '{_esc(job_id)}' AND attempt = {int(attempt)} AND peer = -1"
    tops = store.query(f"SELECT pg, max(seq) AS top FROM collectives WHERE {where} GROUP BY pg LIMIT 256").to_pylist()
    if not tops:
        return []
    near = " OR ".join(f"(pg = '{_esc(str(t['pg']))}' AND seq > {int(t['top']) - FRONTIER})" for t in tops)
    rows = store.query(
        "SELECT pg, seq, groupArray(rank) AS ranks, groupArray(op) AS ops, groupArray(nbytes) AS sizes, "
        "groupArray(dtype) AS dtypes, min(enter_ns) AS first_ns, "
        f"max(enter_ns) AS last_ns, max(step) AS step FROM collectives WHERE {where} AND ({near}) "
        "GROUP BY pg, seq HAVING count() > 1 AND (uniqExact(op) > 1 OR uniqExact(nbytes) > 1 OR uniqExact(dtype) > 1) "
        "ORDER BY first_ns LIMIT 64"
    ).to_pylist()
    out: list[Finding] = []
    blamed: set[str] = set()  # one finding per group: its first disagreement is the cause
    host: dict[int, str] | None = None
    for r in rows:
        ops = [str(o) for o in r["ops"]]
        desync = len(set(ops)) > 1
        if not desync and ops[0] not in _EQUAL_INPUTS:
            continue
        if str(r["pg"]) in blamed:
            continue
        by_sig: dict[tuple[str, int, str], list[int]] = {}
        for rank, op, size, dtype in zip(r["ranks"], ops, r["sizes"], r["dtypes"]):
            by_sig.setdefault((op, int(size), str(dtype)), []).append(int(rank))
        if host is None:
            host = rank_hosts(store, job_id, attempt)
        sides = sorted(by_sig.items(), key=lambda kv: (-len(kv[1]), sorted(kv[1])))
        major = sides[0][1]
        if len(major) > len(sides[1][1]):
            culprits = sorted(rk for _, rks in sides[1:] for rk in rks)
            conf, who = (0.9 if 2 * len(major) > len(r["ranks"]) else 0.7), "the minority"
        else:  # a tie: the ledger cannot say which side diverged
            culprits = sorted(int(x) for x in r["ranks"])
            conf, who = 0.4, "every side (a tie)"

        def side(sig: tuple[str, int, str], rks: list[int], desync: bool = desync) -> str:
            names = f"rank {rks[0]}" if len(rks) == 1 else f"ranks {', '.join(map(str, sorted(rks)))}"
            return f"{names} called {sig[0]}" if desync else f"{names} passed {sig[1]:,} B {sig[2]}"

        kind = "desync" if desync else "size_mismatch"
        what = "different collectives" if desync else f"{ops[0]} with different inputs"
        title = f"{kind.replace('_', ' ')} at collective #{r['seq']} of pg {r['pg']}: " + "; ".join(
            side(sig, rks) for sig, rks in sides
        )
        blamed.add(str(r["pg"]))
        suspects = [Suspect(rk, host.get(rk, "")) for rk in culprits]
        out.append(
            _finding(
                job_id,
                attempt,
                kind,
                f"{r['pg']}:{r['seq']}",
                "critical",
                title,
                suspects[0],
                int(r["first_ns"]),
                int(r["last_ns"]),
                {
                    "source": "collectives",
                    "cause": kind,
                    "pg": str(r["pg"]),
                    "seq": int(r["seq"]),
                    "blamed": who,
                    "calls": [
                        {"ranks": sorted(rks), "op": sig[0], "nbytes": sig[1], "dtype": sig[2]} for sig, rks in sides
                    ],
                    "action": "restart_job",
                    "action_reason": f"members called {what} at the same point: a program bug (a branch, a "
                    "shape that depends on the rank's data); restart from the checkpoint after fixing it",
                    "sql": f"SELECT rank, op, nbytes, dtype, step FROM collectives WHERE {where} "
                    f"AND pg = '{_esc(str(r['pg']))}' AND seq = {int(r['seq'])} ORDER BY rank",
                },
                extra=suspects[1:],
                confidence=conf,
                step=int(r["step"]),
            )
        )
    return out


# torchrun's ChildFailedError summary: "Root Cause (first observed failure):" then the rank and its exit code
_ROOT_CAUSE = re.compile(r"Root Cause[^\n]*\n(?:[^\n]*\n){0,4}?\s*rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")


def _torchrun_crashes(store: Store, job_id: str, attempt: int) -> list[Finding]:
    """``crash`` findings from the launcher's own account: torchrun's failure summary names the rank
    that failed first and its exit code (the others were stopped by the launcher), which is all there
    is to see when every rank is gone within a second of the first."""
    rows = store.query(
        "SELECT host, ts_ns, message, source FROM log_events "
        f"WHERE job_id = '{_esc(job_id)}' AND attempt = {int(attempt)} AND klass = 'rank_failure' "
        "AND position(message, 'Root Cause') > 0 ORDER BY ts_ns LIMIT 16"
    ).to_pylist()
    out: list[Finding] = []
    seen: set[int] = set()
    out += _elastic_failures(store, job_id, attempt, seen)
    for r in rows:
        m = _ROOT_CAUSE.search(str(r["message"]))
        if m is None or int(m.group(1)) in seen:
            continue
        rank, code = int(m.group(1)), int(m.group(2))
        seen.add(rank)
        out.append(
            _crash(
                job_id, attempt, rank, code, r, "the launcher's first observed failure; the other ranks were stopped"
            )
        )
    return out


# torch elastic's line when a worker fails (each time, also when it restarts the group afterwards)
_WORKER_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")


def _elastic_failures(store: Store, job_id: str, attempt: int, seen: set[int]) -> list[Finding]:
    """``crash`` findings from torch elastic's "failed (exitcode: N) local_rank: L (pid: P)" line: the
    pid is looked up in the job's heartbeats, which says the rank and the attempt (the group may have
    been restarted since, so no failure summary is printed)."""
    rows = store.query(
        "SELECT host, ts_ns, message FROM log_events "
        f"WHERE job_id = '{_esc(job_id)}' AND klass = 'rank_failure' AND position(message, 'failed (exitcode:') > 0 "
        "ORDER BY ts_ns LIMIT 64"
    ).to_pylist()
    failed = []
    for r in rows:
        m = _WORKER_FAILED.search(str(r["message"]).split("\n", 1)[0])
        if m:
            failed.append((int(m.group(1)), int(m.group(3)), r))
    if not failed:
        return []
    pids = ", ".join(str(p) for _, p, _ in failed)
    who = {
        (int(h["pid"]), str(h["host"])): (int(h["rank"]), int(h["attempt"]))
        for h in store.query(
            "SELECT DISTINCT pid, host, rank, attempt FROM heartbeats "
            f"WHERE job_id = '{_esc(job_id)}' AND pid IN ({pids})"
        ).to_pylist()
    }
    out = []
    for code, pid, r in failed:
        found = who.get((pid, str(r["host"]))) or next((v for (p, _h), v in who.items() if p == pid), None)
        if found is None or found[1] != attempt or found[0] in seen:
            continue
        rank = found[0]
        seen.add(rank)
        out.append(_crash(job_id, attempt, rank, code, r, "torch elastic stopped the worker group", pid=pid))
    return out


def _crash(job_id: str, attempt: int, rank: int, code: int, row: dict[str, Any], what: str, *, pid: int = 0) -> Finding:
    """A ``crash`` finding from the launcher's log line ``row`` (rank ``rank`` ended with ``code``)."""
    how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
    if pid:
        how += f", pid {pid}"
    evidence: dict[str, object] = {"source": "log_events", "class": "rank_failure", "exit_code": code, "cause": "crash"}
    evidence.update({"action": "restart_job", **({"pid": pid} if pid else {}), "log": row.get("source", "")})
    return _finding(
        job_id,
        attempt,
        "crash",
        f"torchrun:{rank}",
        "critical",
        f"rank {rank} crashed ({how}): {what}",
        Suspect(rank, str(row["host"])),
        int(row["ts_ns"]),
        int(row["ts_ns"]),
        evidence,
    )


def _finding(
    job_id: str,
    attempt: int,
    kind: str,
    key: str,
    severity: str,
    title: str,
    suspect: Suspect,
    first_ns: int,
    last_ns: int,
    evidence: dict[str, object],
    *,
    extra: list[Suspect] | None = None,
    confidence: float | None = None,
    step: int = -1,
) -> Finding:
    """A finding of this module: confidence 0.9 when critical, 0.7 otherwise, unless given."""
    return Finding(
        id=finding_id(job_id, attempt, kind, key),
        job_id=job_id,
        attempt=attempt,
        kind=kind,
        severity=Severity(severity),
        confidence=(0.9 if severity == "critical" else 0.7) if confidence is None else confidence,
        title=title,
        suspects=(suspect, *(extra or ())),
        first_seen_step=step,
        last_seen_step=step,
        first_seen_ns=first_ns,
        last_seen_ns=last_ns,
        evidence=dict(evidence),
        detector=DETECTOR,
    )
