"""records.arrow_array: columns from buffers equal to pa.array's, and one-shot commands free of pandas.

pyarrow imports pandas (~50 MB, ~0.2 s) on any ``pa.array`` of Python values or NumPy arrays, to
check whether they are pandas'; arrow_array builds the schema's column types from buffers instead
and hands everything else to ``pa.array`` (issue 17: a one-shot ingest's and analysis's peak RSS).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from ranklens.records import arrow_array, arrow_schema, arrow_table

CASES = [
    (pa.int64(), [1, -2, 2**62]),
    (pa.int32(), [0, 2**31 - 1, -(2**31)]),
    (pa.uint8(), [0, 255]),
    (pa.uint64(), [0, 2**64 - 1]),
    (pa.float64(), [1.5, -0.0, float("inf"), 3]),
    (pa.float64(), [float("nan")]),
    (pa.string(), ["a", "", "nccl:all_reduce", "ünïcödé ✓", "x" * 1000]),
    (pa.string(), []),
    (pa.int64(), []),
    (pa.list_(pa.string()), [[], ["a", "é"], []]),
    (pa.list_(pa.int64()), [[1, 2], [], [3]]),
    (pa.list_(pa.string()), [[], []]),
]


@pytest.mark.parametrize("t,values", CASES, ids=lambda v: str(v)[:30])
def test_equal_to_pa_array(t, values):
    got = arrow_array(t, values)
    want = pa.array(values, type=t)
    got.validate(full=True)
    assert got.type == t and len(got) == len(values)
    assert got.to_pylist() == want.to_pylist() or (t == pa.float64() and np.isnan(got.to_pylist()).all())


def test_numpy_and_arrow_inputs_and_a_checked_cast():
    assert arrow_array(pa.int32(), np.array([1, 2], np.int64)).to_pylist() == [1, 2]
    a = pa.array([1, 2], pa.int64())
    assert arrow_array(pa.int64(), a) is a
    assert arrow_array(pa.int32(), a).type == pa.int32()
    # a sliced NumPy view (non-contiguous) is copied, not read past its stride
    assert arrow_array(pa.int64(), np.arange(10, dtype=np.int64)[::3]).to_pylist() == [0, 3, 6, 9]


def test_what_the_buffers_cannot_hold_goes_to_pa_array():
    # out of range: pa.array's error, not a silent wrap
    with pytest.raises(pa.ArrowInvalid):
        arrow_array(pa.int32(), [2**40])
    with pytest.raises((pa.ArrowInvalid, OverflowError)):
        arrow_array(pa.uint8(), [-1])
    # None: pa.array's null; a bool in an integer column: pa.array's type error
    assert arrow_array(pa.int64(), [1, None]).to_pylist() == [1, None]
    assert arrow_array(pa.string(), ["a", None]).to_pylist() == ["a", None]
    with pytest.raises(pa.ArrowTypeError):
        arrow_array(pa.int64(), [True])
    # a lone surrogate cannot be UTF-8
    with pytest.raises((pa.ArrowInvalid, UnicodeEncodeError)):
        arrow_array(pa.string(), ["\udc80"])
    # types that are not a plain buffer of NumPy values
    assert arrow_array(pa.bool_(), [True, False, True]).to_pylist() == [True, False, True]


def test_arrow_table_fills_defaults_and_names_an_unknown_column():
    schema = arrow_schema("trace_events")
    cols = {"job_id": ["j", "j"], "rank": [0, 1], "ts_ns": [1, 2], "cat": ["kernel"] * 2, "name": ["k", "ü"]}
    t = arrow_table(cols, schema=schema)
    assert t.schema == schema and t.num_rows == 2
    assert t.column("name").to_pylist() == ["k", "ü"]
    assert t.column("dur_ns").to_pylist() == [0, 0] and t.column("pg").to_pylist() == ["", ""]  # defaults
    with pytest.raises(ValueError, match="no column nope"):
        arrow_table({**cols, "nope": [1, 2]}, schema=schema)
    with pytest.raises(ValueError, match="required column ts_ns"):
        arrow_table({k: v for k, v in cols.items() if k != "ts_ns"}, schema=schema)


def _imports_pandas(code: str) -> bool:
    """Whether running ``code`` in a fresh interpreter imports pandas."""
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys\nprint('pandas' in sys.modules)\n"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip() == "True"


def test_building_a_trace_batch_and_reading_a_query_result_do_not_import_pandas():
    code = (
        "from ranklens.records import arrow_schema, arrow_table\n"
        "arrow_table({'job_id': ['j'] * 2, 'rank': [0, 1], 'ts_ns': [5, 6], 'cat': ['k', 'k'], 'name': ['a', 'b']},"
        " schema=arrow_schema('trace_events'))\n"
        "from ranklens.store.server import _arrow_table\n"
        "_arrow_table([('a', 'Int64'), ('s', 'String'), ('l', 'Array(String)')], [[1, 2], ['x', 'y'], [['p'], []]])\n"
    )
    assert not _imports_pandas(code)


NUMPY_CASES = [
    *CASES,
    (pa.list_(pa.float64()), [[0.5], [], [1.0, float("nan")]]),
    (pa.uint16(), [1, 65535]),
]


@pytest.mark.parametrize("t,values", NUMPY_CASES, ids=lambda v: str(v)[:30])
@pytest.mark.parametrize("chunks", [1, 2, 0], ids=["one-chunk", "two-chunks", "slices"])
def test_numpy_array_equals_to_numpy(t, values, chunks):
    """records.numpy_array (QueryResult.column's conversion) gives what pyarrow's to_numpy gives,
    for one array, a column of two chunks and sliced chunks (an offset into the buffers)."""
    from ranklens.records import numpy_array

    a = arrow_array(t, values)
    if chunks == 1:
        col = pa.chunked_array([a], type=t)
    elif chunks == 2:
        col = pa.chunked_array([a, a], type=t)
    else:
        col = pa.chunked_array([a.slice(1), a.slice(0, 1)], type=t) if len(a) else pa.chunked_array([], type=t)
    got, want = numpy_array(col), col.to_numpy(zero_copy_only=False)
    assert got.dtype == want.dtype and len(got) == len(want)
    for x, y in zip(got, want):
        if isinstance(y, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y, equal_nan=x.dtype.kind == "f")
        else:
            assert (x == y) or (x != x and y != y)


def test_numpy_array_with_nulls_and_bools_takes_to_numpy():
    from ranklens.records import numpy_array

    for a in (pa.array([1, None, 3]), pa.array([True, False]), pa.array(["a", None])):
        got, want = numpy_array(a), a.to_numpy(zero_copy_only=False)
        assert got.dtype == want.dtype
        assert [str(x) for x in got] == [str(x) for x in want]


def test_analyze_reads_its_query_results_without_pandas(tmp_path):
    """`QueryResult.column` (every analyzer's read) and blame's list columns go through
    records.numpy_array: pyarrow's to_numpy imports pandas (~0.4 s and ~50 MB of a one-shot
    `ranklens analyze`)."""
    code = (
        "import pyarrow as pa\n"
        "from ranklens.records import arrow_array, numpy_array\n"
        "from ranklens.store.api import QueryResult\n"
        "t = pa.Table.from_arrays([arrow_array(pa.int64(), [1, 2]), arrow_array(pa.string(), ['a', 'b']),"
        " arrow_array(pa.list_(pa.int64()), [[1], []])], names=['i', 's', 'l'])\n"
        "r = QueryResult(t)\n"
        "assert r.column('i').tolist() == [1, 2] and r.column('s').tolist() == ['a', 'b']\n"
        "assert [x.tolist() for x in r.column('l')] == [[1], []]\n"
    )
    assert not _imports_pandas(code)
