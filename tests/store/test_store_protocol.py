"""The Store protocol (issue 13): optional capabilities as protocols, the streaming read
``iter_query`` on both backends, and the test stores of ``ranklens.store.testing``."""

from __future__ import annotations

import threading
import tracemalloc

import pyarrow as pa
import pytest

from ranklens.errors import StoreError, StoreUnavailable
from ranklens.records import to_arrow
from ranklens.store import LazyStore, Store, SupportsCompact, SupportsDiscardIngest, SupportsIngestRows
from ranklens.store.testing import DownStore, FlakyStore, RecordingStore, SlowStore

ROW = {"job_id": "j", "rank": 1, "pg": "0", "seq": 0, "op": "all_reduce", "enter_ns": 1_790_000_000_000_000_123}


def _rows(n: int, **kw) -> list[dict]:
    return [dict(ROW, seq=i, **kw) for i in range(n)]


# --- protocols ------------------------------------------------------------------------------------


def test_backends_offer_the_protocol_and_say_which_capabilities(store):
    assert isinstance(store, Store) and isinstance(store, SupportsDiscardIngest)
    # the embedded store's parts are merged by a caller; a ClickHouse server merges its own
    assert isinstance(store, SupportsCompact) == (store.backend == "embedded")


def test_lazy_store_is_a_server_store_that_connects_later():
    lazy = LazyStore("clickhouse://default@127.0.0.1:1/db?retries=0&connect_timeout=1")
    assert isinstance(lazy, Store) and isinstance(lazy, SupportsDiscardIngest)
    assert not isinstance(lazy, SupportsCompact) and not lazy.connected
    batches = lazy.iter_query("SELECT 1")  # nothing is connected until the first batch is asked for
    with pytest.raises(StoreUnavailable):
        next(batches)
    with pytest.raises(StoreUnavailable):
        lazy.discard_ingest("collectives", [1])


def test_wrappers_offer_a_capability_exactly_when_the_store_inside_does(embedded_store):
    for wrapper in (FlakyStore(embedded_store, failures=0), SlowStore(embedded_store), RecordingStore(embedded_store)):
        assert isinstance(wrapper, Store) and isinstance(wrapper, SupportsCompact)
        assert isinstance(wrapper, SupportsDiscardIngest)
    down = DownStore()
    assert isinstance(down, Store) and not isinstance(down, SupportsCompact)
    assert not isinstance(down, SupportsDiscardIngest)
    for wrapper in (FlakyStore(down), SlowStore(down), RecordingStore(down)):
        assert isinstance(wrapper, Store) and not isinstance(wrapper, SupportsCompact)
        assert not isinstance(wrapper, SupportsDiscardIngest)


def test_wrapper_capabilities_are_methods_not_attribute_lookups(embedded_store):
    """Python 3.12+'s isinstance against a runtime-checkable protocol looks the methods up with
    ``inspect.getattr_static``, which does not see ``__getattr__``: the methods must be defined."""
    import inspect

    for wrapper in (FlakyStore(embedded_store, failures=0), SlowStore(embedded_store), RecordingStore(embedded_store)):
        for name in ("compact", "discard_ingest", "write", "query", "iter_query"):
            assert callable(inspect.getattr_static(wrapper, name)), (wrapper, name)
        assert type(wrapper).__name__ in repr(wrapper) and isinstance(wrapper, type(wrapper).__mro__[1])
    for wrapper in (FlakyStore(DownStore()), RecordingStore(DownStore())):
        for name in ("compact", "discard_ingest"):
            with pytest.raises(AttributeError):
                inspect.getattr_static(wrapper, name)
            assert not hasattr(wrapper, name)
    # the capability goes through the wrapper: recorded, and a fault applies to it
    rec = RecordingStore(embedded_store)
    rec.write("collectives", _rows(3, ingest_id=5))
    assert rec.discard_ingest("collectives", [5]) == 3 and rec.ops()[-1] == "discard_ingest"
    assert isinstance(rec.compact(), dict) and rec.ops()[-1] == "compact"
    flaky = FlakyStore(embedded_store, failures=1, ops={"compact"})
    with pytest.raises(StoreUnavailable):
        flaky.compact()
    assert isinstance(flaky.compact(), dict)


def test_discard_ingest_returns_the_rows_removed(store):
    store.write_many({"collectives": to_arrow("collectives", _rows(3, ingest_id=11) + _rows(2, ingest_id=12))})
    assert store.discard_ingest("collectives", []) == 0
    assert store.discard_ingest("collectives", [99]) == 0  # nothing of it stored: nothing to do
    assert store.discard_ingest("collectives", [11, 99]) == 3
    assert store.query("SELECT ingest_id, count() FROM collectives GROUP BY ingest_id").rows() == [(12, 2)]


# --- iter_query -----------------------------------------------------------------------------------


def test_iter_query_yields_the_result_in_batches(store):
    store.write("collectives", _rows(2500))
    sql = "SELECT seq, op, enter_ns FROM collectives ORDER BY seq"
    batches = list(store.iter_query(sql, batch_rows=1000))
    assert [b.num_rows for b in batches] == [1000, 1000, 500]
    whole = store.query(sql)
    assert all(b.columns == whole.columns for b in batches)
    assert pa.concat_tables([b.arrow for b in batches]).equals(whole.arrow)
    assert [b.num_rows for b in store.iter_query(sql)] == [2500]  # the default batch is larger


def test_iter_query_edge_cases(store):
    store.write("collectives", _rows(3))
    assert list(store.iter_query("SELECT seq FROM collectives WHERE seq > 100")) == []
    # a trailing ';' or comment, as `ranklens sql` passes them on
    got = store.iter_query("SELECT seq FROM collectives ORDER BY seq; -- three rows", batch_rows=2)
    assert [b.column("seq").tolist() for b in got] == [[0, 1], [2]]
    for bad in (0, -1, 1.5, True, "10"):
        with pytest.raises(ValueError, match="batch_rows"):
            store.iter_query("SELECT 1", batch_rows=bad)
    with pytest.raises(StoreError):
        next(store.iter_query("SELECT nosuch FROM collectives"))
    # an abandoned stream leaves the store usable (the server: its own connection; embedded: no lock held)
    stream = store.iter_query("SELECT number FROM numbers(100000)", batch_rows=10)
    assert next(stream).num_rows == 10
    assert store.query("SELECT count() FROM collectives").scalar() == 3
    assert next(stream).column("number").tolist() == list(range(10, 20))
    stream.close()
    assert store.query("SELECT count() FROM collectives").scalar() == 3


@pytest.mark.slow  # 1 M / 0.5 M rows (the driver decodes in Python): 10-25 s on a loaded machine
def test_iter_query_holds_one_batch_not_the_result(store):
    """A result read 5 000 rows at a time: the process never holds much more than a batch
    (query() of the same result holds 8 MB of Arrow on the embedded store, ~20 MB of Python
    objects in the server's driver; chDB's blocks are 65 536 rows, 0.5 MB)."""
    batch = 5_000
    if store.backend == "embedded":
        n = 1_000_000
        sql = f"SELECT number FROM numbers({n})"
    else:
        n = 500_000  # the driver decodes in Python (slow under tracemalloc)
        sql = f"SELECT number FROM system.numbers LIMIT {n}"
    tracemalloc.start()
    try:
        arrow_before = pa.total_allocated_bytes()
        seen = total = 0
        arrow_peak = 0
        for b in store.iter_query(sql, batch_rows=batch):
            assert b.num_rows == batch
            total += sum(b.column("number").tolist())
            seen += b.num_rows
            arrow_peak = max(arrow_peak, pa.total_allocated_bytes() - arrow_before)
        _, py_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert seen == n and total == n * (n - 1) // 2
    assert arrow_peak < 2 * 10**6, f"{arrow_peak / 1e6:.1f} MB of Arrow held at once"
    assert py_peak < 8 * 10**6, f"{py_peak / 1e6:.1f} MB of Python objects held at once"


@pytest.mark.server
def test_server_stream_can_be_abandoned_mid_result(server_store):
    """An endless result: only a stream can give its first batch, and closing it ends the query."""
    stream = server_store.iter_query("SELECT number FROM system.numbers", batch_rows=1000)
    assert next(stream).column("number").tolist() == list(range(1000))
    stream.close()
    assert server_store.query("SELECT 42").scalar() == 42


# --- ranklens.store.testing -----------------------------------------------------------------------


def test_down_store_refuses_everything_and_counts():
    down = DownStore(url="down://x")
    for call in (
        lambda: down.write("collectives", _rows(1)),
        lambda: down.write_many({"collectives": _rows(1)}),
        lambda: down.query("SELECT 1"),
        lambda: next(down.iter_query("SELECT 1")),
    ):
        with pytest.raises(StoreUnavailable, match="down://x"):
            call()
    assert down.attempts == 4
    refusing = DownStore(error=lambda: StoreError("read-only"))
    with pytest.raises(StoreError, match="read-only"):
        refusing.query("SELECT 1")


def test_flaky_store_fails_n_times_then_works(embedded_store):
    flaky = FlakyStore(embedded_store, failures=2, ops={"write_many"})
    for _ in range(2):
        with pytest.raises(StoreUnavailable):
            flaky.write_many({"collectives": _rows(2)})
    assert flaky.query("SELECT count() FROM collectives").scalar() == 0  # failed before: nothing written
    assert flaky.write_many({"collectives": _rows(2)}) == {"collectives": 2} and flaky.failed == 2

    lost_ack = FlakyStore(embedded_store, failures=1, ops={"write_many"}, after=True)
    with pytest.raises(StoreUnavailable, match="answer lost"):
        lost_ack.write_many({"collectives": _rows(3)})
    assert embedded_store.query("SELECT count() FROM collectives").scalar() == 5  # written, then failed

    forever = FlakyStore(embedded_store, failures=None, ops={"query"})
    for _ in range(5):
        with pytest.raises(StoreUnavailable):
            forever.query("SELECT 1")
    forever.heal()
    assert forever.query("SELECT 1").scalar() == 1

    picky = FlakyStore(
        embedded_store, failures=None, when=lambda op, args: op == "write" and args[0] == "steps", error=ValueError
    )
    with pytest.raises(ValueError):
        picky.write("steps", [])
    assert picky.write("collectives", _rows(1)) == 1
    with pytest.raises(ValueError, match="failures"):
        FlakyStore(embedded_store, failures=-1)


def test_flaky_capabilities_fail_too(embedded_store):
    embedded_store.write("collectives", _rows(2, ingest_id=5))
    flaky = FlakyStore(embedded_store, failures=1, ops={"discard_ingest"})
    with pytest.raises(StoreUnavailable):
        flaky.discard_ingest("collectives", [5])
    assert flaky.discard_ingest("collectives", [5]) == 2


def test_slow_store_answers_once_its_condition_holds(embedded_store):
    go = threading.Event()
    slow = SlowStore(embedded_store, until=go.is_set, ops={"write_many"})
    done: list[dict] = []
    t = threading.Thread(target=lambda: done.append(slow.write_many({"collectives": _rows(1)})))
    t.start()
    assert slow.entered.wait(30)
    assert slow.query("SELECT count() FROM collectives").scalar() == 0 and not done  # queries are not slow
    go.set()
    t.join(30)
    assert done == [{"collectives": 1}]
    assert SlowStore(embedded_store, until=lambda: False, timeout_s=0.05).query("SELECT 1").scalar() == 1


def test_recording_store_records_calls_and_outcomes(embedded_store):
    rec = RecordingStore(embedded_store)
    rec.write_many({"collectives": to_arrow("collectives", _rows(4)), "steps": []})
    rec.write("collectives", _rows(1))
    with pytest.raises(StoreError):
        rec.query("SELECT nosuch")
    assert [b.num_rows for b in rec.iter_query("SELECT seq FROM collectives", batch_rows=3)] == [3, 2]
    assert rec.compact(min_parts=100) == {}
    assert rec.ops() == ["write_many", "write", "query", "iter_query", "compact"]
    assert rec.written() == {"collectives": 5, "steps": 0}
    failed = rec.calls[2]
    assert failed.sql == "SELECT nosuch" and isinstance(failed.error, StoreError)
    assert rec.calls[0].tables == ["collectives", "steps"] and rec.calls[3].kwargs == {"batch_rows": 3}


def test_write_once_discards_a_half_stored_batch_through_the_capability(store):
    from ranklens.store.once import key_ingest_id, stamp, write_once

    data = to_arrow("collectives", _rows(4))
    iid = key_ingest_id([b"k", b"collectives"])
    store.write("collectives", stamp(data.slice(0, 2), iid))  # an earlier write interrupted half-way
    rec = RecordingStore(store)
    assert write_once(rec, {"collectives": data}, [b"k"]) == ({"collectives": 4}, {})
    # "which rows are stored?": a query, or the embedded store's footers (SupportsIngestRows)
    asked = "ingest_rows" if store.backend == "embedded" else "query"
    assert rec.ops() == [asked, "discard_ingest", "write_many"]
    assert store.query("SELECT count() FROM collectives").scalar() == 4
    assert write_once(rec, {"collectives": data}, [b"k"]) == ({}, {"collectives": 4})  # and not again


def test_every_store_has_the_protocols_signatures(embedded_store):
    """Each backend and test store takes the arguments the protocol names (a method added to the
    protocol and missing from a store, or taking other arguments, fails here)."""
    import inspect

    from ranklens.store.embedded import EmbeddedStore
    from ranklens.store.server import ServerStore

    def shape(fn) -> list[tuple[str, object]]:
        """(kind, and the name of a keyword-only) per parameter but self (positional names may differ)."""
        ps = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
        return [(p.kind, p.name if p.kind is inspect.Parameter.KEYWORD_ONLY else "") for p in ps]

    for cls in (EmbeddedStore, ServerStore, LazyStore, DownStore, FlakyStore, SlowStore, RecordingStore):
        for name in ("write", "write_many", "query", "iter_query", "close"):
            assert shape(getattr(cls, name)) == shape(getattr(Store, name)), (cls.__name__, name)
    for cls in (EmbeddedStore, ServerStore, LazyStore):  # the server's own keyword (timeout_s) is extra
        assert shape(cls.discard_ingest)[:2] == shape(SupportsDiscardIngest.discard_ingest), cls.__name__
    inspect.signature(EmbeddedStore.compact).bind(embedded_store)  # callable as SupportsCompact.compact()
    assert shape(EmbeddedStore.ingest_rows) == shape(SupportsIngestRows.ingest_rows)
    rec = RecordingStore(embedded_store)  # a wrapper passes the capability on through its _call
    assert isinstance(rec, SupportsIngestRows) and rec.ingest_rows("collectives", [1]) == {}
    assert rec.ops() == ["ingest_rows"]
