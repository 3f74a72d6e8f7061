"""ranklens on a real ClickHouse cluster: ZooKeeper + 2 shards x 2 replicas of Debian's 18.16
(``cluster`` fixture, tests/conftest.py), the generated cluster DDL (``ON CLUSTER``), rows written
through the server store and the collector's shipper into the Distributed tables, read back on every
replica's local table:

* a replica killed (SIGKILL) while the shipper ships, then restarted: every row once on every replica;
* a whole shard stopped: the shipper keeps the segments, reports the store down, catches up;
* a batch stored in part (a shard died mid-insert, after the other shard took its rows): the shipper
  finds it in doubt, discards the part and sends it again: every row once (this lost the shard's
  rows while the inserts let the replicated tables deduplicate, see docs/cluster.md);
* part of a batch on a replica that is dead (its peer never fetched it): the discard neither fails
  (the dead one was the shard's first replica) nor waits for the replica to come back (the
  mutation does), the shipper sends the batch again at once: every row once when it is back;
* `ranklens analyze` through the Distributed tables finds what it finds on one server.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ranklens.collector.journal import Journal
from ranklens.collector.settle import ingest_id_of, stamp
from ranklens.collector.shipper import JOURNAL, Shipper
from ranklens.errors import StoreUnavailable
from ranklens.formats.spool import SpoolWriter
from ranklens.schema import table
from ranklens.store import open_store
from tests._sync import wait_until
from tests.conftest import CLUSTER_DB

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
SETTLE_S = 120.0  # readiness deadline (replication after a restart, a loaded machine); not a measurement
INSERT = {"insert_distributed_sync": 1, "insert_deduplicate": 0}  # what ServerStore.write_many sends


def _client(cluster: Any, node: int) -> Any:
    from clickhouse_driver import Client

    return Client("127.0.0.1", port=cluster.tcp(node), database=CLUSTER_DB, send_receive_timeout=60)


def _local_keys(cluster: Any, node: int, job: str) -> collections.Counter:
    """(rank, seq) -> rows in node's local collectives table for ``job`` (that replica's own copy)."""
    c = _client(cluster, node)
    try:
        rows = c.execute(f"SELECT rank, seq, count() FROM collectives_local WHERE job_id = '{job}' GROUP BY rank, seq")
    finally:
        c.disconnect()
    return collections.Counter({(r, s): n for r, s, n in rows})


def _assert_once_on_every_replica(cluster: Any, job: str, expected: set[tuple[int, int]]) -> None:
    """Every (rank, seq) of ``expected`` exactly once in the cluster: on both replicas of one shard,
    and on no other shard. Waits (readiness) for the replicas to agree first."""

    def agreed() -> dict[int, collections.Counter] | None:
        got = {n: _local_keys(cluster, n, job) for n in (1, 2, 3, 4)}
        same = got[1] == got[2] and got[3] == got[4]
        return got if same and sum(got[1].values()) + sum(got[3].values()) >= len(expected) else None

    last: dict[str, Any] = {}

    def probe() -> dict[int, collections.Counter] | None:
        last["got"] = {n: sum(_local_keys(cluster, n, job).values()) for n in (1, 2, 3, 4)}
        return agreed()

    got = wait_until(
        probe,
        SETTLE_S,
        f"the replicas to agree on {len(expected)} rows",
        interval_s=0.5,
        detail=lambda: f"rows per node: {last.get('got')}",
    )
    shard1, shard2 = got[1], got[3]
    twice = {k: n for k, n in (shard1 + shard2).items() if n > 1}
    assert not twice, f"{len(twice)} row(s) stored more than once, e.g. {sorted(twice.items())[:5]}"
    assert not set(shard1) & set(shard2)
    assert set(shard1) | set(shard2) == expected
    assert shard1 and shard2, "every row on one shard: the shard key does not spread this job"


class Writer:
    """Rank spools being written while the shipper runs: segments of ``collectives`` rows, one
    ``seq`` per row; every ``mixed``-th segment has rows of every rank (it spans both shards)."""

    def __init__(self, spool: Path, job: str, *, ranks: int = 16, rows: int = 50, mixed: int = 4) -> None:
        self.job, self.ranks, self.k, self.mixed = job, ranks, rows, mixed
        self.writers = [SpoolWriter.for_rank(spool, job, 0, r) for r in range(ranks)]
        self.keys: set[tuple[int, int]] = set()
        self.segments = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def segment(self) -> None:
        i = self.segments
        rank0 = i % self.ranks
        rows = []
        for j in range(self.k):
            rank = (rank0 + j) % self.ranks if i % self.mixed == 0 else rank0
            seq = i * self.k + j
            rows.append({"job_id": self.job, "rank": rank, "pg": "0", "seq": seq, "op": "all_reduce", "enter_ns": seq})
            self.keys.add((rank, seq))
        self.writers[rank0].write("collectives", rows)
        self.segments += 1

    def start(self, interval_s: float = 0.02) -> None:
        def loop() -> None:
            while not self._stop.is_set():
                self.segment()
                time.sleep(interval_s)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)


def _stored(store: Any, job: str) -> int:
    return int(store.query(f"SELECT count() FROM collectives WHERE job_id = '{job}'").scalar())


def _stored_now(store: Any, job: str) -> int | None:
    """The count, or None while the cluster cannot answer (a replica was just killed: the store says
    it is unavailable, and it is asked again)."""
    try:
        return _stored(store, job)
    except StoreUnavailable:
        return None


def _drain(sh: Shipper) -> None:
    """Ship until the spool is empty (passes that fail while the cluster recovers are retried)."""
    wait_until(
        lambda: sh.ship_once().ok and not sh.pending(), SETTLE_S, "the shipper to drain its spool", interval_s=0.2
    )


@pytest.fixture
def store(cluster):
    s = open_store(cluster.url(CLUSTER_DB))
    yield s
    s.close()


def test_schema_on_every_node_and_rows_on_one_shard_each_replica(cluster, store):
    job = "c-schema"
    for n in (1, 2, 3, 4):
        c = _client(cluster, n)
        engines = dict(c.execute(f"SELECT name, engine FROM system.tables WHERE database = '{CLUSTER_DB}'"))
        macros = dict(c.execute("SELECT macro, substitution FROM system.macros"))
        c.disconnect()
        assert engines["collectives"] == "Distributed" and engines["collectives_local"] == "ReplicatedMergeTree"
        assert engines["findings_local"] == "ReplicatedReplacingMergeTree"
        assert macros == {"shard": f"0{cluster.shard_of(n)}", "replica": f"r{2 - n % 2}"}
    rows = [
        {"job_id": job, "rank": r, "pg": "0", "seq": s, "op": "all_reduce", "enter_ns": s}
        for r in range(8)
        for s in range(25)
    ]
    assert store.write("collectives", rows) == 200
    _assert_once_on_every_replica(cluster, job, {(r["rank"], r["seq"]) for r in rows})


def test_replica_killed_mid_ingest_every_row_once_on_every_replica(cluster, store, tmp_path):
    job = "c-kill"
    w = Writer(tmp_path / "spool", job)
    sh = Shipper(tmp_path / "spool", store, host="node-c", budget=None)
    w.start()
    loop = sh.start(interval_s=0.05)
    try:
        wait_until(lambda: _stored(store, job) >= 1500, SETTLE_S, "the first rows through the cluster")
        cluster.kill_node(4)  # shard 2's second replica, while batches are going to it
        before = wait_until(lambda: _stored_now(store, job), SETTLE_S, "a count with a replica dead")
        wait_until(
            lambda: (_stored_now(store, job) or 0) >= before + 1500, SETTLE_S, "rows shipped with a replica dead"
        )
        cluster.start_node(4)
        after = wait_until(lambda: _stored_now(store, job), SETTLE_S, "a count after the restart")
        wait_until(lambda: (_stored_now(store, job) or 0) >= after + 500, SETTLE_S, "rows shipped after the restart")
    finally:
        w.stop()
        loop.close(60)
    _drain(sh)
    assert not (tmp_path / "spool" / "quarantine").exists()
    _assert_once_on_every_replica(cluster, job, w.keys)


def test_whole_shard_down_the_shipper_spools_and_catches_up(cluster, store, tmp_path):
    job = "c-shard"
    w = Writer(tmp_path / "spool", job, mixed=2)
    for _ in range(12):
        w.segment()
    sh = Shipper(tmp_path / "spool", store, host="node-c", budget=None)
    cluster.stop_node(3)
    cluster.stop_node(4)
    try:
        # the server is up, its cluster is not: the store is unavailable (retried later, never a
        # refusal that quarantines: a CI run's replica kill made a good segment one)
        with pytest.raises(StoreUnavailable, match="could not complete the query on its cluster"):
            _stored(store, job)
        r = sh.ship_once()
        assert not r.ok and r.segments == 0, r
        assert "could not complete the query on its cluster" in (r.error or ""), r.error
        assert sh.failures >= 1 and len(sh.pending()) == 12
        for _ in range(6):  # the ranks keep writing
            w.segment()
        assert not sh.ship_once().ok and len(sh.pending()) == 18
    finally:
        cluster.start_node(3)
        cluster.start_node(4)
    _drain(sh)
    assert sh.failures == 0
    assert not (tmp_path / "spool" / "quarantine").exists()
    _assert_once_on_every_replica(cluster, job, w.keys)


def test_batch_stored_in_part_is_discarded_and_sent_again(cluster, store, tmp_path):
    """A Distributed insert interrupted for real: its first block (the rows of shard 1) is stored on
    shard 1, then both replicas of shard 2 are killed before the second block. The segment is in
    the shipper's journal (the shipper was killed too); its next pass asks, finds part of it,
    discards that part on one replica per shard, sends the segment again: every row once."""
    job = "c-part"
    c1 = _client(cluster, 1)
    # which shard each row goes to: the Distributed table's own key (ranklens.schema), slot 0 = shard 1
    key = table("collectives").shard_key
    placed = c1.execute(
        f"SELECT rank, seq, {key} % 2 AS slot FROM (SELECT '{job}' AS job_id, '0' AS pg, "
        "toInt32(intDiv(number, 20)) AS rank, toInt64(number) AS seq FROM numbers(320)) ORDER BY slot, seq"
    )
    # the segment lists shard 1's rows first: the interrupted insert's first block is then exactly
    # the shard-1 share a whole resend gives shard 1 (the block a replicated table would deduplicate)
    rows = [{"job_id": job, "rank": r, "pg": "0", "seq": s, "op": "all_reduce", "enter_ns": s} for r, s, _ in placed]
    k = sum(1 for *_, slot in placed if slot == 0)
    assert 0 < k < len(rows)
    spool = tmp_path / "spool"
    seg = SpoolWriter.for_rank(spool, job, 0, 0).write("collectives", rows)
    assert seg is not None
    rel = seg.relative_to(spool).as_posix()
    iid = ingest_id_of(rel, seg.read_bytes())
    from ranklens.formats.rows import read_jsonl

    _name, data = read_jsonl(seg)
    cols = table("collectives").column_names
    data = stamp(data, iid)  # the rows exactly as the shipper sends them
    values = list(zip(*(data.column(c).to_pylist() for c in cols)))
    gate, failed = threading.Event(), []

    def gen() -> Any:
        for i, v in enumerate(values):
            if i == k:
                gate.wait(120)  # the second block waits until shard 2 is gone
            yield v

    # the client sends blocks of k rows; min_insert_block_size_rows=1: the server writes each as it
    # comes (by default it squashes small blocks into one, written at the end)
    def insert() -> None:
        try:
            c1.execute(
                f"INSERT INTO collectives ({', '.join(cols)}) VALUES",
                gen(),
                settings={**INSERT, "insert_block_size": k, "min_insert_block_size_rows": 1},
            )
        except Exception as e:  # the expected end: shard 2 is gone
            failed.append(e)

    t = threading.Thread(target=insert, daemon=True)
    t.start()
    try:
        wait_until(
            lambda: sum(_local_keys(cluster, 1, job).values()) + sum(_local_keys(cluster, 2, job).values()) >= k,
            SETTLE_S,
            "the first block on shard 1",
        )
        cluster.kill_node(3)
        cluster.kill_node(4)
        gate.set()
        t.join(120)
        assert failed, "the insert should have failed with shard 2 gone"
    finally:
        gate.set()
        c1.disconnect()
        cluster.start_node(3)
        cluster.start_node(4)
    # the shipper that sent it died before hearing back: the segment is in its journal, in doubt
    Journal(spool / JOURNAL, spool, host="node-c").write({rel})
    sh = Shipper(spool, store, host="node-c", budget=None)
    assert rel in sh.in_doubt
    wait_until(lambda: sh.ship_once().ok and not sh.pending(), SETTLE_S, "the segment settled and shipped")
    _assert_once_on_every_replica(cluster, job, {(r["rank"], r["seq"]) for r in rows})


@pytest.mark.parametrize("dead,peer", [(3, 4), (4, 3)], ids=["first-replica-dead", "second-replica-dead"])
def test_part_only_a_dead_replica_holds_does_not_stall_the_shipper(cluster, store, tmp_path, dead, peer):
    """The CI failure of stop 32: a replica of shard 2 died holding the only copy of its share of a
    batch (its peer had not fetched it yet). The shipper found the batch in part and discarded it;
    the mutation on the live replica cannot finish until the dead one is back (it waits for that
    part), and the discard waited for it: the shipper stalled until the replica returned. Here the
    peer's fetches are stopped so that it lacks the part for sure. With the first replica dead, the
    discard also has to run on the second (it ran on replica 1 only)."""
    job = f"c-dead{dead}"
    c1, cd, cp = _client(cluster, 1), _client(cluster, dead), _client(cluster, peer)
    key = table("collectives").shard_key
    placed = c1.execute(
        f"SELECT rank, seq, {key} % 2 AS slot FROM (SELECT '{job}' AS job_id, '0' AS pg, "
        "toInt32(intDiv(number, 20)) AS rank, toInt64(number) AS seq FROM numbers(200)) ORDER BY seq"
    )
    rows = [{"job_id": job, "rank": r, "pg": "0", "seq": s, "op": "all_reduce", "enter_ns": s} for r, s, _ in placed]
    spool = tmp_path / "spool"
    seg = SpoolWriter.for_rank(spool, job, 0, 0).write("collectives", rows)
    assert seg is not None
    rel = seg.relative_to(spool).as_posix()
    from ranklens.formats.rows import read_jsonl

    _name, data = read_jsonl(seg)
    cols = table("collectives").column_names
    data = stamp(data, ingest_id_of(rel, seg.read_bytes()))
    values = list(zip(*(data.column(c).to_pylist() for c in cols)))
    share = {slot: [v for v, (*_, s) in zip(values, placed) if s == slot] for slot in (0, 1)}
    assert share[0] and share[1]
    insert = f"INSERT INTO collectives_local ({', '.join(cols)}) VALUES"
    try:
        cp.execute("SYSTEM STOP FETCHES collectives_local")
        c1.execute(insert, share[0])  # shard 1's share, stored
        cd.execute(insert, share[1])  # shard 2's share: on the replica about to die, on no other
        cluster.kill_node(dead)
    finally:
        cp.execute("SYSTEM START FETCHES collectives_local")
        for c in (c1, cd, cp):
            c.disconnect()
    try:
        Journal(spool / JOURNAL, spool, host="node-c").write({rel})  # in doubt: the shipper died too
        sh = Shipper(spool, store, host="node-c", budget=None)
        t0 = time.monotonic()
        r = sh.ship_once()
        took = time.monotonic() - t0
        assert r.ok and r.partial == 1 and not sh.pending(), (r, sh.failures)
        # the discard's bound on waiting for the rows to go is 60 s; a pass that took that long waited
        # for the dead replica (and one that stalls does not return at all: the timeout fails it)
        assert took < 60, f"the pass took {took:.0f} s with shard 2's replica {dead} dead"
    finally:
        cluster.start_node(dead)
    _assert_once_on_every_replica(cluster, job, {(r["rank"], r["seq"]) for r in rows})


def _ranklens(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("RANKLENS_STORE", None)
    r = subprocess.run(
        [sys.executable, "-m", "ranklens.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )
    assert r.returncode == 0, f"ranklens {' '.join(args)} exited {r.returncode}: {r.stderr[-2000:]}"
    return r


def _findings(out: str) -> list[tuple]:
    got = []
    for item in json.loads(out)["findings"]:
        f = item.get("finding", item)
        got.append(
            (f["kind"], f.get("severity"), tuple(sorted(s["rank"] for s in f.get("suspects", []))), f.get("title"))
        )
    return sorted(got)


def test_analyze_through_the_distributed_tables_finds_what_one_server_finds(cluster, server_db_url, tmp_path):
    job = "c-analyze"
    out = tmp_path / "sim"
    _ranklens(
        "simulate",
        "--ranks",
        "64",
        "--steps",
        "30",
        "--pp",
        "2",
        "--tp",
        "4",
        "--fault",
        "slow_gpu:21:1.5@10",
        "--seed",
        "3",
        "--job",
        job,
        "--out",
        str(out),
    )
    files = sorted(str(p) for p in out.glob("*.parquet"))
    found = {}
    for name, url in (("cluster", cluster.url(CLUSTER_DB)), ("server", server_db_url)):
        _ranklens("ingest", "--store", url, *files)
        r = _ranklens("analyze", "--store", url, "--job", job, "--json", "--no-save")
        found[name] = _findings(r.stdout)
    assert found["cluster"], "the slowed rank should be found"
    assert any(21 in f[2] for f in found["cluster"]), found["cluster"]
    assert found["cluster"] == found["server"]


def test_the_rollup_on_the_cluster_is_filled_on_every_shard_and_blame_reads_it(cluster, store, monkeypatch):
    """The view on each shard's local ledger fills the shard's local rollup; through the Distributed
    rollup, blame gives what the raw ledger gives (a collective's members on one shard: its rollup
    rows there too), and both replicas of a shard hold its rows."""
    import numpy as np

    from ranklens.analyzers.blame import compute_blame
    from ranklens.simulate import simulate

    job = "c-rollup"
    simulate(store, ranks=32, steps=10, faults=["slow_gpu:9:1.5@3", "clock_skew:node0002:30"], job_id=job, seed=5)
    monkeypatch.setenv("RANKLENS_ROLLUPS", "1")  # the rollup wherever it serves (by default: once the raw is gone)
    rolled = compute_blame(store, job)
    monkeypatch.setenv("RANKLENS_ROLLUPS", "0")
    raw = compute_blame(store, job)
    assert "collective_arrivals" in rolled.sql and "collective_arrivals" not in raw.sql
    assert np.array_equal(rolled.last_count, raw.last_count)
    assert np.allclose(rolled.delay_s, raw.delay_s, rtol=1e-9, atol=1e-9)
    per_node = {}
    for n in (1, 2, 3, 4):
        c = _client(cluster, n)
        c.execute("SYSTEM SYNC REPLICA " + f"{CLUSTER_DB}.collective_arrivals_local")
        per_node[n] = c.execute(
            f"SELECT sum(n) FROM (SELECT countMerge(rows) AS n FROM {CLUSTER_DB}.collective_arrivals_local "
            f"WHERE job_id = '{job}' GROUP BY pg, seq, step, host)"
        )[0][0]
        c.disconnect()
    total = store.query(f"SELECT count() FROM collectives WHERE job_id = '{job}'").scalar()
    assert per_node[1] == per_node[2] and per_node[3] == per_node[4], per_node  # replicas alike
    assert per_node[1] > 0 and per_node[3] > 0 and per_node[1] + per_node[3] == total, (per_node, total)
