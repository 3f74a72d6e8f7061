"""Executors (analyzers/recovery/executors): the policy's [[executor]] tables, the torchrun executor on
real processes, and the engine writing each result as an ``actions`` row — never an exception."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ranklens.analyzers.recovery import RecoveryEngine
from ranklens.analyzers.recovery.api import Decision, Level, PolicyError
from ranklens.analyzers.recovery.executors import ExecContext, ExecutorSpec, build_executor
from ranklens.analyzers.recovery.policy import parse_policy
from ranklens.config import ENV_JOB_ID, node_name
from tests.recovery_helpers import finding

EXECUTOR = {"name": "elastic", "kind": "torchrun", "kinds": ["hang"], "stacks_wait_s": 0}


def _policy(dry_run: bool = False, **executor: object):
    return parse_policy(
        {
            "dry_run": dry_run,
            "rule": [{"name": "hangs", "kinds": ["hang"], "level": "restart_rank"}],
            "executor": [{**EXECUTOR, **executor}],
        }
    )


def test_executor_tables_are_checked_by_name_and_key():
    p = _policy(signal="sigterm")
    (spec,) = p.executors
    assert (spec.name, spec.kind, spec.options["signal"]) == ("elastic", "torchrun", "SIGTERM")
    assert spec.accepts(Level.RESTART_RANK, "hang") and not spec.accepts(Level.RESTART_RANK, "straggler")
    assert not spec.accepts(Level.NOTIFY, "hang")
    for bad, says in [
        ({"kind": "webhook"}, "webhooks are [[endpoint]] tables, not executors"),
        ({"kind": "teleport"}, "'teleport' is not an executor kind; one of ['kubernetes', 'slurm', 'torchrun']"),
        ({"kind": "slurm"}, "unknown key(s) ['stacks_wait_s']"),  # the torchrun key on another kind
        ({"colour": "red"}, "unknown key(s) ['colour']"),
        ({"signal": "SIGHUP"}, "'SIGHUP': one of 'SIGKILL', 'SIGTERM', 'SIGINT'"),
        ({"levels": ["reboot"]}, "'reboot' is not a recovery level"),
    ]:
        with pytest.raises(PolicyError) as e:
            _policy(**bad)
        assert says in str(e.value) and "executor[0]" in str(e.value)


def _rank_process(job_id: str, rank: int, attempt: int = 0) -> subprocess.Popen[bytes]:
    env = {**os.environ, ENV_JOB_ID: job_id, "RANK": str(rank), "TORCHELASTIC_RESTART_COUNT": str(attempt)}
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env=env)


def _beat(store, job_id: str, rank: int, pid: int, host: str | None = None) -> None:
    store.write(
        "heartbeats",
        [
            {
                "job_id": job_id,
                "attempt": 0,
                "rank": rank,
                "ts_ns": time.time_ns(),
                "pid": pid,
                "host": host or node_name(),
            }
        ],
    )


def _decision(f, level: Level = Level.RESTART_RANK, target: str | None = None, dry_run: bool = False) -> Decision:
    return Decision(f, level, target or f"rank:{f.suspects[0].rank}", "hangs", "test", dry_run, "k", time.time_ns())


def _wait_gone(p: subprocess.Popen[bytes]) -> int:
    return p.wait(timeout=30)


def test_torchrun_executor_ends_the_ranks_process_and_only_it(embedded_store, tmp_path):
    job = "exec-job"
    mine, other, later = _rank_process(job, 2), _rank_process("another-job", 2), _rank_process(job, 1, attempt=1)
    procs = (mine, other, later)
    try:
        _beat(embedded_store, job, 2, mine.pid)
        _beat(embedded_store, job, 3, other.pid)  # a pid that is not this job's rank 3 any more
        _beat(embedded_store, job, 1, later.pid)  # rank 1's pid, now a worker of the next attempt
        stacks = tmp_path / job / "0" / "stacks"
        stacks.mkdir(parents=True)
        frames = [{"file": "train.py", "line": 7, "func": "main", "code": "time.sleep(9)"}]
        main = {"thread": "MainThread", "main": True, "frames": frames}
        doc = {"rank": 2, "pid": mine.pid, "ts_ns": time.time_ns(), "threads": [main]}  # the tracer's dump
        (stacks / "stacks_rank_2.json").write_text(json.dumps(doc))
        ex = build_executor(ExecutorSpec("elastic", "torchrun", options={"stacks_wait_s": 0}))
        ctx = ExecContext(store=embedded_store, host=node_name(), spool_dir=str(tmp_path))
        f = finding(job_id=job, kind="hang", rank=2)
        res = ex.execute(_decision(f), ctx)
        assert res.outcome == "acknowledged", res.detail
        assert _wait_gone(mine) == -9
        assert "SIGKILL to rank 2" in res.detail and "train.py:7 main: time.sleep(9)" in res.detail
        assert res.data["signalled"][0]["innermost"] == ["train.py:7 main: time.sleep(9)"]
        res = ex.execute(_decision(finding(job_id=job, kind="hang", rank=3)), ctx)
        assert res.outcome == "skipped" and "is no longer rank 3 of job exec-job attempt 0: left alone" in res.detail
        res = ex.execute(_decision(finding(job_id=job, kind="hang", rank=1)), ctx)
        assert res.outcome == "skipped" and "is no longer rank 1" in res.detail
        assert other.poll() is None and later.poll() is None
        res = ex.execute(_decision(f), ctx)  # rank 2 is gone now
        assert res.outcome == "skipped" and "has already exited" in res.detail
        res = ex.execute(_decision(f, Level.REPLACE_NODE, "node:node1"), ctx)
        assert res.outcome == "skipped" and "cannot move a rank to another node" in res.detail
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_stack_dump_from_before_the_hang_is_not_taken_for_it(embedded_store, tmp_path):
    job = "stale-job"
    p = _rank_process(job, 0)
    try:
        _beat(embedded_store, job, 0, p.pid)
        stacks = tmp_path / job / "0" / "stacks"
        stacks.mkdir(parents=True)
        main = {"thread": "MainThread", "main": True, "frames": []}
        old = {"rank": 0, "pid": p.pid, "ts_ns": time.time_ns() - 3600 * 10**9, "threads": [main]}
        (stacks / "stacks_rank_0.json").write_text(json.dumps(old))
        ex = build_executor(ExecutorSpec("elastic", "torchrun", options={"stacks_wait_s": 0, "py_spy": ""}))
        ctx = ExecContext(store=embedded_store, host=node_name(), spool_dir=str(tmp_path))
        res = ex.execute(_decision(finding(job_id=job, kind="hang", rank=0, duration_s=60)), ctx)
        assert res.outcome == "acknowledged" and "no stack dump of rank 0 within 0 s" in res.detail
    finally:
        p.kill()
        p.wait()


def test_without_a_tracer_dump_py_spy_reads_the_stuck_ranks_stack(embedded_store, tmp_path):
    """A rank whose tracer cannot dump (spinning in C with the GIL, or untraced): py-spy reads its
    stack from outside, in the tracer's format, before the restart."""
    from ranklens.analyzers.recovery.executors.torchrun import find_tool

    py_spy = find_tool("py-spy")
    if py_spy is None:
        pytest.skip("py-spy is not installed (pip install py-spy; the dev extra has it)")
    job = "pyspy-job"
    script = tmp_path / "stuck.py"
    script.write_text("import time\n\n\ndef wait_for_data():\n    time.sleep(600)\n\n\nwait_for_data()\n")
    env = {**os.environ, ENV_JOB_ID: job, "RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0"}
    p = subprocess.Popen([sys.executable, str(script)], env=env)
    try:
        _beat(embedded_store, job, 0, p.pid)
        ex = build_executor(ExecutorSpec("elastic", "torchrun", options={"stacks_wait_s": 0.5}))
        ctx = ExecContext(store=embedded_store, host=node_name(), spool_dir=str(tmp_path))
        deadline = time.monotonic() + 30  # the process is in its sleep before we look
        while (
            "wait_for_data"
            not in subprocess.run([py_spy, "dump", "--pid", str(p.pid)], capture_output=True, text=True).stdout
        ):
            assert time.monotonic() < deadline, "py-spy never saw the script's frame"
            time.sleep(0.2)
        res = ex.execute(_decision(finding(job_id=job, kind="hang", rank=0, duration_s=5)), ctx)
        assert res.outcome == "acknowledged", res.detail
        assert _wait_gone(p) == -9
        (sig,) = res.data["signalled"]
        assert sig["source"] == "py-spy"
        assert sig["innermost"][0] == f"{script}:5 wait_for_data: time.sleep(600)"
        assert "rank 0's stack before it (py-spy): " + sig["innermost"][0] in res.detail
        doc = json.loads(Path(sig["stacks"]).read_text())
        assert Path(sig["stacks"]).name == "stacks_rank_0.pyspy.json" and doc["pid"] == p.pid
        from ranklens.formats.stacks import read_stack_dump

        assert read_stack_dump(sig["stacks"])["threads"][0]["main"] is True  # the post-mortem reader reads it
    finally:
        p.kill()
        p.wait()


def test_without_a_tracer_dump_torchs_worker_server_gives_the_stack(embedded_store, tmp_path):
    """A script under torch elastic's worker_main serves dump_traceback on $TORCH_WORKER_SERVER_SOCKET
    (the handler behind torch's debug server's /stacks): the executor asks it before py-spy."""
    job = "torch-ws-job"
    script = tmp_path / "served.py"
    script.write_text(
        "import time\n"
        "from torch.distributed.elastic.control_plane import worker_main\n\n\n"
        "def stuck_in_collective():\n    time.sleep(600)\n\n\n"
        "with worker_main():\n    stuck_in_collective()\n"
    )
    sock = tmp_path / "ws.sock"
    env = {**os.environ, ENV_JOB_ID: job, "RANK": "1", "TORCHELASTIC_RESTART_COUNT": "0"}
    env["TORCH_WORKER_SERVER_SOCKET"] = str(sock)
    p = subprocess.Popen([sys.executable, str(script)], env=env, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():  # the server is up once its socket is
            assert p.poll() is None and time.monotonic() < deadline, "the worker server never came up"
            time.sleep(0.1)
        _beat(embedded_store, job, 1, p.pid)
        ex = build_executor(ExecutorSpec("elastic", "torchrun", options={"stacks_wait_s": 0, "py_spy": ""}))
        ctx = ExecContext(store=embedded_store, host=node_name(), spool_dir=str(tmp_path))
        res = ex.execute(_decision(finding(job_id=job, kind="hang", rank=1, duration_s=5)), ctx)
        assert res.outcome == "acknowledged", res.detail
        assert _wait_gone(p) == -9
        (sig,) = res.data["signalled"]
        assert sig["source"] == "torch"
        assert sig["innermost"][0] == f"{script}:6 stuck_in_collective: time.sleep(600)", sig["innermost"]
        assert Path(sig["stacks"]).name == "stacks_rank_1.torch.json"
    finally:
        p.kill()
        p.wait()


def test_faulthandler_text_parses_into_the_dump_format():
    from ranklens.formats.stacks import parse_faulthandler

    text = (
        "Current thread 0x00007f0000000001 (most recent call first):\n  <no Python frame>\n\n"
        "Thread 0x00007f0000000002 (most recent call first):\n"
        '  File "/x/loader.py", line 9 in fetch\n  File "/usr/lib/python3.11/threading.py", line 1002 in run\n\n'
        "Thread 0x00007f0000000003 (most recent call first):\n"
        '  File "/x/train.py", line 40 in step\n  File "/x/train.py", line 80 in <module>\n'
    )
    threads = parse_faulthandler(text)
    assert [(t["thread"], t["main"]) for t in threads] == [("0x00007f0000000002", False), ("0x00007f0000000003", True)]
    assert [(f["func"], f["line"]) for f in threads[1]["frames"]] == [("<module>", 80), ("step", 40)]
    assert parse_faulthandler("garbage\n") == [] and parse_faulthandler("") == []


def test_a_rank_on_another_node_is_not_signalled(embedded_store):
    _beat(embedded_store, "remote-job", 1, 12345, host="some-other-node")
    ex = build_executor(ExecutorSpec("elastic", "torchrun"))
    res = ex.execute(_decision(finding(job_id="remote-job", kind="hang", rank=1)), ExecContext(embedded_store, "here"))
    assert res.outcome == "skipped" and "runs on some-other-node, not here (here)" in res.detail


def _actions(store, job: str):
    return store.query(f"SELECT target, outcome, detail FROM actions WHERE job_id = '{job}' ORDER BY ts_ns").to_pylist()


def test_the_engine_writes_each_executor_result_as_an_actions_row(embedded_store, tmp_path):
    job = "engine-job"
    p = _rank_process(job, 2)
    try:
        _beat(embedded_store, job, 2, p.pid)
        ctx = ExecContext(store=embedded_store, host=node_name(), spool_dir=str(tmp_path))
        with RecoveryEngine(_policy(), embedded_store, tmp_path / "outbox", context=ctx) as engine:
            report = engine.process([finding(job_id=job, kind="hang", rank=2)])
        assert [(x, r.outcome) for x, _f, r in report.executed] == [("elastic", "acknowledged")]
        assert _wait_gone(p) == -9
    finally:
        p.kill()
        p.wait()
    rows = _actions(embedded_store, job)
    assert [(r["target"], r["outcome"]) for r in rows] == [("rank:2", "decided"), ("executor:elastic", "acknowledged")]


def test_dry_run_says_what_it_would_do_and_does_nothing(embedded_store, tmp_path):
    job = "dry-job"
    p = _rank_process(job, 2)
    try:
        _beat(embedded_store, job, 2, p.pid)
        with RecoveryEngine(_policy(dry_run=True), embedded_store, tmp_path / "outbox") as engine:
            engine.process([finding(job_id=job, kind="hang", rank=2)])
        assert p.poll() is None
    finally:
        p.kill()
        p.wait()
    rows = _actions(embedded_store, job)
    assert [(r["target"], r["outcome"]) for r in rows] == [("rank:2", "dry_run"), ("executor:elastic", "skipped")]
    assert "dry run: would send SIGKILL to rank 2" in rows[1]["detail"]


def test_an_executor_that_raises_is_a_failed_row(embedded_store, tmp_path, monkeypatch):
    from ranklens.analyzers.recovery.executors import torchrun

    def boom(self, d, ctx):
        raise OSError("the launcher is gone")

    monkeypatch.setattr(torchrun.TorchrunExecutor, "execute", boom)
    with RecoveryEngine(_policy(), embedded_store, tmp_path / "outbox") as engine:
        report = engine.process([finding(job_id="boom-job", kind="hang", rank=1)])
    assert report.executed[0][2].outcome == "failed"
    rows = _actions(embedded_store, "boom-job")
    assert rows[-1]["outcome"] == "failed" and "OSError: the launcher is gone" in rows[-1]["detail"]


def test_a_jobs_recovery_summary_adds_up_its_remediations():
    from ranklens.recover import RecoveryTimes, job_recovery_summary

    s = 10**9
    hang = RecoveryTimes("f1", "hang", "t", 0, 100 * s, 110 * s, 111 * s, 118 * s, 1, 4)
    crash = RecoveryTimes("f2", "crash", "t", 1, 200 * s, 206 * s, 206 * s, 212 * s, 2, 4)
    stuck = RecoveryTimes("f3", "hang", "t", 2, 300 * s, 311 * s, 312 * s, None, None, 4)
    assert job_recovery_summary("j", [hang, crash, stuck]) == (
        "job j: 3 remediation(s), 2 resumed training; mean MTTD 9.0 s, mean MTTR 15.0 s, 120 GPU-s lost to recovery"
    )
    assert job_recovery_summary("j", [stuck]) == "job j: 1 remediation(s), 0 resumed training; mean MTTD 11.0 s"
    assert job_recovery_summary("j", []) == "job j: no remediation"


def test_a_requeued_slurm_job_resumes_as_its_next_run(store):
    """Slurm requeues a job under the same id; ranklens names the next run `slurm-<id>-r1`. The
    requeue's remediation of `slurm-42` ends when `slurm-42-r1` completes its first step (not a
    later attempt of `slurm-42`, which never comes); another Slurm job's runs do not count."""
    from ranklens.analyzers import save_findings
    from ranklens.analyzers.recovery.audit import action_row
    from ranklens.recover import earlier_runs, recovery_times

    s = 10**9
    t0 = time.time_ns() - 3600 * s
    f = finding(job_id="slurm-42", kind="hang", rank=1, now_ns=t0 + 100 * s)
    save_findings(store, [f])
    key = "k-42"
    common = dict(finding_id=f.id, job_id="slurm-42", attempt=0, action="replace_node", idempotency_key=key)
    store.write("actions", [
        action_row(**common, target="node:n1", outcome="decided", ts_ns=t0 + 110 * s),
        action_row(**common, target="executor:slurm", outcome="acknowledged", ts_ns=t0 + 112 * s),
    ])  # fmt: skip

    def step(job: str, end_s: float) -> dict:
        return {"job_id": job, "attempt": 0, "rank": 0, "step": 0, "start_ns": t0, "end_ns": t0 + int(end_s * s)}

    # the other job's requeued run resumed first; slurm-42's own earlier steps are before the action
    store.write("steps", [step("slurm-420-r1", 130), step("slurm-42", 50), step("slurm-42-r1", 160)])
    (t,) = recovery_times(store, "slurm-42")
    assert t.resumed_job == "slurm-42-r1" and t.resumed_ns == t0 + 160 * s
    assert t.mttr_s == pytest.approx((t0 + 160 * s - t.onset_ns) / 1e9)
    assert "training resumed (job slurm-42-r1's first step done)" in t.line()
    rows = store.query("SELECT outcome, detail FROM actions WHERE job_id = 'slurm-42' AND outcome = 'resumed'").rows()
    assert len(rows) == 1 and json.loads(rows[0][1])["resumed_job"] == "slurm-42-r1"
    recovery_times(store, "slurm-42")  # recorded once
    assert store.query("SELECT count() FROM actions WHERE outcome = 'resumed'").rows()[0][0] == 1
    # what `ranklens run --recover` of the requeued run looks at, besides its own id
    assert earlier_runs("slurm-42-r2") == ["slurm-42", "slurm-42-r1"]
    assert earlier_runs("slurm-42") == [] and earlier_runs("job-r") == []
    # a job that is not a Slurm job has no later runs
    g = finding(job_id="plain", kind="hang", rank=1, now_ns=t0 + 100 * s)
    save_findings(store, [g])
    store.write("actions", [action_row(finding_id=g.id, job_id="plain", attempt=0, action="restart_job",
                                       idempotency_key="k-p", target="job:plain", outcome="decided",
                                       ts_ns=t0 + 110 * s)])  # fmt: skip
    store.write("steps", [step("plain-r1", 200)])
    (p,) = recovery_times(store, "plain")
    assert p.resumed_ns is None and p.resumed_job == ""
