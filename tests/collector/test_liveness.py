"""The collector's liveness watcher against real processes."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pyarrow as pa

from ranklens.collector.liveness import EXITED_GONE, LivenessWatcher
from ranklens.collector.outbox import Outbox
from ranklens.formats.rows import read_jsonl
from ranklens.records import to_arrow

T0 = time.time_ns()


def _hb(pid: int, *, ts: int, rank: int = 0, exited: int = 0, host: str | None = None) -> pa.Table:
    row = {"job_id": "j", "rank": rank, "ts_ns": T0 + ts, "pid": pid, "host": host or socket.gethostname(),
           "step": 7, "pgs": ["0"], "pg_entered": [12], "pg_completed": [11], "exited": exited}  # fmt: skip
    return to_arrow("heartbeats", [row])


def test_dead_process_gets_one_last_heartbeat_after_two_checks(tmp_path):
    outbox = Outbox(tmp_path / "spool", host="n")
    w = LivenessWatcher(outbox)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        w.observe("heartbeats", _hb(child.pid, ts=100))
        w.observe("heartbeats", _hb(child.pid, ts=50))  # older: ignored
        w.observe("heartbeats", _hb(child.pid, ts=90, rank=1, host="other-node"))  # not ours
        assert w.check(force=True) == [] and list(w.watched) == [("j", 0, 0)]
    finally:
        child.kill()
        child.wait()
    assert w.check(force=True) == []  # gone once: maybe a clean exit whose last heartbeat is on its way
    (row,) = w.check(force=True)
    assert row["exited"] == EXITED_GONE and row["ts_ns"] == T0 + 101 and row["pg_entered"] == [12]
    assert w.watched == {} and w.check(force=True) == []
    (seg,) = list((tmp_path / "spool").rglob("heartbeats.*.jsonl"))
    _, data = read_jsonl(seg)
    assert data.column("exited").to_pylist() == [EXITED_GONE] and data.column("step").to_pylist() == [7]


def test_clean_exit_is_not_reported(tmp_path):
    w = LivenessWatcher(Outbox(tmp_path / "spool", host="n"))
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    w.observe("heartbeats", _hb(child.pid, ts=100))
    assert w.check(force=True) == []  # suspect
    w.observe("heartbeats", _hb(child.pid, ts=200, exited=1))  # its last heartbeat arrives
    assert w.check(force=True) == [] and w.watched == {}


def test_only_pids_of_our_pid_namespace_are_watched(tmp_path):
    from ranklens.formats.process import pid_namespace

    w = LivenessWatcher(Outbox(tmp_path / "spool", host="n"))
    ours = pid_namespace()
    assert ours  # Linux
    i = _hb(1, ts=1).column_names.index("pid_ns")
    same_ns = _hb(4242, ts=1, rank=0, host="training-pod-7").set_column(i, "pid_ns", pa.array([ours]))
    other_ns = _hb(4242, ts=1, rank=1).set_column(i, "pid_ns", pa.array([ours + 1]))
    w.observe("heartbeats", same_ns)  # another host name (a container), our pid namespace: checkable
    w.observe("heartbeats", other_ns)  # our host name, a pid namespace of its own: its pid means nothing here
    assert list(w.watched) == [("j", 0, 0)]
