"""`ranklens run` when tracing cannot do its job (issue 22, defects 7 and 8), with real commands:
a spool the ranks cannot write, a store that is down when the job starts, a spool that stops being
writable mid-run. Training starts and exits with its own code every time; ranklens says once what
it could not do, and never floods the job's stderr."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ranklens.store import open_store
from tests._jobs import ranklens
from tests._sync import wait_until

# readiness deadlines are generous (torch starts in tens of seconds on a loaded machine); the
# timeout only guards against a hang
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
READY_S = 300.0
ROOT = Path(__file__).resolve().parents[2]
JOB = str(ROOT / "tests" / "run_fault_job.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKLENS_")}
    env.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1")
    env.update(PYTHONPATH=str(ROOT), **extra)
    return env


def _ranklens_run(*args: str) -> list[str]:
    return [sys.executable, "-m", "ranklens.cli", "run", *args, "--", sys.executable, JOB]


def _run_job(*args: str) -> subprocess.CompletedProcess[str]:
    """``ranklens run ARGS -- python run_fault_job.py`` to its end (within READY_S), output captured."""
    return ranklens("run", *args, "--", sys.executable, JOB, timeout=READY_S, env=_env())


def _lines(text: str, needle: str) -> list[str]:
    return [ln for ln in text.splitlines() if needle in ln]


# --- defect 7: an unwritable spool ---------------------------------------------------------------


@pytest.fixture
def read_only_dir(tmp_path):
    mnt = tmp_path / "ro"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here (needs root): {r.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


@pytest.mark.parametrize(
    ("where", "collect"),
    [("through_a_file", False), ("through_a_file", True), ("read_only_fs", True)],
)
def test_unwritable_spool_runs_the_command_untraced_with_one_warning(tmp_path, request, where, collect):
    if where == "through_a_file":
        (tmp_path / "a-file").write_text("not a directory\n")
        spool = tmp_path / "a-file" / "spool"
    else:
        spool = request.getfixturevalue("read_only_dir") / "spool"
    args = ["--store", f"embedded://{tmp_path / 'store'}"] if collect else ["--no-collect"]
    p = _run_job(*args, "--spool", str(spool), "--job-id", "ro")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "trained 3 steps on rank 0" in p.stdout  # training ran, to its end
    warnings = _lines(p.stderr, "cannot write the spool")
    assert len(warnings) == 1 and "running the command untraced" in warnings[0] and str(spool) in warnings[0]
    assert "Traceback" not in p.stderr and "ranklens:" not in p.stderr.replace("ranklens run:", "")  # no tracer noise


def test_failing_command_exit_code_passes_through_an_unwritable_spool(tmp_path):
    (tmp_path / "a-file").write_text("")
    script = tmp_path / "fail.py"
    script.write_text("import sys; sys.exit(3)\n")
    spool = str(tmp_path / "a-file" / "x")
    p = ranklens("run", "--no-collect", "--spool", spool, "--", sys.executable, str(script), timeout=60, env=_env())
    assert p.returncode == 3 and len(_lines(p.stderr, "cannot write the spool")) == 1


# --- defect 7: the store is down when the job starts -------------------------------------------------


def test_store_down_at_start_trains_spools_and_ships_when_the_store_comes_up(tmp_path):
    from tests.collector.test_collector_exactly_once import Server, _need_clickhouse_server

    _need_clickhouse_server()
    server = Server(tmp_path / "ch")  # not started: the store is down when the job starts
    url = f"clickhouse://default@127.0.0.1:{server.tcp}/rl_run_down"
    started, go = tmp_path / "started", tmp_path / "go"
    err = tmp_path / "run.err"
    with open(err, "w") as ef:
        p = subprocess.Popen(
            _ranklens_run("--store", url, "--spool", str(tmp_path / "spool"), "--job-id", "down"),
            stdout=subprocess.PIPE,
            stderr=ef,
            text=True,
            env=_env(RUN_FAULT_STARTED=str(started), RUN_FAULT_GO=str(go), RUN_FAULT_STEPS="5"),
        )
    try:
        wait_until(  # training started although the store is down
            started.exists, READY_S, f"the job to start ({started})", procs=[p], detail=lambda: err.read_text()[-3000:]
        )
        server.start()
        go.touch()
        out, _ = p.communicate(timeout=READY_S)
    finally:
        if p.poll() is None:
            p.kill()
    try:
        text = err.read_text()
        assert p.returncode == 0, text[-3000:]
        assert "trained 5 steps on rank 0" in out
        warnings = _lines(text, "ranklens run: warning:")
        assert len(warnings) == 1 and "unavailable" in warnings[0] and "shipped when the store is up" in warnings[0]
        assert "Traceback" not in text
        store = open_store(url, create=False)
        try:
            n = store.query("SELECT count() FROM collectives WHERE job_id = 'down'").scalar()
            ranks = store.query("SELECT count() FROM ranks WHERE job_id = 'down'").scalar()
        finally:
            store.close()
        assert n == 6 and ranks == 1, text[-2000:]  # every all-reduce, the ones before the store was up too
        assert "collected" in text and not list((tmp_path / "spool").rglob("*.jsonl"))
    finally:
        server.stop()


def test_store_down_for_the_whole_run_leaves_the_records_in_the_spool_and_says_how_to_ship(tmp_path):
    url = f"clickhouse://default@127.0.0.1:{_free_port()}/rl_run_down"  # nothing listens there
    p = _run_job("--store", url, "--spool", str(tmp_path / "spool"), "--job-id", "down2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "trained 3 steps on rank 0" in p.stdout
    assert len(_lines(p.stderr, "ranklens run: warning:")) == 1
    left = list((tmp_path / "spool" / "down2").rglob("*.jsonl"))
    assert left, "the records were not kept"
    assert _lines(p.stderr, f"{len(left)} segment(s) wait in {tmp_path / 'spool'}")
    hint = _lines(p.stderr, "ship them with:")
    assert len(hint) == 1 and f"collect --store {url} --spool {tmp_path / 'spool'}" in hint[0]
    assert "Traceback" not in p.stderr
    # and they do ship, once there is a store
    store_url = f"embedded://{tmp_path / 'store'}"
    c = ranklens("collect", "--store", store_url, "--spool", str(tmp_path / "spool"), timeout=READY_S, env=_env())
    assert c.returncode == 0, c.stderr
    store = open_store(store_url, create=False)
    assert store.query("SELECT count() FROM collectives WHERE job_id = 'down2'").scalar() == 4


# --- defect 8: the spool stops being writable mid-run: one warning, then counts ------------------------


def test_spool_unwritable_mid_run_gives_one_warning_and_a_count_not_a_traceback_per_flush(tmp_path):
    spool = tmp_path / "spool"
    started, go = tmp_path / "started", tmp_path / "go"
    err = tmp_path / "run.err"
    with open(err, "w") as ef:
        p = subprocess.Popen(
            _ranklens_run("--no-collect", "--spool", str(spool), "--job-id", "flood"),
            stdout=subprocess.PIPE,
            stderr=ef,
            text=True,
            env=_env(RUN_FAULT_STARTED=str(started), RUN_FAULT_GO=str(go), RUN_FAULT_STEPS="25"),
        )
    try:
        wait_until(
            lambda: list(spool.glob("flood/0/rank-0/*.jsonl")),
            READY_S,
            "the tracer's first spool segment",
            procs=[p],
            detail=lambda: err.read_text()[-3000:],
        )
        for i in range(50):  # the job's spool directory becomes a file: every write fails from now on
            os.rename(spool / "flood", tmp_path / f"moved-{i}")  # atomic, while the tracer may be writing
            try:  # (unless its writer made the directory again in between: then once more)
                os.close(os.open(spool / "flood", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                break
            except FileExistsError:
                continue
        assert (spool / "flood").is_file()
        go.touch()
        out, _ = p.communicate(timeout=READY_S)
    finally:
        if p.poll() is None:
            p.kill()
    text = err.read_text()
    assert p.returncode == 0, text[-3000:]
    assert "trained 25 steps on rank 0" in out
    assert "Traceback" not in text, text[-3000:]
    first = _lines(text, "cannot write the spool under")
    # 2.5 s of training after the fault: ~5 failed flushes (a traceback for each table before the fix);
    # now the first warning and, at exit, one line with the count of the rest
    assert len(first) == 2, text[-3000:]
    assert "rows dropped and counted" in first[0] or "row(s) dropped and counted" in first[0]
    assert "more failure(s)" in first[1] and "failing" in first[1]
    more = int(first[1].split("failing; ", 1)[1].split(" ", 1)[0])
    assert more >= 3, first[1]


def test_failure_log_reports_once_then_at_most_once_per_interval():
    from ranklens.tracing._failures import FailureLog

    records: list[str] = []

    class H(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("test.failure_log")
    logger.addHandler(H())
    logger.propagate = False
    logger.setLevel(logging.WARNING)
    now = [0.0]
    f = FailureLog(logger, "rank 0 cannot write the spool", interval_s=60, clock=lambda: now[0])
    for _ in range(121):  # two flushes a second for a minute
        f.failed(OSError(30, "Read-only file system"), rows=7)
        now[0] += 0.5
    assert len(records) == 2  # the first, and one count when the minute was up
    assert "Read-only file system" in records[0] and "7 row(s) dropped" in records[0]
    assert "failing; 120 more failure(s) in the last 60 s, 840 row(s) dropped" in records[1]
    f.ok()  # within the minute of the last line: held back, no flood from a flapping failure
    f.failed("again", rows=1)
    f.ok()
    assert len(records) == 2
    now[0] += 61
    f.ok()
    f.close()
    assert len(records) == 3 and "works again; 1 more failure(s)" in records[2] and "in all 122" in records[2]


def test_profiler_windows_that_cannot_be_written_warn_once(tmp_path, caplog):
    from ranklens.tracing.profiler import ProfilerWindows

    (tmp_path / "a-file").write_text("")
    w = ProfilerWindows(str(tmp_path / "a-file" / "kineto"), 0, every=1)
    with caplog.at_level(logging.WARNING, logger="ranklens.tracing"):
        for step in range(4):  # a window every step, each export fails
            w.step_started(step)
            w.step_ended(step)
        w.close()
    msgs = [r.getMessage() for r in caplog.records if "torch.profiler" in r.getMessage()]
    assert w.failures == 4 and w.exported == []
    assert len(msgs) == 2 and "could not export" in msgs[0] and "3 more failure(s)" in msgs[1], msgs
    assert not any(r.exc_info for r in caplog.records)  # an OSError is a condition, not a bug: no traceback


def test_embedded_store_that_cannot_be_opened_trains_and_keeps_the_records(tmp_path):
    (tmp_path / "a-file").write_text("")
    bad = f"embedded://{tmp_path / 'a-file' / 'store'}"
    spool = tmp_path / "spool"
    p = _run_job("--store", bad, "--spool", str(spool), "--job-id", "emb")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "trained 3 steps on rank 0" in p.stdout
    warnings = _lines(p.stderr, "ranklens run: warning:")
    assert len(warnings) == 1 and "cannot create the embedded store" in warnings[0]
    assert len(_lines(p.stderr, "ship them with: ")) == 1 and "Traceback" not in p.stderr
    assert list((spool / "emb").rglob("collectives.*.jsonl"))  # traced, kept for later
