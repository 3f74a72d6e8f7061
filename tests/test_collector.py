"""The shipper: spools into the store, nothing lost when the store fails or a segment is corrupt."""

from __future__ import annotations

import shutil

from ranklens.collector import Shipper
from ranklens.tracing.spool import SpoolWriter

ROW = {"job_id": "j", "attempt": 0, "rank": 0, "pg": "0", "seq": 1, "op": "all_reduce", "enter_ns": 5}


def test_ships_and_deletes_acknowledged_segments(tmp_path, store):
    w = SpoolWriter(tmp_path / "spool", "j", 0, 0)
    w.write("collectives", [ROW, dict(ROW, seq=2)])
    w.write("steps", [{"job_id": "j", "rank": 0, "step": 0, "start_ns": 1, "end_ns": 2}])
    sh = Shipper(tmp_path / "spool", store)
    r = sh.ship_once()
    assert r.ok and r.segments == 2 and r.rows == {"collectives": 2, "steps": 1}
    assert sh.pending() == []
    assert store.query("SELECT count() FROM collectives").scalar() == 2
    assert sh.ship_once().segments == 0  # nothing twice


def test_corrupt_segment_is_quarantined_not_lost(tmp_path, embedded_store):
    w = SpoolWriter(tmp_path / "spool", "j", 0, 0)
    good = w.write("collectives", [ROW])
    bad = w.write("collectives", [ROW])
    bad.write_text(bad.read_text()[:-8])  # truncated mid-record
    r = Shipper(tmp_path / "spool", embedded_store).ship_once()
    assert r.ok and r.segments == 1 and r.quarantined == 1
    assert not good.exists()
    q = list((tmp_path / "spool" / "quarantine").iterdir())
    assert any(p.suffix == ".jsonl" for p in q) and any(p.suffix == ".reason" for p in q)
    reason = next(p for p in q if p.suffix == ".reason").read_text()
    assert "line 2" in reason and "not valid JSON" in reason
    assert embedded_store.query("SELECT sum(count) FROM drops WHERE what = 'spool_segment_quarantined'").scalar() == 1


def test_store_failure_keeps_segments_for_retry(tmp_path, embedded_store):
    w = SpoolWriter(tmp_path / "spool", "j", 0, 0)
    seg = w.write("collectives", [ROW])
    parts = embedded_store.root / "parts" / "collectives"
    shutil.move(parts, tmp_path / "moved")  # the store's disk "fails"
    sh = Shipper(tmp_path / "spool", embedded_store)
    r = sh.ship_once()
    assert not r.ok and "cannot write" in r.error and seg.exists()
    shutil.move(tmp_path / "moved", parts)  # it comes back
    assert sh.ship_once().ok and not seg.exists()
    assert embedded_store.query("SELECT count() FROM collectives").scalar() == 1
