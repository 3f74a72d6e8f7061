"""The collector's profiler traces (``<spool>/<job>/<attempt>/kineto/*.pt.trace.json``): each row
exactly once through a lost acknowledgement and a partly stored batch, a corrupt trace put aside
(nothing written), a trace that cannot be staged left for the next pass."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from ranklens.collector import Shipper
from ranklens.collector.settle import batch_id, ingest_id_of, stamp
from ranklens.store.testing import FlakyStore

DATA = Path(__file__).parent.parent / "data" / "kineto"
TWO_BATCHES = DATA / "hta_recsys_a100_80gb_rank0_of16" / "rank0.json.gz"  # 67,217 events: 50,000 + the rest


def _spool_trace(spool: Path, src: Path = TWO_BATCHES) -> tuple[Path, int]:
    """A recorded trace in the spool as the tracer's profiler windows leave it; its complete events."""
    d = spool / "j" / "0" / "kineto"
    d.mkdir(parents=True)
    raw = gzip.decompress(src.read_bytes())
    trace = d / "rank0-step4.pt.trace.json"
    trace.write_bytes(raw)
    return trace, sum(1 for e in json.loads(raw)["traceEvents"] if e.get("ph") == "X")


def _count(store) -> tuple[int, int]:
    return tuple(store.query("SELECT count(), uniqExact(ts_ns, name, tid, correlation) FROM trace_events").rows()[0])


def test_a_lost_acknowledgement_does_not_store_a_trace_twice(tmp_path, store):
    from ranklens.errors import StoreUnavailable

    spool = tmp_path / "spool"
    trace, events = _spool_trace(spool)
    flaky = FlakyStore(
        store, failures=None, ops={"write_many"}, after=True, error=lambda: StoreUnavailable("reset after the block")
    )
    sh = Shipper(spool, flaky)
    assert not sh.ship_once().ok and trace.exists() and sh.in_doubt  # batch 0 stored, not acknowledged
    flaky.heal()
    r = sh.ship_once()
    assert r.ok and not trace.exists() and not sh.in_doubt
    assert r.rows == {"trace_events": events - 50_000}  # only batch 1 sent again
    n, distinct = _count(store)
    assert n == events and distinct <= n


def test_a_partly_stored_trace_batch_is_discarded_and_sent_again(tmp_path, store):
    from ranklens.formats.kineto import iter_kineto_batches

    spool = tmp_path / "spool"
    trace, events = _spool_trace(spool)
    rel = trace.relative_to(spool).as_posix()
    base = ingest_id_of(rel, iter([trace.read_bytes()]))
    first, second = iter_kineto_batches(trace, job_id="j", attempt=0)
    store.write("trace_events", stamp(first, batch_id(base, 0)))  # batch 0 whole
    store.write("trace_events", stamp(second.slice(0, 1000), batch_id(base, 1)))  # batch 1 in part
    sh = Shipper(spool, store)
    sh.in_doubt.add(rel)
    r = sh.ship_once()
    assert r.ok and r.rows == {"trace_events": second.num_rows} and not trace.exists()
    assert _count(store)[0] == events


def test_a_truncated_trace_is_put_aside_and_nothing_of_it_written(tmp_path, embedded_store):
    spool = tmp_path / "spool"
    trace, _ = _spool_trace(spool)
    trace.write_bytes(trace.read_bytes()[: trace.stat().st_size // 2])
    r = Shipper(spool, embedded_store).ship_once()
    assert r.quarantined == 1 and not trace.exists()
    assert list((spool / "quarantine").rglob("*.pt.trace.json"))
    assert embedded_store.query("SELECT count() FROM trace_events").scalar() == 0


def test_a_trace_that_cannot_be_staged_waits_for_the_next_pass(tmp_path, embedded_store, monkeypatch):
    """A full temporary disk is not the trace's fault: it stays where it is, not put aside."""
    import tempfile

    spool = tmp_path / "spool"
    trace, events = _spool_trace(spool, DATA / "hta_recsys_2rank_of128" / "sampled_rank-0.json.gz")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-dir"))
    with pytest.raises(FileNotFoundError):
        tempfile.mkdtemp()
    r = Shipper(spool, embedded_store).ship_once()
    assert r.quarantined == 0 and trace.exists()
    monkeypatch.setattr(tempfile, "tempdir", None)
    r = Shipper(spool, embedded_store).ship_once()
    assert r.ok and not trace.exists()
    assert embedded_store.query("SELECT count() FROM trace_events").scalar() == events
