"""The log tailer with real files: globs, rotation by rename, truncation, restarts with saved
offsets, a sink that fails, and the events reaching the spool as ``log_events`` rows."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ranklens.collector.outbox import Outbox
from ranklens.collector.tailer import LogSource, Tailer
from ranklens.errors import ConfigError
from ranklens.formats.rows import read_jsonl
from tests._sync import free_port, wait_until

ERR = "RuntimeError: CUDA error: an illegal memory access was encountered"
OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"


class Sink:
    """Records what a tailer commits (and can fail on demand)."""

    def __init__(self) -> None:
        self.rows: dict[str, list[dict]] = {}
        self.fail = False

    def __call__(self, table: str, rows: list[dict]) -> None:
        if self.fail:
            raise OSError(28, "No space left on device")
        self.rows.setdefault(table, []).extend(rows)

    def messages(self) -> list[str]:
        return [r["message"] for r in self.rows.get("log_events", [])]


def _append(p: Path, *lines: str) -> None:
    with open(p, "a") as f:
        f.write("".join(line + "\n" for line in lines))


OPEN: list[Tailer] = []


def _tailer(tmp_path: Path, sink, **kw) -> Tailer:
    t = Tailer(
        [LogSource(glob=str(tmp_path / "logs" / "*.log"), stream="stderr", job_id="job-1")],
        sink=sink,
        state_path=tmp_path / "state" / "tailer.json",
        host="node-a",
        **kw,
    )
    OPEN.append(t)
    return t


@pytest.fixture(autouse=True)
def _close_tailers():
    yield
    while OPEN:
        OPEN.pop().close()


def _cycle(t: Tailer) -> None:
    t.poll()
    t.poll()  # an idle poll closes events at the end of a file
    r = t.commit()
    assert r.error is None, r.error


@pytest.fixture
def logs(tmp_path):
    d = tmp_path / "logs"
    d.mkdir()
    return d


def test_follows_globs_rank_from_path_and_writes_rows(tmp_path, logs):
    sink = Sink()
    t = _tailer(tmp_path, sink)
    _append(logs / "rank-3.log", "step 1", "step 2", ERR, "step 3")
    _append(logs / "rank-4.log", OOM)
    (logs / "notes.txt").write_text(ERR + "\n")  # not matched by the glob
    _cycle(t)
    rows = sorted(sink.rows["log_events"], key=lambda r: r["rank"])
    assert [(r["rank"], r["klass"], r["job_id"], r["host"], r["stream"]) for r in rows] == [
        (3, "cuda_error", "job-1", "node-a", "stderr"),
        (4, "cuda_oom", "job-1", "node-a", "stderr"),
    ]
    assert rows[0]["context"] == ["step 1", "step 2"]
    drops = sink.rows["drops"]
    assert sum(d["count"] for d in drops if d["what"] == "log_lines_dropped") == 3
    assert {d["component"] for d in drops} == {"log_filter"}


def test_rotation_by_rename_drains_the_old_file_and_reads_the_new_one(tmp_path, logs):
    sink = Sink()
    t = _tailer(tmp_path, sink)
    p = logs / "rank-0.log"
    _append(p, "a", ERR + " #1")
    _cycle(t)
    _append(p, ERR + " #2")  # written just before the rotation, not read yet
    os.rename(p, logs / "rank-0.log.1")  # logrotate: rename, then a new file
    _append(p, ERR + " #3")
    _cycle(t)
    _cycle(t)
    assert sorted(m[-2:] for m in sink.messages()) == ["#1", "#2", "#3"]
    assert len(t.files) == 1  # the rotated file was closed once drained


def test_truncation_is_detected_and_the_file_read_again(tmp_path, logs):
    sink = Sink()
    t = _tailer(tmp_path, sink)
    p = logs / "rank-0.log"
    _append(p, "x" * 200, ERR + " before")
    _cycle(t)
    with open(p, "w") as f:  # copytruncate, or a job restarted into the same file
        f.write(ERR + " after\n")
    _cycle(t)
    assert [m.rsplit(" ", 1)[1] for m in sink.messages()] == ["before", "after"]
    assert t.truncations == 1


def test_restart_resumes_at_the_saved_offsets_without_loss_or_duplicates(tmp_path, logs):
    sink = Sink()
    p = logs / "rank-1.log"
    _append(p, ERR + " one", "ok")
    t = _tailer(tmp_path, sink)
    _cycle(t)
    t.close()
    _append(p, ERR + " two")
    with open(p, "a") as f:
        f.write("partial line without newline")
    t2 = _tailer(tmp_path, sink)  # a new collector process
    _cycle(t2)
    assert [m.rsplit(" ", 1)[1] for m in sink.messages()] == ["one", "two"]
    state = json.loads((tmp_path / "state" / "tailer.json").read_text())
    (entry,) = state["files"]
    assert entry["offset"] == p.stat().st_size - len("partial line without newline")  # not committed yet
    t2.close()
    _append(p, " ends here", ERR + " three")
    t3 = _tailer(tmp_path, sink)
    _cycle(t3)
    assert [m.rsplit(" ", 1)[1] for m in sink.messages()] == ["one", "two", "three"]


def test_rotated_while_the_collector_was_down_is_drained_by_inode(tmp_path, logs):
    sink = Sink()
    p = logs / "rank-2.log"
    _append(p, ERR + " one")
    t = _tailer(tmp_path, sink)
    _cycle(t)
    t.close()
    _append(p, ERR + " two")
    os.rename(p, logs / "rank-2.log.1")  # not matched by *.log any more
    _append(p, ERR + " three")
    t2 = _tailer(tmp_path, sink)
    _cycle(t2)
    _cycle(t2)
    assert sorted(m.rsplit(" ", 1)[1] for m in sink.messages()) == ["one", "three", "two"]


def test_a_failing_sink_loses_nothing(tmp_path, logs):
    sink = Sink()
    t = _tailer(tmp_path, sink)
    p = logs / "rank-0.log"
    _append(p, ERR + " one")
    sink.fail = True
    t.poll()
    t.poll()
    assert t.commit().error is not None and sink.messages() == []
    assert not (tmp_path / "state" / "tailer.json").exists()  # no offset saved past unsent events
    sink.fail = False
    _append(p, ERR + " two")
    _cycle(t)
    assert [m.rsplit(" ", 1)[1] for m in sink.messages()] == ["one", "two"]


def test_start_at_end_skips_old_content_of_files_present_at_start(tmp_path, logs):
    sink = Sink()
    p = logs / "old.log"
    _append(p, ERR + " old")
    t = Tailer([LogSource(glob=str(logs / "*.log"), start_at="end")], sink=sink, state_path=None, host="h")
    OPEN.append(t)
    _cycle(t)
    _append(p, ERR + " new")
    _append(logs / "later.log", ERR + " later")  # a file that appears later is read from its start
    _cycle(t)
    assert sorted(m.rsplit(" ", 1)[1] for m in sink.messages()) == ["later", "new"]


def test_events_reach_the_spool_as_valid_segments(tmp_path, logs):
    out = Outbox(tmp_path / "spool", host="node-a")
    t = _tailer(tmp_path, out.write)
    _append(logs / "rank-0.log", "fine", ERR)
    _cycle(t)
    segs = sorted(out.dir.glob("*.jsonl"))
    tables = {read_jsonl(s)[0]: read_jsonl(s)[1] for s in segs}
    assert tables["log_events"].num_rows == 1 and tables["drops"].num_rows == 1
    assert tables["log_events"].column("klass").to_pylist() == ["cuda_error"]


def test_outbox_never_overwrites_a_pending_segment(tmp_path):
    out = Outbox(tmp_path / "spool", host="h", fsync=False)
    paths = {out.write("drops", [{"ts_ns": 1, "component": "c", "what": "w", "count": i}]) for i in range(50)}
    assert len(paths) == 50 and all(p.exists() for p in paths)
    with pytest.raises(ValueError, match="not a column"):
        out.write("drops", [{"ts_ns": 1, "component": "c", "what": "w", "count": 1, "colour": 1}])


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"glob": ""}, "needs a glob"),
        ({"glob": "x", "stream": "tty"}, "stream='tty'"),
        ({"glob": "x", "start_at": "middle"}, "start_at='middle'"),
        ({"glob": "x", "rank_pattern": "rank"}, "needs a group"),
    ],
)
def test_bad_log_sources(kw, needle):
    with pytest.raises(ConfigError, match=needle):
        LogSource(**kw)


class Crash(BaseException):
    """Stands for kill -9 at a chosen point of a commit."""


def _spool_messages(out: Outbox) -> list[str]:
    msgs = []
    for seg in sorted(out.dir.glob("log_events.*.jsonl")):
        msgs += read_jsonl(seg)[1].column("message").to_pylist()
    return sorted(m.rsplit(" ", 1)[1] for m in msgs)


@pytest.mark.parametrize("crash_at", ["after_state_saved", "before_state_saved"])
def test_a_crash_inside_a_commit_gives_each_event_exactly_once(tmp_path, logs, monkeypatch, crash_at):
    out = Outbox(tmp_path / "spool", host="node-a", fsync=False)
    p = logs / "rank-0.log"
    _append(p, ERR + " one")
    t = _tailer(tmp_path, out)
    t.poll()
    t.poll()
    if crash_at == "after_state_saved":  # offsets saved, segments still staged
        monkeypatch.setattr(out, "publish", lambda staged: (_ for _ in ()).throw(Crash()))
    else:  # segments staged, offsets not saved
        monkeypatch.setattr(t, "_save_state", lambda *a, **k: (_ for _ in ()).throw(Crash()))
    with pytest.raises(Crash):
        t.commit()
    assert _spool_messages(out) == []  # nothing visible to the shipper yet
    t.close()
    _append(p, ERR + " two")
    out2 = Outbox(tmp_path / "spool", host="node-a", fsync=False)
    t2 = _tailer(tmp_path, out2)  # the restarted collector
    _cycle(t2)
    assert _spool_messages(out2) == ["one", "two"]
    assert not [q for q in out2.dir.iterdir() if q.name.startswith(".")]


# --- a long line without a newline (issue 22, defect 4) -------------------------------------------


def _write_long_line(p: Path, nbytes: int, head: bytes = b"") -> None:
    chunk = b"x" * (1 << 20)
    with open(p, "ab") as f:
        f.write(head)
        left = nbytes - len(head)
        while left > 0:
            f.write(chunk[: min(left, len(chunk))])
            left -= len(chunk)


def test_a_long_line_is_cut_marked_counted_and_skipped_in_flat_memory(tmp_path, logs):
    from ranklens.collector import logfilter

    p = logs / "rank-0.log"
    _append(p, OOM + " before")
    n = 40 << 20
    _write_long_line(p, n, head=(ERR + " huge ").encode())
    sink = Sink()
    t = _tailer(tmp_path, sink)
    t.poll()
    r = t.commit()
    # the line before is not held back by the unfinished line after it
    assert len(sink.messages()) == 2 and sink.messages()[0] == OOM + " before"
    cut = sink.messages()[1]
    assert cut.startswith(ERR + " huge x") and cut.endswith(logfilter.CUT_MARK)
    assert len(cut) == logfilter.MAX_EVENT_CHARS + len(logfilter.CUT_MARK)
    assert r.error is None and t.files == [str(p)]
    f = next(iter(t._files.values()))
    assert f.sf.pending_bytes == 0 and f.sf.skipping  # nothing of the line is held
    _append(p, "", ERR + " after")  # the newline that ends the long line, then a line
    _cycle(t)
    assert sink.messages()[-1] == ERR + " after"
    drops = {}
    for d in sink.rows["drops"]:
        drops[d["what"]] = drops.get(d["what"], 0) + d["count"]
    assert drops["log_lines_truncated"] == 1
    assert drops["log_bytes_cut"] == n - logfilter.MAX_LINE_BYTES


def test_a_restart_inside_a_cut_line_goes_on_skipping(tmp_path, logs):
    from ranklens.collector import logfilter

    p = logs / "rank-0.log"
    _append(p, OOM + " before")
    _write_long_line(p, 3 * logfilter.MAX_LINE_BYTES, head=(ERR + " huge ").encode())
    sink = Sink()
    t = _tailer(tmp_path, sink)
    _cycle(t)
    state = json.loads((tmp_path / "state" / "tailer.json").read_text())
    assert state["files"][0]["skip"] is True
    t.close()
    _write_long_line(p, 2 * logfilter.MAX_LINE_BYTES)  # the same line goes on while the collector is down
    _append(p, " tail of the long line " + ERR, OOM + " after")
    t2 = _tailer(tmp_path, sink)  # the restarted collector
    _cycle(t2)
    msgs = sink.messages()
    assert len(msgs) == 3 and msgs[0] == OOM + " before" and msgs[2] == OOM + " after"  # no tail as a new line
    cut = sum(d["count"] for d in sink.rows["drops"] if d["what"] == "log_bytes_cut")
    assert cut == 5 * logfilter.MAX_LINE_BYTES + len(" tail of the long line " + ERR) - logfilter.MAX_LINE_BYTES


def _vm_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {key} in /proc/{pid}/status")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


# The collector's own peak RSS (Python, pyarrow, the store client) is ~100-170 MB here; before the
# fix a 200 MB line took it past 900 MB (300 MB: 1.38 GB). Flat memory means the line adds only the
# read buffer (a few MiB) and the 1 MiB head it keeps.
COLLECTOR_PEAK_RSS_MB = 300


@pytest.mark.timeout(900)  # a hang guard: the readiness waits below are generous on a loaded machine
@pytest.mark.parametrize("backend", ["embedded", pytest.param("server", marks=pytest.mark.server)])
def test_collector_with_a_200mb_line_without_newline_keeps_memory_flat_and_lines_flowing(
    tmp_path, logs, backend, request
):
    """The real `ranklens collector`: an error line, then 200 MB without a newline while the
    collector runs, then the newline and another error line."""
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    from ranklens.collector import logfilter
    from ranklens.store import open_store

    url = f"embedded://{tmp_path / 'store'}" if backend == "embedded" else request.getfixturevalue("server_db_url")
    open_store(url).close()  # the schema
    cfg = tmp_path / "collector.toml"
    cfg.write_text(
        "[collector]\nship_interval_s = 0.2\ncommit_interval_s = 0.2\nlog_poll_interval_s = 0.05\n"
        'host = "node-long"\nnvml = false\n'
    )
    root = Path(__file__).resolve().parents[2]
    port = free_port()
    err_log = tmp_path / "collector.log"
    p = logs / "rank-0.log"
    _append(p, OOM + " ready")
    n = int(os.environ.get("RANKLENS_TEST_LONG_LINE_MB", "200")) << 20  # the probe's 2 GiB: 2048
    with open(err_log, "w") as err:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-c", "from ranklens.cli import main; main()", "collector", "--store", url),
                *("--config", str(cfg), "--spool", str(tmp_path / "spool"), "--logs", str(logs / "*.log")),
                *("--metrics-port", str(port), "--metrics-addr", "127.0.0.1"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={**os.environ, "PYTHONPATH": str(root)},
        )

    def messages() -> list[str]:
        s = open_store(url, create=False)
        try:
            return [m for (m,) in s.query("SELECT message FROM log_events ORDER BY ts_ns").rows()]
        finally:
            s.close()

    def wait_for(cond, what: str, timeout: float = 240.0) -> None:
        wait_until(cond, timeout, what, interval_s=0.1, procs=[proc], detail=lambda: err_log.read_text()[-3000:])

    try:
        wait_for(lambda: OOM + " ready" in messages(), "the collector to store a first line")
        base_kb, cpu0 = _vm_kb(proc.pid, "VmHWM"), _cpu_s(proc.pid)
        t0 = time.monotonic()
        # an error line and, right after it, a long line without a newline (still unfinished)
        _append(p, ERR + " before")
        _write_long_line(p, n, head=(OOM + " huge ").encode())
        wrote_s = time.monotonic() - t0
        wait_for(lambda: ERR + " before" in messages(), "the error line before the long line to be stored")
        before_s = time.monotonic() - t0
        _append(p, "", ERR + " after")  # the newline that ends it, then a line
        wait_for(lambda: ERR + " after" in messages(), "the line after the long one to be stored")
        took = time.monotonic() - t0
        peak_kb, cpu = _vm_kb(proc.pid, "VmHWM"), _cpu_s(proc.pid) - cpu0
        msgs = messages()
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60).read().decode()
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
    assert rc == 0, err_log.read_text()[-3000:]
    print(
        f"{backend}: collector peak RSS {base_kb // 1024} MB before the {n >> 20} MB line, {peak_kb // 1024} MB "
        f"after; {wrote_s:.1f} s to write it; the error line before it stored {before_s:.1f} s after it was "
        f"written (the long line unfinished), the line after it {took:.1f} s; collector CPU {cpu:.1f} s"
    )
    assert peak_kb < COLLECTOR_PEAK_RSS_MB * 1024, f"collector peak RSS {peak_kb // 1024} MB"
    # nothing waits on the unfinished line (before the fix: 51 s here for 200 MB, never for 2 GiB)
    assert before_s - wrote_s < 20, f"the error line before the long line took {before_s - wrote_s:.1f} s"
    cut = [m for m in msgs if m.startswith(OOM + " huge")]  # (events of one poll share a time: no order)
    assert sorted(msgs) == sorted([OOM + " ready", ERR + " before", *cut, ERR + " after"]), [m[:80] for m in msgs]
    assert len(cut) == 1 and cut[0].startswith(OOM + " huge xxx") and cut[0].endswith(logfilter.CUT_MARK)
    s = open_store(url, create=False)
    try:
        drops = dict(
            s.query(
                "SELECT what, sum(count) FROM drops WHERE component = 'log_filter' "
                "AND what IN ('log_lines_truncated', 'log_bytes_cut') GROUP BY what"
            ).rows()
        )
    finally:
        s.close()
    assert drops == {"log_lines_truncated": 1, "log_bytes_cut": n - logfilter.MAX_LINE_BYTES}
    values = {ln.split()[0]: float(ln.split()[1]) for ln in metrics.splitlines() if ln and not ln.startswith("#")}
    assert values["ranklens_collector_log_lines_truncated_total"] == 1
    assert values["ranklens_collector_log_bytes_cut_total"] == n - logfilter.MAX_LINE_BYTES
