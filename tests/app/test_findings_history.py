"""Findings outlive the job: a hang seen live by `analyze --follow` is still reported afterwards by
`analyze --job ID`, with when it opened and closed; `--follow` started before the job waits for it
(issue 21, item 4)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from ranklens.cli import cli
from tests._sync import wait_for_file, wait_until
from tests.helpers import cpu_rows, synthetic_job

SCRIPT = Path(__file__).parent.parent.joinpath("hang_job.py")
ROOT = Path(__file__).resolve().parents[2]


def _follow(store_url: str, *args: str, as_json: bool = True) -> subprocess.Popen:
    fmt = ["--json"] if as_json else []
    return subprocess.Popen(
        [sys.executable, "-m", "ranklens.cli", "analyze", "--store", store_url, "--follow", *fmt, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        # Ctrl-C reaches it as at a terminal, even when this run was started in the background
        # (a shell starts background jobs with SIGINT ignored, and a child inherits that)
        preexec_fn=_default_sigint,
    )


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _lines(stream, into: list[str]) -> threading.Thread:
    t = threading.Thread(target=lambda: into.extend(iter(stream.readline, "")), daemon=True)
    t.start()
    return t


def _stop(proc: subprocess.Popen, readers: list[threading.Thread]) -> None:
    proc.send_signal(signal.SIGINT)  # Ctrl-C: --follow stops quietly
    try:
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:  # it did not stop: fail, but leave no process or pipe behind
            proc.kill()
            proc.wait()
        for t in readers:
            t.join(timeout=10)
        proc.stdout.close()
        proc.stderr.close()


def _until(cond, timeout_s: float, what: str, proc: subprocess.Popen) -> None:
    """``cond`` within ``timeout_s``; ``analyze --follow`` (``proc``) exiting fails the wait at once."""
    wait_until(cond, timeout_s, f"{what} (from analyze --follow)", interval_s=0.1, procs=[proc])


def test_follow_started_before_the_job_waits_for_it(tmp_path):
    url = f"embedded://{tmp_path}/store"  # not created yet: the collector will create it
    proc = _follow(url, "--job", "job-synth", "--interval", "0.2")
    out: list[str] = []
    err: list[str] = []
    readers = [_lines(proc.stdout, out), _lines(proc.stderr, err)]
    try:
        _until(lambda: any("waiting for the store to be created" in e for e in err), 60, "the wait message", proc)
        from ranklens.store import open_store

        store = open_store(url)  # the store appears, still without the job
        _until(
            lambda: any("waiting for job job-synth to write its first records" in e for e in err), 120, "the job", proc
        )
        assert proc.poll() is None, "".join(err)
        store.write_many(synthetic_job(slow_rank=3))
        _until(lambda: out, 60, "a finding event", proc)
    finally:
        _stop(proc, readers)
    assert proc.returncode == 0, err
    event = json.loads(out[0])
    assert event["event"] == "new" and [s["rank"] for s in event["finding"]["suspects"]] == [3]
    assert any("job job-synth wrote its first records" in e for e in err)


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_hang_seen_live_is_reported_after_the_job_by_analyze_job(tmp_path):
    from ranklens.collector import Shipper
    from ranklens.store import open_store

    spool, job_id = tmp_path / "spool", "hang-history"
    store = open_store(f"embedded://{tmp_path}/store")
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "4",
           "RANKLENS_SPOOL": str(spool), "RANKLENS_JOB_ID": job_id, "OMP_NUM_THREADS": "1", "HANG_MODE": "sleep",
           "HANG_RANK": "2", "HANG_STEP": "3", "HANG_MARKER": str(tmp_path / "fault"),
           "RANKLENS_FR_STUCK_S": "0"}  # fmt: skip
    logs = [open(tmp_path / f"rank{r}.log", "w") for r in range(4)]
    ranks = [
        subprocess.Popen([sys.executable, str(SCRIPT)], env={**env, "RANK": str(r)}, stdout=log, stderr=log)
        for r, log in enumerate(logs)
    ]
    stop = threading.Event()

    def ship() -> None:
        shipper = Shipper(spool, store)
        while not stop.is_set():
            shipper.ship_once()
            stop.wait(0.3)

    shipping = threading.Thread(target=ship, daemon=True)
    shipping.start()
    follow = _follow(store.url, "--job", job_id, "--interval", "0.5")  # before the job has written
    events: list[str] = []
    err: list[str] = []
    readers = [_lines(follow.stdout, events), _lines(follow.stderr, err)]

    def seen(event: str, kind: str) -> list[dict]:
        parsed = [json.loads(line) for line in list(events)]
        return [e["finding"] for e in parsed if e["event"] == event and e["finding"]["kind"] == kind]

    try:
        # readiness: four ranks start on a loaded machine and rank 2 reaches its fault (the marker);
        # only then does the detection deadline start
        wait_for_file(tmp_path / "fault", 300, "rank 2 to start its hang at step 3", procs=ranks, interval_s=0.2)
        _until(lambda: seen("new", "hang"), 90, "analyze --follow to report the hang", follow)
        [hang] = seen("new", "hang")
        assert [s["rank"] for s in hang["suspects"]] == [2]
        for p in ranks:  # the job ends (killed, as a scheduler would) with the hang never resolved
            p.kill()
            p.wait()
        _until(lambda: any(f["id"] == hang["id"] for f in seen("resolved", "hang")), 60, "the hang to close", follow)
    finally:
        _stop(follow, readers)
        stop.set()
        shipping.join(timeout=30)
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    assert any("waiting for job hang-history" in e for e in err), err

    r = CliRunner().invoke(cli, ["analyze", "--store", store.url, "--job", job_id, "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    [f] = [f for f in out["findings"] if f["id"] == hang["id"]]
    assert (f["kind"], [s["rank"] for s in f["suspects"]], f["state"]) == ("hang", [2], "resolved")
    assert f["seen_now"] is False and f["title"].startswith("rank 2 never entered all_reduce")
    onset = int((tmp_path / "fault").read_text())
    # opened when ranks 0, 1, 3 entered the all_reduce rank 2 never reached (as it began to sleep)
    assert abs(f["opened_ns"] - onset) < 2e9 and f["opened_ns"] < f["closed_ns"] <= time.time_ns()
    assert f["closed_ns"] - f["opened_ns"] > 10e9  # it stayed open until after the job was killed
    # every finding of this pass carries the same keys (the shape is kept, keys are added)
    assert all(
        {"id", "kind", "state", "suspects", "opened_ns", "closed_ns", "seen_now"} <= set(x) for x in out["findings"]
    )
    text = CliRunner().invoke(cli, ["analyze", "--store", store.url, "--job", job_id], catch_exceptions=False).stdout
    assert "Earlier findings of this job" in text and f["title"] in text and "resolved 20" in text


def test_job_history_opened_and_closed_on_both_backends(store):
    """The history query (newest version per id, first and last save) on the embedded store and on
    a ClickHouse server (18.16 in CI)."""
    import dataclasses

    from ranklens.analyzers.findings import Finding, Severity, Suspect, save_findings
    from ranklens.live_service import job_history

    t0 = time.time_ns()
    hang = Finding(
        "h1", "j", 0, "hang", Severity.CRITICAL, 0.9, "rank 2 hung", (Suspect(2),), 3, 3, t0, t0, updated_ns=t0
    )
    slow = Finding("s1", "j", 0, "straggler", Severity.WARNING, 0.8, "rank 1 slow", (Suspect(1),), 1, 9, updated_ns=t0)
    save_findings(store, [hang, slow])
    save_findings(store, [dataclasses.replace(hang, state="resolved", updated_ns=t0 + 5_000_000_000)])
    save_findings(store, [dataclasses.replace(hang, job_id="other", id="h2")])  # another job: not shown
    now = dataclasses.replace(slow, title="rank 1 slower", first_seen_ns=t0 + 1)
    h = job_history(store, "j", 0, [now])
    out = {f["id"]: f for f in h.to_json()}
    assert list(out) == ["s1", "h1"]  # this pass first, then what only earlier passes saw
    assert (out["h1"]["state"], out["h1"]["seen_now"]) == ("resolved", False)
    assert (out["h1"]["opened_ns"], out["h1"]["closed_ns"]) == (t0, t0 + 5_000_000_000)
    # seen again now, but opened when an earlier pass first saved it
    assert (out["s1"]["seen_now"], out["s1"]["title"], out["s1"]["opened_ns"]) == (True, "rank 1 slower", t0)
    assert out["s1"]["closed_ns"] is None


@pytest.mark.server
def test_follow_waits_for_a_server_database_not_created_yet(server_store):
    """On a ClickHouse server the store is a database: --follow waits until the collector creates it."""
    from ranklens.store import open_store

    url = server_store.url.rsplit("/", 1)[0] + f"/rl_follow_wait_{os.getpid()}"
    proc = _follow(url, "--job", "job-synth", "--interval", "0.2")
    out: list[str] = []
    err: list[str] = []
    readers = [_lines(proc.stdout, out), _lines(proc.stderr, err)]
    created = None
    try:
        _until(lambda: any("waiting for the store to be created" in e for e in err), 60, "the wait message", proc)
        created = open_store(url)  # what the collector does when it first ships
        created.write_many(synthetic_job(slow_rank=1))
        _until(lambda: out, 60, "a finding event", proc)
    finally:
        _stop(proc, readers)
        if created is not None:
            created.drop_database()
            created.close()
    assert [s["rank"] for s in json.loads(out[0])["finding"]["suspects"]] == [1]


# ------------------------------------------------- host CPU contention notes in the live loop


def _starved_job(url: str) -> None:
    """A job whose rank 3 is 60 ms/step behind because its threads waited for a CPU (node1's run
    queue): the analysis leaves the straggler out and says why in a note."""
    from ranklens.store import open_store

    rows = synthetic_job(job_id="j", slow_rank=3, extra_s=0.06, step_s=0.1)
    open_store(url, create=True).write_many({**rows, "cpu": cpu_rows("j", {0: 0.05, 1: 0.05, 2: 0.06, 3: 0.65})})


def test_live_passes_note_host_cpu_contention_once(tmp_path):
    from ranklens.live_service import LiveAnalysis
    from ranklens.store import open_store

    url = f"embedded://{tmp_path}/store"
    _starved_job(url)
    live = LiveAnalysis(open_store(url), "j", 0, save=False)
    first, second = live.run_pass(), live.run_pass()
    assert first.all() == [] and second.all() == []  # rank 3 is not a straggler
    ((n,),) = [first.notes]
    assert (n.kind, n.node, n.ranks) == ("straggler", "node1", (3,))
    assert second.notes == []  # the same contention is said once, not every pass


@pytest.mark.parametrize("as_json", [True, False], ids=["json", "text"])
def test_follow_prints_the_host_cpu_contention_note(tmp_path, as_json):
    url = f"embedded://{tmp_path}/store"
    _starved_job(url)
    args = ["--job", "j", "--interval", "0.2", "--no-save"]
    proc = _follow(url, *args, as_json=as_json)
    out: list[str] = []
    err: list[str] = []
    readers = [_lines(proc.stdout, out), _lines(proc.stderr, err)]
    try:
        _until(lambda: any("host CPU contention" in line or "host_cpu_contention" in line for line in out), 60,
               "the contention note", proc)  # fmt: skip
    finally:
        _stop(proc, readers)
    assert proc.returncode == 0, err
    if as_json:
        events = [json.loads(line) for line in out]
        assert [e["event"] for e in events] == ["note"], events
        note = events[0]["host_cpu_contention"]
        assert (note["kind"], note["node"], note["ranks"]) == ("straggler", "node1", [3])
        assert note["run_delay_ms_per_step"] > note["excess_ms_per_step"] / 2
    else:
        (line,) = [x for x in out if x.strip()]
        assert " note " in line and "host CPU contention on node1: rank 3 waited" in line, line
        assert "not a straggler" in line and "straggler:" not in "".join(out), out
