"""Every row exactly once, against a real ClickHouse server, through the real `ranklens collector`:

* the server is stopped in the middle of a run (the collector keeps running, the ranks keep
  writing) and started again;
* the collector is killed with SIGKILL in the middle of a run, several times, once exactly between
  the store's acknowledgement and the segments' deletion (``RANKLENS_COLLECTOR_FAULT``), and
  restarted.

Rows come from the tracer's own spool writer (collectives, one ``seq`` per row) and from log lines
the collector filters at the source (one marker per line), so "exactly once" is checked per row.
"""

from __future__ import annotations

import functools
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ranklens.formats.spool import SpoolWriter
from tests._clickhouse import ClickHouseServer
from tests._sync import wait_until
from tests.conftest import REQUIRE_SERVER

ROOT = Path(__file__).resolve().parents[2]
ERR = "NCCL WARN Call to ibv_reg_mr failed with error Cannot allocate memory"
# readiness deadlines are generous (a loaded machine starts a collector in tens of seconds); the
# timeout only guards against a hang
pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]
READY_S = 180.0


# a throw-away clickhouse-server of our own (tests/_clickhouse.py), to stop, kill and start
Server = functools.partial(ClickHouseServer, database="rl_exactly_once")


def _need_clickhouse_server() -> None:
    if shutil.which("clickhouse-server") is None:
        msg = "clickhouse-server is not installed (apt-get install clickhouse-server)"
        if REQUIRE_SERVER:
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture
def own_server(tmp_path):
    _need_clickhouse_server()
    s = Server(tmp_path / "ch")
    s.start()
    yield s
    s.stop()


class Ranks:
    """Rank spools and a rank log being written while the collector runs (a writer thread)."""

    def __init__(self, root: Path, *, rows_per_segment: int = 40, ranks: int = 4) -> None:
        self.spool = root / "spool"
        self.logs = root / "logs"
        self.logs.mkdir(parents=True)
        self.writers = [SpoolWriter.for_rank(self.spool, "job-eo", 0, r) for r in range(ranks)]
        self.k = rows_per_segment
        self.seq = 0
        self.lines = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _segment(self) -> None:
        rank = self.seq // self.k % len(self.writers)
        w = self.writers[rank]
        rows = [
            {"job_id": "job-eo", "rank": rank, "pg": "0", "seq": self.seq + i, "op": "all_reduce", "enter_ns": 1}
            for i in range(self.k)
        ]
        w.write("collectives", rows)
        self.seq += self.k
        with open(self.logs / "rank-0.log", "a") as f:
            f.write(f"step {self.lines} loss 1.0\n{ERR} #{self.lines}\n")
        self.lines += 1

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.is_set():
                self._segment()
                time.sleep(0.01)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(10)


def _collector(ranks: Ranks, url: str, out: Path, **env_extra: str) -> subprocess.Popen:
    cfg = out.with_suffix(".toml")
    cfg.write_text(
        "[collector]\nship_interval_s = 0.1\ncommit_interval_s = 0.1\nlog_poll_interval_s = 0.05\n"
        'host = "node-eo"\nnvml = false\n'
    )
    env = {k: v for k, v in os.environ.items() if k != "RANKLENS_COLLECTOR_FAULT"}
    env.update(PYTHONPATH=str(ROOT), **env_extra)
    with open(out, "w") as err:
        return subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from ranklens.cli import main; main()",
                "collector",
                "--store",
                url,
                "--config",
                str(cfg),
                "--spool",
                str(ranks.spool),
                "--logs",
                str(ranks.logs / "*.log"),
                "--log-format",
                "json",
            ],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env,
        )


def _drained(ranks: Ranks) -> bool:
    return not any(ranks.spool.rglob("*.jsonl"))


def _tail(log: Path) -> Callable[[], str]:
    return lambda: "collector log (tail):\n" + (log.read_text()[-3000:] if log.exists() else "(none)")


def _logged(log: Path, text: str, p: subprocess.Popen, what: str, *, after: int = 0) -> None:
    """Wait until the collector's log holds ``text`` (past its first ``after`` characters)."""
    wait_until(
        lambda: log.exists() and text in log.read_text()[after:],
        READY_S,
        what,
        interval_s=0.1,
        procs=[p],
        detail=_tail(log),
    )


def _stored(url: str) -> tuple[int, int]:
    """(distinct collective seqs, distinct log-event marks) in the store now; (-1, -1) while it is down
    or its schema not made yet (the collector makes it when the server comes up)."""
    from ranklens.errors import StoreError
    from ranklens.store import open_store

    try:
        store = open_store(url, create=False)
        try:
            seqs = store.query("SELECT uniqExact(seq) FROM collectives WHERE job_id = 'job-eo'").scalar()
            marks = store.query("SELECT uniqExact(message) FROM log_events").scalar()
        finally:
            store.close()
    except StoreError:
        return -1, -1
    return int(seqs), int(marks)


def _shipping(url: str, p: subprocess.Popen, log: Path, since: int) -> None:
    """Wait until the running collector is up (its first line) and has stored collective rows beyond
    the ``since`` stored before it started."""
    _logged(log, "Ctrl-C to stop", p, "the collector's first line")
    wait_until(
        lambda: _stored(url)[0] > since,
        READY_S,
        f"the collector to store collective rows (more than the {since} stored before it started)",
        interval_s=0.2,
        procs=[p],
        detail=_tail(log),
    )


def _all_stored(url: str, ranks: Ranks, p: subprocess.Popen, log: Path) -> None:
    """Wait until every row the ranks wrote (they have stopped) is in the store, once checked later."""
    want = (ranks.seq, ranks.lines)
    wait_until(
        lambda: all(got >= n for got, n in zip(_stored(url), want)),
        READY_S,
        f"every row in the store: {want[0]} collective seqs and {want[1]} log events",
        interval_s=0.2,
        procs=[p],
        detail=lambda: f"now stored {_stored(url)}; " + _tail(log)(),
    )


def _check_exactly_once(url: str, ranks: Ranks) -> tuple[int, int]:
    from ranklens.store import open_store

    store = open_store(url, create=False)
    try:
        n, distinct, lo, hi = store.query(
            "SELECT count(), uniqExact(seq), min(seq), max(seq) FROM collectives WHERE job_id = 'job-eo'"
        ).rows()[0]
        msgs = [m for (m,) in store.query("SELECT message FROM log_events").rows()]
    finally:
        store.close()
    marks = [int(m.rsplit("#", 1)[1]) for m in msgs]
    assert (n, distinct, lo, hi) == (ranks.seq, ranks.seq, 0, ranks.seq - 1), "collective rows lost or doubled"
    assert sorted(marks) == list(range(ranks.lines)), "log events lost or doubled"
    return int(n), len(marks)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["stop", "kill"])
def test_server_stopped_mid_run_every_row_exactly_once(tmp_path, own_server, how):
    from ranklens.store import open_store

    open_store(own_server.url).close()  # create the schema
    ranks = Ranks(tmp_path)
    ranks.start()
    log = tmp_path / "collector.log"
    p = _collector(ranks, own_server.url, log)
    try:
        _shipping(own_server.url, p, log, since=0)  # mid-run: the collector ships as the ranks write
        before = ranks.seq
        getattr(own_server, how)()  # inserts in flight fail, the ranks keep writing
        _logged(log, "store unavailable", p, "the collector to see the outage ('store unavailable')")
        assert not _drained(ranks)  # the spool holds what the store cannot take
        own_server.start()
        _logged(log, "available again", p, "the collector to ship again once the server is back")
        ranks.stop()  # (they wrote on while it caught up)
        _all_stored(own_server.url, ranks, p, log)
    finally:
        p.send_signal(signal.SIGTERM)
        rc = p.wait(60)
    assert rc == 0, log.read_text()[-3000:]
    n, events = _check_exactly_once(own_server.url, ranks)
    text = log.read_text()
    assert "store unavailable" in text  # the outage happened mid-run and was seen
    print(
        f"server {how}/start: {n} collective rows ({before} before the stop), {events} log events, exactly once; "
        f"outage logged {text.count('store unavailable')}x, back {text.count('available again')}x, "
        f"{text.count('already stored')} settle passes"
    )


@pytest.mark.slow
def test_collector_killed_mid_run_every_row_exactly_once(tmp_path, server_db_url):
    from ranklens.store import open_store

    open_store(server_db_url).close()
    ranks = Ranks(tmp_path)
    ranks.start()
    logs: list[Path] = []
    try:
        # 1: killed by its own fault hook right after its 3rd store write: rows stored, segments not deleted
        logs.append(tmp_path / "collector-0.log")
        p = _collector(ranks, server_db_url, logs[-1], RANKLENS_COLLECTOR_FAULT="kill_after_write:3")
        assert p.wait(READY_S) == -signal.SIGKILL, logs[-1].read_text()[-3000:]
        # 2-4: kill -9 at random moments of a run that is shipping (started and storing rows)
        rnd = random.Random(4)
        for i in range(1, 4):
            logs.append(tmp_path / f"collector-{i}.log")
            since = _stored(server_db_url)[0]
            p = _collector(ranks, server_db_url, logs[-1])
            if i == 1:  # the restart after the fault settles the segments in doubt, then ships on
                _logged(logs[-1], "already stored", p, "the restart to settle the segments in doubt")
            _shipping(server_db_url, p, logs[-1], since)
            time.sleep(rnd.uniform(0.0, 1.5))  # a random moment of its run
            p.send_signal(signal.SIGKILL)
            assert p.wait(30) == -signal.SIGKILL, logs[-1].read_text()[-3000:]
        # 5: a clean run to the end
        logs.append(tmp_path / "collector-last.log")
        since = _stored(server_db_url)[0]
        p = _collector(ranks, server_db_url, logs[-1])
        _shipping(server_db_url, p, logs[-1], since)
        ranks.stop()
        _all_stored(server_db_url, ranks, p, logs[-1])
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0, logs[-1].read_text()[-3000:]
    finally:
        ranks.stop()
    n, events = _check_exactly_once(server_db_url, ranks)
    # the restart after the fault found the segments in doubt already stored and did not resend them
    assert "already stored" in logs[1].read_text(), logs[1].read_text()[-3000:]
    settled = sum(t.read_text().count("already stored") for t in logs)
    print(f"kill -9 x4 + restarts: {n} collective rows, {events} log events, exactly once ({settled} settle passes)")


def test_partly_stored_segment_on_a_distributed_table(tmp_path, server_db_url):
    """On a cluster the tables are Distributed: a partly stored segment is deleted from the local
    table on every shard, then sent again (here a one-shard cluster of the test server,
    `ranklens_self` in scripts/clickhouse.sh)."""
    from ranklens.collector import Shipper
    from ranklens.collector.settle import ingest_id_of, stamp
    from ranklens.formats.rows import read_jsonl
    from ranklens.store import open_store

    store = open_store(server_db_url)
    db = store.config.database
    if not store.query("SELECT count() FROM system.clusters WHERE cluster = 'ranklens_self'").scalar():
        msg = "the test server has no 'ranklens_self' cluster (start it with scripts/clickhouse.sh)"
        if REQUIRE_SERVER:
            pytest.fail(msg)
        pytest.skip(msg)
    store._execute(f"RENAME TABLE {db}.collectives TO {db}.collectives_local")
    store._execute(
        f"CREATE TABLE {db}.collectives AS {db}.collectives_local "
        f"ENGINE = Distributed('ranklens_self', '{db}', 'collectives_local', rand())"
    )
    spool = tmp_path / "spool"
    rows = [{"job_id": "d", "rank": 0, "pg": "0", "seq": i, "op": "all_reduce", "enter_ns": 1} for i in range(6)]
    seg = SpoolWriter.for_rank(spool, "d", 0, 0).write("collectives", rows)
    rel = seg.relative_to(spool).as_posix()
    _, data = read_jsonl(seg)
    store.write("collectives", stamp(data.slice(0, 4), ingest_id_of(rel, seg.read_bytes())))  # half a batch
    assert store.query(f"SELECT count() FROM {db}.collectives_local").scalar() == 4  # synchronous insert
    sh = Shipper(spool, store)
    sh.in_doubt.add(rel)
    r = sh.ship_once()
    assert r.ok and r.partial == 1 and r.rows == {"collectives": 6}, r
    got = sorted(s for (s,) in store.query("SELECT seq FROM collectives").rows())
    assert got == list(range(6))
    store.close()


@pytest.mark.slow
def test_collector_started_before_its_store(tmp_path):
    """A node collector that starts while ClickHouse is still down keeps running (logs, spool) and
    ships everything, once, when the server comes up."""
    _need_clickhouse_server()
    server = Server(tmp_path / "ch")  # not started yet
    ranks = Ranks(tmp_path)
    ranks.start()
    log = tmp_path / "collector.log"
    p = _collector(ranks, server.url, log)
    try:
        try:
            _logged(log, "connecting when it is up", p, "the collector to start without its store")
            # still collecting: its log tailer's events reach the spool while the store is down
            outbox = ranks.spool / "_collector"
            wait_until(
                lambda: any(outbox.rglob("log_events.*.jsonl")),
                READY_S,
                f"log events in the collector's spool ({outbox})",
                interval_s=0.1,
                procs=[p],
                detail=_tail(log),
            )
            assert p.poll() is None, log.read_text()[-3000:]
            server.start()
            _shipping(server.url, p, log, since=0)
            ranks.stop()  # (they wrote on while it caught up)
            _all_stored(server.url, ranks, p, log)
        finally:
            p.send_signal(signal.SIGTERM)
            rc = p.wait(60)
            ranks.stop()
        assert rc == 0, log.read_text()[-3000:]
        n, events = _check_exactly_once(server.url, ranks)
    finally:
        server.stop()  # (also when the test failed: no server left behind)
    print(f"collector before store: {n} collective rows, {events} log events, exactly once")
