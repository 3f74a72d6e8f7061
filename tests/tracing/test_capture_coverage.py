"""Every collective is in the arrival ledger, whatever API issued it (issue 21 #0).

The real-job tests run an unmodified 4-rank gloo script (``tests/jobs_capture.py``: FSDP2, DTensor
tensor parallel, DDP's native reducer, batch_isend_irecv, object and coalesced collectives) under
``ranklens run`` and compare the ledger with torch's own flight-recorder ring, which the script
dumps at its end. The unit tests drive the ledger's join of ring entries and wrapper claims with a
ring of known content.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from ranklens.store import open_store
from ranklens.tracing._fr_ring import new_entries, ring_capacity
from ranklens.tracing._ledger import Ledger
from ranklens.tracing.tracer import Tracer
from tests.tracing._fakes import FakeClock

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
WORLD = 4


def _run(tmp: Path, job: str, **env_extra: str) -> tuple[object, dict[int, list[dict]]]:
    """Run tests/jobs_capture.py ``all`` under ``ranklens run``; the store and each rank's ring."""
    fr = tmp / "fr"
    fr.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CAPTURE_FR_DIR": str(fr), **env_extra}
    env.pop("RANKLENS_JOB_ID", None)
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", str(WORLD), str(ROOT / "tests/jobs_capture.py"), "all"]
    run = [sys.executable, "-m", "ranklens.cli", "run", "--store", f"embedded://{tmp}/store"]
    proc = subprocess.run(
        [*run, "--spool", str(tmp / "spool"), "--job-id", job, "--", *cmd],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rings = {r: json.loads((fr / f"rank{r}.json").read_bytes())["entries"] for r in range(WORLD)}
    return open_store(f"embedded://{tmp}/store"), rings


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    store, rings = _run(tmp_path_factory.mktemp("capture"), "capture")
    rows = store.query(
        "SELECT rank, pg, seq, op, nbytes, step, enter_ns, end_ns, async_op FROM collectives WHERE job_id = 'capture'"
    ).to_pylist()
    groups = {
        pg: sorted(r)
        for pg, r in store.query(
            "SELECT pg, any(ranks) FROM process_groups WHERE job_id = 'capture' GROUP BY pg"
        ).rows()
    }
    return rows, rings, groups, store


def _collectives(rows):
    return [r for r in rows if "/p2p:" not in r["pg"]]


@pytest.mark.e2e
def test_every_ring_entry_is_in_the_ledger_once_per_rank(job):
    rows, rings, _groups, _store = job
    for rank in range(WORLD):
        ring = Counter((e["process_group"][0], e["collective_seq_id"]) for e in rings[rank] if not e["is_p2p"])
        mine = Counter((r["pg"], r["seq"]) for r in _collectives(rows) if r["rank"] == rank)
        assert max(mine.values()) == 1, [k for k, n in mine.items() if n > 1][:5]  # no duplicates
        assert mine == ring, (sorted(set(ring) - set(mine))[:10], sorted(set(mine) - set(ring))[:10])
    # the ring held the whole job (else the comparison would be partial)
    assert all(e[0]["record_id"] == 0 for e in rings.values())


@pytest.mark.e2e
def test_each_collective_has_the_same_pg_seq_op_and_size_on_every_member(job):
    rows, _rings, groups, _store = job
    by_key = defaultdict(list)
    for r in _collectives(rows):
        by_key[(r["pg"], r["seq"])].append(r)
    assert by_key
    for (pg, seq), rs in by_key.items():
        assert sorted(r["rank"] for r in rs) == groups[pg], (pg, seq)
        assert len({r["op"] for r in rs}) == 1 and len({r["nbytes"] for r in rs}) == 1, (pg, seq, rs)
    # the ring-only groups were registered too (DeviceMesh's, FSDP2's default group, evens)
    assert set(groups) >= {pg for pg, _ in by_key}


@pytest.mark.e2e
def test_fsdp2_tensor_parallel_ddp_and_functional_collectives_are_all_there(job):
    rows, _rings, _groups, _store = job
    ops = Counter(r["op"] for r in _collectives(rows) if r["rank"] == 0)
    # FSDP2: 3 sharded Linear layers + root, 3 steps: unshard forward and backward, reduce-scatter grads
    assert ops["all_gather_single"] >= 2 * 3 * 3 and ops["reduce_scatter_single"] >= 3 * 3, ops
    # DTensor: distribute_tensor scatters the shards (Colwise: weight and bias, Rowwise: weight);
    # RowwiseParallel all-reduces its output (functional collectives: no torch.distributed function
    # is called, only the ring sees them)
    assert ops["scatter"] == 3, ops
    ring_only = [r for r in _collectives(rows) if r["rank"] == 0 and r["end_ns"] == 0]
    # TP's 3 forward all-reduces, the C++-hooked DDP model's buckets (>= 1 a step, 3 steps), funcol's
    assert Counter(r["op"] for r in ring_only)["all_reduce"] >= 3 + 3 + 2, ring_only
    # the DDP model with ranklens' hook: its buckets are wrapped calls, numbered by the ring, with
    # their completion time
    hooked = [r for r in _collectives(rows) if r["rank"] == 0 and r["op"] == "all_reduce" and r["async_op"]]
    assert len(hooked) >= 3 and all(r["end_ns"] > r["enter_ns"] for r in hooked), hooked
    # those rows carry the step the rank was in (inferred from the optimizer) when torch created them
    assert {r["step"] for r in ring_only} - {-1}, ring_only


@pytest.mark.e2e
def test_p2p_object_and_coalesced_ops(job):
    rows, _rings, _groups, store = job
    p2p = [r for r in rows if "/p2p:" in r["pg"]]
    pairs = defaultdict(list)
    for r in p2p:
        pairs[(r["pg"], r["seq"])].append((r["rank"], r["op"]))
    # batch_isend_irecv around the ring, twice: 4 directions x 2, a sender and a receiver each
    assert len(pairs) == WORLD * 2
    for (pg, _seq), who in pairs.items():
        src, dst = (int(x) for x in pg.rsplit(":", 1)[1].split("->"))
        assert sorted(who) == sorted([(src, "isend"), (dst, "irecv")]), (pg, who)
    ops = Counter(r["op"] for r in _collectives(rows) if r["rank"] == 1)
    assert ops["all_gather"] >= 2 + 1  # all_gather_object (sizes, then payloads) + funcol all_gather
    assert ops["broadcast"] >= 2  # broadcast_object_list (sizes, then payloads)
    assert ops["all_reduce_coalesced"] == 1
    # the two all_reduces inside _coalescing_manager are one coalesced collective in torch: one row,
    # the wrappers' two calls counted as explained by it
    drops = store.query(
        "SELECT rank, sum(count) FROM drops WHERE job_id = 'capture' "
        "AND what = 'collectives:wrapped_call_without_own_entry' GROUP BY rank"
    ).rows()
    assert sorted(drops) == [(r, 2) for r in range(WORLD)]


@pytest.mark.e2e
def test_without_the_ring_functional_and_ddp_collectives_are_missed(tmp_path):
    """The wrappers alone (the capture before this change) miss what no torch.distributed function
    issues: the same job with the ring off has fewer rows than torch's own record of it."""
    store, rings = _run(tmp_path, "no-ring", RANKLENS_DDP="0", RANKLENS_FR_LEDGER="0")
    n = store.query(
        "SELECT count() FROM collectives WHERE job_id = 'no-ring' AND rank = 0 AND position(pg, '/p2p:') = 0"
    ).scalar()
    ring = sum(1 for e in rings[0] if not e["is_p2p"])
    assert n < ring, (n, ring)


# -- the join, with a ring of known content -----------------------------------------------------


class FakeRing:
    def __init__(self) -> None:
        self.entries: list[dict] = []
        self.last_ids = [-1]
        self.last_data = [b""]

    def add(self, pg: str, seq: int, created: int, op: str = "gloo:all_reduce", retired: bool = True) -> None:
        self.entries.append(
            {
                "collective_seq_id": seq,
                "input_dtypes": ["Float"],
                "input_sizes": [[4]],
                "is_p2p": False,
                "op_id": seq,
                "process_group": [pg, ""],
                "profiling_name": op,
                "record_id": len(self.entries),
                "retired": retired,
                "time_created_ns": created,
                "time_discovered_completed_ns": 0,
            }
        )

    def dump(self) -> bytes:
        # torch's layout: nlohmann's compact dump, keys sorted
        doc = {"comm_lib_version": "", "entries": self.entries, "nccl_comm_state": {}}
        return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()

    def status(self) -> tuple[int, bool]:
        return len(self.entries), any(not e["retired"] for e in self.entries)

    def read(self):
        data = self.dump()
        self.last_data[0] = data
        got, lost = new_entries(data, self.last_ids[0])
        for e in got:
            e["_ring"] = 0
        if got:
            self.last_ids[0] = got[-1]["record_id"]
        return got, lost


def _ledger(tmp_path):
    clock = FakeClock()
    t = Tracer(job_id="j", attempt=0, rank=0, world_size=2, spool_dir=str(tmp_path), flush_interval_s=60, clock=clock)
    ring = FakeRing()
    t.ledger = Ledger(t, ring, capacity=8, max_delay_s=0)
    t._pg_names[0] = ("0", None)  # a known group: no registration
    t.ledger._known_pgs.add("0")
    return t, ring, clock


def _rows(t):
    return [r for table, r in t._buf if table == "collectives"]


def test_a_wrapped_call_takes_the_ring_seq_and_keeps_its_completion(tmp_path):
    t, ring, clock = _ledger(tmp_path)
    c = t.ledger.entered("0", "all_reduce", 16, "float32", False)
    ring.add("0", 7, clock())  # torch records it during the call
    c.t1 = clock()
    t.collective_completed(c.row)  # completes before the reader numbered it: held
    assert _rows(t) == []
    t.ledger.poll(clock())
    (row,) = _rows(t)
    assert (row["seq"], row["op"], row["nbytes"]) == (7, "all_reduce", 16) and row["end_ns"] > row["enter_ns"]
    assert t._completed["0"] == 7


def test_numbered_before_completion_then_written_once(tmp_path):
    t, ring, clock = _ledger(tmp_path)
    c = t.ledger.entered("0", "all_reduce", 16, "float32", True)
    ring.add("0", 1, clock())
    c.t1 = clock()
    t.ledger.poll(clock())
    assert _rows(t) == [] and ("0", 1) in t._inflight  # in flight, numbered: heartbeats name it
    t.collective_completed(c.row)
    assert [r["seq"] for r in _rows(t)] == [1] and ("0", 1) not in t._inflight


def test_a_row_finishing_after_a_held_claim_waits_for_it(tmp_path):
    # A live pass takes a rank's stored ledger as complete up to its newest arrival: a later
    # collective written before an earlier one that waits for the ring made a healthy rank's waits
    # look like compute (a CI run of the network drill named a healthy rank a straggler).
    t, ring, clock = _ledger(tmp_path)
    t.ledger.max_delay_ns = 60 * 10**9  # no periodic read in this test
    t._pg_names[1] = ("1", None)
    t.ledger._known_pgs.add("1")
    slow = t.ledger.entered("1", "all_reduce", 16, "float32", True)  # in flight across a read
    ring.add("1", 1, clock())
    slow.t1 = clock()
    t.ledger.poll(clock(), force=True)  # numbered: written when it completes
    early = t.ledger.entered("0", "all_reduce", 16, "float32", False)
    ring.add("0", 1, clock())
    early.t1 = clock()
    t.collective_completed(early.row)  # finished, not numbered yet: held
    t.collective_completed(slow.row)  # finished after it, numbered: waits behind it
    assert _rows(t) == []
    assert ("1", 1) not in t._inflight and t._completed == {"1": 1}  # heartbeats see its progress now
    t.ledger.poll(clock(), force=True)
    assert [(r["pg"], r["seq"]) for r in _rows(t)] == [("0", 1), ("1", 1)]
    assert not t._inflight and t._completed == {"0": 1, "1": 1}
    # nothing held: a numbered row is written at once
    c = t.ledger.entered("1", "all_reduce", 16, "float32", True)
    ring.add("1", 2, clock())
    c.t1 = clock()
    t.ledger.poll(clock(), force=True)
    t.collective_completed(c.row)
    assert [(r["pg"], r["seq"]) for r in _rows(t)][-1] == ("1", 2)


def test_a_failing_ring_read_keeps_no_finished_row_back(tmp_path):
    t, ring, clock = _ledger(tmp_path)
    t._pg_names[1] = ("1", None)
    t.ledger._known_pgs.add("1")
    held = t.ledger.entered("0", "all_reduce", 16, "float32", False)
    held.t1 = clock()
    t.collective_completed(held.row)  # held: its entry never comes
    other = {**t._ident, "pg": "9", "seq": 5, "op": "all_reduce", "nbytes": 4, "dtype": "float32", "peer": -1}
    other.update(step=0, enter_ns=clock(), async_op=0)
    t.collective_completed(other)  # a group the ring does not cover, finishing behind the held claim
    assert _rows(t) == []

    def broken():
        raise OSError("ring unreadable")

    ring.read = broken
    t.ledger.poll(clock(), force=True)
    assert [(r["pg"], r["seq"]) for r in _rows(t)] == [("9", 5)]


def test_ring_only_entries_get_the_step_of_their_creation_time(tmp_path):
    t, ring, clock = _ledger(tmp_path)
    t._step = 4
    ring.add("0", 1, clock(), op="gloo:all_gather")  # e.g. DDP's reducer or a functional collective
    t._step = 5
    ring.add("0", 2, clock())
    t.ledger.poll(clock())
    got = [(r["seq"], r["op"], r["step"], r["end_ns"]) for r in _rows(t)]
    assert got == [(1, "all_gather", 4, 0), (2, "all_reduce", 5, 0)]  # gloo's ring: no end time


def test_calls_coalesced_into_one_entry_are_one_row(tmp_path):
    t, ring, clock = _ledger(tmp_path)
    calls = []
    for _ in range(2):  # two wrapped calls inside _coalescing_manager: torch issues nothing yet
        c = t.ledger.entered("0", "all_reduce", 16, "float32", False)
        c.t1 = clock()
        t.collective_completed(c.row)
        calls.append(c)
    ring.add("0", 1, clock())  # the manager's exit: one coalesced collective
    t.ledger.poll(clock())
    assert [r["seq"] for r in _rows(t)] == [1]
    assert t._drops["collectives:wrapped_call_without_own_entry"] == 2


def test_wrapped_calls_whose_entries_were_overwritten_keep_their_seqs(tmp_path):
    t, ring, clock = _ledger(tmp_path)
    for seq in (1, 2, 3):
        c = t.ledger.entered("0", "all_reduce", 16, "float32", False)
        ring.add("0", seq, clock())
        c.t1 = clock()
        t.collective_completed(c.row)
    del ring.entries[:2]  # the ring wrapped before the reader came: entries 1 and 2 are gone
    t.ledger.poll(clock())
    assert sorted(r["seq"] for r in _rows(t)) == [1, 2, 3]
    assert t.ledger.recovered == 2 and not t._drops  # nothing lost, nothing counted as lost


def test_overwritten_entries_no_wrapper_saw_are_counted_as_lost(tmp_path):
    t, ring, clock = _ledger(tmp_path)
    for seq in (1, 2, 3):
        ring.add("0", seq, clock())  # e.g. DDP's reducer: no wrapped call
    del ring.entries[:2]
    t.ledger.poll(clock())
    assert [r["seq"] for r in _rows(t)] == [3]
    assert t._drops["collectives:fr_ring_overwritten"] == 2


def test_a_collective_in_flight_is_read_soon_though_the_ring_is_quiet(tmp_path):
    t, ring, _clock = _ledger(tmp_path)
    t.ledger.max_delay_ns = 60 * 10**9  # no periodic read in this test
    t.ledger.poll(10**9)  # a first read: nothing
    ring.add("0", 1, 10**9 + 1, retired=False)  # e.g. DDP's reducer, stuck: no wrapper saw it
    t.ledger.poll(10**9 + 10**8)
    assert not t._inflight  # 0.1 s: not yet
    t.ledger.poll(10**9 + 7 * 10**8)
    assert ("0", 1) in t._inflight  # 0.6 s in flight: read, heartbeats show it


def test_an_in_flight_ring_entry_is_written_when_it_retires(tmp_path):
    t, ring, clock = _ledger(tmp_path)
    ring.add("0", 1, clock(), retired=False)
    t.ledger.poll(clock())
    assert _rows(t) == [] and ("0", 1) in t._inflight
    ring.entries[0]["retired"] = True
    ring.add("0", 2, clock())
    t.ledger.poll(clock())
    assert sorted(r["seq"] for r in _rows(t)) == [1, 2] and not t._inflight


def test_overwritten_entries_are_counted_and_parsing_only_the_new_part_is_exact():
    ring = FakeRing()
    for i in range(10):
        ring.add("0", i + 1, 100 + i)
    data = ring.dump()
    got, lost = new_entries(data, 3)
    assert [e["record_id"] for e in got] == list(range(4, 10)) and lost == 0
    assert got == json.loads(data)["entries"][4:]
    del ring.entries[:6]  # the ring wrapped: ids 0..5 are gone
    got, lost = new_entries(ring.dump(), 2)
    assert [e["record_id"] for e in got] == [6, 7, 8, 9] and lost == 3
    assert new_entries(ring.dump(), 9) == ([], 0)
    # another layout (spaces, other key order): the whole dump is parsed, same answer
    spaced = json.dumps({"entries": ring.entries}).encode()
    assert new_entries(spaced, 7) == (ring.entries[-2:], 0)


def test_ring_capacity_follows_torch_variables():
    assert ring_capacity({}) == 2000
    assert ring_capacity({"TORCH_FR_BUFFER_SIZE": "0"}) == 0
    assert ring_capacity({"TORCH_NCCL_TRACE_BUFFER_SIZE": "500"}) == 500
    assert ring_capacity({"TORCH_FR_BUFFER_SIZE": "64", "TORCH_NCCL_TRACE_BUFFER_SIZE": "500"}) == 64


def test_a_ring_read_that_keeps_failing_warns_once_then_counts(tmp_path, caplog):
    # issue 22, defect 8: a traceback on every failed read (20 a second) would flood training's stderr
    t, ring, clock = _ledger(tmp_path)

    def broken():
        raise RuntimeError("ring went away")

    ring.read = broken
    ring.status = lambda: (1, True)
    with caplog.at_level("WARNING", logger="ranklens.tracing"):
        for _ in range(200):
            t.ledger.poll(clock())
        t.ledger.poll(clock(), force=True)
    lines = [r for r in caplog.records if "flight-recorder ring" in r.getMessage()]
    assert t._drops["collectives:fr_read_error"] >= 200
    assert 1 <= len(lines) <= 2, [r.getMessage() for r in lines]
    assert sum(r.exc_info is not None for r in lines) == 1


_REINIT_JOB = """
import sys, torch, torch.distributed as dist
import ranklens.tracing as rlt
spool, pg = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{pg}", rank=0, world_size=1)
x = torch.ones(1 << 10)
dist.all_reduce(x)  # before the first init: the first job's (DDP's parameter broadcast is such a call)
rlt.init(job_id="first", spool_dir=spool, flush_interval_s=0.1)
for _ in range(3):
    dist.all_reduce(x)
rlt.shutdown()
dist.all_reduce(x)  # untraced, between the two jobs
dist.barrier()
rlt.init(job_id="second", spool_dir=spool, flush_interval_s=0.1)
for _ in range(2):
    dist.all_reduce(x)
rlt.shutdown()
dist.destroy_process_group()
"""


@pytest.mark.e2e
def test_a_tracer_started_again_in_the_same_process_takes_none_of_the_previous_jobs_collectives(tmp_path):
    # torch's ring is process-wide and outlives a tracer: a second init's reader used to read it from
    # its start, and the first job's collectives landed in the second job's ledger (with no end time)
    from ranklens.collector import Shipper

    proc = subprocess.run(
        [sys.executable, "-c", _REINIT_JOB, str(tmp_path / "spool"), str(tmp_path / "pg")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    store = open_store(f"embedded://{tmp_path}/store")
    Shipper(tmp_path / "spool", store).ship_once()
    rows = store.query("SELECT job_id, seq, op FROM collectives WHERE op != 'barrier' ORDER BY job_id, seq").rows()
    by_job = defaultdict(list)
    for job, seq, op in rows:
        by_job[job].append((int(seq), op))
    all_reduce = "all_reduce"
    assert by_job["first"] == [(s, all_reduce) for s in (1, 2, 3, 4)], rows
    assert by_job["second"] == [(s, all_reduce) for s in (7, 8)], rows
    # the second job's calls got their own seqs: none counted as lost or left without an entry
    drops = store.query("SELECT job_id, what, sum(count) FROM drops GROUP BY job_id, what").rows()
    assert [d for d in drops if str(d[1]).startswith("collectives:")] == [], drops
