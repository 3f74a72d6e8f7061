"""Store behaviour on both backends: chDB (embedded) and a real ClickHouse server."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest

from ranklens.errors import ConfigError, SchemaVersionError, StoreError, StoreUnavailable
from ranklens.records import record_type, to_arrow
from ranklens.store import open_store
from ranklens.store.server import ServerConfig

ROW = {
    "job_id": "j",
    "rank": 1,
    "pg": "0",
    "seq": 7,
    "op": "all_reduce",
    "enter_ns": 1_790_000_000_000_000_123,
}


def test_roundtrip_defaults_and_types(store):
    assert store.write("collectives", [ROW]) == 1
    r = store.query("SELECT * FROM collectives")
    (row,) = r.to_pylist()
    assert row["enter_ns"] == ROW["enter_ns"]  # full ns precision, no float round trip
    assert row["peer"] == -1 and row["step"] == -1 and row["clock"] == "cpu" and row["end_ns"] == 0
    assert r.column("seq").tolist() == [7]


def test_arrays_and_floats(store):
    store.write("process_groups", [{"job_id": "j", "pg": "3", "ranks": [0, 2, 4], "name": "dp_0"}])
    store.write("steps", [{"job_id": "j", "rank": 0, "step": 1, "start_ns": 1, "end_ns": 2, "loss": 0.5}])
    assert store.query("SELECT ranks FROM process_groups").scalar() == [0, 2, 4]
    assert store.query("SELECT loss FROM steps").scalar() == 0.5
    assert math.isnan(store.query("SELECT grad_norm FROM steps").scalar())


def test_records_dataclasses(store):
    Steps = record_type("steps")
    rec = Steps(job_id="j", rank=3, step=4, start_ns=10, end_ns=20)
    with pytest.raises(AttributeError):
        rec.step = 5  # frozen
    store.write("steps", [rec])
    assert store.query("SELECT rank, step, samples FROM steps").rows() == [(3, 4, -1)]


def test_write_many_and_aggregation(store):
    rows = [dict(ROW, rank=r, seq=s, enter_ns=ROW["enter_ns"] + r * 1000 + s) for r in range(4) for s in range(50)]
    counts = store.write_many({"collectives": to_arrow("collectives", rows), "steps": []})
    assert counts == {"collectives": 200, "steps": 0}
    r = store.query(
        "SELECT seq, argMax(rank, enter_ns) AS last_rank, count() AS n FROM collectives "
        "GROUP BY seq ORDER BY seq LIMIT 3"
    )
    assert r.rows() == [(0, 3, 4), (1, 3, 4), (2, 3, 4)]


def test_bad_sql_is_a_store_error(store):
    with pytest.raises(StoreError):
        store.query("SELECT no_such_column FROM collectives")
    with pytest.raises(StoreError):
        store.query("SELECT * FROM no_such_table")


def test_invalid_rows_write_nothing(store):
    with pytest.raises(ValueError, match="row 1: column seq"):
        store.write("collectives", [ROW, dict(ROW, seq="x")])
    with pytest.raises(ValueError, match="unknown column"):
        store.write("collectives", [dict(ROW, sq=1)])
    with pytest.raises(ConfigError, match="unknown table"):
        store.write("nope", [ROW])
    assert store.query("SELECT count() FROM collectives").scalar() == 0


def test_arrow_input_is_cast_to_schema(store):
    t = pa.table(
        {
            "job_id": ["j"],
            "rank": pa.array([2], pa.int64()),
            "pg": ["0"],
            "seq": [1],
            "op": ["barrier"],
            "enter_ns": [5],
        }
    )
    full = to_arrow("collectives", t.to_pylist())
    store.write("collectives", full)
    assert store.query("SELECT rank FROM collectives").scalar() == 2


# -- embedded specifics --------------------------------------------------------------------


def test_embedded_compaction_keeps_rows(embedded_store):
    for i in range(20):
        embedded_store.write("collectives", [dict(ROW, seq=i)])
    assert len(embedded_store.parts("collectives")) == 20
    merged = embedded_store.compact(min_parts=8)
    assert merged == {"collectives": 19}
    assert len(embedded_store.parts("collectives")) == 1
    assert embedded_store.query("SELECT count(), sum(seq) FROM collectives").rows() == [(20, sum(range(20)))]


def test_embedded_schema_version_mismatch(tmp_path):
    s = open_store(f"embedded://{tmp_path}/s")
    meta = tmp_path / "s" / "meta.json"
    meta.write_text('{"schema_version": 999}')
    with pytest.raises(SchemaVersionError, match="schema version 999"):
        open_store(f"embedded://{tmp_path}/s")
    del s


def test_embedded_missing_store_without_create(tmp_path):
    with pytest.raises(StoreUnavailable, match="no ranklens store"):
        open_store(f"embedded://{tmp_path}/absent", create=False)


def test_embedded_store_in_a_directory_with_odd_characters(tmp_path):
    # quotes, spaces and glob characters other than braces are read back; braces (glob alternatives
    # in chDB's file()) made the store read nothing after a write: now a clear error
    for name in ("q'x", "s x", "st*r", "qm?x", "br[a]"):
        s = open_store(f"embedded://{tmp_path / name}")
        s.write("collectives", [ROW])
        assert s.query("SELECT count() FROM collectives").scalar() == 1, name
    with pytest.raises(ConfigError, match="braces"):
        open_store(f"embedded://{tmp_path / 'b{x}'}")
    assert not (tmp_path / "b{x}").exists()


def test_embedded_write_failure_commits_nothing(embedded_store):
    import shutil

    embedded_store.write("steps", [{"job_id": "j", "rank": 0, "step": 0, "start_ns": 1, "end_ns": 2}])
    shutil.rmtree(embedded_store.root / "parts" / "collectives")
    with pytest.raises(StoreUnavailable):
        embedded_store.write_many(
            {
                "steps": [{"job_id": "j", "rank": 0, "step": 1, "start_ns": 1, "end_ns": 2}],
                "collectives": [ROW],
            }
        )
    # the steps part of the failed call was not committed either
    assert embedded_store.query("SELECT count() FROM steps").scalar() == 1


def test_two_embedded_stores_in_one_process(tmp_path):
    a = open_store(f"embedded://{tmp_path}/a")
    b = open_store(f"embedded://{tmp_path}/b")
    a.write("collectives", [ROW])
    b.write("collectives", [ROW, dict(ROW, seq=8)])
    assert a.query("SELECT count() FROM collectives").scalar() == 1
    assert b.query("SELECT count() FROM collectives").scalar() == 2
    assert a.query("SELECT count() FROM collectives").scalar() == 1


# -- server specifics -----------------------------------------------------------------------


def test_url_parsing():
    c = ServerConfig.from_url("clickhouses://bob:s%40cret@ch.example:9441/rl?verify=false&ca_certs=/ca.pem")
    assert (c.user, c.password, c.host, c.port, c.database, c.secure, c.verify, c.ca_certs) == (
        "bob",
        "s@cret",
        "ch.example",
        9441,
        "rl",
        True,
        False,
        "/ca.pem",
    )
    assert "s@cret" not in c.redacted_url()
    assert ServerConfig.from_url("clickhouse://h/db", password_env="pw").password == "pw"
    assert ServerConfig.from_url("clickhouses://h").port == 9440
    with pytest.raises(ConfigError, match="unknown store URL option"):
        ServerConfig.from_url("clickhouse://h/db?timeout=3")
    with pytest.raises(ConfigError):
        open_store("postgres://h/db")


def test_server_down_is_unavailable():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(StoreUnavailable, match="unavailable"):
        open_store(f"clickhouse://default@127.0.0.1:{port}/x?retries=1&connect_timeout=1")


@pytest.mark.server
def test_server_schema_version_mismatch(server_store):
    server_store._execute(
        f"INSERT INTO {server_store.config.database}.ranklens_meta (key, value, updated_ns) VALUES",
        [("schema_version", "999", 2**62)],
    )
    with pytest.raises(SchemaVersionError, match="schema version 999"):
        open_store(server_store.config.redacted_url())


@pytest.mark.server
def test_server_store_threads_use_their_own_clients(server_store):
    from concurrent.futures import ThreadPoolExecutor

    def work(i: int) -> int:
        server_store.write("collectives", [dict(ROW, seq=i)])
        return int(server_store.query("SELECT count() FROM collectives").scalar())

    with ThreadPoolExecutor(4) as ex:
        list(ex.map(work, range(16)))
    assert server_store.query("SELECT count() FROM collectives").scalar() == 16


def test_server_errors_that_say_the_cluster_is_unreachable_are_the_store_unavailable():
    """Server error codes from the server's own network or coordination (a replica killed mid-ingest
    answers ALL_CONNECTION_TRIES_FAILED, a read past the end from another server) make the store
    unavailable, retried later; the same read-past-the-end on the query's own data is a refusal."""
    from ranklens.store.server import _unavailable

    assert _unavailable(279, "DB::NetException: All connection tries failed")
    assert _unavailable(209, "Timeout exceeded while reading from socket (127.0.0.1:33777)")
    assert _unavailable(32, "Attempt to read after eof: while receiving packet from 127.0.0.1:52525")
    assert not _unavailable(32, "Attempt to read after eof: (at row 3)")
    assert not _unavailable(62, "Syntax error: failed at position 1")  # a query at fault
    assert not _unavailable(60, "Table ranklens.nope doesn't exist")
    assert not _unavailable(None, "")
