"""Soak (issue 22): nothing lost, nothing twice, training never hurt, with everything going wrong at once.

A real 2-rank gloo job traced by ranklens writes continuously while:

* the node collector (``ranklens collector``, the real CLI) is killed with SIGKILL at random moments
  and restarted at once;
* the ClickHouse server (our own, on a free port) is stopped mid-run and started again;
* a bad segment (a lone surrogate in ``job_id``) and an invalid-UTF-8 segment are dropped into
  the spool;
* the rank log receives a storm (bursts of noise and of one repeated error) and a 100 MB line
  without a newline, with uniquely numbered error lines before, between and after.

At the end: every step, phase, collective and heartbeat row is in the store exactly once (counts
per table against what the job did, and no key twice), every numbered log line exactly once,
the storm's repeats all counted, the two bad segments quarantined (with their reasons) and
counted in ``drops``, the long line cut and counted, the collector's RSS stayed under
:data:`RSS_BOUND_MB`, and both ranks exited 0. The figures are printed (``pytest -s``).

Bounded: ``RANKLENS_SOAK_S`` seconds of training (default 45), well under 5 minutes in all.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests._sync import free_port as _free_port
from tests._sync import wait_until
from tests.collector.test_collector_exactly_once import Server, _need_clickhouse_server
from tests.collector.test_collector_faults import LONE_SURROGATE_ROW, _pending, _raw_segment

ROOT = Path(__file__).resolve().parents[2]
SOAK_S = float(os.environ.get("RANKLENS_SOAK_S", "45"))
STEP_S = 0.05
RSS_BOUND_MB = 400  # the collector's peak resident memory, whatever the log throws at it
ERR = "NCCL WARN Call to ibv_reg_mr failed with error Cannot allocate memory"
STORM_ERR = "RuntimeError: CUDA error: an illegal memory access was encountered"
BIG_LINE = 100 * 10**6
READY_S = 180.0  # readiness deadlines: generous, a loaded machine starts a collector in tens of seconds
pytestmark = [pytest.mark.server, pytest.mark.e2e, pytest.mark.timeout(900)]  # (a hang guard)

TRAIN = """
import sys, time
import torch, torch.distributed as dist
import ranklens.tracing as rlt
dist.init_process_group("gloo")
rlt.init(flush_interval_s=0.2, dataloader=False)
steps, dt = int(sys.argv[1]), float(sys.argv[2])
t = torch.ones(64)
for s in range(steps):
    with rlt.step(s):
        with rlt.phase("forward"):
            time.sleep(dt)
        dist.all_reduce(t)
rlt.shutdown()
dist.destroy_process_group()
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANKLENS_COLLECTOR_", "RANKLENS_STORE"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **extra)
    return env


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class Log:
    """The rank log: numbered error lines (each must arrive once), storms, one 100 MB line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.marks = 0
        self.storm_repeats = 0
        self.noise = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._t = threading.Thread(target=self._loop, daemon=True)

    def write(self, text: str) -> None:
        with self._lock, open(self.path, "a") as f:
            f.write(text)

    def mark(self) -> None:
        with self._lock, open(self.path, "a") as f:
            f.write(f"{ERR} #{self.marks}\n")
            self.marks += 1

    def storm(self, seconds: float) -> None:
        """Bursts of noise and of one repeated error line: 20 a second, 2,000 + 500 lines each."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            with self._lock, open(self.path, "a") as f:
                f.write("".join(f"step {self.noise + i} loss 1.0 lr 0.1 throughput 1234\n" for i in range(2000)))
                f.write(f"{STORM_ERR}\n" * 500)
                f.write(f"{ERR} #{self.marks}\n")
            self.noise += 2000
            self.storm_repeats += 500
            self.marks += 1
            time.sleep(0.05)

    def big_line(self) -> None:
        """100 MB without a newline (in 1 MB writes), then the newline and a numbered line."""
        chunk = "x" * 10**6
        with self._lock, open(self.path, "a") as f:
            for _ in range(BIG_LINE // len(chunk)):
                f.write(chunk)
                f.flush()
            f.write("\n")
        self.mark()

    def _loop(self) -> None:
        while not self._stop.wait(0.05):
            self.mark()

    def start(self) -> None:
        self._t.start()

    def stop(self) -> None:
        self._stop.set()
        self._t.join(10)


def _collector(url: str, spool: Path, logs: Path, out: Path) -> subprocess.Popen:
    cfg = out.with_suffix(".toml")
    cfg.write_text(
        "[collector]\nship_interval_s = 0.2\ncommit_interval_s = 0.2\nlog_poll_interval_s = 0.05\n"
        'host = "node-soak"\nnvml = false\n'
    )
    with open(out, "a") as err:
        return subprocess.Popen(
            [
                *(sys.executable, "-m", "ranklens.cli", "collector", "--store", url, "--config", str(cfg)),
                *("--spool", str(spool), "--logs", str(logs / "*.log"), "--log-format", "json"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=_env(),
        )


def _ranks(spool: Path, tmp: Path, steps: int) -> list[subprocess.Popen]:
    script = tmp / "train.py"
    script.write_text(TRAIN)
    port = _free_port()
    procs = []
    for r in range(2):
        env = _env(
            RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            RANKLENS_SPOOL=str(spool), RANKLENS_JOB_ID="soak",
        )  # fmt: skip
        with open(tmp / f"rank-{r}.out", "w") as out:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), str(steps), str(STEP_S)], env=env, stdout=out, stderr=out
                )
            )
    return procs


def _count(path: Path, *needles: str) -> int:
    text = path.read_text() if path.exists() else ""
    return sum(text.count(n) for n in needles)


OUTAGE = ("store unavailable", "is unavailable")  # a running collector's pass / a starting one's open


def test_soak_everything_at_once(tmp_path):
    _need_clickhouse_server()
    from ranklens.store import open_store

    t_start = time.monotonic()
    server = Server(tmp_path / "ch")
    server.start()
    spool, logs = tmp_path / "spool", tmp_path / "logs"
    logs.mkdir()
    log = Log(logs / "rank-0.log")
    steps = int(SOAK_S / (STEP_S + 0.02))
    clog = tmp_path / "collector.log"
    rnd = random.Random(22)
    kills, rss_peak, outages = 0, 0.0, 0
    try:
        open_store(server.url).close()
        ranks = _ranks(spool, tmp_path, steps)
        log.start()
        chaos_done = threading.Event()
        chaos_failed: list[BaseException] = []
        wait_until(
            lambda: any(spool.glob("soak/*/rank-*/*.jsonl")),
            READY_S,
            "the ranks' first spool segments",
            interval_s=0.2,
            procs=ranks,
            detail=lambda: "\n".join((tmp_path / f"rank-{r}.out").read_text()[-1500:] for r in range(2)),
        )

        def chaos() -> None:
            try:
                _chaos()
            except BaseException as e:  # (fails the test from the main thread)
                chaos_failed.append(e)
            finally:
                chaos_done.set()

        def _chaos() -> None:
            nonlocal outages
            time.sleep(SOAK_S * 0.15)  # the chaos is paced from the job's start
            _raw_segment(spool / "bad_" / "0" / "rank-0" / "steps.1.00000001.jsonl", "steps", [LONE_SURROGATE_ROW])
            row = b'{"job_id":"j\xffbad","rank":1,"step":0,"start_ns":1,"end_ns":2}'
            _raw_segment(spool / "bad_" / "0" / "rank-1" / "steps.1.00000001.jsonl", "steps", [row])
            log.storm(SOAK_S * 0.1)
            time.sleep(SOAK_S * 0.05)
            seen = _count(clog, *OUTAGE)
            server.stop()  # mid-run: inserts in flight fail, the ranks and the log keep writing
            outages += 1
            time.sleep(SOAK_S * 0.15)
            wait_until(lambda: _count(clog, *OUTAGE) > seen, READY_S, "a collector to see the server's outage")
            server.start()
            log.big_line()
            log.storm(SOAK_S * 0.05)

        chaos_thread = threading.Thread(target=chaos, daemon=True)
        chaos_thread.start()
        # kill -9 the collector at random moments while the job runs
        while any(p.poll() is None for p in ranks) or not chaos_done.is_set():
            started = _count(clog, "Ctrl-C to stop")
            c = _collector(server.url, spool, logs, clog)
            wait_until(  # up (its first line), then killed at a random moment of its run
                lambda n=started: _count(clog, "Ctrl-C to stop") > n,
                READY_S,
                "the collector's first line",
                interval_s=0.1,
                procs=[c],
                detail=lambda: clog.read_text()[-3000:],
            )
            until = time.monotonic() + rnd.uniform(0.5, 4.0)
            while time.monotonic() < until:
                rss_peak = max(rss_peak, _rss_mb(c.pid))
                time.sleep(0.1)
            c.send_signal(signal.SIGKILL)
            c.wait(30)
            kills += 1
        chaos_thread.join(60)
        if chaos_failed:
            raise chaos_failed[0]
        log.stop()
        log.mark()  # the last numbered line, written after everything else
        rcs = [p.wait(60) for p in ranks]
        # a last collector to the end: everything drains
        c = _collector(server.url, spool, logs, clog)
        try:
            store = open_store(server.url, create=False)

            def drained() -> bool:
                """The spool drained, every numbered line and every storm repeat arrived."""
                nonlocal rss_peak
                rss_peak = max(rss_peak, _rss_mb(c.pid))
                if _pending(spool):
                    return False
                (marks, storm) = store.query(
                    f"SELECT uniqExactIf(message, message LIKE '{ERR} #%'), "
                    "sumIf(repeat_count, message LIKE '%illegal memory access%') FROM log_events"
                ).rows()[0]
                return marks >= log.marks and storm >= log.storm_repeats

            wait_until(
                drained,
                READY_S,
                f"the spool to drain, {log.marks} numbered log lines and {log.storm_repeats} storm repeats to arrive",
                interval_s=0.2,
                procs=[c],
                detail=lambda: clog.read_text()[-3000:],
            )
        finally:
            c.send_signal(signal.SIGTERM)
            rc_last = c.wait(60)
        assert rc_last == 0, clog.read_text()[-3000:]

        def one(sql: str):
            return store.query(sql).rows()[0]

        j = "job_id = 'soak'"
        figures = {}
        for table_name, key in (
            ("steps", "rank, step"),
            ("phases", "rank, step, phase"),
            ("collectives", "rank, pg, seq"),
            ("heartbeats", "rank, ts_ns"),
            ("ranks", "rank"),
        ):
            n, distinct = one(f"SELECT count(), uniqExact({key}) FROM {table_name} WHERE {j}")
            figures[table_name] = (int(n), int(distinct))
            assert n == distinct, f"{table_name}: {n} rows, {distinct} keys: duplicates"
        assert figures["steps"][0] == 2 * steps, figures
        assert figures["phases"][0] == 2 * steps, figures
        assert one(f"SELECT count() FROM collectives WHERE {j} AND op = 'all_reduce'")[0] == 2 * steps
        assert figures["ranks"][0] == 2 and figures["heartbeats"][0] > 0
        msgs = [m for (m,) in store.query(f"SELECT message FROM log_events WHERE message LIKE '{ERR} #%'").rows()]
        marks = sorted(int(m.rsplit("#", 1)[1]) for m in msgs)
        assert marks == list(range(log.marks)), "numbered log lines lost or doubled"
        (storm,) = one("SELECT sum(repeat_count) FROM log_events WHERE message LIKE '%illegal memory access%'")
        assert storm == log.storm_repeats, (storm, log.storm_repeats)
        drops = dict(store.query("SELECT what, sum(count) FROM drops GROUP BY what").rows())
        reasons = sorted(p.read_text() for p in (spool / "quarantine").glob("*.reason"))
        assert len(reasons) == 2, reasons
        assert any("not valid Unicode" in r for r in reasons) and any("not UTF-8" in r for r in reasons), reasons
        assert drops.get("spool_segment_quarantined") == 2, drops
        assert drops.get("log_lines_truncated", 0) >= 1, drops
        (bad,) = one("SELECT count() FROM steps WHERE job_id != 'soak'")
        assert bad == 0
        store.close()
    finally:
        server.stop()
    assert rcs == [0, 0], [(tmp_path / f"rank-{r}.out").read_text()[-2000:] for r in range(2)]
    assert rss_peak < RSS_BOUND_MB, f"collector RSS peaked at {rss_peak:.0f} MB"
    text = clog.read_text()
    outage_seen = text.count("store unavailable") + text.count("is unavailable")
    why = [r.strip().split(".jsonl: ", 1)[-1] for r in reasons]
    assert outage_seen, "no collector saw the server's outage"
    print(
        f"\nsoak {time.monotonic() - t_start:.0f} s: training {steps} steps x 2 ranks exited {rcs}; "
        f"collector kill -9 x{kills}, server stopped/restarted x{outages}; "
        + ", ".join(f"{t} {n} rows ({d} distinct keys)" for t, (n, d) in figures.items())
        + f"; {len(marks)} numbered log lines exactly once; storm {log.noise} noise lines + {storm} repeats "
        f"(all counted); drops {drops}; quarantined 2 ({'; '.join(why)}); "
        f"collector RSS peak {rss_peak:.0f} MB (bound {RSS_BOUND_MB} MB); "
        f"{text.count('already stored')} settle passes, {outage_seen} outage log lines"
    )
