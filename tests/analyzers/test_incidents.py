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
