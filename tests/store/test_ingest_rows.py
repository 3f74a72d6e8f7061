"""The embedded store counts the rows of ingest_id batches from its Parquet footers (no chDB).

``stored_ingest_rows`` (what ``ranklens ingest`` and the write-once ingests ask before writing) and
the shipper's settling use it, so a one-shot ingest into the embedded store never starts chDB
(issue 17/18: ~250 MB and ~0.3 s of the command). Its answer must be the SQL's, also on compacted
parts whose row groups hold several batches, and after a batch was discarded.
"""

from __future__ import annotations

import subprocess
import sys

from ranklens.store.once import stamp, stored_ingest_rows
from tests.helpers import synthetic_job


def collective_rows(job: str, n: int) -> list[dict]:
    rows = synthetic_job(job_id=job, ranks=2, steps=n, collectives_per_step=1)["collectives"]
    return rows[:n]


def _sql_counts(store, ids):
    got = store.query(
        f"SELECT ingest_id, count() FROM collectives WHERE ingest_id IN ({', '.join(map(str, ids))}) GROUP BY ingest_id"
    ).rows()
    return {int(i): int(n) for i, n in got}


def _write(store, iid: int, n: int, job: str = "j"):
    from ranklens.records import to_arrow

    rows = collective_rows(job, n)
    store.write("collectives", stamp(to_arrow("collectives", rows), iid))


def test_counts_equal_the_sql_on_written_compacted_and_discarded_parts(embedded_store):
    store = embedded_store
    sizes = {101: 5, 2**62 + 7: 3, 303: 8, 404: 1}
    for iid, n in sizes.items():
        _write(store, iid, n)
    ask = [*sizes, 999, 1]  # two ids never written
    assert store.ingest_rows("collectives", ask) == sizes == _sql_counts(store, ask)
    assert stored_ingest_rows(store, "collectives", ask) == sizes
    assert store.ingest_rows("collectives", []) == {} and store.ingest_rows("steps", [101]) == {}
    # compacted: the batches share a part and its row group (min != max: the column is read)
    for iid in range(500, 520):
        _write(store, iid, 2)
    assert store.compact(min_parts=2)
    assert len(store.parts("collectives")) == 1
    ask = [*sizes, *range(500, 520), 999]
    want = {**sizes, **dict.fromkeys(range(500, 520), 2)}
    assert store.ingest_rows("collectives", ask) == want == _sql_counts(store, ask)
    # a batch discarded is gone from the counts
    store.discard_ingest("collectives", [303, 510])
    want = {k: v for k, v in want.items() if k not in (303, 510)}
    assert store.ingest_rows("collectives", ask) == want == _sql_counts(store, ask)


def test_an_ingest_into_the_embedded_store_never_starts_chdb_nor_pandas(tmp_path):
    src = tmp_path / "collectives.jsonl"
    import json

    src.write_text("".join(json.dumps(r) + "\n" for r in collective_rows("j", 50)))
    code = (
        "import sys\n"
        "from ranklens.cli import main\n"
        f"sys.argv = ['ranklens', 'ingest', '--store', 'embedded://{tmp_path}/s', '{src}']\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print('chdb' in sys.modules, 'pandas' in sys.modules, file=sys.stderr)\n"
    )
    for attempt in ("first", "again"):  # the second finds the rows stored: nothing written
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stderr.strip().splitlines()[-1] == "False False", (attempt, out.stderr[-2000:])
        assert ("already in the store" in out.stdout) == (attempt == "again"), out.stdout
