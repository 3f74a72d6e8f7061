"""The collector and tracer faults of issue 22 (#1, #2, #3, #5, #6), each reproduced as it was found:
real ``ranklens`` processes (``collect``, ``collector``, ``run``), a real spool, a real store, on
both backends (the embedded store and a ClickHouse server).

1. one bad segment (a lone surrogate in ``job_id``, as the tracer wrote it from a non-UTF-8
   ``RANKLENS_JOB_ID``) stopped every pass, and killed the shipper of ``ranklens run``;
2. the free-space floor deleted the spool while the store was up;
3. a one-off ``collect`` (or ``ranklens run``) killed after its store write, next to a running
   collector: every row twice;
5. a ``\\xff`` byte reached the store through the fast JSON path, and readers then crashed;
6. the disk budget was exceeded while the store was down (checked only at backed-off passes).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ranklens.formats.spool import SpoolWriter, header_line
from tests._sync import wait_until

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(params=["embedded", pytest.param("server", marks=pytest.mark.server)])
def store_url(request, tmp_path):
    """A fresh store on each backend (schema created)."""
    from ranklens.store import open_store

    url = (
        f"embedded://{tmp_path / 'store'}" if request.param == "embedded" else request.getfixturevalue("server_db_url")
    )
    open_store(url).close()
    return url


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANKLENS_COLLECTOR_", "RANKLENS_STORE"))}
    env.update(PYTHONPATH=str(ROOT), **extra)
    return env


def _cli(*args: str, **kw) -> list[str]:
    return [sys.executable, "-m", "ranklens.cli", *args]


def _run(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(_cli(*args), env=env or _env(), capture_output=True, text=True, timeout=timeout)


def _q(url: str, sql: str):
    from ranklens.store import open_store

    s = open_store(url, create=False)
    try:
        return s.query(sql).rows()
    finally:
        s.close()


def _raw_segment(path: Path, table: str, lines: list[bytes]) -> Path:
    """A segment written byte for byte (what an older tracer, or a foreign writer, left), whole at
    once as the spool's writers do (a hidden name, then a rename): a collector passing while a plain
    write had created the file but not filled it read an empty segment, shipped its nothing and
    removed it (a soak run lost its invalid-UTF-8 segment that way)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(header_line(table).encode() + b"".join(ln + b"\n" for ln in lines))
    os.replace(tmp, path)
    return path


def _steps(spool: Path, job: str, ranks: int = 3, steps: int = 10) -> int:
    for r in range(ranks):
        SpoolWriter.for_rank(spool, job, 0, r).write(
            "steps", [{"job_id": job, "rank": r, "step": s, "start_ns": 1 + s, "end_ns": 2 + s} for s in range(steps)]
        )
    return ranks * steps


def _pending(spool: Path, under: str = "") -> list[Path]:
    return [p for p in (spool / under).rglob("*.jsonl") if "quarantine" not in p.parts and not p.name.startswith(".")]


def _quarantined(spool: Path) -> dict[str, str]:
    q = spool / "quarantine"
    return {p.name: p.read_text() for p in q.glob("*.reason")} if q.is_dir() else {}


# --- 1: one bad segment ---------------------------------------------------------------------------


LONE_SURROGATE_ROW = b'{"job_id":"job\\udcff","rank":0,"step":0,"start_ns":1,"end_ns":2}'  # the old tracer's bytes


def test_a_bad_segment_is_quarantined_and_every_other_segment_ships(tmp_path, store_url):
    spool = tmp_path / "spool"
    _raw_segment(spool / "job_" / "0" / "rank-0" / "steps.7.00000001.jsonl", "steps", [LONE_SURROGATE_ROW])
    good = _steps(spool, "good")
    r = _run("collect", "--store", store_url, "--spool", str(spool))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "1 quarantined" in r.stderr, r.stderr[-3000:]
    assert _q(store_url, "SELECT count() FROM steps WHERE job_id = 'good'") == [(good,)]
    (reason,) = _quarantined(spool).values()
    assert "job_id" in reason and "not valid Unicode" in reason, reason
    assert not _pending(spool, "job_")
    r = _run("collect", "--store", store_url, "--spool", str(spool))  # the drop count travels like any row
    assert r.returncode == 0, r.stderr[-3000:]
    assert _q(store_url, "SELECT sum(count) FROM drops WHERE what = 'spool_segment_quarantined'") == [(1,)]


def test_ranklens_run_with_a_non_utf8_job_id_ships_and_its_shipper_survives_a_bad_segment(tmp_path, store_url):
    """The tracer of a job whose RANKLENS_JOB_ID holds a \\xff byte writes valid segments (the byte
    becomes U+FFFD), and a bad segment already in the spool does not kill ``ranklens run``'s shipper."""
    spool = tmp_path / "spool"
    _raw_segment(spool / "old_" / "0" / "rank-0" / "steps.7.00000001.jsonl", "steps", [LONE_SURROGATE_ROW])
    train = tmp_path / "train.py"
    train.write_text(
        "import ranklens.tracing as rt\n"
        "rt.init(patch_distributed=False, dataloader=False, flush_interval_s=0.1)\n"
        "for i in range(20):\n"
        "    with rt.step(i):\n"
        "        pass\n"
        "rt.shutdown()\n"
    )
    env = {k.encode(): v.encode() for k, v in _env().items()}
    env[b"RANKLENS_JOB_ID"] = b"job\xff"  # not UTF-8
    p = subprocess.run(
        _cli("run", "--store", store_url, "--spool", str(spool), "--", sys.executable, str(train)),
        env=env,
        capture_output=True,
        timeout=180,
    )
    err = p.stderr.decode("utf-8", "replace")
    assert p.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "collected no records" not in err, err[-3000:]
    assert _q(store_url, "SELECT job_id, count() FROM steps GROUP BY job_id") == [("job\ufffd", 20)]
    assert len(_quarantined(spool)) == 1  # the old bad segment, aside with its reason


# --- 2: the free-space floor with a healthy store -------------------------------------------------


@contextlib.contextmanager
def _small_filesystem(path: Path, size: str = "48m"):
    """A tmpfs of ``size`` at ``path``: far less free space than the default 1 GiB floor."""
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {r.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _mixed_spool(spool: Path, job: str, k: int = 4) -> dict[str, int]:
    w = SpoolWriter.for_rank(spool, job, 0, 0)
    for i in range(k):
        w.write(
            "collectives",
            [
                {"job_id": job, "rank": 0, "pg": "0", "seq": 10 * i + j, "op": "all_reduce", "enter_ns": 1}
                for j in range(10)
            ],
        )
        w.write("gpu_samples", [{"host": "n", "gpu_index": 0, "ts_ns": 10 * i + j, "job_id": job} for j in range(10)])
        w.write("heartbeats", [{"job_id": job, "rank": 0, "ts_ns": 10 * i + j} for j in range(10)])
    return {"collectives": 10 * k, "gpu_samples": 10 * k, "heartbeats": 10 * k}


def test_free_space_floor_never_deletes_what_a_healthy_store_can_take(tmp_path, store_url):
    with _small_filesystem(tmp_path / "spool") as spool:
        want = _mixed_spool(spool, "lowdisk")
        assert shutil.disk_usage(spool).free < 1024**3  # below the default floor (spool_min_free_bytes)
        r = _run("collect", "--store", store_url, "--spool", str(spool))
        assert r.returncode == 0, r.stderr[-3000:]
        assert "over the disk budget" not in r.stderr, r.stderr[-3000:]
        for t, n in want.items():
            assert _q(store_url, f"SELECT count() FROM {t} WHERE job_id = 'lowdisk'") == [(n,)], t
        assert not _pending(spool, "lowdisk")
        assert _q(store_url, "SELECT count() FROM drops") == [(0,)]


def test_free_space_floor_evicts_low_value_data_only_while_the_store_is_down(tmp_path, store_url):
    """The floor is a last resort: with the store down it removes the least valuable data first
    (injected free-space probe: 10 MB free, a 1 GiB floor) and counts it; the rest ships later."""
    from ranklens.collector import Shipper
    from ranklens.collector.shipper import SpoolBudget
    from ranklens.store import open_store
    from ranklens.store.testing import DownStore

    spool = tmp_path / "spool"
    want = _mixed_spool(spool, "down", k=6)
    store = open_store(store_url)
    total = sum(p.stat().st_size for p in _pending(spool))
    free = {"bytes": 10 * 10**6}
    budget = SpoolBudget(max_bytes=0, min_free_bytes=10 * 10**6 + total // 3, check_interval_s=0)
    sh = Shipper(spool, DownStore(store.url, store.backend), budget=budget, free_bytes=lambda _p: free["bytes"])
    r = sh.ship_once()
    assert not r.ok and set(r.evicted) <= {"gpu_samples", "heartbeats"} and r.evicted, r
    sh.store = store
    free["bytes"] = 10 * 1024**3
    assert sh.ship_once().ok and sh.ship_once().ok
    assert _q(store_url, "SELECT count() FROM collectives WHERE job_id = 'down'") == [(want["collectives"],)]
    for t in ("gpu_samples", "heartbeats"):
        (stored,) = _q(store_url, f"SELECT count() FROM {t} WHERE job_id = 'down'")[0]
        dropped = _q(store_url, f"SELECT sum(count) FROM drops WHERE what = 'spool_budget:{t}'")[0][0] or 0
        assert stored + dropped == want[t], (t, stored, dropped)  # nothing lost silently
    store.close()


# --- 3: two shippers on one spool -----------------------------------------------------------------


def _toml(v: object) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    return repr(v) if isinstance(v, (int, float)) else f'"{v}"'


def _collector(url: str, spool: Path, log: Path, **cfg: object) -> subprocess.Popen:
    conf = {"ship_interval_s": 0.1, "commit_interval_s": 0.1, "host": "node-a", "nvml": False, **cfg}
    toml = log.with_suffix(".toml")
    toml.write_text("[collector]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in conf.items()))
    with open(log, "w") as f:
        return subprocess.Popen(
            _cli("collector", "--store", url, "--config", str(toml), "--spool", str(spool), "--log-format", "json"),
            stdout=subprocess.DEVNULL,
            stderr=f,
            env=_env(),
        )


def _ready(url: str, spool: Path) -> None:
    """Readiness: a segment written now reaches the store through the running collector."""
    _steps(spool, "ready", ranks=1, steps=1)
    wait_until(
        lambda: _q(url, "SELECT count() FROM steps WHERE job_id = 'ready'") == [(1,)], 90, "the collector's first pass"
    )


@contextlib.contextmanager
def _frozen(p: subprocess.Popen, spool: Path):
    """SIGSTOP the collector between two passes (never while it holds the spool's ship lock)."""
    lock = spool / ".ranklens-ship.lock"

    def stopped_between_passes() -> bool:
        os.kill(p.pid, signal.SIGSTOP)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return True
        except BlockingIOError:
            os.kill(p.pid, signal.SIGCONT)  # mid-pass: let it finish and try again
            return False
        finally:
            os.close(fd)

    wait_until(stopped_between_passes, 120, "the collector between two passes", interval_s=0.02, procs=[p])
    try:
        yield
    finally:
        os.kill(p.pid, signal.SIGCONT)


def _collectives(spool: Path, job: str, segments: int = 5, k: int = 10) -> int:
    w = SpoolWriter.for_rank(spool, job, 0, 0)
    for i in range(segments):
        w.write(
            "collectives",
            [
                {"job_id": job, "rank": 0, "pg": "0", "seq": k * i + j, "op": "all_reduce", "enter_ns": 1}
                for j in range(k)
            ],
        )
    return segments * k


def _stop(p: subprocess.Popen, log: Path) -> None:
    p.send_signal(signal.SIGTERM)
    assert p.wait(60) == 0, log.read_text()[-3000:]


def test_one_off_collect_killed_after_its_store_write_next_to_a_running_collector(tmp_path, store_url):
    spool = tmp_path / "spool"
    log = tmp_path / "collector.log"
    p = _collector(store_url, spool, log)
    try:
        _ready(store_url, spool)
        with _frozen(p, spool):  # the one-off gets the spool first
            n = _collectives(spool, "dup")
            r = _run(
                "collect", "--store", store_url, "--spool", str(spool), "--host", "node-b",
                env=_env(RANKLENS_COLLECTOR_FAULT="kill_after_write:1"),
            )  # fmt: skip
            assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
            assert _q(store_url, "SELECT count() FROM collectives WHERE job_id = 'dup'") == [(n,)]
            assert len(_pending(spool, "dup")) == 5  # stored, not deleted: in doubt
        wait_until(lambda: not _pending(spool, "dup"), 90, "the running collector to settle the segments")
    finally:
        _stop(p, log)
    assert _q(store_url, "SELECT count(), uniqExact(seq) FROM collectives WHERE job_id = 'dup'") == [(n, n)]


def test_ranklens_run_next_to_a_running_collector_sends_nothing_twice(tmp_path, store_url):
    spool = tmp_path / "spool"
    log = tmp_path / "collector.log"
    p = _collector(store_url, spool, log)
    job = (
        "import sys\n"
        "from ranklens.formats.spool import SpoolWriter\n"
        "w = SpoolWriter.for_rank(sys.argv[1], 'rundup', 0, 0)\n"
        "for i in range(5):\n"
        "    w.write('collectives', [{'job_id': 'rundup', 'rank': 0, 'pg': '0', 'seq': 10 * i + j, 'op': 'x',"
        " 'enter_ns': 1} for j in range(10)])\n"
    )
    try:
        _ready(store_url, spool)
        with _frozen(p, spool):
            r = _run(
                "run", "--store", store_url, "--spool", str(spool), "--job-id", "rundup", "--",
                sys.executable, "-c", job, str(spool),
                env=_env(RANKLENS_COLLECTOR_FAULT="kill_after_write:1"),
            )  # fmt: skip
            assert r.returncode in (0, -signal.SIGKILL), r.stderr[-3000:]
        wait_until(lambda: not _pending(spool, "rundup"), 90, "the spool to drain")
    finally:
        _stop(p, log)
    assert _q(store_url, "SELECT count(), uniqExact(seq) FROM collectives WHERE job_id = 'rundup'") == [(50, 50)]
    assert r.returncode == 0 and "served by another collector" in r.stderr, r.stderr[-3000:]


# --- 5: invalid UTF-8 ---------------------------------------------------------------------------


def test_invalid_utf8_is_quarantined_at_ingest_never_stored(tmp_path, store_url):
    spool = tmp_path / "spool"
    row = b'{"job_id":"j\xffbad","rank":0,"step":0,"start_ns":1,"end_ns":2}'
    _raw_segment(spool / "jbad" / "0" / "rank-0" / "steps.7.00000001.jsonl", "steps", [row])
    good = _steps(spool, "good")
    r = _run("collect", "--store", store_url, "--spool", str(spool))
    assert r.returncode == 0 and "1 quarantined" in r.stderr, r.stderr[-3000:]
    assert _q(store_url, "SELECT job_id, count() FROM steps GROUP BY job_id") == [("good", good)]
    (reason,) = _quarantined(spool).values()
    assert "not UTF-8" in reason, reason


def _store_bad_bytes(url: str) -> None:
    """Rows whose job_id is not UTF-8, written past ranklens' validation (an older release, another client)."""
    import pyarrow as pa

    from ranklens.records import to_arrow
    from ranklens.store import open_store

    t = to_arrow(
        "steps", [{"job_id": "jXbad", "rank": 0, "step": i, "start_ns": 1 + i, "end_ns": 5 + i} for i in range(3)]
    )
    s = open_store(url)
    try:
        if s.backend == "embedded":
            col = t.column("job_id").combine_chunks()
            data = pa.py_buffer(col.buffers()[2].to_pybytes().replace(b"X", b"\xff"))
            bad = pa.Array.from_buffers(pa.string(), len(col), [None, col.buffers()[1], data])
            s.write("steps", t.set_column(t.column_names.index("job_id"), "job_id", bad))
        else:
            cols = [t.column(c).to_pylist() for c in t.column_names]
            cols[t.column_names.index("job_id")] = [b"j\xffbad"] * t.num_rows
            s._execute(f"INSERT INTO steps ({', '.join(t.column_names)}) VALUES", cols, columnar=True)
    finally:
        s.close()


def test_readers_decode_bad_bytes_already_stored(tmp_path, store_url):
    _store_bad_bytes(store_url)
    r = _run("sql", "--store", store_url, "SELECT job_id, count() AS n FROM steps GROUP BY job_id")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "j\ufffdbad" in r.stdout, r.stdout
    r = _run("analyze", "--store", store_url)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]


# --- 6: the disk budget while the store is down ---------------------------------------------------


class _Writer:
    """Rank data arriving at no more than ``rate`` bytes/s, mostly low-value GPU samples, some steps.

    A writer that falls behind (a loaded machine) does not catch up in a burst: it never writes
    faster than ``rate``. Every write and every spool measurement is recorded with its wall time
    (``arrivals``, ``samples``), so the test bounds the spool by what really arrived."""

    def __init__(self, spool: Path, rate: float) -> None:
        self.w = SpoolWriter.for_rank(spool, "budget", 0, 0)
        self.spool, self.rate = spool, rate
        self.rows = {"gpu_samples": 0, "steps": 0}
        self.arrivals: list[tuple[float, int]] = []  # (wall time after the write, bytes written so far)
        self.samples: list[tuple[float, int]] = []  # (wall time, spool bytes then)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    @property
    def peak(self) -> int:
        return max((b for _, b in self.samples), default=0)

    def _sample(self) -> None:
        self.samples.append((time.time(), _spool_bytes(self.spool)))

    def _loop(self) -> None:
        pad = "x" * 200
        written = 0
        due = time.monotonic()
        while not self._stop.is_set():
            i = self.rows["gpu_samples"]
            gpu = [{"host": pad, "gpu_index": 0, "ts_ns": i + j, "job_id": "budget"} for j in range(400)]
            size = 0
            for table, rows in (
                ("gpu_samples", gpu),
                ("steps", [{"job_id": "budget", "rank": 0, "step": self.rows["steps"] + j, "start_ns": 1, "end_ns": 2}
                           for j in range(5)]),
            ):  # fmt: skip
                p = self.w.write(table, rows)
                with contextlib.suppress(OSError):
                    size += p.stat().st_size if p else 0
                self.rows[table] += len(rows)
            written += size
            self.arrivals.append((time.time(), written))
            due = max(due, time.monotonic()) + size / self.rate  # late: go on from now, no burst
            while time.monotonic() < due and not self._stop.is_set():
                self._sample()
                time.sleep(0.02)
            self._sample()

    def arrived(self, after: float, upto: float) -> int:
        """Bytes written after wall time ``after`` up to ``upto`` (a write counts from when it returned)."""
        before = max((b for t, b in self.arrivals if t <= after), default=0)
        until = max((b for t, b in self.arrivals if t <= upto), default=0)
        return until - before

    def __enter__(self) -> _Writer:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(10)


def _evictions(log: Path) -> list[float]:
    """Wall times of the collector's budget evictions (its JSON log lines, millisecond stamps)."""
    import calendar
    import json

    out = []
    for line in log.read_text().splitlines():
        with contextlib.suppress(ValueError):
            rec = json.loads(line)
            if "over its budget" in rec.get("msg", ""):
                ts = rec["ts"]  # 2026-12-01T20:57:02.123Z
                out.append(calendar.timegm(time.strptime(ts[:19], "%Y-%m-%dT%H:%M:%S")) + int(ts[20:23]) / 1000)
    return out


def _spool_bytes(spool: Path) -> int:
    total = 0
    for p in _pending(spool):
        with contextlib.suppress(FileNotFoundError):
            total += p.stat().st_size
    return total


@contextlib.contextmanager
def _store_down(url: str, tmp_path: Path):
    """The store goes away and comes back: the embedded store's parts move off; a server (our own,
    on a free port) is stopped. Yields the URL the collector uses."""
    if url.startswith("embedded://"):
        parts = Path(url[len("embedded://") :]) / "parts"
        away = tmp_path / "parts-away"
        yield url, {"down": lambda: shutil.move(parts, away), "up": lambda: shutil.move(away, parts)}
    else:
        from tests.collector.test_collector_exactly_once import Server, _need_clickhouse_server

        _need_clickhouse_server()
        server = Server(tmp_path / "ch")
        server.start()
        try:
            from ranklens.store import open_store

            open_store(server.url).close()
            yield server.url, {"down": server.stop, "up": server.start}
        finally:
            server.stop()


@pytest.mark.slow
def test_disk_budget_holds_as_data_arrives_while_the_store_is_down(tmp_path, store_url):
    budget = 4 * 10**6
    rate = 1.0 * 10**6  # bytes/s into the spool (at most)
    check_s = 1.0  # spool_check_interval_s
    spool = tmp_path / "spool"
    with _store_down(store_url, tmp_path) as (url, ctl):
        log = tmp_path / "collector.log"
        p = _collector(url, spool, log, spool_max_bytes=budget, spool_min_free_bytes=0, spool_check_interval_s=check_s)
        try:
            _ready(url, spool)
            ctl["down"]()
            down_at = time.time()
            with _Writer(spool, rate) as w:
                time.sleep(20)  # passes back off for seconds by now; data keeps arriving
            ctl["up"]()
            wait_until(lambda: not _pending(spool, "budget"), 120, "the spool to drain after the store came back")
            wait_until(
                lambda: _q(url, "SELECT count() FROM steps WHERE job_id = 'budget'")[0][0] >= w.rows["steps"],
                120,
                "the last steps in the store",
            )
        finally:
            _stop(p, log)
        # lowest-value data went first: every step arrived once; every GPU sample is stored or counted
        steps = _q(url, "SELECT count(), uniqExact(step) FROM steps WHERE job_id = 'budget'")
        (stored,) = _q(url, "SELECT count() FROM gpu_samples WHERE job_id = 'budget'")[0]
        dropped = _q(url, "SELECT sum(count) FROM drops WHERE what = 'spool_budget:gpu_samples'")[0][0] or 0
    evictions = [t for t in _evictions(log) if t >= down_at]
    marks = [down_at, *evictions]  # the spool's history in intervals: store down, eviction 1, 2, ...
    # over the budget: from the first measurement over it to the eviction that ended it (or the end)
    over = []
    for k, end in enumerate([*evictions, w.samples[-1][0]]):
        first = next((t for t, size in w.samples if marks[k] < t <= end and size > budget), None)
        if first is not None:
            over.append(round(end - first, 2))
    between = [round(w.arrived(a, b) / 1e6, 2) for a, b in itertools.pairwise(evictions)]
    print(
        f"budget {budget / 1e6:.1f} MB, data at <= {rate / 1e6:.1f} MB/s for 20 s while the store was down: "
        f"spool peak {w.peak / 1e6:.1f} MB; {len(evictions)} evictions (arrivals between them {between} MB), "
        f"over the budget for {over} s; {dropped} of {w.rows['gpu_samples']} GPU samples evicted and counted"
    )
    assert len(evictions) >= 3, (
        f"{len(evictions)} evictions in 20 s of data over the budget:\n{log.read_text()[-3000:]}"
    )
    # The bound follows what arrived: at time t after eviction k, the spool holds what check k kept
    # (within the budget) plus what arrived since check k listed the spool, which was after eviction
    # k-1 (the checks run one after another, in one thread).
    for t, size in w.samples:
        k = sum(1 for e in evictions if e <= t)  # evictions done by t
        bound = budget + w.arrived(marks[k - 1], t) if k else size  # before the first: what arrived
        assert size <= bound, (
            f"spool at {size / 1e6:.2f} MB {t - evictions[k - 1]:.2f} s after eviction {k}: over the "
            f"{budget / 1e6:.0f} MB budget plus the {(bound - budget) / 1e6:.2f} MB that arrived since the check before"
        )
    # and the checks ran as data arrived (every spool_check_interval_s, scheduling allowing), not only
    # at the backed-off passes (0.1 s doubling: 3.2, 6.4, 12.8 s apart within these 20 s)
    assert max(over) <= 2.5 * check_s, f"the spool stayed over its budget for {over} s"
    assert steps == [(w.rows["steps"],) * 2]
    assert dropped > 0 and stored + dropped == w.rows["gpu_samples"], (stored, dropped, w.rows)


def test_collect_ships_a_spool_of_more_segments_than_one_pass_takes(tmp_path):
    """A pass takes 2000 segments; a long job's spool (or one kept while the store was down) holds
    more: the one-off ``collect`` used to ship the first 2000 and say nothing of the rest."""
    spool, url = tmp_path / "spool", f"embedded://{tmp_path / 'store'}"
    w = SpoolWriter.for_rank(spool, "long", 0, 0)
    n = 2050
    for s in range(n):
        w.write("steps", [{"job_id": "long", "rank": 0, "step": s, "start_ns": 1 + s, "end_ns": 2 + s}])
    r = _run("collect", "--store", url, "--spool", str(spool), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"{n} segment(s) in 2 passes" in r.stderr, r.stderr[-2000:]
    assert _q(url, "SELECT count(), uniqExact(step) FROM steps WHERE job_id = 'long'") == [(n, n)]
    assert not _pending(spool, "long")


def test_an_empty_segment_just_created_in_place_waits_for_its_writer(tmp_path, store_url):
    """A foreign writer that creates its segment in place (no hidden name and rename) shows it empty
    for a moment: a collector passing then read an empty table, shipped nothing and removed the
    file, and the rows written next were lost. A young empty segment now waits for a later pass;
    an old one is removed as the empty table it is."""
    spool, url = tmp_path / "spool", store_url
    seg = spool / "inplace" / "0" / "rank-0" / "steps.7.00000001.jsonl"
    seg.parent.mkdir(parents=True)
    with open(seg, "wb") as f:  # created, not written yet
        r = _run("collect", "--store", url, "--spool", str(spool))
        assert r.returncode == 0, r.stderr[-3000:]
        assert "1 empty and just written: left for the next run" in r.stderr, r.stderr[-2000:]
        assert seg.exists()
        row = b'{"job_id":"inplace","rank":0,"step":%d,"start_ns":%d,"end_ns":%d}'
        rows = [row % (s, 1 + s, 2 + s) for s in range(4)]
        f.write(header_line("steps").encode() + b"".join(ln + b"\n" for ln in rows))
    r = _run("collect", "--store", url, "--spool", str(spool))
    assert r.returncode == 0, r.stderr[-3000:]
    assert _q(url, "SELECT count() FROM steps WHERE job_id = 'inplace'") == [(4,)]
    assert not seg.exists()

    old = spool / "inplace" / "0" / "rank-0" / "steps.7.00000002.jsonl"
    old.write_bytes(b"")
    os.utime(old, (time.time() - 120, time.time() - 120))  # empty for two minutes: an empty table
    r = _run("collect", "--store", url, "--spool", str(spool))
    assert r.returncode == 0 and "empty and just written" not in r.stderr, r.stderr[-2000:]
    assert not old.exists()
    assert _q(url, "SELECT count() FROM steps WHERE job_id = 'inplace'") == [(4,)]
