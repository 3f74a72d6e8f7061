"""Kineto (torch.profiler) traces: streamed ingest of real GPU traces, corrupt input writes nothing."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from ranklens.collector.kineto import ingest_kineto
from ranklens.errors import IngestError
from ranklens.formats.kineto import is_kineto_file

DATA = Path(__file__).parent.parent.joinpath("data") / "kineto"
# the recorded traces under 1 MB (the larger sets are ingested, on both backends, by test_traces_hta)
TRACES = sorted(p for p in DATA.rglob("*.json.gz") if p.stat().st_size < 1_000_000)


def _complete_events(path: Path) -> list[dict]:
    with gzip.open(path) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


@pytest.mark.parametrize("trace", TRACES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_real_trace_ingests(trace, store):
    expected = _complete_events(trace)
    assert is_kineto_file(trace)
    written = ingest_kineto(store, [trace], job_id="k")
    assert written == {"trace_events": len(expected)}
    r = store.query("SELECT count(), uniqExact(rank), countIf(collective != '') FROM trace_events").rows()[0]
    assert r[0] == len(expected) and r[1] == 1
    nccl = [e for e in expected if e.get("cat") == "kernel" and "nccl" in e["name"].lower()]
    assert r[2] >= len(nccl) > 0
    # microsecond timestamps become epoch nanoseconds (2023+), with baseTimeNanoseconds applied
    assert store.query("SELECT min(ts_ns) FROM trace_events").scalar() > 1_600_000_000 * 10**9


def test_rank_and_job_from_the_trace(tmp_path, embedded_store):
    ingest_kineto(embedded_store, [DATA / "hta_resnet_ddp_a100_rank0_of2" / "nccl_data.json.gz"])
    ((job, rank),) = embedded_store.query("SELECT DISTINCT job_id, rank FROM trace_events").rows()
    assert rank == 0 and job.startswith(
        "kineto-hta_resnet_ddp_a100_rank0_of2-"
    )  # distributedInfo.rank; job from the directory
    kinds = dict(
        embedded_store.query(
            "SELECT collective, count() FROM trace_events WHERE collective != '' GROUP BY collective"
        ).rows()
    )
    assert kinds.get("allreduce", 0) > 0


@pytest.mark.parametrize("damage", ["truncate", "garbage", "bad_event"])
def test_corrupt_traces_write_nothing(tmp_path, embedded_store, damage):
    with gzip.open(DATA / "hta_recsys_2rank_of128" / "sampled_rank-0.json.gz") as f:
        raw = f.read()
    bad = tmp_path / "rank0.json.gz"
    if damage == "truncate":
        bad.write_bytes(gzip.compress(raw[: len(raw) // 2]))
    elif damage == "garbage":
        bad.write_bytes(gzip.compress(raw[:5000] + b"\x00{not json" + raw[5000:]))
    else:
        doc = json.loads(raw)
        doc["traceEvents"].append({"ph": "X", "cat": "kernel", "name": "k", "ts": "soon", "dur": 1})
        bad.write_bytes(gzip.compress(json.dumps(doc).encode()))
    good = DATA / "hta_resnet_ddp_a100_rank0_of2" / "nccl_data.json.gz"
    with pytest.raises(IngestError) as e:
        ingest_kineto(embedded_store, [good, bad])
    assert str(bad) in str(e.value)
    assert embedded_store.query("SELECT count() FROM trace_events").scalar() == 0


def test_cli_detects_kineto(tmp_path):
    from click.testing import CliRunner

    from ranklens.cli import cli

    store = f"embedded://{tmp_path}/s"
    r = CliRunner().invoke(
        cli,
        [
            "ingest",
            "--store",
            store,
            "--job",
            "resnet",
            str(DATA / "hta_resnet_ddp_a100_rank0_of2" / "nccl_data.json.gz"),
        ],
    )
    assert r.exit_code == 0, r.output
    assert "trace_events:" in r.output


def test_epoch_microseconds_convert_exactly(embedded_store):
    """Integer `ts` in epoch microseconds (~1.7e15) times 1000 is past float64's mantissa: the
    conversion must be integer arithmetic, or starts move by up to 128 ns (and HTA's microsecond
    numbers no longer match)."""
    path = DATA / "hta_recsys_2rank_of128" / "sampled_rank-0.json.gz"
    with gzip.open(path) as f:
        ev = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    ingest_kineto(embedded_store, [path], job_id="exact")
    got = sorted(tuple(map(int, r)) for r in embedded_store.query("SELECT ts_ns, dur_ns FROM trace_events").rows())
    want = sorted((e["ts"] * 1000, round(e["dur"] * 1000)) for e in ev)
    assert isinstance(ev[0]["ts"], int) and ev[0]["ts"] > 10**15
    assert got == want


def test_batches_are_built_in_pieces_with_the_same_rows_and_bounds():
    """A batch is built 10,000 events at a time (memory) and written whole: its rows and its bounds
    (part of the write-once key of each batch) are those of a batch built at once."""
    from ranklens.formats import kineto as K

    trace = DATA / "hta_resnet_ddp_a100_rank0_of2" / "nccl_data.json.gz"
    n = len(_complete_events(trace))
    assert n > 20_000  # pieces: 10,000, 10,000, then the rest
    pieced = list(K.iter_kineto_batches(trace, job_id="k", batch_rows=20_000))
    assert [b.num_rows for b in pieced] == [20_000] * (n // 20_000) + ([n % 20_000] if n % 20_000 else [])
    assert all(b.column("ts_ns").num_chunks == 2 for b in pieced[:-1])  # two pieces of 10,000
    whole = list(K.iter_kineto_batches(trace, job_id="k", batch_rows=20_001))  # not a multiple: built at once
    assert all(b.column("ts_ns").num_chunks == 1 for b in whole)
    import pyarrow as pa

    assert pa.concat_tables(pieced).equals(pa.concat_tables(whole))


def test_info_keys_are_the_top_level_ones_wherever_they_are(tmp_path):
    """kineto_info parses only for the keys the file names: distributedInfo before the events,
    baseTimeNanoseconds after them (past the first 1 MB read, a name across two reads), and a key
    named only inside an event is not taken for the top-level one."""
    from ranklens.formats.kineto import kineto_info

    events = [{"ph": "X", "name": "k", "ts": 1, "dur": 1}]
    doc = {"distributedInfo": {"rank": 5}, "traceEvents": events, "pad": "", "baseTimeNanoseconds": 42}
    bare = json.dumps(doc, separators=(",", ":")).index('"baseTimeNanoseconds":42')
    doc["pad"] = "x" * ((1 << 20) - 10 - bare)  # the trailing key's name across the first 1 MB read
    text = json.dumps(doc, separators=(",", ":"))
    start = text.index('"baseTimeNanoseconds":42')
    assert start < 1 << 20 < start + len('"baseTimeNanoseconds"')
    full = tmp_path / "rank5.json.gz"
    full.write_bytes(gzip.compress(text.encode()))
    assert kineto_info(full) == {"distributedInfo": {"rank": 5}, "baseTimeNanoseconds": 42}

    del doc["baseTimeNanoseconds"]  # named by an event only: no top-level value
    doc["traceEvents"] = [
        {"ph": "X", "name": "baseTimeNanoseconds", "ts": 1, "dur": 1, "args": {"baseTimeNanoseconds": 7}}
    ]
    inner = tmp_path / "inner.json"
    inner.write_text(json.dumps(doc))
    assert kineto_info(inner) == {"distributedInfo": {"rank": 5}}
    assert kineto_info(inner, ("cuptiVersion",)) == {}


def test_a_trace_is_parsed_once_and_its_spilled_batches_are_the_readers(tmp_path, embedded_store, monkeypatch):
    """Ingest parses each trace once: its batches go to a temporary Arrow file while the whole set
    is validated, and are written from there (the same rows and bounds as the reader's batches,
    so the same write-once keys); the temporary files are gone afterwards, also after a refusal."""
    import tempfile

    import ranklens.formats.kineto as fk

    trace = DATA / "hta_recsys_a100_80gb_rank0_of16" / "rank0.json.gz"  # two batches: 50,000 rows + the rest
    direct = list(fk.iter_kineto_batches(trace, job_id="j"))
    spilled = fk.spill_kineto(trace, tmp_path / "t.arrow", job_id="j")
    replayed = list(spilled)
    assert len(direct) == 2 and [t.num_rows for t in replayed] == [t.num_rows for t in direct] == spilled.batch_rows
    assert all(a.equals(b) for a, b in zip(direct, replayed))
    assert [t.num_rows for t in spilled] == spilled.batch_rows  # replayed as often as asked

    parses = []
    real = fk._row_lists
    monkeypatch.setattr(fk, "_row_lists", lambda p, *a, **k: parses.append(p) or real(p, *a, **k))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    assert ingest_kineto(embedded_store, [trace], job_id="once") == {"trace_events": spilled.rows}
    assert parses == [trace]
    assert not list((tmp_path / "tmp").iterdir())
    bad = tmp_path / "rank1.json"
    bad.write_text('{"traceEvents": [{"ph": "X", "name": "k", "ts": 1, "dur": 1}, ')
    with pytest.raises(IngestError, match="corrupt or truncated"):
        ingest_kineto(embedded_store, [trace, bad], job_id="twice")
    assert not list((tmp_path / "tmp").iterdir())
    assert embedded_store.query("SELECT count() FROM trace_events WHERE job_id = 'twice'").scalar() == 0


def test_a_spill_that_cannot_be_written_is_a_clear_error(tmp_path):
    from ranklens.formats.kineto import spill_kineto

    trace = DATA / "hta_recsys_2rank_of128" / "sampled_rank-0.json.gz"
    with pytest.raises(IngestError, match=r"cannot keep the parsed trace in .*TMPDIR"):
        spill_kineto(trace, tmp_path / "missing" / "t.arrow", job_id="j")
