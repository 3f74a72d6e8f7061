"""GPU and log errors as findings of their own (analyzers/incidents.py), on both backends."""

from __future__ import annotations

from ranklens.analyzers.incidents import find_incidents
from ranklens.analyzers.job import analyze_job

SUMMARY = """E1203 18:34:50.140000 5161 torch/distributed/elastic/multiprocessing/api.py:1002] failed \
(exitcode: 3) local_rank: 1 (pid: 5186) of binary: /usr/bin/python
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-03_18:34:50
  host      : node7
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 5185)  (SIGTERM)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-03_18:34:50
  host      : node7
  rank      : 9 (local_rank: 1)
  exitcode  : 3 (pid: 5186)
  error_file: <N/A>
============================================================"""


def _log(job, rank, klass, severity, ts, message, host="node7"):
    return {
        "job_id": job,
        "attempt": 0,
        "host": host,
        "rank": rank,
        "ts_ns": ts,
        "stream": "stdout",
        "source": "job.log",
        "rule": klass,
        "klass": klass,
        "severity": severity,
        "message": message,
        "repeat_count": 1,
        "context": [],
    }


def test_errors_become_findings_warnings_do_not(store):
    j = "inc-job"
    store.write(
        "log_events",
        [
            _log(j, 2, "cuda_oom", "error", 1_000, "[rank2]: torch.OutOfMemoryError: CUDA out of memory."),
            _log(j, 2, "cuda_oom", "error", 2_000, "[rank2]: torch.OutOfMemoryError: CUDA out of memory."),
            _log(j, 3, "nccl_warn", "warning", 1_500, "NCCL WARN something"),
            _log(j, -1, "rank_failure", "error", 3_000, SUMMARY),
            _log("other-job", 1, "cuda_oom", "error", 1_000, "not this job"),
        ],
    )
    store.write(
        "gpu_events",
        [
            {
                "host": "node7",
                "gpu_index": 5,
                "gpu_uuid": "GPU-5",
                "ts_ns": 1_200,
                "job_id": j,
                "rank": 13,
                "kind": "xid",
                "code": 79,
                "message": "GPU has fallen off the bus",
            },
            {
                "host": "node7",
                "gpu_index": 6,
                "gpu_uuid": "GPU-6",
                "ts_ns": 1_300,
                "job_id": j,
                "rank": 14,
                "kind": "ecc_sbe",
                "code": 1,
                "message": "corrected",
            },
        ],
    )
    found = {(f.kind, tuple(s.rank for s in f.suspects)): f for f in find_incidents(store, j, 0)}
    assert set(found) == {("gpu_error", (13,)), ("log_error", (2,)), ("crash", (9,)), ("log_error", (-1,))}
    oom = found[("log_error", (2,))]
    assert oom.evidence["class"] == "cuda_oom" and oom.evidence["count"] == 2 and "(2 times)" in oom.title
    assert "CUDA out of memory" in oom.title
    xid = found[("gpu_error", (13,))]
    assert xid.severity.value == "critical" and xid.evidence["code"] == 79 and "XID 79" in xid.title
    crash = found[("crash", (9,))]
    assert crash.evidence["exit_code"] == 3 and "rank 9 crashed (exit code 3)" in crash.title
    # stable identity: the same errors give the same ids on the next pass
    assert {f.id for f in find_incidents(store, j, 0)} == {f.id for f in found.values()}
    # and analyze_job reports them
    assert {f.id for f in found.values()} <= {f.id for f in analyze_job(store, j, 0)}


def test_a_job_without_errors_has_no_incidents(store):
    assert find_incidents(store, "nothing-here", 0) == []


def test_nan_names_the_rank_that_had_non_finite_gradients_before_the_all_reduce(store):
    j = "nan-job"

    def row(rank, step, ts):
        msg = f"rank {rank}: non-finite gradients (NaN/Inf) in DDP bucket 0 before the all-reduce at step {step}: x"
        return _log(j, rank, "nonfinite_grad", "error", ts, msg)

    store.write("log_events", [row(2, 10, 1_000), row(0, 11, 2_000), row(1, 11, 2_100), row(3, 11, 2_050)])
    (f,) = find_incidents(store, j, 0)
    assert f.kind == "nan" and [s.rank for s in f.suspects] == [2]
    assert f.evidence["step"] == 10 and f.evidence["after_all_reduce"] == [0, 1, 3]
    assert "rank 2 produced non-finite gradients (NaN/Inf) at step 10" in f.title


def _coll(job, rank, seq, nbytes, op="all_reduce", pg="0", dtype="float32", step=-1):
    return {
        "job_id": job,
        "attempt": 0,
        "rank": rank,
        "pg": pg,
        "seq": seq,
        "op": op,
        "nbytes": nbytes,
        "dtype": dtype,
        "peer": -1,
        "step": step if step >= 0 else seq // 2,
        "enter_ns": 1_000_000 * seq + rank,
        "end_ns": 1_000_000 * seq + 500 + rank,
    }


def test_the_rank_that_passed_another_size_is_named_at_the_ledgers_frontier(store):
    j = "mismatch-job"
    rows = [_coll(j, r, s, 18_960 if s % 2 else 4) for s in range(1, 19) for r in range(4)]
    # seq 18: rank 1 all-reduces one element more; rank 0 died before its row reached the store
    rows = [x for x in rows if x["seq"] < 18] + [_coll(j, r, 18, 18_964 if r == 1 else 18_960) for r in (1, 2, 3)]
    # an uneven all_to_all and a gather are not mismatches
    rows += [
        _coll(j, r, s, 100 * (r + 1), op=op, pg="7") for s, op in ((1, "all_to_all"), (2, "gather")) for r in range(4)
    ]
    store.write("collectives", rows)
    got = [f for f in find_incidents(store, j) if f.kind in ("size_mismatch", "desync")]
    assert len(got) == 1, [f.title for f in got]
    f = got[0]
    assert f.kind == "size_mismatch" and [s.rank for s in f.suspects] == [1] and f.confidence == 0.9
    assert "rank 1 passed 18,964 B float32" in f.title and "ranks 2, 3 passed 18,960 B" in f.title
    assert f.evidence["seq"] == 18 and f.evidence["pg"] == "0" and "seq = 18" in f.evidence["sql"]
    # what the analysis prints: the cause first, the crash the launcher saw after it says so
    crash = _log(j, -1, "rank_failure", "error", 19_000_000, SUMMARY.replace("rank      : 9", "rank      : 0"))
    store.write("log_events", [crash])
    ordered = analyze_job(store, j, 0)
    assert ordered[0].kind == "size_mismatch"
    c = next(x for x in ordered if x.kind == "crash")
    assert "after the size mismatch at collective #18" in c.title and c.evidence["after"] == f.id


def test_a_different_collective_is_a_desync_and_a_tie_blames_both_sides(store):
    j = "desync-job"
    rows = [_coll(j, r, s, 64) for s in range(1, 6) for r in range(4)]
    rows += [_coll(j, r, 6, 64, op="broadcast" if r == 2 else "all_reduce") for r in range(4)]
    rows += [_coll(j, r, s, 64, pg="1") for s in range(1, 4) for r in (0, 1)]
    rows += [_coll(j, r, 4, 64 if r == 0 else 128, pg="1") for r in (0, 1)]
    store.write("collectives", rows)
    got = {f.evidence["pg"]: f for f in find_incidents(store, j) if f.kind in ("size_mismatch", "desync")}
    assert got["0"].kind == "desync" and [s.rank for s in got["0"].suspects] == [2]
    assert "rank 2 called broadcast" in got["0"].title
    assert got["1"].kind == "size_mismatch" and [s.rank for s in got["1"].suspects] == [0, 1]
    assert got["1"].confidence == 0.4 and got["1"].evidence["blamed"] == "every side (a tie)"
    # a healthy ledger: nothing
    store.write("collectives", [_coll("fine", r, s, 64) for s in range(1, 30) for r in range(4)])
    assert not [f for f in find_incidents(store, "fine") if f.kind in ("size_mismatch", "desync")]


def test_a_launchers_lines_after_every_rank_ended_cleanly_are_not_findings(store):
    """torch elastic's exit-barrier race after a successful multi-node job (the network drill's false
    log_error): lines after every rank's clean exit are the launcher's shutdown; before it, or while a
    rank has not ended cleanly, they count."""
    j = "clean-end"
    barrier = "E1205 api.py:1008] Error waiting on exit barrier. Elapsed: 0.021"
    oom = "[rank1]: torch.OutOfMemoryError: CUDA out of memory."
    store.write(
        "log_events",
        [_log(j, 1, "cuda_oom", "error", 1_000, oom), _log(j, -1, "rank_failure", "error", 9_000, barrier, "node1")],
    )
    beats = [{"job_id": j, "attempt": 0, "rank": r, "ts_ns": 5_000 + r, "host": "node7", "exited": 1} for r in (0, 1)]
    store.write("heartbeats", [{**beats[0], "exited": 0}, beats[1]])  # rank 0 not ended yet
    assert sorted(f.evidence["class"] for f in find_incidents(store, j)) == ["cuda_oom", "rank_failure"]
    store.write("heartbeats", [beats[0]])  # now every rank ended cleanly, before the barrier line
    assert [f.evidence["class"] for f in find_incidents(store, j)] == ["cuda_oom"]


def test_the_heartbeats_are_read_only_when_there_are_error_lines_to_judge(embedded_store):
    from ranklens.store.testing import RecordingStore

    rec = RecordingStore(embedded_store)
    assert find_incidents(rec, "nothing-here", 0) == []
    assert not [c for c in rec.calls if c.op == "query" and "exited = 1" in str(c.args[0])]
