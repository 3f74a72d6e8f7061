"""The tracer: unit behaviour (buffers, drops, spool, fork) and a real multi-process gloo job."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ranklens.collector import Shipper
from ranklens.tracing.tracer import Tracer
from tests._sync import wait_until
from tests.tracing._fakes import FakeClock


def _segments(root: Path, table: str) -> list[dict]:
    rows = []
    for p in sorted(root.rglob(f"{table}.*.jsonl")):
        lines = p.read_text().splitlines()
        assert json.loads(lines[0]) == {"ranklens": "records", "version": 1, "table": table}
        rows += [json.loads(x) for x in lines[1:]]
    return rows


def _tracer(tmp_path, **kw) -> Tracer:
    return Tracer(job_id="j", attempt=0, rank=3, world_size=4, spool_dir=str(tmp_path), flush_interval_s=60, **kw)


def test_steps_phases_and_spool(tmp_path):
    t = _tracer(tmp_path, clock=FakeClock())
    with t.step(7, tokens=100, loss=0.5), t.phase("forward"), t.phase("attention"):
        pass
    t.shutdown()
    (step,) = _segments(tmp_path, "steps")
    assert step["step"] == 7 and step["tokens"] == 100 and step["loss"] == 0.5 and step["end_ns"] > step["start_ns"]
    phases = _segments(tmp_path, "phases")
    assert [p["phase"] for p in phases] == ["attention", "forward"]  # inner closes first
    assert _segments(tmp_path, "ranks")[0]["rank"] == 3
    assert _segments(tmp_path, "heartbeats")[-1]["step"] == 7


def test_user_exceptions_pass_through_and_are_still_timed(tmp_path):
    t = _tracer(tmp_path)
    with pytest.raises(KeyError), t.step(1), t.phase("data"):
        raise KeyError("boom")
    t.shutdown()
    assert len(_segments(tmp_path, "phases")) == 1 and len(_segments(tmp_path, "steps")) == 1


def test_bounded_buffer_drops_and_counts(tmp_path):
    t = _tracer(tmp_path, max_buffered=5)
    for i in range(20):
        with t.step(i):
            pass
    t.shutdown()
    assert len(_segments(tmp_path, "steps")) == 4  # 5 slots, one taken by the ranks row
    drops = _segments(tmp_path, "drops")
    assert sum(d["count"] for d in drops if d["what"] == "steps:buffer_full") == 16


def test_unwritable_spool_never_raises(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    t = Tracer(job_id="j", attempt=0, rank=0, world_size=1, spool_dir=str(blocker), flush_interval_s=60)
    with t.step(0):
        pass
    t.flush()  # logs, counts, does not raise
    assert t._drops["steps:spool_write_failed"] == 1
    t.shutdown()


def test_forked_child_is_not_traced(tmp_path):
    import ranklens.tracing as rlt

    t = rlt.init(job_id="j", spool_dir=str(tmp_path), rank=0, world_size=1, patch_distributed=False)
    try:
        pid = os.fork()
        if pid == 0:  # child: records nothing, writes nothing
            with rlt.step(99):
                pass
            t.flush()
            t.beat()  # the heartbeat lane's writer neither: the parent's rank is not the child
            os._exit(0 if not t.enabled else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        rlt.shutdown()
    assert all(s["step"] != 99 for s in _segments(tmp_path, "steps"))
    # a segment's name carries the pid of the process that wrote it: the parent's only
    assert list(tmp_path.rglob(f"heartbeats.{os.getpid()}.*.jsonl"))
    assert not list(tmp_path.rglob(f"*.{pid}.*.jsonl"))


def test_disabled_by_env(tmp_path, monkeypatch):
    import ranklens.tracing as rlt

    monkeypatch.setenv("RANKLENS_DISABLE", "1")
    assert rlt.init(job_id="j", spool_dir=str(tmp_path)) is None
    with rlt.step(1), rlt.phase("x"):  # no-ops
        pass
    assert not list(tmp_path.iterdir())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_gloo_job(script: str, world: int, job_id: str, tmp_path: Path, store) -> None:
    """Run tests/<script> as a real ``world``-rank gloo job traced into ``tmp_path/spool``; ship it."""
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(world),
        "RANKLENS_SPOOL": str(tmp_path / "spool"),
        "RANKLENS_JOB_ID": job_id,
        "OMP_NUM_THREADS": "1",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(Path(__file__).parent.parent.joinpath(script))],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    Shipper(tmp_path / "spool", store).ship_once()


@pytest.mark.e2e
def test_real_gloo_job_ledger(tmp_path, embedded_store):
    world = 4
    _run_gloo_job("dist_job.py", world, "dist-test", tmp_path, embedded_store)
    q = embedded_store.query

    groups = {pg: sorted(r) for pg, r in q("SELECT pg, any(ranks) FROM process_groups GROUP BY pg").rows()}
    assert sorted(groups.values()) == [[0, 1, 2, 3], [0, 2]]
    # every (pg, seq) has exactly the members of its group, all agreeing on op and size
    bad = q(
        "SELECT pg, seq, count() AS n, uniqExact(op) AS ops, uniqExact(nbytes) AS sizes FROM collectives "
        "WHERE pg NOT LIKE '%/p2p:%' GROUP BY pg, seq HAVING ops > 1 OR sizes > 1"
    )
    assert bad.num_rows == 0, bad.to_pylist()
    counts = q("SELECT pg, seq, count() AS n FROM collectives WHERE pg NOT LIKE '%/p2p:%' GROUP BY pg, seq").rows()
    for pg, _seq, n in counts:
        assert n == len(groups[pg])
    ops = {op for (op,) in q("SELECT DISTINCT op FROM collectives").rows()}
    assert {
        "all_reduce",
        "broadcast",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "barrier",
        "send",
        "recv",
        "isend",
        "irecv",
    } <= ops
    # p2p pairs line up: rank 0's send #k matches rank 1's recv #k
    # p2p: every (pg, seq) of a direction pairs one sending call on the source with one receiving call
    # on the destination, of the same size (send/recv, isend/irecv and batch_isend_irecv share the counter)
    p2p = q(
        "SELECT pg, seq, groupArray(op), groupArray(rank), uniqExact(nbytes) FROM collectives "
        "WHERE pg LIKE '%/p2p:%' GROUP BY pg, seq"
    ).rows()
    for pg, _seq, ops_, ranks_, sizes in p2p:
        src, dst = (int(x) for x in pg.rsplit(":", 1)[1].split("->"))
        by_rank = dict(zip(ranks_, ops_))
        assert sorted(by_rank) == sorted([src, dst]) and sizes == 1, (pg, ops_, ranks_)
        assert by_rank[src] in ("send", "isend") and by_rank[dst] in ("recv", "irecv"), (pg, by_rank)
    # send/recv pairs between ranks 0 and 1 (2 per step) and the batch_isend_irecv ring (4 per step), 3 steps
    assert len(p2p) == 3 * (2 + 4)
    # async completion comes from the work's future, not from the late wait(): < 0.2 s
    async_ms = q(
        "SELECT max(end_ns - enter_ns) / 1e6 FROM collectives WHERE async_op = 1 AND op = 'all_reduce'"
    ).scalar()
    assert 0 < async_ms < 150
    # rank 1 sleeps 200 ms before the first all_reduce of each step: it is the last arriver there
    last = q(
        "SELECT seq, argMax(rank, enter_ns), (max(enter_ns) - min(enter_ns)) / 1e6 FROM collectives "
        "WHERE pg = '0' AND op = 'all_reduce' AND async_op = 0 GROUP BY seq ORDER BY seq"
    ).rows()
    assert [r for _, r, _ in last] == [1, 1, 1] and all(ms >= 150 for *_, ms in last), last
    steps = q("SELECT rank, count() FROM steps GROUP BY rank ORDER BY rank").rows()
    assert steps == [(r, 3) for r in range(world)]
    # every ledger row names its rank's node, as the ranks table does (the rollup aligns clocks by it)
    hosts = q("SELECT DISTINCT c.host = r.host, c.host != '' FROM collectives AS c JOIN ranks AS r USING (rank)").rows()
    assert hosts == [(True, True)], hosts


def test_phase_as_decorator_applied_before_init(tmp_path):
    import ranklens.tracing as rlt

    @rlt.phase("forward")
    def forward(x):
        return x * 2

    assert forward(2) == 4  # no tracer yet: a no-op
    rlt.init(job_id="j", spool_dir=str(tmp_path), rank=0, world_size=1, patch_distributed=False)
    try:
        with rlt.step(0):
            assert forward(3) == 6
            assert forward(4) == 8
    finally:
        rlt.shutdown()
    assert [p["phase"] for p in _segments(tmp_path, "phases")] == ["forward", "forward"]


def test_deleted_spool_directory_is_recreated(tmp_path):
    import shutil

    t = _tracer(tmp_path)
    with t.step(0):
        pass
    t.flush()
    shutil.rmtree(tmp_path / "j")  # an operator cleans /tmp under a running job
    with t.step(1):
        pass
    t.shutdown()
    assert [s["step"] for s in _segments(tmp_path, "steps")] == [1]
    assert not t._drops  # nothing lost after the directory came back


def test_full_disk_drops_and_counts_without_raising(tmp_path):
    import subprocess as sp

    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if sp.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root) to simulate a full disk")
    try:
        t = Tracer(job_id="j", attempt=0, rank=0, world_size=1, spool_dir=str(mnt), flush_interval_s=60)
        for i in range(3000):
            with t.step(i), t.phase("forward"):
                pass
        t.flush()  # ENOSPC inside: logged and counted, never raised
        t.shutdown()
        assert t._drops["phases:spool_write_failed"] > 0 or t._drops["steps:spool_write_failed"] > 0
        assert not list(mnt.rglob("*.tmp"))  # no half-written segment left behind
    finally:
        sp.run(["umount", str(mnt)], check=False)


def test_profiler_windows_every_n_steps_and_on_trigger(tmp_path, embedded_store):
    import ranklens.tracing as rlt

    t = rlt.init(job_id="prof", spool_dir=str(tmp_path), rank=0, world_size=1, patch_distributed=False,
                 profile_every=4)  # fmt: skip
    import torch

    try:
        for i in range(6):
            if i == 5:
                (tmp_path / "prof" / "0" / "profile-now").touch()  # on demand
            with rlt.step(i), rlt.phase("forward"):
                torch.ones(64, 64) @ torch.ones(64, 64)
    finally:
        rlt.shutdown()
    names = sorted(p.name for p in (tmp_path / "prof" / "0" / "kineto").glob("*.pt.trace.json"))
    assert names == ["rank0-step0.pt.trace.json", "rank0-step4.pt.trace.json", "rank0-step5.pt.trace.json"]
    assert t is not None and t.profiler.failures == 0
    r = Shipper(tmp_path, embedded_store).ship_once()
    assert r.ok and r.rows.get("trace_events", 0) > 0
    assert not list((tmp_path / "prof" / "0" / "kineto").glob("*.json"))  # shipped, then removed
    q = "SELECT DISTINCT job_id, rank FROM trace_events"
    assert embedded_store.query(q).rows() == [("prof", 0)]
    assert embedded_store.query("SELECT count() FROM trace_events WHERE name LIKE '%mm%'").scalar() >= 3


def test_dataloader_waits_are_timed_automatically(tmp_path):
    import time as _time

    import torch

    import ranklens.tracing as rlt

    class Slow(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            _time.sleep(0.02)
            return torch.ones(2)

    rlt.init(job_id="dl", spool_dir=str(tmp_path), rank=0, world_size=1, patch_distributed=False)
    try:
        loader = torch.utils.data.DataLoader(Slow(), batch_size=2)
        for i, _batch in enumerate(loader):
            with rlt.step(i), rlt.phase("data"):  # an explicit data phase is not doubled
                pass
        it = iter(loader)
        with rlt.step(9):
            next(it)
    finally:
        rlt.shutdown()
    data = [p for p in _segments(tmp_path, "phases") if p["phase"] == "data"]
    auto = [p for p in data if p["step"] == 9]
    assert len(auto) == 1 and auto[0]["end_ns"] - auto[0]["start_ns"] >= 30_000_000  # two 20 ms items


def test_rank_coordinates_reach_the_ranks_table(tmp_path):
    import ranklens.tracing as rlt

    rlt.init(job_id="c", spool_dir=str(tmp_path), rank=5, world_size=8, patch_distributed=False, pp=1, tp=1, dp=2)
    rlt.shutdown()
    (row,) = _segments(tmp_path, "ranks")
    assert (row["pp"], row["tp"], row["dp"]) == (1, 1, 2)


def test_watched_works_registered_while_the_watcher_checks_are_never_lost(tmp_path):
    """Async p2p works (gloo isend/irecv have no future) are completed by a watcher thread; works
    registered from other threads while it checks must all end up recorded."""
    import threading

    t = Tracer(job_id="j", attempt=0, rank=0, world_size=1, spool_dir=str(tmp_path), flush_interval_s=60)

    class Work:
        def __init__(self) -> None:
            self.done = False

        def is_completed(self) -> bool:
            return self.done

    works = []

    def register(k: int) -> None:
        for i in range(k):
            w = Work()
            works.append(w)
            t.watch(w, t.collective_entered(f"p2p-{threading.get_ident()}", i, "isend", 4, "f32", 1, True))
            w.done = i % 3 != 0  # most complete at once, some later
            if i % 50 == 0:
                time.sleep(0.0005)  # let the watcher interleave

    threads = [threading.Thread(target=register, args=(3000,)) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for w in works:
        w.done = True
    wait_until(
        lambda: not (t._pending or t._inflight),
        20,
        "the watcher to record every completed work",
        interval_s=0.01,
        detail=lambda: f"{len(t._pending)} pending, {len(t._inflight)} in flight",
    )
    assert not t._inflight, f"{len(t._inflight)} completed works never recorded"
    with t._buf_lock:
        rows = [r for table_name, r in t._buf if table_name == "collectives"]
    assert len(rows) == 9000 and all(r["end_ns"] > 0 for r in rows)
    t.shutdown()


@pytest.mark.e2e
def test_device_mesh_gives_each_rank_its_coordinates(tmp_path, embedded_store):
    world = 8
    _run_gloo_job("mesh_job.py", world, "mesh-test", tmp_path, embedded_store)
    got = embedded_store.query(
        "SELECT rank, max(pp), max(tp), max(dp) FROM ranks WHERE job_id = 'mesh-test' GROUP BY rank ORDER BY rank"
    ).rows()
    # mesh (pp=2, dp_replicate=2, tp=2), row-major: rank = pp * 4 + dp * 2 + tp
    assert got == [(r, r // 4, r % 2, (r // 2) % 2) for r in range(world)]


def test_mesh_dimension_names_map_to_coordinates():
    from ranklens.tracing._patch import mesh_coords

    class Mesh:
        def __init__(self, names, shape, coord, root=None):
            self.mesh_dim_names, self.shape, self._coord, self._root_mesh = names, shape, coord, root

        def size(self):
            n = 1
            for s in self.shape:
                n *= s
            return n

        def get_coordinate(self):
            return self._coord

    # HSDP: replicate x shard flatten into one dp index; unknown dimensions (cp) are ignored
    assert mesh_coords(Mesh(("dp_replicate", "dp_shard", "cp", "TP"), (2, 4, 2, 2), [1, 3, 0, 1]), 32) == {
        "dp": 1 * 4 + 3,
        "tp": 1,
    }
    assert mesh_coords(Mesh(("pp", "tp"), (2, 2), [1, 0]), 8) is None  # not the whole job
    assert mesh_coords(Mesh(("pp", "tp"), (2, 2), [1, 0], root=object()), 4) is None  # a sub-mesh
    assert mesh_coords(Mesh(None, (4,), [1]), 4) is None  # no names
    assert mesh_coords(Mesh(("pp",), (4,), None), 4) is None  # this rank is not in it


def test_init_registers_no_fork_hook_and_forked_children_reset(tmp_path, monkeypatch):
    """issue 13: os.register_at_fork ran again at every init() with a strong reference to the
    tracer. The hooks are registered once at import (weakly held); init() adds none."""
    import ranklens.tracing as rlt

    calls = []
    monkeypatch.setattr(os, "register_at_fork", lambda **kw: calls.append(kw))
    for _ in range(3):
        t = rlt.init(job_id="j", spool_dir=str(tmp_path), rank=0, world_size=1, patch_distributed=False)
        assert t is not None
        rlt.shutdown()
    assert calls == []
    monkeypatch.undo()
    t = rlt.init(job_id="j", spool_dir=str(tmp_path), rank=0, world_size=1, patch_distributed=False)
    try:
        pid = os.fork()
        if pid == 0:  # the child: the tracer is off and its worker holds no task of the parent's
            ok = not t.enabled and not t.worker._tasks and t.worker._tick_thread is None
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        rlt.shutdown()


def _tracer_with_a_stuck_write(tmp_path):
    """A tracer flushing every 10 ms whose spool writes hang (up to 30 s) until ``release`` is set;
    ``writing`` is set as one starts. Returns (tracer, writing, release)."""
    import threading

    t = Tracer(job_id="j", attempt=0, rank=0, world_size=1, spool_dir=str(tmp_path), flush_interval_s=0.01)
    writing, release = threading.Event(), threading.Event()
    real_write = t._writer.write

    def stuck_write(table, rows):
        writing.set()
        release.wait(30)
        return real_write(table, rows)

    t._writer.write = stuck_write
    return t, writing, release


def test_one_worker_and_a_stuck_disk_never_stalls_the_watcher(tmp_path):
    """The tracer's flush, watcher (and ring reader, CUDA timer) share one worker; the flush is a
    queued job, so a spool write that hangs does not keep the 1 ms watcher from completing works,
    and shutdown stays bounded."""
    import threading

    t, writing, release = _tracer_with_a_stuck_write(tmp_path)
    try:
        assert writing.wait(10)  # a flush is stuck in the disk write

        class Work:
            done = False

            def is_completed(self):
                return self.done

        w = Work()
        t.watch(w, t.collective_entered("p2p", 1, "isend", 4, "f32", 1, True))
        w.done = True
        wait_until(
            lambda: not t._inflight, 10, "the watcher to complete the work while the flush is stuck", interval_s=0.001
        )
        names = {th.name for th in threading.enumerate()}
        assert "ranklens-flush" not in names and "ranklens-watch" not in names
        assert {"ranklens-trace-tick", "ranklens-trace-jobs"} <= names
        t0 = time.monotonic()
        t.shutdown(timeout_s=0.5)
        assert time.monotonic() - t0 < 3.0
    finally:
        release.set()


def test_cuda_timer_polls_on_the_worker_and_a_hung_calibration_is_bounded():
    """The CUDA event poller is a task on the shared worker (idle while nothing is pending); a
    calibration event that never completes (a hung device) gives up after calibrate_timeout_s
    instead of blocking the worker's tick, which the 1 ms watcher and the ring reader share."""
    import threading

    from ranklens._worker import Worker
    from ranklens.tracing.timing import CalibrationTimeout, CudaEventTimer
    from tests.tracing.test_cuda_timing import FakeCuda, FakeDevice

    dev = FakeDevice(host_offset_ns=0)
    worker = Worker("cuda-test")
    done = threading.Event()
    got = []
    timer = CudaEventTimer(
        FakeCuda(dev),
        lambda row, a, b, err: (got.append((row["seq"], a, b)), done.set()),
        worker=worker,
        clock=dev.host_ns,
    )
    try:
        dev.queue_ms = 5.0
        start = timer.begin()
        dev.queue_ms = 7.0
        timer.end(start, {"seq": 1})
        dev.now_ms = 8.0  # the device ran both events: the worker's task resolves them
        assert done.wait(10)
        assert got == [(1, 5_000_000, 7_000_000)]
        # a device that never reaches the calibration event: the poll on the worker's tick gives up
        # (counted) and the tick goes on (event.synchronize() there would hold it forever)
        stuck = FakeCuda(dev)
        stuck.Event.query = lambda self: False
        hung = CudaEventTimer(stuck, lambda *a: None, worker=worker, clock=dev.host_ns, calibrate_timeout_s=0.05)
        hung.end(hung.begin(), {"seq": 2})
        # it timed out, returned, and was tried again
        wait_until(lambda: hung.poll_errors >= 2, 10, "a second timed-out poll of the stuck event", interval_s=0.005)
        ticked = threading.Event()
        worker.every(0.001, ticked.set, name="watch")
        assert ticked.wait(10)
        hung.close(0.0)
        with pytest.raises(CalibrationTimeout):
            hung.calibrate()
    finally:
        timer.close(1.0)
        assert worker.close(5.0).clean


def test_worker_overruns_reach_the_drops_table(tmp_path):
    """A flush that outlasts its period skips runs (the worker counts overruns); the count is
    spooled as a ``drops`` row like the tracer's own."""
    t, writing, release = _tracer_with_a_stuck_write(tmp_path)
    try:
        assert writing.wait(10)
        wait_until(
            lambda: t.worker.stats().overruns_by_name.get("flush", 0) >= 3,
            10,
            "three overruns of the stuck flush",
            interval_s=0.005,
        )
    finally:
        release.set()
    t.shutdown(timeout_s=10)
    rows = [r for r in _segments(tmp_path, "drops") if r["what"] == "worker:flush_overruns"]
    assert rows and sum(r["count"] for r in rows) >= 3


def test_heartbeats_keep_flowing_while_a_data_write_is_stuck(tmp_path):
    """Issue 18: heartbeats have their own lane and writer. While a data flush hangs in the disk
    write, heartbeats still reach the spool and say what the rank is doing now (a collective
    entered after the flush got stuck), and the shutdown's last heartbeat (``exited``) is
    written within the shutdown's bound although the final data flush cannot run."""
    t, writing, release = _tracer_with_a_stuck_write(tmp_path)
    try:
        assert writing.wait(10)  # a data flush is stuck in the disk write
        t.collective_entered("0", 5, "all_reduce", 64, "float32", -1, False)

        def beat_names_it() -> bool:
            return any(5 in hb["pending_seqs"] for hb in _segments(tmp_path, "heartbeats"))

        wait_until(beat_names_it, 10, "a heartbeat naming seq 5 while the data write is stuck", interval_s=0.01)
        assert not release.is_set() and not _segments(tmp_path, "steps") and not _segments(tmp_path, "ranks")
        t0 = time.monotonic()
        t.shutdown(timeout_s=1.0)
        assert time.monotonic() - t0 < 5.0
        last = _segments(tmp_path, "heartbeats")[-1]
        assert last["exited"] == 1 and last["pending_seqs"] == [5]
        assert not _segments(tmp_path, "ranks")  # the data lane is still stuck: its rows are not in yet
    finally:
        release.set()


def test_a_failing_heartbeat_write_is_counted_and_never_raises(tmp_path):
    import errno

    t = _tracer(tmp_path)

    def full(table, rows):
        raise OSError(errno.ENOSPC, "No space left on device")

    t._hb_writer.write = full
    t.beat()  # logged and counted, not raised
    t.beat()
    assert t._drops["heartbeats:spool_write_failed"] == 2
    t.flush()  # the data lane reports the heartbeat lane's losses
    drops = [d for d in _segments(tmp_path, "drops") if d["what"] == "heartbeats:spool_write_failed"]
    assert sum(d["count"] for d in drops) == 2
    t.shutdown()
