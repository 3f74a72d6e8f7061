"""ranklens._worker: the one background worker (bounded queue, error isolation, fork reset,
bounded close, a 1 ms task's cadence while a blocking task is slow). Synchronised on events."""

from __future__ import annotations

import itertools
import os
import select
import threading
import time

import pytest

from ranklens._worker import IDLE, Worker

WAIT_S = 10.0  # generous upper bound for an event on a loaded 2-core machine (never a fixed sleep)


@pytest.fixture
def worker():
    w = Worker("test-worker", max_queue=3)
    yield w
    w.close(1.0)


def test_submit_drops_and_counts_when_the_queue_is_full(worker):
    started, release = threading.Event(), threading.Event()
    ran = []

    def hold():
        started.set()
        release.wait(WAIT_S)

    assert worker.submit(hold, name="hold")
    assert started.wait(WAIT_S)  # the job thread is busy: what follows stays queued
    assert all(worker.submit(lambda i=i: ran.append(i), name=f"q{i}") for i in range(3))
    t0 = time.monotonic()
    assert worker.submit(lambda: ran.append("x"), name="over") is False  # full: dropped, not blocked
    assert worker.submit(lambda: ran.append("y"), name="over") is False
    assert time.monotonic() - t0 < 0.5
    s = worker.stats()
    assert (s.jobs_dropped, s.queued) == (2, 3)
    release.set()
    report = worker.close(WAIT_S)
    assert report.clean, report
    assert ran == [0, 1, 2]
    assert worker.stats().jobs_run == 4
    assert worker.submit(lambda: None) is False  # closed: dropped and counted too
    assert worker.stats().jobs_dropped == 3


def test_errors_are_counted_and_never_end_the_threads(worker):
    ok_ticks, job_done = threading.Event(), threading.Event()
    n = [0]

    def bad():
        raise RuntimeError("boom")

    def good():
        n[0] += 1
        if n[0] >= 5:
            ok_ticks.set()

    worker.every(0.001, bad, name="bad-task")
    worker.every(0.001, good, name="good-task")
    worker.submit(bad, name="bad-job")
    worker.submit(job_done.set, name="good-job")
    assert ok_ticks.wait(WAIT_S) and job_done.wait(WAIT_S)
    s = worker.stats()
    assert s.errors_by_name["bad-job"] == 1
    assert s.errors_by_name["bad-task"] >= 1
    assert "good-task" not in s.errors_by_name
    assert s.task_errors == sum(s.errors_by_name.values())


def test_idle_task_pauses_until_woken(worker):
    runs, again = [], threading.Event()

    def poll():
        runs.append(1)
        if len(runs) == 2:
            again.set()
        return IDLE

    task = worker.every(0.001, poll, name="poller")
    done = threading.Event()
    worker.every(0.001, lambda: done.set() if len(runs) >= 1 else None, name="probe")
    assert done.wait(WAIT_S)
    # paused: a few hundred further ticks of the probe, and the poller has not run again
    seen = threading.Event()
    count = [0]

    def count_ticks():
        count[0] += 1
        if count[0] >= 50:
            seen.set()

    worker.every(0.001, count_ticks, name="count")
    assert seen.wait(WAIT_S)
    assert len(runs) == 1
    task.wake()
    assert again.wait(WAIT_S)


def test_close_is_bounded_with_a_stuck_job_and_reports_it():
    w = Worker("stuck-worker")
    stuck, release, finals = threading.Event(), threading.Event(), []
    w.submit(lambda: (stuck.set(), release.wait(60)), name="stuck-flush")
    assert stuck.wait(WAIT_S)
    w.submit(lambda: None, name="behind")
    t0 = time.monotonic()
    report = w.close(0.3, final=lambda: finals.append(1))
    took = time.monotonic() - t0
    try:
        assert took < 2.0, took
        assert not report.clean
        assert report.unfinished == ("stuck-flush", "behind", "final")
        assert report.final_ran is False and finals == []
    finally:
        release.set()


def test_close_runs_the_queue_then_the_final_flush():
    w = Worker("final-worker")
    order = []
    for i in range(3):
        w.submit(lambda i=i: order.append(i))
    report = w.close(WAIT_S, final=lambda: order.append("final"))
    assert report.clean and report.final_ran
    assert order == [0, 1, 2, "final"]


def test_a_1ms_task_keeps_its_cadence_while_a_blocking_task_is_slow(worker):
    """The slow task stands for a flush on a stalled disk: as a blocking (queued) task it must not
    stall the 1 ms watcher that shares the worker."""
    ticks: list[float] = []
    slow_started, slow_done = threading.Event(), threading.Event()

    def slow_flush():
        slow_started.set()
        time.sleep(0.5)  # the workload under test (a disk write that takes 0.5 s), not a synchronisation
        slow_done.set()

    def watch():
        ticks.append(time.monotonic())

    worker.every(0.001, watch, name="watch")
    worker.every(0.005, slow_flush, name="flush", blocking=True)
    assert slow_started.wait(WAIT_S)
    start = time.monotonic()
    assert slow_done.wait(WAIT_S)
    end = time.monotonic()
    during = [t for t in ticks if start <= t <= end]
    gaps = [b - a for a, b in itertools.pairwise(during)]
    # 0.5 s at 1 ms is ~500 ticks; on a busy 2-core machine accept a fifth of that, and no gap near
    # the flush's length (the same flush run on the tick thread gives one 500 ms gap)
    assert len(during) >= 100, len(during)
    assert max(gaps) < 0.1, max(gaps)
    assert worker.stats().overruns_by_name.get("flush", 0) >= 1  # due again while still running: skipped


def test_forked_child_starts_with_a_fresh_worker():
    """Fork while another thread holds the worker's lock and a job runs: the child inherits
    neither (it would deadlock on the lock, or wait for a thread that does not exist there)."""
    w = Worker("fork-worker")
    running, release = threading.Event(), threading.Event()
    w.submit(lambda: (running.set(), release.wait(WAIT_S)), name="parent-job")
    w.submit(lambda: None, name="parent-queued")
    w.every(0.01, lambda: None, name="parent-task")
    assert running.wait(WAIT_S)
    locked, unlock = threading.Event(), threading.Event()

    def hold_lock():
        with w._lock:
            locked.set()
            unlock.wait(WAIT_S)

    holder = threading.Thread(target=hold_lock, daemon=True)
    holder.start()
    assert locked.wait(WAIT_S)
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report in one line, exit without running pytest's teardown
        try:
            s = w.stats()
            ok = threading.Event()
            accepted = w.submit(ok.set, name="child-job")
            ran = ok.wait(5.0)
            ticked = threading.Event()
            w.every(0.001, ticked.set, name="child-task")
            t_ok = ticked.wait(5.0)
            msg = f"{s.queued} {len(w._tasks)} {int(accepted)} {int(ran)} {int(t_ok)} {w.stats().jobs_run}"
        except BaseException as e:  # anything goes back to the parent as text
            msg = f"error {e!r}"
        os.write(wfd, msg.encode())
        os._exit(0)
    os.close(wfd)
    try:
        ready, _, _ = select.select([r], [], [], 20.0)
        assert ready, "the forked child did not answer (deadlocked on inherited worker state?)"
        out = os.read(r, 1000).decode()
    finally:
        unlock.set()
        release.set()
        os.close(r)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    # child: nothing queued, no task inherited; its own job and task ran on new threads
    assert out == "0 1 1 1 1 1", out
    assert w.close(WAIT_S).clean


def test_fork_hook_is_registered_once_at_import(monkeypatch):
    calls = []
    monkeypatch.setattr(os, "register_at_fork", lambda **kw: calls.append(kw))
    for _ in range(3):
        Worker("another").close(1.0)
    assert calls == []


def test_bad_arguments_are_clear_errors():
    w = Worker("args")
    with pytest.raises(ValueError, match="period_s must be > 0"):
        w.every(0, lambda: None, name="x")
    with pytest.raises(ValueError, match="max_queue must be >= 1"):
        Worker("q", max_queue=0)
    w.close(1.0)


def test_the_final_job_never_runs_beside_a_periodic_task():
    """close() ends the tick thread before the final job: a last flush never overlaps a poll."""
    w = Worker("overlap")
    state = {"in_tick": 0, "overlap": None, "ticks": 0}
    ticking = threading.Event()

    def tick():
        state["in_tick"] += 1
        state["ticks"] += 1
        sum(range(20_000))  # a poll that takes a while
        if state["ticks"] >= 3:
            ticking.set()
        state["in_tick"] -= 1

    def final():
        state["overlap"] = state["in_tick"]

    w.every(0.0005, tick, name="poll")
    assert ticking.wait(WAIT_S)
    report = w.close(WAIT_S, final=final)
    assert report.clean and report.final_ran
    assert state["overlap"] == 0


def test_a_stuck_lane_does_not_hold_up_another():
    """A store that does not answer (a stuck job on one lane) must not stop a job on another."""
    w = Worker("lanes")
    stuck, release, other = threading.Event(), threading.Event(), threading.Event()
    w.submit(lambda: (stuck.set(), release.wait(60)), name="ship", lane="ship")
    assert stuck.wait(WAIT_S)
    w.submit(other.set, name="sample", lane="gpu")
    ticked = threading.Event()
    w.every(0.001, lambda: None, name="sample-gpu", blocking=True, lane="gpu")
    w.every(0.001, ticked.set, name="budget")
    try:
        assert other.wait(WAIT_S) and ticked.wait(WAIT_S)
        report = w.close(0.3, final=lambda: None)
        assert "ship" in report.unfinished and "sample-gpu" not in report.unfinished
    finally:
        release.set()
