"""The shipper: spools into the store, nothing lost when the store fails or a segment is corrupt."""

from __future__ import annotations

import shutil

from ranklens.collector import Shipper
from ranklens.formats.spool import SpoolWriter
from ranklens.store.testing import DownStore, FlakyStore, SlowStore

ROW = {"job_id": "j", "attempt": 0, "rank": 0, "pg": "0", "seq": 1, "op": "all_reduce", "enter_ns": 5}


def test_ships_and_deletes_acknowledged_segments(tmp_path, store):
    w = SpoolWriter.for_rank(tmp_path / "spool", "j", 0, 0)
    w.write("collectives", [ROW, dict(ROW, seq=2)])
    w.write("steps", [{"job_id": "j", "rank": 0, "step": 0, "start_ns": 1, "end_ns": 2}])
    sh = Shipper(tmp_path / "spool", store)
    r = sh.ship_once()
    assert r.ok and r.segments == 2 and r.rows == {"collectives": 2, "steps": 1}
    assert sh.pending() == []
    assert store.query("SELECT count() FROM collectives").scalar() == 2
    assert sh.ship_once().segments == 0  # nothing twice


def test_corrupt_segment_is_quarantined_not_lost(tmp_path, embedded_store):
    w = SpoolWriter.for_rank(tmp_path / "spool", "j", 0, 0)
    good = w.write("collectives", [ROW])
    bad = w.write("collectives", [ROW])
    bad.write_text(bad.read_text()[:-8])  # truncated mid-record
    sh = Shipper(tmp_path / "spool", embedded_store)
    r = sh.ship_once()
    assert r.ok and r.segments == 1 and r.quarantined == 1
    assert not good.exists()
    q = list((tmp_path / "spool" / "quarantine").iterdir())
    assert any(p.suffix == ".jsonl" for p in q) and any(p.suffix == ".reason" for p in q)
    reason = next(p for p in q if p.suffix == ".reason").read_text()
    assert "line 2" in reason and "not valid JSON" in reason
    assert sh.ship_once().ok  # the drop count travels through the spool like every row
    assert embedded_store.query("SELECT sum(count) FROM drops WHERE what = 'spool_segment_quarantined'").scalar() == 1


def test_a_quarantine_cut_short_by_a_kill_is_still_counted_once(tmp_path, embedded_store, monkeypatch):
    # A soak run killed the collector (SIGKILL) between a segment's move into quarantine and its
    # drop row: the segment was aside, its count lost. The count is now owed by a marker made
    # before the move; the next pass pays it.
    w = SpoolWriter.for_rank(tmp_path / "spool", "j", 0, 0)
    bad = w.write("collectives", [ROW])
    bad.write_text(bad.read_text()[:-8])
    sh = Shipper(tmp_path / "spool", embedded_store)
    monkeypatch.setattr(sh, "_count_quarantined", lambda markers=None: None)  # "killed" before counting
    assert sh.ship_once().quarantined == 1
    q = tmp_path / "spool" / "quarantine"
    assert len(list(q.glob("*.tocount"))) == 1
    lost = w.write("collectives", [ROW])  # and a marker whose move never happened: the segment stays
    (q / (lost.name + ".tocount")).touch()
    again = Shipper(tmp_path / "spool", embedded_store)  # the restarted collector
    assert again.ship_once().ok and again.ship_once().ok
    assert not list(q.glob("*.tocount"))
    assert embedded_store.query("SELECT sum(count) FROM drops WHERE what = 'spool_segment_quarantined'").scalar() == 1
    assert embedded_store.query("SELECT count() FROM collectives").scalar() == 1  # the good one shipped
    assert again.ship_once().ok
    assert embedded_store.query("SELECT sum(count) FROM drops WHERE what = 'spool_segment_quarantined'").scalar() == 1


def test_store_failure_keeps_segments_for_retry(tmp_path, embedded_store):
    w = SpoolWriter.for_rank(tmp_path / "spool", "j", 0, 0)
    seg = w.write("collectives", [ROW])
    parts = embedded_store.root / "parts" / "collectives"
    shutil.move(parts, tmp_path / "moved")  # the store's disk "fails"
    sh = Shipper(tmp_path / "spool", embedded_store)
    r = sh.ship_once()
    assert not r.ok and "cannot write" in r.error and seg.exists()
    shutil.move(tmp_path / "moved", parts)  # it comes back
    assert sh.ship_once().ok and not seg.exists()
    assert embedded_store.query("SELECT count() FROM collectives").scalar() == 1


# --- exactly once: segments in doubt, partial batches, the journal, the disk budget -----------------


def _rows(n: int, start: int = 0) -> list[dict]:
    return [dict(ROW, seq=start + i) for i in range(n)]


def _seqs(store) -> list[int]:
    return sorted(int(s) for (s,) in store.query("SELECT seq FROM collectives").rows())


def _fail_after_write(inner):
    """The store takes the rows, then the connection drops before the answer (the ack is lost),
    until healed."""
    from ranklens.errors import StoreUnavailable

    return FlakyStore(
        inner,
        failures=None,
        ops={"write_many"},
        after=True,
        error=lambda: StoreUnavailable("connection reset after the block was sent"),
    )


def test_lost_acknowledgement_is_not_shipped_twice(tmp_path, store):
    SpoolWriter.for_rank(tmp_path / "spool", "j", 0, 0).write("collectives", _rows(5))
    flaky = _fail_after_write(store)
    sh = Shipper(tmp_path / "spool", flaky)
    assert not sh.ship_once().ok and len(sh.pending()) == 1 and sh.in_doubt
    flaky.heal()
    r = sh.ship_once()
    assert r.ok and r.already_stored == 1 and r.rows == {} and sh.pending() == []
    assert _seqs(store) == list(range(5))
    ids = store.query("SELECT DISTINCT ingest_id FROM collectives").rows()
    assert len(ids) == 1 and ids[0][0] != 0


def test_restart_after_a_crash_between_store_and_delete(tmp_path, store):
    spool = tmp_path / "spool"
    SpoolWriter.for_rank(spool, "j", 0, 0).write("collectives", _rows(3))
    flaky = _fail_after_write(store)
    Shipper(spool, flaky).ship_once()  # rows stored, segment kept, journal names it
    journal = spool / "_collector" / "state"
    assert list(journal.rglob("shipping.json"))
    SpoolWriter.for_rank(spool, "j", 0, 1).write("collectives", _rows(2, start=10))
    sh = Shipper(spool, store)  # "restarted": a new object reads the journal
    assert sh.in_doubt
    r = sh.ship_once()
    assert r.ok and r.already_stored == 1 and r.segments == 2 and r.rows == {"collectives": 2}
    assert _seqs(store) == [0, 1, 2, 10, 11]
    assert not sh.in_doubt and sh.ship_once().segments == 0


def test_partly_stored_segment_is_discarded_and_sent_again(tmp_path, store):
    from ranklens.collector.settle import ingest_id_of, stamp
    from ranklens.formats.rows import read_jsonl

    spool = tmp_path / "spool"
    seg = SpoolWriter.for_rank(spool, "j", 0, 0).write("collectives", _rows(6))
    rel = seg.relative_to(spool).as_posix()
    _, data = read_jsonl(seg)
    store.write("collectives", stamp(data.slice(0, 4), ingest_id_of(rel, seg.read_bytes())))  # a half block
    sh = Shipper(spool, store)
    sh.in_doubt.add(rel)
    r = sh.ship_once()
    assert r.ok and r.partial == 1 and r.rows == {"collectives": 6}
    assert _seqs(store) == list(range(6))


def test_segments_not_in_doubt_are_sent_without_asking(tmp_path, embedded_store):
    SpoolWriter.for_rank(tmp_path / "spool", "j", 0, 0).write("collectives", _rows(2))
    queries = []
    real = embedded_store.query
    embedded_store.query = lambda sql: queries.append(sql) or real(sql)
    try:
        assert Shipper(tmp_path / "spool", embedded_store).ship_once().ok
    finally:
        del embedded_store.query
    assert queries == []


def test_big_passes_are_split_at_segment_boundaries(tmp_path, embedded_store, monkeypatch):
    import ranklens.collector.settle as settle

    monkeypatch.setattr(settle, "MAX_BLOCK_ROWS", 5)
    w = SpoolWriter.for_rank(tmp_path / "spool", "j", 0, 0)
    for k in range(4):
        w.write("collectives", _rows(3, start=10 * k))
    calls = []
    real = embedded_store.write_many
    monkeypatch.setattr(
        embedded_store, "write_many", lambda b: calls.append({k: v.num_rows for k, v in b.items()}) or real(b)
    )
    assert Shipper(tmp_path / "spool", embedded_store).ship_once().ok
    assert calls == [{"collectives": 3}] * 4  # 3 + 3 > 5: never half a segment in a block
    assert len(_seqs(embedded_store)) == 12


def test_unreadable_journal_puts_every_segment_in_doubt(tmp_path, embedded_store):
    spool = tmp_path / "spool"
    SpoolWriter.for_rank(spool, "j", 0, 0).write("collectives", _rows(2))
    sh = Shipper(spool, embedded_store)
    sh.journal_path.parent.mkdir(parents=True)
    sh.journal_path.write_text("{not json")
    sh = Shipper(spool, embedded_store)
    assert len(sh.in_doubt) == 1
    assert sh.ship_once().ok and _seqs(embedded_store) == [0, 1]


def test_disk_budget_drops_oldest_low_value_data_first_and_counts_it(tmp_path, embedded_store):
    from ranklens.collector.shipper import SpoolBudget

    spool = tmp_path / "spool"
    w = SpoolWriter.for_rank(spool, "j", 0, 0)
    hb = {"job_id": "j", "rank": 0, "ts_ns": 1}
    old_hb = [w.write("heartbeats", [dict(hb, ts_ns=i) for i in range(50)]) for _ in range(3)]
    coll = [w.write("collectives", _rows(50, start=100 * k)) for k in range(3)]
    logs = w.write("log_events", [{"job_id": "j", "ts_ns": 1, "klass": "nccl_error", "message": "NCCL WARN x"}] * 50)
    sizes = {p: p.stat().st_size for p in [*old_hb, *coll, logs]}
    # over budget by more than one heartbeat segment, less than two, counting the budget's hysteresis
    # (it frees down to a tenth below the limit)
    limit = int((sum(sizes.values()) - sizes[old_hb[0]] - sizes[old_hb[1]] / 2) / 0.9)

    sh = Shipper(spool, DownStore(), budget=SpoolBudget(max_bytes=limit, min_free_bytes=0, check_interval_s=0))
    r = sh.ship_once()
    assert not r.ok
    # heartbeats go first (low value), oldest first; collectives and log events are kept
    assert r.evicted == {"heartbeats": 100}
    assert [p.exists() for p in old_hb] == [False, False, True]
    assert all(p.exists() for p in [*coll, logs])
    sh.store = embedded_store
    assert sh.ship_once().ok and sh.ship_once().ok
    assert embedded_store.query("SELECT count() FROM heartbeats").scalar() == 50
    assert embedded_store.query("SELECT count() FROM collectives").scalar() == 150
    got = embedded_store.query("SELECT what, sum(count) AS n FROM drops GROUP BY what").rows()
    assert got == [("spool_budget:heartbeats", 100)]


def test_parse_bytes_and_budget_errors():
    import pytest

    from ranklens.collector.shipper import parse_bytes
    from ranklens.errors import ConfigError

    assert parse_bytes("20GiB") == 20 * 1024**3 and parse_bytes("500MB") == 500 * 10**6
    assert parse_bytes("1.5 kib") == 1536 and parse_bytes(123) == 123 and parse_bytes("0") == 0
    for bad in ("lots", "-1GB", True, -5):
        with pytest.raises(ConfigError):
            parse_bytes(bad, "spool_max_bytes")


def test_two_shippers_on_one_spool_never_send_a_segment_twice(tmp_path, embedded_store):
    import threading

    results = {}

    def slow():
        """The store answers only once the other shipper has had its go (or after 60 s): both
        shippers would read the same segments before either deletes, whatever the threads' pace."""
        return SlowStore(embedded_store, until=lambda: bool(results), timeout_s=60, ops={"write_many"})

    w = SpoolWriter.for_rank(tmp_path / "spool", "j", 0, 0)
    for k in range(10):
        w.write("collectives", _rows(5, start=10 * k))
    a, b = Shipper(tmp_path / "spool", slow(), host="a"), Shipper(tmp_path / "spool", slow(), host="b")
    threads = [
        threading.Thread(target=lambda s=s, n=n: results.update({n: s.ship_once()})) for n, s in (("a", a), ("b", b))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.busy for r in results.values()) == [False, True]  # one shipped, the other stood aside
    assert _seqs(embedded_store) == sorted(10 * k + i for k in range(10) for i in range(5))
    assert b.ship_once(wait_s=1).segments == 0 and a.ship_once().segments == 0


# --- issue 22: one journal per spool, a segment at fault, eviction only while the store is down ---


def test_the_journal_is_read_again_at_every_pass(tmp_path, store):
    """A shipper started first does not miss what another one sent and could not delete."""
    spool = tmp_path / "spool"
    first = Shipper(spool, store, host="a")  # reads the (empty) journal now
    SpoolWriter.for_rank(spool, "j", 0, 0).write("collectives", _rows(4))
    assert not Shipper(spool, _fail_after_write(store), host="b").ship_once().ok  # stored, not deleted
    r = first.ship_once()
    assert r.ok and r.already_stored == 1 and r.rows == {}
    assert _seqs(store) == list(range(4))


def test_a_segment_the_store_cannot_take_is_quarantined_and_the_rest_ships(tmp_path, store):
    # fails converting one segment's rows (as a driver would on a value it cannot encode)
    picky = FlakyStore(
        store,
        failures=None,
        ops={"write_many"},
        when=lambda _op, args: "collectives" in args[0] and 666 in args[0]["collectives"]["seq"].to_pylist(),
        error=lambda: ValueError("cannot encode seq 666"),
    )
    w = SpoolWriter.for_rank(tmp_path / "spool", "j", 0, 0)
    for k in range(3):
        w.write("collectives", _rows(3, start=10 * k))
    w.write("collectives", _rows(1, start=666))
    sh = Shipper(tmp_path / "spool", picky)
    r = sh.ship_once()
    assert r.ok and r.quarantined == 1 and r.segments == 3, r
    assert _seqs(store) == [0, 1, 2, 10, 11, 12, 20, 21, 22]
    (reason,) = (tmp_path / "spool" / "quarantine").glob("*.reason")
    assert "ValueError: cannot encode seq 666" in reason.read_text()


def test_free_space_floor_never_evicts_while_the_store_takes_the_rows(tmp_path, embedded_store):
    from ranklens.collector.shipper import SpoolBudget

    SpoolWriter.for_rank(tmp_path / "spool", "j", 0, 0).write("collectives", _rows(5))
    budget = SpoolBudget(min_free_bytes=1024**3, check_interval_s=0)
    r = Shipper(tmp_path / "spool", embedded_store, budget=budget, free_bytes=lambda _p: 0).ship_once()
    assert r.ok and r.evicted == {} and r.rows == {"collectives": 5}


def test_ship_loop_ships_in_the_background_and_its_last_pass_at_close(tmp_path, embedded_store):
    from ranklens.store.testing import RecordingStore
    from tests._sync import wait_until

    rec = RecordingStore(embedded_store)
    w = SpoolWriter.for_rank(tmp_path / "spool", "j", 0, 0)
    w.write("collectives", _rows(2))
    passes = []
    loop = Shipper(tmp_path / "spool", rec).start(interval_s=3600, on_pass=passes.append)
    wait_until(lambda: _seqs(embedded_store) == [0, 1], 60, "the first pass, at once")
    w.write("collectives", _rows(2, start=10))  # written after the first pass, long before the next
    assert loop.close(timeout_s=60)
    assert _seqs(embedded_store) == [0, 1, 10, 11] and all(r.ok for r in passes) and len(passes) == 2
    assert rec.ops()[-1] == "compact"  # the last pass merges the embedded store's parts
    assert loop.close(timeout_s=1)  # a second close is harmless


def test_ship_loop_close_is_bounded_while_the_store_hangs(tmp_path, embedded_store):
    import threading
    import time

    release = threading.Event()
    slow = SlowStore(embedded_store, until=release.is_set, timeout_s=60, ops={"write_many"})
    SpoolWriter.for_rank(tmp_path / "spool", "j", 0, 0).write("collectives", _rows(2))
    loop = Shipper(tmp_path / "spool", slow).start(interval_s=3600)
    try:
        assert slow.entered.wait(60)  # the first pass is stuck in the store
        t0 = time.monotonic()
        assert loop.close(timeout_s=0.5) is False  # the last pass could not run: said, not raised
        assert time.monotonic() - t0 < 5
    finally:
        release.set()


def _refusing_deletes():
    """(real ``Path.unlink``, one that refuses to delete spool segments): a spool whose permissions
    keep the collector from deleting (no ACLs, a training umask)."""
    import pathlib

    real_unlink = pathlib.Path.unlink

    def refused(self, missing_ok=False):
        if self.suffix != ".lock" and "spool" in self.parts and "_collector" not in self.parts:
            raise PermissionError(13, "Permission denied", str(self))
        return real_unlink(self, missing_ok=missing_ok)

    return real_unlink, refused


def test_a_stored_segment_that_cannot_be_deleted_is_never_sent_twice(tmp_path, store, monkeypatch, caplog):
    """A spool whose permissions keep the collector from deleting (no ACLs, a training umask):
    the rows are stored once, the segment stays in doubt, and goes once deleting works again."""
    import pathlib

    SpoolWriter.for_rank(tmp_path / "spool", "j", 0, 0).write("collectives", _rows(5))
    real_unlink, refused = _refusing_deletes()
    monkeypatch.setattr(pathlib.Path, "unlink", refused)
    sh = Shipper(tmp_path / "spool", store)
    r = sh.ship_once()
    assert r.ok and r.rows == {"collectives": 5} and len(sh.pending()) == 1 and sh.in_doubt
    assert "cannot be deleted" in caplog.text
    r = sh.ship_once()  # its delete retried, nothing read, sent or asked
    assert r.ok and r.segments == 0 and r.rows == {} and len(sh.pending()) == 1 and sh.undeletable == 1
    monkeypatch.setattr(pathlib.Path, "unlink", real_unlink)
    r = sh.ship_once()
    assert r.ok and r.removed == 1 and sh.pending() == [] and not sh.in_doubt and sh.undeletable == 0
    assert _seqs(store) == list(range(5))
    # another shipper (a restart) does not know it was stored: it asks the store, never sends twice
    SpoolWriter.for_rank(tmp_path / "spool", "j", 0, 0).write("collectives", _rows(1, start=5))
    monkeypatch.setattr(pathlib.Path, "unlink", refused)
    assert Shipper(tmp_path / "spool", store).ship_once().ok
    monkeypatch.setattr(pathlib.Path, "unlink", real_unlink)
    r = Shipper(tmp_path / "spool", store).ship_once()
    assert r.ok and r.already_stored == 1 and r.rows == {} and sh.pending() == []
    assert _seqs(store) == list(range(6))


def test_a_lock_file_another_user_owns_is_still_a_lock(tmp_path, monkeypatch):
    """A training pod (another uid, in the collector's group) cannot open the collector's 0644 lock
    for writing; it opens it read-only, which flock needs no more than, and sees it held."""
    import os

    from ranklens.collector.locks import COLLECTOR_LOCK, hold_collector_lock

    spool = tmp_path / "spool"
    with hold_collector_lock(spool) as held:
        assert held
        real_open = os.open

        def as_other_user(path, flags, *a):
            if str(path).endswith(COLLECTOR_LOCK) and flags & (os.O_RDWR | os.O_WRONLY):
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(path, flags, *a)

        monkeypatch.setattr(os, "open", as_other_user)
        with hold_collector_lock(spool) as second:
            assert second is False  # held by the first, seen through the read-only descriptor
    with hold_collector_lock(spool) as third:
        assert third  # free again, taken read-only


def test_ship_all_drains_a_spool_larger_than_one_pass_and_the_ship_loops_last_pass_does_too(tmp_path, store):
    # a pass takes max_segments (2000 by default): `ranklens collect` and the last pass of
    # `ranklens run` used to ship one pass and leave the rest of a long job's spool behind
    w = SpoolWriter.for_rank(tmp_path / "spool", "j", 0, 0)
    for i in range(7):
        w.write("collectives", _rows(1, start=i))
    sh = Shipper(tmp_path / "spool", store, max_segments=3)
    first = sh.ship_once()
    assert first.segments == 3 and first.more and len(sh.pending()) == 3
    r = sh.ship_all()
    assert r.ok and r.segments == 4 and r.passes == 2 and not r.more and r.rows == {"collectives": 4}
    assert sh.pending() == [] and _seqs(store) == list(range(7))
    for i in range(7, 14):
        w.write("collectives", _rows(1, start=i))
    loop = Shipper(tmp_path / "spool", store, max_segments=3).start(interval_s=3600)
    assert loop.close(timeout_s=120)  # the first pass at start, the last one at close
    assert _seqs(store) == list(range(14))


def test_ship_all_stops_at_a_failing_pass_and_keeps_the_rest(tmp_path, embedded_store):
    w = SpoolWriter.for_rank(tmp_path / "spool", "j", 0, 0)
    for i in range(5):
        w.write("collectives", _rows(1, start=i))
    sh = Shipper(tmp_path / "spool", embedded_store, max_segments=2)
    r = sh.ship_all(deadline_s=0)  # the deadline: one pass, the rest waits
    assert r.ok and r.segments == 2 and r.more and r.passes == 1
    shutil.move(embedded_store.root / "parts" / "collectives", tmp_path / "moved")
    r = sh.ship_all()
    assert not r.ok and r.passes == 1 and len(list((tmp_path / "spool").rglob("collectives.*.jsonl"))) == 3
    shutil.move(tmp_path / "moved", embedded_store.root / "parts" / "collectives")
    assert sh.ship_all().ok and _seqs(embedded_store) == list(range(5))


def test_stored_segments_that_cannot_be_deleted_never_hold_back_newer_ones(tmp_path, store, monkeypatch):
    """Stored but not deletable (a spool whose permissions keep the collector out), more than a pass
    holds: a pass used to take the same oldest segments again (settle them, fail to delete), so the
    newer ones never shipped and ship_all never ended. They are left out of later passes now."""
    import pathlib

    w = SpoolWriter.for_rank(tmp_path / "spool", "j", 0, 0)
    for i in range(5):
        w.write("collectives", _rows(1, start=i))
    _real_unlink, refused = _refusing_deletes()
    monkeypatch.setattr(pathlib.Path, "unlink", refused)
    sh = Shipper(tmp_path / "spool", store, max_segments=2)
    r = sh.ship_all()
    assert r.ok and not r.more and r.removed == 0 and r.passes == 3 and r.segments == 5
    assert _seqs(store) == list(range(5)) and sh.undeletable == 5  # each row once
    r = sh.ship_all()  # nothing new: one pass, nothing read or sent
    assert r.ok and r.passes == 1 and r.segments == 0 and r.rows == {}
