"""The server store's column conversions (issue 18): inserts hand the driver plain lists made
through numpy, not ``to_pylist``; a query's numeric columns become Arrow arrays from buffers. The
values must be exactly what ``to_pylist`` / ``pa.array`` give."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pyarrow as pa
import pytest

from ranklens.store.server import _arrow_table, _column_values


@pytest.mark.parametrize(
    "col",
    [
        pa.chunked_array([pa.array([1, -2, 3], pa.int32()), pa.array([2**31 - 1], pa.int32())]),
        pa.chunked_array([pa.array([0, 2**64 - 1], pa.uint64())]),
        pa.chunked_array([pa.array([0, 255, 7], pa.uint8()).slice(1)]),  # a slice: an offset into its buffer
        pa.chunked_array([pa.array([1.5, math.inf, -0.0], pa.float64())]),
        pa.chunked_array([pa.array(["a", "bb", "a", "", "é"]), pa.array(["bb", "a"]).slice(1)]),
        pa.chunked_array([pa.array([[1, 2], []], pa.list_(pa.int32()))]),
        pa.chunked_array([], pa.string()),
    ],
)
def test_insert_columns_are_the_values_to_pylist_gives(col):
    got = _column_values(col)
    assert got == col.to_pylist()
    assert [type(v) for v in got] == [type(v) for v in col.to_pylist()]


def test_query_columns_keep_their_types_and_values():
    types = [("n", "UInt64"), ("i", "Int32"), ("x", "Float64"), ("s", "String")]
    t = _arrow_table(types, [(2**64 - 1, 0), (-5, 7), (0.25, math.nan), ("a", "b")])
    assert t.schema.types == [pa.uint64(), pa.int32(), pa.float64(), pa.string()]
    assert t.column("n").to_pylist() == [2**64 - 1, 0]
    assert t.column("i").to_pylist() == [-5, 7]
    assert t.column("x").to_pylist()[0] == 0.25 and math.isnan(t.column("x").to_pylist()[1])
    assert _arrow_table(types, []).num_rows == 0


def test_an_embedded_ingest_does_not_import_pandas(tmp_path):
    """pandas' import was ~0.5 s of a one-shot ``ranklens ingest`` (chDB's ArrowTable results,
    ``pa.array`` of Python lists): the ingest path builds its Arrow data without it (creating a
    store, once, may)."""
    from ranklens.store import open_store

    open_store(f"embedded://{tmp_path}/store").close()
    (tmp_path / "collectives.jsonl").write_text(
        '{"job_id": "j", "rank": 0, "pg": "0", "seq": 1, "op": "all_reduce", "enter_ns": 100}\n'
    )
    code = (
        "import sys\n"
        "from ranklens.store import open_store\n"
        "from ranklens.ingest import ingest_paths\n"
        f"s = open_store('embedded://{tmp_path}/store')\n"
        f"assert ingest_paths(s, [{str(tmp_path / 'collectives.jsonl')!r}]) == {{'collectives': 1}}\n"
        "assert s.query('SELECT count() FROM collectives').scalar() == 1\n"
        "print('pandas' in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_the_driver_is_imported_with_its_lazy_date_table_and_the_environment_is_left_as_it_was():
    code = (
        "import os, datetime\n"
        "from ranklens.store.server import _import_driver\n"
        "_import_driver()\n"
        "import clickhouse_driver.columns.datecolumn as dc\n"
        "assert 'CLICKHOUSE_DRIVER_LASY_DATE_LUT' not in os.environ\n"
        "assert dc._date_lut[19844] == datetime.date(2024, 5, 1)\n"  # filled on demand, the same date
        "assert dc._date_lut_reverse[datetime.date(2024, 5, 1)] == 19844\n"
        "print(type(dc._date_lut).__name__)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CLICKHOUSE_DRIVER_LASY_DATE_LUT"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "LazyLUT"


def _open_sockets() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


@pytest.mark.server
def test_a_cli_command_run_in_process_closes_its_server_connections(server_db_url):
    # A CI run failed on a ResourceWarning for a socket to the server left open by an earlier test
    # that ran a command in-process (click's runner): the command's store was never closed, and
    # the error's traceback (kept in the runner's result) held it until the garbage collector
    # found it during a later test. A command closes its store when it ends, also on an error.
    from click.testing import CliRunner

    from ranklens.cli import cli
    from ranklens.store import open_store

    open_store(server_db_url).close()
    before = _open_sockets()
    results = []
    for args in (["analyze", "--job", "no-such-job"], ["sql", "SELECT 1"], ["sql", "SELECT nope"]):
        results.append(CliRunner().invoke(cli, [args[0], "--store", server_db_url, *args[1:]]))
        assert _open_sockets() == before, (args, results[-1].output)
    assert [r.exit_code for r in results] == [8, 0, 3], [r.output for r in results]
