"""The spool's one writer (ranklens.formats.spool.SpoolWriter), used by the tracer and the collector."""

from __future__ import annotations

import json
import os

import pytest

from ranklens.formats import spool
from ranklens.formats.rows import read_jsonl
from ranklens.formats.spool import STAGED, SpoolWriter

ROW = {"job_id": "j", "rank": 0, "pg": "0", "seq": 1, "op": "all_reduce", "enter_ns": 5}


def _names(d):
    return sorted(p.name for p in d.iterdir())


def test_a_rank_writer_lays_out_the_spool_and_writes_whole_segments(tmp_path):
    w = SpoolWriter.for_rank(tmp_path, "job/1", 2, 3)
    seg = w.write("collectives", [ROW, dict(ROW, seq=2)])
    assert seg is not None and seg.parent == tmp_path / "job_1" / "2" / "rank-3"
    assert _names(seg.parent) == [seg.name]  # no hidden file left behind
    table, pid, seq, ext = seg.name.split(".")
    assert (table, pid, ext, len(seq)) == ("collectives", str(os.getpid()), "jsonl", 20)
    lines = seg.read_text().splitlines()
    assert json.loads(lines[0]) == {"ranklens": "records", "version": 1, "table": "collectives"}
    name, data = read_jsonl(seg)
    assert name == "collectives" and data.column("seq").to_pylist() == [1, 2]
    assert w.write("collectives", []) is None


def test_a_restarted_writer_never_replaces_a_pending_segment(tmp_path, monkeypatch):
    # a container restart gives the new process the old one's pid; with a clock that repeats itself
    # too, the writer's first name is one a pending segment already has: that segment must survive
    monkeypatch.setattr(spool.time, "time_ns", lambda: 1_000)
    w = SpoolWriter.for_rank(tmp_path, "j", 0, 0)
    taken = w.dir / f"collectives.{os.getpid()}.{1_000:020d}.jsonl"
    w.dir.mkdir(parents=True)
    taken.write_text("pending\n")
    seg = w.write("collectives", [ROW])
    assert seg is not None and seg != taken and taken.read_text() == "pending\n"
    assert read_jsonl(seg)[1].num_rows == 1


def test_without_hard_links_segments_are_renamed_into_free_names(tmp_path, monkeypatch):
    def no_links(src, dst):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(spool.os, "link", no_links)
    monkeypatch.setattr(spool.time, "time_ns", lambda: 7)
    w = SpoolWriter.for_rank(tmp_path, "j", 0, 0)
    w.dir.mkdir(parents=True)
    taken = w.dir / f"steps.{os.getpid()}.{7:020d}.jsonl"
    taken.write_text("pending\n")
    seg = w.write("steps", [{"job_id": "j", "rank": 0, "step": 1, "start_ns": 1, "end_ns": 2}])
    assert seg is not None and seg != taken and taken.read_text() == "pending\n"
    assert sorted(_names(w.dir)) == sorted([taken.name, seg.name])


def test_two_phase_write_publishes_only_what_was_committed(tmp_path):
    w = SpoolWriter(tmp_path / "c", validate=True)
    kept = w.stage("collectives", [ROW])
    lost = w.stage("collectives", [dict(ROW, seq=2)])
    assert kept and lost and all(p.name.startswith(STAGED) for p in (kept, lost))
    assert not [n for n in _names(w.dir) if not n.startswith(".")]  # the shipper sees nothing yet
    # a crash here; the restarted writer publishes the staged segment whose offsets were saved
    assert SpoolWriter(tmp_path / "c", validate=True).recover([kept.name]) == (1, 1)
    (seg,) = [p for p in w.dir.iterdir() if not p.name.startswith(".")]
    assert read_jsonl(seg)[1].column("seq").to_pylist() == [1]


def test_validation_refuses_a_bad_row_and_writes_nothing(tmp_path):
    w = SpoolWriter(tmp_path / "c", validate=True)
    with pytest.raises(ValueError, match="not_a_column"):
        w.write("collectives", [dict(ROW, not_a_column=1)])
    with pytest.raises((TypeError, ValueError)):
        w.write("collectives", [dict(ROW, seq="one")])
    assert not (tmp_path / "c").exists() or not list((tmp_path / "c").iterdir())


def test_strings_that_are_not_unicode_are_cleaned_and_counted(tmp_path):
    w = SpoolWriter.for_rank(tmp_path, "j", 0, 0)
    seg = w.write("collectives", [dict(ROW, op="all\udcffreduce"), ROW])
    assert seg is not None and w.cleaned_rows == 1
    assert read_jsonl(seg)[1].column("op").to_pylist() == ["all\ufffdreduce", "all_reduce"]
