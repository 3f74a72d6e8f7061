"""Live crash analysis, decided on a fixed heartbeat picture (fast; the real jobs are in
tests/analyzers/test_live_hangs.py): a rank that died while waiting inside a collective is collateral."""

from __future__ import annotations

from ranklens.analyzers.live_hangs import HangConfig, detect_live_hangs

NOW = 1_796_000_000_000_000_000
S = 1_000_000_000


def _hb(rank: int, age_s: float, *, pending: bool, exited: int = 0) -> dict:
    return {
        "job_id": "j", "attempt": 0, "rank": rank, "ts_ns": NOW - int(age_s * S), "pid": 1000 + rank,
        "host": "elsewhere", "step": 10, "phase": "data" if not pending else "", "phase_start_ns": NOW - 30 * S,
        "last_progress_ns": NOW - 20 * S, "pgs": ["0"], "pg_entered": [40 if pending else 39],
        "pg_completed": [39], "pending_pgs": ["0"] if pending else [], "pending_seqs": [40] if pending else [],
        "pending_ops": ["all_reduce"] if pending else [], "pending_nbytes": [256] if pending else [],
        "pending_enter_ns": [NOW - 20 * S] if pending else [], "exited": exited,
    }  # fmt: skip


def test_rank_that_died_waiting_in_a_collective_is_not_blamed_before_its_failed_row_arrives(embedded_store):
    # Rank 1 stopped in its data phase (its heartbeats stopped; from here its pid cannot be checked);
    # rank 2 was waiting for it in the world all_reduce and has died since (its node's collector saw
    # the process go), but its failed ledger row has not been shipped yet.
    embedded_store.write(
        "heartbeats",
        [
            _hb(0, 0.2, pending=True),
            _hb(1, 15, pending=False),
            _hb(2, 8, pending=True, exited=2),
            _hb(3, 0.2, pending=True),
        ],
    )
    embedded_store.write("ranks", [{"job_id": "j", "attempt": 0, "rank": r, "world_size": 4} for r in range(4)])
    findings = detect_live_hangs(
        embedded_store,
        "j",
        config=HangConfig(min_stall_s=2, heartbeat_stale_s=5, startup_stall_s=2),
        now_ns=NOW,
        pid_alive=lambda h, p: None,
    )
    assert [(f.kind, [s.rank for s in f.suspects]) for f in findings] == [("hang", [1])]
    assert findings[0].evidence["cause"] == "unresponsive" and findings[0].evidence["missing"] == [1]


def _hb2(rank: int, pending: tuple[str, int, float] | None) -> dict:
    hb = _hb(rank, 0.2, pending=False)
    hb.update(pgs=["0", "1", "2"], pg_entered=[9, 4, 4], pg_completed=[9, 4, 4], phase="compute")
    if pending:
        pg, seq, age_s = pending
        hb.update(
            pending_pgs=[pg], pending_seqs=[seq], pending_ops=["all_reduce"], pending_nbytes=[256],
            pending_enter_ns=[NOW - int(age_s * S)], phase="",
        )  # fmt: skip
    return hb


def test_a_group_the_origin_blocks_is_its_cascade_before_it_is_stuck_the_full_threshold(embedded_store):
    # rank 3 stopped in compute; rank 2 has waited for it in pair_1 for 12 s; ranks 0 and 1 entered the
    # world all_reduce a moment later (7 s ago, on a loaded host): the pass between the two thresholds
    # still says the world group is blocked by rank 3, and blames no one in it
    embedded_store.write(
        "heartbeats", [_hb2(0, ("0", 10, 7)), _hb2(1, ("0", 10, 7)), _hb2(2, ("2", 5, 12)), _hb2(3, None)]
    )
    embedded_store.write("ranks", [{"job_id": "j", "attempt": 0, "rank": r, "world_size": 4} for r in range(4)])
    embedded_store.write(
        "process_groups",
        [
            {"job_id": "j", "attempt": 0, "pg": "0", "name": "default_pg", "ranks": [0, 1, 2, 3]},
            {"job_id": "j", "attempt": 0, "pg": "1", "name": "pair_0", "ranks": [0, 1]},
            {"job_id": "j", "attempt": 0, "pg": "2", "name": "pair_1", "ranks": [2, 3]},
        ],
    )
    cfg = HangConfig(min_stall_s=10, heartbeat_stale_s=5, startup_stall_s=10)
    findings = detect_live_hangs(embedded_store, "j", config=cfg, now_ns=NOW, pid_alive=lambda h, p: True)
    assert [(f.kind, [s.rank for s in f.suspects]) for f in findings] == [("hang", [3])]
    (f,) = findings
    assert f.evidence["origin_group"] == "pair_1"
    assert [(c["group"], c["waiting"]) for c in f.evidence["cascade"]] == [("default_pg", [0, 1])]
    # and a stall shorter than the threshold everywhere is no hang at all
    embedded_store.write("heartbeats", [dict(_hb2(2, ("2", 5, 6)), ts_ns=NOW + 1)])
    later = detect_live_hangs(embedded_store, "j", config=cfg, now_ns=NOW + 2, pid_alive=lambda h, p: True)
    assert later == []


def _paced_job(store, origin_phase: str, stuck_s: float, *, step_s: float = 0.2) -> list:
    """Ranks 0, 1, 3 wait ``stuck_s`` in the world all_reduce; rank 2 (fresh heartbeats) is in
    ``origin_phase``; the job has a pace of its own: 30 completed steps of ``step_s``."""
    rows = []
    for r in range(4):
        hb = _hb(r, 0.2, pending=r != 2)
        hb.update(pending_enter_ns=[NOW - int(stuck_s * S)] if r != 2 else [], phase="" if r != 2 else origin_phase)
        rows.append(hb)
    store.write("heartbeats", rows)
    store.write("ranks", [{"job_id": "j", "attempt": 0, "rank": r, "world_size": 4} for r in range(4)])
    t0 = NOW - 60 * S
    store.write(
        "steps",
        [
            {"job_id": "j", "attempt": 0, "rank": r, "step": i, "start_ns": t0 + int(i * step_s * S),
             "end_ns": t0 + int((i + 1) * step_s * S)}
            for r in range(4) for i in range(30)
        ],
    )  # fmt: skip
    return detect_live_hangs(store, "j", now_ns=NOW, pid_alive=lambda h, p: True)


def test_a_rank_stuck_inside_a_step_of_a_fast_job_is_named_after_5_s_between_steps_after_10(tmp_path):
    from ranklens.store import open_store

    stores = iter(range(100))

    def named(phase: str, stuck_s: float, **kw) -> list:
        store = open_store(f"embedded://{tmp_path}/store{next(stores)}")
        found = _paced_job(store, phase, stuck_s, **kw)
        return [(f.kind, [s.rank for s in f.suspects], f.evidence["threshold_s"]) for f in found]

    # inside a step (its forward, backward, optimizer or data loading): 5 s, the floor of a fast job
    for phase in ("forward", "backward", "optimizer", "data"):
        assert named(phase, 6) == [("hang", [2], 5.0)], phase
    assert named("forward", 4) == []
    # between steps (a checkpoint, an evaluation, logging: phase '' or the script's own): 10 s
    assert named("", 6) == [] and named("checkpoint", 6) == []
    assert named("", 11) == [("hang", [2], 10.0)]
    # a slow job's own pace sets it higher: 5 x its 1.6 s step
    assert named("forward", 6, step_s=1.6) == []
    assert named("forward", 8.5, step_s=1.6) == [("hang", [2], 8.0)]
