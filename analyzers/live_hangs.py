"""Live hang detection from heartbeats and the collective ledger, within seconds of the stall.

Every traced rank writes a heartbeat every flush interval (0.5 s by default) from a background
thread, so it keeps coming while the training thread is blocked inside a collective. Each carries
what is in flight on the rank, and per process group the last seq it entered and completed.

Metric (SQL): the newest heartbeat of every rank, the members of every process group, the
job's recent step time. Decision (:func:`detect_live_hangs`):

* a collective in flight on some ranks for longer than a threshold is *stuck*; the threshold
  adapts to the job (``max(min_stall_s, step_multiple * median step time)``) so a slow job is not
  a hung job;
* members that never entered it are the suspects. A suspect that is itself waiting in another
  stuck collective is a victim: following "waits for" links leads to the origin rank and the
  origin group (a hang in a subgroup that blocks the rest is named as such: a *cascade*);
* the origin rank is classified: heartbeats stopped and its process is gone (checked here, or
  reported by the rank's node collector: a heartbeat with ``exited = 2``) → ``crash``;
  heartbeats stopped but the process may be alive (other host) → ``hang`` of an unresponsive
  process; heartbeats fresh → ``hang``: stuck before the collective, in its last phase;
* every member entered and nothing completes → ``hang`` with ``cause = "network"`` (for the link
  analyzer); ranks in flight at the same ``(pg, seq)`` with different ops → ``desync``.

Each finding carries the per-group picture (entered / missing / completed), what each missing rank
was last doing, and a recommended recovery level.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ranklens.analyzers.findings import Finding, Severity, Suspect, finding_id
from ranklens.formats.process import pid_alive_local
from ranklens.store.api import Store
from ranklens.store.api import sql_escape as _esc

__all__ = ["HangConfig", "LiveRank", "detect_live_hangs"]

DETECTOR = "live_hangs"
# a rank's heartbeat phases inside a training step (the tracer's own, inferred or marked):
# HangConfig.fast_stall_s applies to a rank stuck in one of them
# (the tracer's step inference also says after_forward / after_backward for the gaps between them)
MID_STEP_PHASES = frozenset({"data", "forward", "after_forward", "backward", "after_backward", "optimizer"})


@dataclass(frozen=True)
class HangConfig:
    """Thresholds of the live hang detector (seconds).

    Args:
        min_stall_s: a collective must be stuck at least this long.
        step_multiple: ...and at least this many times the job's own pace: the larger of its median
            step time and the 99th percentile of its completed collectives' durations.
        heartbeat_stale_s: a rank whose newest heartbeat is older than this is unresponsive.
        live_window_s: heartbeats older than this (every rank) mean the job is not running.
        startup_stall_s: the threshold while the job has no pace yet (fewer than ``min_history``
            completed collectives and no completed step).
        fast_stall_s: the floor instead of ``min_stall_s`` when the job has its pace from completed
            steps and the rank holding the others up is, by its fresh heartbeat, inside a step's
            data loading or compute (:data:`MID_STEP_PHASES`): a fast-stepping job stuck there for
            dozens of steps' time is hung. Between steps, where checkpoints, evaluation and logging
            run, or with no fresh heartbeat, ``min_stall_s`` holds.
    """

    min_stall_s: float = 10.0
    fast_stall_s: float = 5.0
    step_multiple: float = 5.0
    heartbeat_stale_s: float = 5.0
    live_window_s: float = 120.0
    startup_stall_s: float = 60.0
    min_history: int = 20

    def __post_init__(self) -> None:
        for name in (
            "min_stall_s",
            "fast_stall_s",
            "step_multiple",
            "heartbeat_stale_s",
            "live_window_s",
            "startup_stall_s",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"HangConfig.{name}={getattr(self, name)} must be >= 0")


@dataclass(frozen=True)
class LiveRank:
    """The newest heartbeat of one rank."""

    rank: int
    ts_ns: int
    pid: int
    host: str
    step: int
    phase: str
    phase_start_ns: int
    last_progress_ns: int
    entered: dict[str, int] = field(default_factory=dict)
    completed: dict[str, int] = field(default_factory=dict)
    pending: dict[tuple[str, int], tuple[str, int, int]] = field(default_factory=dict)  # -> (op, nbytes, enter_ns)
    exited: bool = False  # shut tracing down cleanly: finished, not dead
    gone: bool = False  # its node's collector saw its process disappear without that


def _heartbeat_sql(job_id: str, attempt: int, since_ns: int = 0) -> str:
    cols = (
        "ts_ns",
        "pid",
        "host",
        "step",
        "phase",
        "phase_start_ns",
        "last_progress_ns",
        "pgs",
        "pg_entered",
        "pg_completed",
        "pending_pgs",
        "pending_seqs",
        "pending_ops",
        "pending_nbytes",
        "pending_enter_ns",
        "exited",
    )
    latest = ", ".join(f"argMax({c}, ts_ns) AS hb_{c}" for c in cols)
    return (
        f"SELECT rank, {latest} FROM heartbeats WHERE job_id = '{_esc(job_id)}' AND attempt = {int(attempt)} "
        f"AND ts_ns >= {int(since_ns)} GROUP BY rank ORDER BY rank"
    )


def _load_ranks(store: Store, job_id: str, attempt: int, since_ns: int = 0) -> dict[int, LiveRank]:
    out = {}
    for row in store.query(_heartbeat_sql(job_id, attempt, since_ns)).to_pylist():
        h = {k.removeprefix("hb_"): v for k, v in row.items()}
        pending = {
            (pg, int(seq)): (op, int(nb), int(t))
            for pg, seq, op, nb, t in zip(
                h["pending_pgs"], h["pending_seqs"], h["pending_ops"], h["pending_nbytes"], h["pending_enter_ns"]
            )
        }
        out[int(h["rank"])] = LiveRank(
            rank=int(h["rank"]),
            ts_ns=int(h["ts_ns"]),
            pid=int(h["pid"]),
            host=str(h["host"]),
            step=int(h["step"]),
            phase=str(h["phase"]),
            phase_start_ns=int(h["phase_start_ns"]),
            last_progress_ns=int(h["last_progress_ns"]),
            entered=dict(zip(h["pgs"], map(int, h["pg_entered"]))),
            completed=dict(zip(h["pgs"], map(int, h["pg_completed"]))),
            pending=pending,
            exited=int(h["exited"]) == 1,
            gone=int(h["exited"]) == 2,
        )
    return out


def _groups(store: Store, job_id: str, attempt: int, world: int) -> dict[str, tuple[int, ...]]:
    r = store.query(
        f"SELECT pg, any(name) AS desc, any(ranks) AS members FROM process_groups WHERE job_id = '{_esc(job_id)}' "
        f"AND attempt = {int(attempt)} GROUP BY pg"
    )
    groups = {str(pg): tuple(sorted(int(x) for x in members)) for pg, _d, members in r.rows()}
    groups.setdefault("0", tuple(range(world)))
    return groups


def _group_names(store: Store, job_id: str, attempt: int) -> dict[str, str]:
    r = store.query(
        f"SELECT pg, any(name) AS desc FROM process_groups WHERE job_id = '{_esc(job_id)}' "
        f"AND attempt = {int(attempt)} GROUP BY pg"
    )
    return {str(pg): str(d) for pg, d in r.rows()}


def _members(pg: str, groups: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    if "/p2p:" in pg:
        src, dst = pg.rsplit("/p2p:", 1)[1].split("->")
        return tuple(sorted({int(src), int(dst)}))
    return groups.get(pg, ())


def _pace_s(store: Store, job_id: str, attempt: int) -> tuple[float, float, int]:
    """The job's own pace: median step time, p99 collective duration, completed collectives seen."""
    where = f"job_id = '{_esc(job_id)}' AND attempt = {int(attempt)}"
    step = store.query(
        f"SELECT quantileExact(0.5)(end_ns - start_ns) AS d, count() AS n FROM (SELECT end_ns, start_ns FROM steps "
        f"WHERE {where} ORDER BY end_ns DESC LIMIT 1000)"
    ).rows()[0]
    coll = store.query(
        f"SELECT quantileExact(0.99)(end_ns - enter_ns) AS d, count() AS n FROM (SELECT end_ns, enter_ns FROM "
        f"collectives WHERE {where} AND end_ns > 0 ORDER BY end_ns DESC LIMIT 5000)"
    ).rows()[0]
    step_s = float(step[0]) / 1e9 if step[1] else 0.0
    coll_s = float(coll[0]) / 1e9 if coll[1] else 0.0
    return step_s, coll_s, int(coll[1]) + (1000 if step[1] else 0)


def detect_live_hangs(
    store: Store,
    job_id: str,
    attempt: int = 0,
    *,
    config: HangConfig | None = None,
    now_ns: int | None = None,
    pid_alive: Callable[[str, int], bool | None] = pid_alive_local,
    exit_codes: dict[int, int] | None = None,
) -> list[Finding]:
    """Hang, crash and desync findings of a running job, from its newest heartbeats.

    Args:
        store: where the job's heartbeats, process groups and steps are.
        job_id, attempt: the job.
        config: thresholds (defaults: :class:`HangConfig`).
        now_ns: the current time (default: this machine's clock).
        pid_alive: tells whether a rank's process still exists (default: checks local pids only).
        exit_codes: exit codes of ranks known to have exited (a launcher may know them).

    Returns:
        Findings, origins first; empty when nothing is stuck or the job is not running.
    """
    cfg = config or HangConfig()
    now = now_ns if now_ns is not None else time.time_ns()
    # only recent heartbeats: a live loop does not rescan the job's whole history each pass
    ranks = _load_ranks(store, job_id, attempt, since_ns=now - int(cfg.live_window_s * 1e9))
    if not ranks:
        return []
    if now - max(r.ts_ns for r in ranks.values()) > cfg.live_window_s * 1e9:
        return []  # no rank has spoken for a long time: the job is over, not hung
    if all(r.exited for r in ranks.values()):
        return []  # every rank shut down cleanly: the job finished
    world_q = store.query(
        f"SELECT max(world_size) FROM ranks WHERE job_id = '{_esc(job_id)}' AND attempt = {int(attempt)}"
    )
    world = int(world_q.scalar() or 0) or (max(ranks) + 1)
    groups = _groups(store, job_id, attempt, world)
    names = _group_names(store, job_id, attempt)
    step_s, coll_s, history = _pace_s(store, job_id, attempt)
    pace_s = cfg.step_multiple * max(step_s, coll_s)
    if history >= cfg.min_history:
        threshold_s = max(cfg.min_stall_s, pace_s)
    else:
        threshold_s = max(cfg.min_stall_s, cfg.startup_stall_s)
    # the threshold for an origin stuck inside a step (see HangConfig.fast_stall_s); never above threshold_s
    fast_s = threshold_s
    if history >= cfg.min_history and step_s > 0:
        fast_s = min(threshold_s, max(cfg.fast_stall_s, pace_s))
    exit_codes = exit_codes or {}
    gone = {(r.host, r.pid) for r in ranks.values() if r.gone}
    if gone:  # the node's collector saw these processes disappear: no need to be on their host
        local_check = pid_alive

        def pid_alive(host: str, pid: int) -> bool | None:
            return False if (host, pid) in gone else local_check(host, pid)

    def stale(r: int) -> bool:
        return r not in ranks or (now - ranks[r].ts_ns) > cfg.heartbeat_stale_s * 1e9

    # stuck collectives: in flight somewhere for longer than the threshold
    stuck: dict[tuple[str, int], dict[int, tuple[str, int, int]]] = {}
    # (a collective stuck half as long still counts as *blocked by* an origin: the victims entered
    # it a moment after the origin's group stalled, and a pass between the two must still see it)
    for r in ranks.values():
        for key, info in r.pending.items():
            if (now - info[2]) / 1e9 >= fast_s / 2:
                stuck.setdefault(key, {})[r.rank] = info
    findings: list[Finding] = []

    def picture(key: tuple[str, int]) -> dict[str, Any]:
        pg, seq = key
        members = _members(pg, groups) or tuple(sorted(stuck[key]))
        in_flight = sorted(stuck[key])
        entered = sorted(
            m for m in members if m in ranks and (key in ranks[m].pending or ranks[m].entered.get(pg, -1) >= seq)
        )
        completed = sorted(
            m for m in members if m in ranks and key not in ranks[m].pending and ranks[m].completed.get(pg, -1) >= seq
        )
        missing = sorted(set(members) - set(entered))
        ops = {r: stuck[key][r][0] for r in in_flight}
        oldest = min(v[2] for v in stuck[key].values())
        return {
            "pg": pg,
            "pg_desc": names.get(pg, ""),
            "seq": seq,
            "members": list(members),
            "entered": entered,
            "in_flight": in_flight,
            "completed": completed,
            "missing": missing,
            "ops": ops,
            "op": sorted(set(ops.values()))[0],
            "nbytes": stuck[key][in_flight[0]][1],
            "stuck_s": round((now - oldest) / 1e9, 3),
            "since_ns": oldest,
            "threshold_s": round(threshold_s, 3),
        }

    pics = {key: picture(key) for key in stuck}
    waiting_in = {r: key for key in stuck for r in stuck[key]}  # rank -> the stuck collective it waits in

    def root_of(rank: int) -> int | None:
        """Follow "waits for" links from a missing rank; None when they loop (no root)."""
        seen: set[int] = set()
        while rank in waiting_in:
            if rank in seen:
                return None
            seen.add(rank)
            missing = pics[waiting_in[rank]]["missing"]
            if not missing:
                return None  # waits where nobody is missing: not this rank's doing
            rank = missing[0]
        return rank

    roots: dict[int, list[tuple[str, int]]] = {}  # origin rank -> stuck collectives it holds up

    def held_up(key: tuple[str, int]) -> None:
        """``key`` waits for its missing ranks: file it under the origin each leads to."""
        for m in pics[key]["missing"]:
            root = root_of(m)
            if root is not None and key not in roots.setdefault(root, []):
                roots[root].append(key)

    for key, pic in sorted(pics.items(), key=lambda kv: kv[1]["stuck_s"], reverse=True):
        pg, seq = key
        if pic["stuck_s"] < threshold_s:  # not stuck yet by itself: only as blocked by an origin
            held_up(key)
            continue
        distinct_ops = sorted(set(pic["ops"].values()))
        if len(distinct_ops) > 1:
            by_op: dict[str, list[int]] = {}
            for r, op in pic["ops"].items():
                by_op.setdefault(op, []).append(r)
            minority = min(by_op.values(), key=len)
            sides = "; ".join(
                f"ranks {', '.join(map(str, sorted(rs)))} called {op}" for op, rs in sorted(by_op.items())
            )
            findings.append(
                _finding(
                    job_id,
                    attempt,
                    "desync",
                    0.9,
                    minority,
                    ranks,
                    f"desync at seq {seq} of {pic['pg_desc'] or 'pg ' + pg}: {sides}",
                    {
                        **pic,
                        "cause": "desync",
                        "action": "restart_job",
                        "action_reason": "ranks issued different collectives at the same point: a program bug; restart "
                        "from the checkpoint after fixing the branch",
                    },
                    key=f"{pg}:{seq}",
                )
            )
            continue
        if not pic["missing"]:
            if pic["completed"]:
                continue  # some members already left it: the rest will (a straggler, not a hang)
            findings.append(
                _finding(
                    job_id,
                    attempt,
                    "hang",
                    0.7,
                    pic["members"],
                    ranks,
                    f"every member of {pic['pg_desc'] or 'pg ' + pg} entered {pic['op']} #{seq} but it has not "
                    f"completed for {pic['stuck_s']:.0f} s: suspect the network or a link between these ranks",
                    {
                        **pic,
                        "cause": "network",
                        "action": "notify",
                        "action_reason": "all ranks arrived; the transfer itself is stuck: check the links (slow-link "
                        "analyzer) before restarting anything",
                    },
                    key=f"network:{pg}:{seq}",
                )
            )
            continue
        held_up(key)

    def origin_threshold(root: int) -> float:
        """fast_s for an origin whose fresh heartbeat says it is inside a step, else threshold_s."""
        hb = ranks.get(root)
        inside = hb is not None and not stale(root) and hb.phase in MID_STEP_PHASES
        return fast_s if inside else threshold_s

    # a root whose collectives are all stuck under its threshold is not one yet
    need = {r: origin_threshold(r) for r in roots}
    roots = {r: ks for r, ks in roots.items() if any(pics[k]["stuck_s"] >= need[r] for k in ks)}
    for root, keys in roots.items():
        # The origin group: where the root is itself missing and nobody else is (the others missing
        # from a group are victims stuck elsewhere); among those, the one stuck the longest.
        keys = sorted(keys, key=lambda k: -pics[k]["stuck_s"])
        direct = [k for k in keys if root in pics[k]["missing"] and pics[k]["stuck_s"] >= need[root]] or keys[:1]
        okey = min(direct, key=lambda k: (len(pics[k]["missing"]), -pics[k]["stuck_s"]))
        blocked = [pics[k] for k in keys if k != okey]
        opic = {**pics[okey], "threshold_s": round(need[root], 3)}
        findings.append(
            _origin_finding(job_id, attempt, root, opic, blocked, ranks, stale(root), pid_alive, exit_codes, now)
        )
    findings.extend(_dead_ranks(store, job_id, attempt, ranks, roots, stale, pid_alive, exit_codes, now, world))
    return findings


def _dead_ranks(
    store: Store,
    job_id: str,
    attempt: int,
    ranks: dict[int, LiveRank],
    roots: dict[int, Any],
    stale: Callable[[int], bool],
    pid_alive: Callable[[str, int], bool | None],
    exit_codes: dict[int, int],
    now: int,
    world: int,
) -> list[Finding]:
    """Ranks whose process is gone. Peers of a dead rank often fail right after it ("connection
    closed by peer"), so a dead rank whose own collective failed is collateral; the dead rank that
    died without a failing collective (or, failing that, fell silent first) is the origin. A rank
    that never sent a heartbeat (it died within the first flush interval) counts when its exit
    code is known."""
    dead = sorted(
        r
        for r, hb in ranks.items()
        if not hb.exited and stale(r) and (r in exit_codes or pid_alive(hb.host, hb.pid) is False)
    )
    dead += sorted(r for r in range(world) if r not in ranks and r in exit_codes)
    dead = [r for r in dead if r not in roots]
    if not dead:
        return []
    failed = {
        int(r)
        for (r,) in store.query(
            f"SELECT DISTINCT rank FROM collectives WHERE job_id = '{_esc(job_id)}' AND attempt = {int(attempt)} "
            "AND end_ns = -1"
        ).rows()
    }
    # A rank that died while waiting inside a collective (its last heartbeat has one pending) lost
    # its peer too, even before its failed ledger row has reached the store.
    failed |= {r for r in dead if r in ranks and ranks[r].pending}
    origins = [r for r in dead if r not in failed]
    if not origins and not roots:  # nobody else explains it: the one that fell silent first
        origins = [min(dead, key=lambda r: ranks[r].ts_ns if r in ranks else 0)]
    if not origins:
        return []  # collateral of the hang/crash origins found above
    out = []
    for r in origins:
        hb = ranks.get(r)
        code = exit_codes.get(r)
        collateral = [d for d in dead if d not in origins]
        waiting = sorted(x for x in ranks if x not in dead and ranks[x].pending)
        how = f"exited with code {code}" if code is not None else "its process is gone"
        if hb is None:
            title = f"rank {r} crashed ({how}) before sending any record"
        else:
            title = f"rank {r} crashed ({how}), last seen at step {hb.step}" + (
                f" in phase '{hb.phase}'" if hb.phase else ""
            )
        if collateral:
            title += f"; {_ranks(collateral)} failed after it (collateral)"
        if waiting:
            title += f"; {_ranks(waiting)} {'is' if len(waiting) == 1 else 'are'} still waiting"
        out.append(
            _finding(
                job_id,
                attempt,
                "crash",
                0.95 if code is not None else 0.8,
                [r],
                ranks,
                title,
                {
                    "cause": "crash",
                    "exit_code": code,
                    "collateral": collateral,
                    "waiting": waiting,
                    "last_activity": {}
                    if hb is None
                    else {
                        "step": hb.step,
                        "phase": hb.phase,
                        "heartbeat_age_s": round((now - hb.ts_ns) / 1e9, 3),
                        "pid": hb.pid,
                        "host": hb.host,
                    },
                    "action": "replace_node",
                    "action_reason": "the rank's process died first: restart it (on another node if its log shows a "
                    "hardware or driver error); the collateral ranks only lost their peer",
                },
                key=f"crash:{r}",
            )
        )
    return out


def _ranks(rs: list[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs))


def _origin_finding(
    job_id: str,
    attempt: int,
    root: int,
    opic: dict[str, Any],
    blocked: list[dict[str, Any]],
    ranks: dict[int, LiveRank],
    is_stale: bool,
    pid_alive: Callable[[str, int], bool | None],
    exit_codes: dict[int, int],
    now: int,
) -> Finding:
    pg, seq = opic["pg"], opic["seq"]
    group = opic["pg_desc"] or f"pg {pg}"
    waiting = ", ".join(map(str, opic["in_flight"]))
    label = f"{opic['op']} #{seq} of {group}"
    hb = ranks.get(root)
    last: dict[str, Any] = {}
    if hb is not None:
        last = {
            "step": hb.step,
            "phase": hb.phase,
            "phase_for_s": round((now - hb.phase_start_ns) / 1e9, 3) if hb.phase_start_ns else None,
            "heartbeat_age_s": round((now - hb.ts_ns) / 1e9, 3),
            "pid": hb.pid,
            "host": hb.host,
        }
    alive = pid_alive(hb.host, hb.pid) if hb is not None else None
    code = exit_codes.get(root)
    evidence: dict[str, Any] = {**opic, "origin_group": group, "last_activity": last}
    cascade = ""
    if blocked:
        evidence["cascade"] = [
            {
                "group": b["pg_desc"] or f"pg {b['pg']}",
                "pg": b["pg"],
                "seq": b["seq"],
                "op": b["op"],
                "waiting": b["in_flight"],
            }
            for b in blocked
        ]
        cascade = "; it also blocks " + ", ".join(
            f"{b['op']} #{b['seq']} of {b['pg_desc'] or 'pg ' + b['pg']} (ranks {', '.join(map(str, b['in_flight']))})"
            for b in blocked
        )
    if hb is None or (is_stale and (alive is False or code is not None)):
        how = f"exited with code {code}" if code is not None else "its process is gone"
        kind = "crash"
        title = f"rank {root} crashed ({how}) before {label}; ranks {waiting} are waiting in it{cascade}"
        evidence.update(
            cause="crash",
            exit_code=code,
            action="replace_node",
            action_reason="the rank's process died: restart it (on another node if its log shows a hardware or "
            "driver error)",
        )
        confidence = 0.95 if code is not None or alive is False else 0.7
    elif is_stale:
        kind = "hang"
        title = (
            f"rank {root} stopped sending heartbeats {last.get('heartbeat_age_s', 0):.0f} s ago and never entered "
            f"{label}; ranks {waiting} are waiting in it{cascade}"
        )
        evidence.update(
            cause="unresponsive",
            action="replace_node",
            action_reason="the process (or its host) stopped answering: replace the node",
        )
        confidence = 0.8
    else:
        kind = "hang"
        where = f"in phase '{hb.phase}' for {last['phase_for_s']:.0f} s" if hb.phase else "outside collectives"
        title = (
            f"rank {root} never entered {label} (stuck {where}, step {hb.step}); ranks {waiting} "
            f"are waiting in it for {opic['stuck_s']:.0f} s{cascade}"
        )
        evidence.update(
            cause="never_arrived",
            action="restart_rank",
            action_reason="the rank is alive but stuck before the collective (compute, data loader, host): dump its "
            "stack (py-spy), then restart it in place",
        )
        confidence = 0.9
    return _finding(job_id, attempt, kind, confidence, [root], ranks, title, evidence, key=f"{root}:{pg}:{seq}")


def _finding(
    job_id: str,
    attempt: int,
    kind: str,
    confidence: float,
    suspects: Any,
    ranks: dict[int, LiveRank],
    title: str,
    evidence: dict[str, Any],
    *,
    key: str,
) -> Finding:
    step = max((r.step for r in ranks.values()), default=-1)
    now = max((r.ts_ns for r in ranks.values()), default=0)
    # when the stuck collective was entered: fixed, however long ago the ranks last reported
    first_ns = int(evidence.get("since_ns") or now - float(evidence.get("stuck_s") or 0) * 1e9)
    return Finding(
        id=finding_id(job_id, attempt, kind, key),
        job_id=job_id,
        attempt=attempt,
        kind=kind,
        severity=Severity.CRITICAL,
        confidence=confidence,
        title=title,
        suspects=tuple(Suspect(rank=int(r), node=ranks[r].host if r in ranks else "") for r in suspects),
        first_seen_step=step,
        last_seen_step=step,
        first_seen_ns=first_ns,
        last_seen_ns=now,
        evidence=evidence,
        detector=DETECTOR,
    )
