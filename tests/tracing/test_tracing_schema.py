"""The tracer's rows are the schema's (issue 13 #4: "the tracer types the schema's keys by hand").

The tracer builds its rows as plain dicts on the training thread (no validation there: that would
cost the hot path). Two checks keep those hand-written keys honest, at no cost to training:

- statically, every dict literal that ``tracing/`` hands to ``add("<table>", {...})`` or queues as
  ``("<table>", {...})`` names only columns of that table, and every other row literal (one with
  ``job_id`` or the tracer's identity spread into it) fits some table (a typo in a path no test runs
  fails too);
- at run time, a tracer driven through steps, phases, collectives (completed, failed, in flight),
  process groups, coordinates, drops and its heartbeat writes segments that the strict reader of the
  open format accepts: no unknown key, no missing required column, every value of the column's type.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ranklens.formats.rows import _read_jsonl_strict
from ranklens.schema import TABLES
from ranklens.tracing import tracer as tracer_mod
from ranklens.tracing._patch import _register_group
from ranklens.tracing.tracer import Tracer

TRACING = Path(__file__).resolve().parents[2] / "tracing"


def _literal_rows() -> list[tuple[str, int, str, list[str]]]:
    """(file, line, table, literal keys) of every row dict literal in tracing/ tied to a table name."""
    found = []
    for path in sorted(TRACING.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            pair: tuple[ast.expr, ast.expr] | None = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add":
                if len(node.args) == 2:
                    pair = (node.args[0], node.args[1])
            elif isinstance(node, ast.Tuple) and len(node.elts) == 2:
                pair = (node.elts[0], node.elts[1])
            if pair is None:
                continue
            name, row = pair
            if not (isinstance(name, ast.Constant) and isinstance(name.value, str) and isinstance(row, ast.Dict)):
                continue
            keys = [k.value for k in row.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
            found.append((path.name, node.lineno, name.value, keys))
    return found


def test_the_tracers_row_literals_name_columns_of_their_table():
    rows = _literal_rows()
    assert {t for _f, _l, t, _k in rows} >= {"drops", "process_groups", "phases"}, rows  # the scan sees them
    wrong = []
    for file, line, table, keys in rows:
        if table not in TABLES:
            wrong.append(f"{file}:{line}: {table!r} is not a table")
            continue
        wrong += [f"{file}:{line}: {k!r} is not a column of {table}" for k in keys if not TABLES[table].has_column(k)]
    assert not wrong, "\n".join(wrong)


def test_every_row_built_in_tracing_fits_a_table():
    # rows built in one place and added in another (``row = {**self._ident, ...}``, a heartbeat
    # returned by a method): the table is not in the literal, but a typo still fits no table at all
    rows = []
    for path in sorted(TRACING.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Dict):
                continue
            keys = [k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
            spreads = [ast.unparse(v) for k, v in zip(node.keys, node.values) if k is None]
            if "job_id" in keys or any(s.endswith("._ident") for s in spreads):
                rows.append((path.name, node.lineno, keys))
    assert len(rows) >= 10, rows  # the scan sees the tracer's rows (steps, phases, collectives, heartbeats ...)
    misfits = [
        f"{file}:{line}: {keys} fit no table"
        for file, line, keys in rows
        if not any(all(t.has_column(k) for k in keys) for t in TABLES.values())
    ]
    assert not misfits, "\n".join(misfits)
    assert all(TABLES["ranks"].has_column(c) for c in ("pp", "tp", "dp"))  # the coordinates set_coords writes


def test_the_tables_the_tracer_writes_are_tables_of_the_schema():
    assert set(tracer_mod.TABLES) <= set(TABLES)


class _Dist:
    """The two calls _register_group makes on torch.distributed."""

    @staticmethod
    def get_process_group_ranks(g):
        return [0, 1, 2, 3]

    @staticmethod
    def get_backend(g):
        return "gloo"


class _Group:
    group_desc = "tp"


def test_every_row_the_tracer_spools_fits_its_table(tmp_path):
    ticks = iter(range(1_000, 10**9, 1_000))
    # a clock near 0: a failed collective dumps the flight recorder only 5 s after the last dump
    # (the dump would import torch, seconds on a loaded machine, and is not what this test checks)
    t = Tracer(
        job_id="j",
        attempt=1,
        rank=3,
        world_size=4,
        spool_dir=str(tmp_path),
        flush_interval_s=60,
        clock=lambda: next(ticks),
    )
    try:
        t.set_coords({"pp": 0, "tp": 1, "dp": 2})
        _register_group(t, _Dist, _Group(), "1")
        with t.step(7, samples=8, tokens=100, loss=0.5, grad_norm=1.25), t.phase("forward"):
            done = t.collective_entered("0", 1, "all_reduce", 4096, "float32", -1, False)
            t.collective_completed(done)
            failed = t.collective_entered("0", 2, "broadcast", 16, "int64", -1, True)
            t.collective_failed(failed)
            t.collective_entered("1", 1, "send", 64, "bfloat16", 2, True)  # still in flight: in the heartbeat
        t.count_drop("collectives:buffer_full", 2)
        t.flush()
    finally:
        t.shutdown()
    seen: dict[str, int] = {}
    for seg in sorted(tmp_path.rglob("*.jsonl")):
        name, data = _read_jsonl_strict(seg, None)  # raises IngestError naming the line and the field
        seen[name] = seen.get(name, 0) + data.num_rows
    for table in ("ranks", "process_groups", "steps", "phases", "collectives", "heartbeats", "drops"):
        assert seen.get(table), f"the tracer wrote no {table} rows: {seen}"
    assert set(seen) <= set(tracer_mod.TABLES), seen


@pytest.mark.parametrize("table", ["steps", "phases", "collectives", "heartbeats", "drops", "ranks"])
def test_the_strict_reader_would_catch_a_stray_key(tmp_path, table):
    # the run-time check above can fail: a row with a key that is not a column is refused
    from ranklens.errors import IngestError
    from ranklens.formats.spool import SpoolWriter

    seg = SpoolWriter(tmp_path).write(table, [{"job_id": "j", "no_such_column": 1}])
    assert seg is not None
    with pytest.raises(IngestError, match="no_such_column"):
        _read_jsonl_strict(seg, None)
