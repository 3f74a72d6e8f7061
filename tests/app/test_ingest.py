"""The open ingest format: JSON Lines and Parquet, with clear errors and nothing half-written."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ranklens.errors import IngestError
from ranklens.formats.rows import read_jsonl, read_parquet
from ranklens.ingest import ingest_paths

HEADER = {"ranklens": "records", "version": 1, "table": "collectives"}
ROW = {"job_id": "j", "rank": 0, "pg": "0", "seq": 1, "op": "all_reduce", "enter_ns": 100}


def _jsonl(path, *objs, raw: str = ""):
    path.write_text("".join(json.dumps(o) + "\n" for o in objs) + raw)
    return path


def test_jsonl_with_header(tmp_path, store):
    p = _jsonl(tmp_path / "anything.jsonl", HEADER, ROW, dict(ROW, rank=1, peer=-1, nbytes=8))
    assert ingest_paths(store, [p]) == {"collectives": 2}
    assert store.query("SELECT sum(nbytes), count() FROM collectives").rows() == [(8, 2)]


def test_table_from_file_name_and_option(tmp_path):
    p = _jsonl(tmp_path / "steps-rank3.jsonl", {"job_id": "j", "rank": 3, "step": 0, "start_ns": 1, "end_ns": 2})
    assert read_jsonl(p)[0] == "steps"
    q = _jsonl(tmp_path / "x.jsonl", {"job_id": "j", "rank": 3, "step": 0, "start_ns": 1, "end_ns": 2})
    assert read_jsonl(q, table="steps")[0] == "steps"
    with pytest.raises(IngestError, match="cannot tell which table"):
        read_jsonl(q)


def test_an_unnamed_headerless_file_is_refused_at_its_first_row(tmp_path, monkeypatch):
    """Neither a header, nor --table, nor a table's name: refused as soon as the first row shows it,
    not after every line was parsed into memory (a 1 GB file took as long as its parse to say so)."""
    import ranklens.formats.rows as rows

    parsed = []
    real_loads = json.loads
    monkeypatch.setattr(rows.json, "loads", lambda s, *a, **k: parsed.append(s) or real_loads(s, *a, **k))
    p = _jsonl(tmp_path / "x.jsonl", *[ROW] * 50, raw="not json\n")
    with pytest.raises(IngestError, match="cannot tell which table"):
        read_jsonl(p)
    assert len(parsed) <= 2  # the fast reader's look at a header, then the first row


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            '{"job_id": "j", "rank": 0, "pg": "0", "seq": "one", "op": "x", "enter_ns": 1}',
            "line 3: field 'seq': expected an integer",
        ),
        (
            '{"job_id": "j", "rank": 0, "pg": "0", "seq": 1, "op": "x"}',
            "line 3: required field 'enter_ns' is missing",
        ),
        (
            '{"job_id": "j", "rank": 0, "pg": "0", "seq": 1, "op": "x", "enter_ns": 1, "bogus": 2}',
            "line 3: field 'bogus' is not a column",
        ),
        (
            '{"job_id": "j", "rank": 99999999999, "pg": "0", "seq": 1, "op": "x", "enter_ns": 1}',
            "line 3: field 'rank': 99999999999 is out of range",
        ),
        (
            '{"job_id": "j", "rank": 0, "pg": "0", "seq": 1, "op": "x", "enter_ns": 1',
            "line 3: not valid JSON",
        ),
        ("[1, 2]", "line 3: expected a JSON object"),
    ],
)
def test_jsonl_errors_name_file_line_and_field(tmp_path, line, message):
    p = _jsonl(tmp_path / "c.jsonl", HEADER, ROW, raw=line + "\n")
    with pytest.raises(IngestError) as e:
        read_jsonl(p)
    assert str(p) in str(e.value)
    assert message in str(e.value)


def test_binary_garbage_and_bad_header(tmp_path):
    p = tmp_path / "collectives.jsonl"
    p.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(IngestError, match="not UTF-8"):
        read_jsonl(p)
    q = _jsonl(tmp_path / "collectives2.jsonl", {"ranklens": "records", "version": 99, "table": "collectives"})
    with pytest.raises(IngestError, match="unsupported header"):
        read_jsonl(q)


def test_nothing_half_written(tmp_path, store):
    good = _jsonl(tmp_path / "a.jsonl", HEADER, ROW)
    bad = _jsonl(tmp_path / "b.jsonl", HEADER, ROW, raw="not json\n")
    with pytest.raises(IngestError, match=r"b\.jsonl: line 3"):
        ingest_paths(store, [good, bad])
    assert store.query("SELECT count() FROM collectives").scalar() == 0


def test_parquet(tmp_path, store):
    p = tmp_path / "steps.parquet"
    pq.write_table(
        pa.table(
            {
                "job_id": ["j", "j"],
                "rank": [0, 1],
                "step": [5, 5],
                "start_ns": [1, 1],
                "end_ns": [9, 10],
                "loss": [0.1, 0.2],
            }
        ),
        p,
    )
    assert ingest_paths(store, [p]) == {"steps": 2}
    assert store.query("SELECT max(end_ns), min(tokens) FROM steps").rows() == [(10, -1)]


def test_parquet_errors(tmp_path):
    p = tmp_path / "steps.parquet"
    pq.write_table(pa.table({"job_id": ["j"], "rank": [0], "step": [1], "start_ns": [1]}), p)
    with pytest.raises(IngestError, match="required column 'end_ns' is missing"):
        read_parquet(p)
    pq.write_table(
        pa.table({"job_id": ["j", None], "rank": [0, 1], "step": [1, 1], "start_ns": [1, 1], "end_ns": [2, 2]}),
        p,
    )
    with pytest.raises(IngestError, match="row 1: column 'job_id' is null"):
        read_parquet(p)
    pq.write_table(pa.table({"job_id": ["j"], "rank": ["zero"], "step": [1], "start_ns": [1], "end_ns": [2]}), p)
    with pytest.raises(IngestError, match="column 'rank'"):
        read_parquet(p)
    p.write_bytes(b"PAR1 truncated")
    with pytest.raises(IngestError, match="not a readable Parquet file"):
        read_parquet(p)


@pytest.mark.parametrize(
    ("table", "rows"),
    [
        ("collectives", [ROW, dict(ROW, rank=1, peer=3, nbytes=8, end_ns=-1), dict(ROW, seq=2, clock="cuda")]),
        (
            "steps",
            [
                {"job_id": "j", "rank": 0, "step": 1, "start_ns": 1, "end_ns": 2, "loss": 0.25},
                {"job_id": "j", "rank": 1, "step": 1, "start_ns": 1, "end_ns": 3},
            ],
        ),
        ("process_groups", [{"job_id": "j", "pg": "1", "ranks": [0, 2]}, {"job_id": "j", "pg": "2", "ranks": []}]),
        ("heartbeats", [{"job_id": "j", "rank": 0, "ts_ns": 5, "pgs": ["0"], "pg_entered": [3], "pg_completed": [2]}]),
    ],
)
def test_fast_and_strict_readers_agree(tmp_path, table, rows):
    from ranklens.formats.rows import _read_jsonl_fast, _read_jsonl_strict

    p = _jsonl(tmp_path / "seg.jsonl", {"ranklens": "records", "version": 1, "table": table}, *rows)
    fast = _read_jsonl_fast(p, None)
    assert fast is not None  # a well-formed segment takes the fast path
    strict = _read_jsonl_strict(p, None)
    assert fast[0] == strict[0] == table
    assert fast[1].schema == strict[1].schema
    assert fast[1].to_pylist() == strict[1].to_pylist() or all(
        all((a == b) or (a != a and b != b) for a, b in zip(fa.values(), sa.values()))
        for fa, sa in zip(fast[1].to_pylist(), strict[1].to_pylist())
    )  # NaN defaults compare unequal to themselves


def test_fast_reader_defers_to_strict_errors(tmp_path):
    p = _jsonl(tmp_path / "seg.jsonl", HEADER, ROW, dict(ROW, rank=True))  # a bool is not an integer
    with pytest.raises(IngestError, match="line 3: field 'rank': expected an integer"):
        read_jsonl(p)


def test_ingesting_the_same_file_twice_writes_its_rows_once(tmp_path, store):
    """issue 22 #10: a second `ranklens ingest` of a file duplicated every row. Its rows carry the
    file's ingest_id (from its content): a file the store holds is skipped, renamed or not."""
    import shutil
    import subprocess
    import sys

    jsonl = _jsonl(tmp_path / "collectives.jsonl", HEADER, ROW, dict(ROW, rank=1), dict(ROW, rank=2))
    steps = pa.table({"job_id": ["j", "j"], "rank": [0, 1], "step": [0, 0], "start_ns": [1, 1], "end_ns": [2, 3]})
    pq.write_table(steps, tmp_path / "steps.parquet")

    def ingest(*paths):
        r = subprocess.run(
            [sys.executable, "-m", "ranklens.cli", "ingest", "--store", store_url, *map(str, paths)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        return r.stdout

    store_url = store.url  # the test server has no password: the redacted URL is the URL
    out = ingest(jsonl, tmp_path / "steps.parquet")
    assert "collectives: 3 rows" in out and "steps: 2 rows" in out
    out = ingest(jsonl, tmp_path / "steps.parquet")  # again: nothing written, and it says so
    assert "collectives: 3 rows already in the store" in out and "steps: 2 rows already in the store" in out
    shutil.copy(jsonl, tmp_path / "collectives-copy.jsonl")  # the same content under another name
    ingest(tmp_path / "collectives-copy.jsonl")
    assert store.query("SELECT count() FROM collectives").scalar() == 3
    assert store.query("SELECT count() FROM steps").scalar() == 2
    assert store.query("SELECT uniqExact(ingest_id), min(ingest_id) > 0 FROM collectives").rows() == [(1, 1)]
    # a changed file is new data: its rows are written (the old file's rows stay)
    _jsonl(jsonl, HEADER, dict(ROW, seq=2))
    assert "collectives: 1 rows" in ingest(jsonl)
    assert store.query("SELECT count() FROM collectives").scalar() == 4


def test_reingest_after_a_partial_write_discards_and_writes_again(tmp_path, store):
    from ranklens.ingest import file_ingest_id

    p = _jsonl(tmp_path / "c.jsonl", HEADER, ROW, dict(ROW, rank=1), dict(ROW, rank=2))
    _, rows = read_jsonl(p)
    iid = file_ingest_id(p, "collectives")
    part = rows.slice(0, 1)
    part = part.set_column(part.column_names.index("ingest_id"), "ingest_id", pa.array([iid], type=pa.uint64()))
    store.write("collectives", part)  # an ingest interrupted after one of the file's rows
    assert ingest_paths(store, [p]) == {"collectives": 3}
    assert store.query("SELECT count(), uniqExact(rank) FROM collectives").rows() == [(3, 3)]


def test_a_jsonl_files_ingest_id_is_its_content_hash_whichever_way_the_table_is_told(tmp_path, store):
    """The ingest id of a JSON Lines file is hashed from the bytes read for the parse, in a thread,
    for the table its header, --table or name tells (issue 18); it equals the id from the file on
    disk, so a file ingested by an earlier version is still skipped. A header naming another table
    than the hint (--table wins) takes the id of the table the rows went to."""
    from ranklens.formats.rows import jsonl_table_hint
    from ranklens.ingest import content_ingest_id, file_ingest_id

    headed = _jsonl(tmp_path / "x.jsonl", HEADER, ROW)
    named = tmp_path / "collectives-7.jsonl"
    named.write_text(json.dumps(ROW) + "\n")
    assert jsonl_table_hint(headed, None, headed.read_bytes()) == "collectives"
    assert jsonl_table_hint(named, None, named.read_bytes()) == "collectives"
    assert jsonl_table_hint(tmp_path / "x.jsonl", None, b'{"a": 1}\n') is None  # nothing tells
    assert jsonl_table_hint(headed, None, b'{"ranklens": [\n') is None  # a header that is not JSON
    for p in (headed, named):
        assert content_ingest_id(p.read_bytes(), "collectives") == file_ingest_id(p, "collectives")
        assert ingest_paths(store, [p]) == {"collectives": 1}
        ids = store.query("SELECT DISTINCT ingest_id FROM collectives").column("ingest_id").tolist()
        assert file_ingest_id(p, "collectives") in ids
        assert ingest_paths(store, [p]) == {}  # the same content again: skipped


@pytest.mark.slow
def test_reingesting_kineto_traces_and_flight_recorder_dumps_writes_their_rows_once(tmp_path, store):
    """issue 22 #10, the other formats: a Kineto trace or a set of flight-recorder dumps ingested a
    second time is skipped (batches stamped with an ingest_id from content, job and attempt)."""
    import subprocess
    import sys
    from pathlib import Path

    data = Path(__file__).parent.parent.joinpath("data")
    trace = data / "kineto" / "hta_recsys_2rank_of128" / "sampled_rank-0.json.gz"
    dumps = data / "flight_recorder" / "healthy" / "fr_json"

    def ingest(*args: str) -> None:
        r = subprocess.run(
            [sys.executable, "-m", "ranklens.cli", "ingest", "--store", store.url, *args],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr

    def counts() -> tuple[int, int, int]:
        return tuple(
            store.query(f"SELECT count() FROM {t}").scalar() for t in ("trace_events", "collectives", "process_groups")
        )

    ingest("--job", "k", str(trace))
    ingest("--format", "flight-recorder", "--job", "fr", str(dumps))
    first = counts()
    assert all(n > 0 for n in first), first
    ingest("--job", "k", str(trace))
    ingest("--format", "flight-recorder", "--job", "fr", str(dumps))
    assert counts() == first
    ingest("--job", "k2", str(trace))  # the same trace filed under another job is that job's data
    assert counts()[0] == 2 * first[0]


def _same_rows(a, b) -> bool:
    """Arrow tables equal row by row (NaN equal to NaN)."""
    return a.schema == b.schema and all(
        all((x == y) or (x != x and y != y) for x, y in zip(ra.values(), rb.values()))
        for ra, rb in zip(a.to_pylist(), b.to_pylist())
    )


@pytest.mark.parametrize(
    ("name", "table", "lines"),
    [
        ("collectives.jsonl", None, [ROW, dict(ROW, rank=1, peer=3, nbytes=8), dict(ROW, seq=2, clock="cuda")]),
        ("steps-rank0.jsonl", None, [{"job_id": "j", "rank": 0, "step": 1, "start_ns": 1, "end_ns": 2, "loss": 0.5}]),
        ("anything.jsonl", "heartbeats", [{"job_id": "j", "rank": 0, "ts_ns": 5, "pgs": ["0"], "pg_entered": [3]}]),
        # an explicit null in a Float64 column is NaN, as a missing key is
        ("steps.jsonl", None, [{"job_id": "j", "rank": 0, "step": 1, "start_ns": 1, "end_ns": 2, "loss": None}] * 2),
        # 2**64 - 1 in UInt64, 2**31 - 1 in Int32, 255 in UInt8: the edges of the checked casts
        ("collectives.jsonl", None, [dict(ROW, ingest_id=2**64 - 1, rank=2**31 - 1, async_op=255)]),
    ],
)
def test_headerless_files_take_the_fast_path_and_read_as_the_strict_reader_does(tmp_path, name, table, lines):
    """issue 18: a file without a header line (table from --table or its name) is read by Arrow's
    reader with the table's schema and checked column by column, not value by value in Python."""
    from ranklens.formats.rows import _read_jsonl_fast, _read_jsonl_strict

    p = _jsonl(tmp_path / name, *lines)
    fast = _read_jsonl_fast(p, table)
    assert fast is not None
    strict = _read_jsonl_strict(p, table)
    assert fast[0] == strict[0]
    assert _same_rows(fast[1], strict[1])


@pytest.mark.parametrize(
    ("line", "message"),
    [
        # the errors of the line-by-line reader, with their line numbers, for files the fast path defers
        ({"job_id": "j"}, "line 2: required field 'rank' is missing"),
        (dict(ROW, rank=None), "line 2: field 'rank': expected an integer"),
        (dict(ROW, peer=None), "line 2: field 'peer': expected an integer"),
        (dict(ROW, pg=0), "line 2: field 'pg': expected a string"),
        (dict(ROW, peer=2**31), f"line 2: field 'peer': {2**31} is out of range"),
        (dict(ROW, async_op=-1), "line 2: field 'async_op': -1 is out of range"),
        (dict(ROW, seq=1.5), "line 2: field 'seq': expected an integer"),
        (json.dumps(ROW) + " " + json.dumps(ROW), "line 2: not valid JSON"),
        (json.dumps(ROW)[:30] + "\n" + json.dumps(ROW)[30:], "line 2: not valid JSON"),
        (json.dumps(dict(ROW, pg="\ud800")), "line 2: field 'pg': not valid Unicode"),
        (HEADER, "line 2: field 'ranklens' is not a column"),
    ],
)  # fmt: skip
def test_headerless_errors_are_the_strict_readers(tmp_path, line, message):
    raw = line if isinstance(line, str) else json.dumps(line)
    p = _jsonl(tmp_path / "collectives.jsonl", ROW, raw=raw + "\n")
    with pytest.raises(IngestError) as e:
        read_jsonl(p)
    assert f"{p}: {message}" in str(e.value)


def test_headerless_layouts_the_fast_path_leaves_to_the_strict_reader(tmp_path):
    """Blank lines, CRLF line ends and explicit nulls where a default would differ are still read
    (by the line-by-line reader), with the same rows a canonical file gives."""
    from ranklens.formats.rows import _read_jsonl_fast

    rows = [ROW, dict(ROW, rank=1)]
    canonical = read_jsonl(_jsonl(tmp_path / "collectives.jsonl", *rows))[1]
    body = "".join(json.dumps(r) + "\n" for r in rows)
    nulls = [dict(r, peer=None) for r in rows]  # the line-by-line reader's error (an integer expected)
    assert _read_jsonl_fast(_jsonl(tmp_path / "collectives-x.jsonl", *nulls), None) is None
    named_null = "".join(json.dumps(dict(r, op="null")) + "\n" for r in rows)  # "null" in a string
    canonical_null = canonical.set_column(
        canonical.column_names.index("op"), canonical.schema.field("op"), pa.array(["null"] * 2)
    )
    p = tmp_path / "collectives-y.jsonl"
    p.write_text(named_null)
    assert _same_rows(read_jsonl(p)[1], canonical_null)
    for i, text in enumerate([body.replace("\n", "\r\n"), "\n" + body + "\n\n", " " + body]):
        p = tmp_path / f"collectives-{i}.jsonl"
        p.write_text(text)
        assert _read_jsonl_fast(p, None) is None
        assert _same_rows(read_jsonl(p)[1], canonical), text
