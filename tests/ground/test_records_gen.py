"""The typed records are generated from the schema and cannot drift from it (issue 13 #4).

ranklens/formats/records_gen.py is plain source written by scripts/gen_records.py; these tests
regenerate it and compare, and check every record against its table independently of the generator
(names, Python types, which fields are required, defaults), then round-trip one record of every
table through the Arrow conversion.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import typing
from pathlib import Path

import pytest

from ranklens.formats import records_gen
from ranklens.records import RECORD_TYPES, record_type, to_arrow
from ranklens.schema import TABLES

ROOT = Path(__file__).resolve().parents[2]
# the schema's scalar types as Python types, written out here (not taken from the generator)
PYTHON = {"Int32": int, "Int64": int, "UInt8": int, "UInt32": int, "UInt64": int, "Float64": float, "String": str}
SAMPLE = {int: 7, float: 1.5, str: "x"}


def _generator():
    spec = importlib.util.spec_from_file_location("gen_records", ROOT / "scripts" / "gen_records.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_checked_in_records_are_what_the_schema_generates():
    gen = _generator()
    assert Path(records_gen.__file__).read_text(encoding="utf-8") == gen.render(), (
        "ranklens/formats/records_gen.py is stale: run .venv/bin/python scripts/gen_records.py"
    )
    assert gen.main(["--check"]) == 0


def test_records_re_exports_every_record_class_made_on_first_use():
    import subprocess
    import sys

    import ranklens.records as records

    assert sorted(records._RECORD_NAMES) == sorted(records_gen.__all__)
    assert all(getattr(records, n) is getattr(records_gen, n) for n in records_gen.__all__)
    with pytest.raises(AttributeError):
        records.NoSuchRecord  # noqa: B018
    # importing ranklens.records does not build them (a one-shot ingest never needs them)
    code = "import sys, ranklens.records; print('ranklens.formats.records_gen' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_the_check_fails_on_a_stale_file(tmp_path, monkeypatch):
    gen = _generator()
    stale = tmp_path / "records_gen.py"
    stale.write_text(gen.render().replace("    pg: str\n", "    pg: int\n", 1), encoding="utf-8")
    monkeypatch.setattr(gen, "OUT", stale)
    assert gen.main(["--check"]) == 1


@pytest.mark.parametrize("name", sorted(TABLES))
def test_every_record_matches_its_table(name):
    t = TABLES[name]
    cls = RECORD_TYPES[name]
    assert record_type(name) is cls and name == cls.TABLE
    params = dataclasses.fields(cls)
    assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen
    assert {f.name for f in params} == {c.name for c in t.columns}, "fields are not the table's columns"
    hints = typing.get_type_hints(cls)
    by_name = {f.name: f for f in params}
    for c in t.columns:
        f = by_name[c.name]
        scalar = PYTHON[c.scalar_type]
        assert hints[c.name] == (list[scalar] if c.is_array else scalar), f"{name}.{c.name}: {hints[c.name]}"
        if c.required:
            assert f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING, c.name
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        want = c.default_value()
        if isinstance(want, float) and math.isnan(want):
            assert isinstance(default, float) and math.isnan(default), c.name
        else:
            assert default == want and type(default) is type(want), f"{name}.{c.name}: {default!r} != {want!r}"
    # to_row lists every column once, in the table's order
    required = {
        c.name: [SAMPLE[PYTHON[c.scalar_type]]] if c.is_array else SAMPLE[PYTHON[c.scalar_type]]
        for c in t.columns
        if c.required
    }
    rec = cls(**required)
    assert list(rec.to_row()) == [c.name for c in t.columns]
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(rec, t.columns[0].name, None)
    data = to_arrow(name, [rec])
    assert data.num_rows == 1 and data.column_names == [c.name for c in t.columns]
    for key, value in required.items():
        assert data.column(key).to_pylist() == [value]


def test_a_record_is_a_typed_keyword_only_constructor():
    rec = records_gen.StepsRecord(job_id="j", rank=1, step=3, start_ns=10, end_ns=20)
    assert rec.to_row()["step"] == 3 and rec.attempt == 0
    with pytest.raises(TypeError):
        records_gen.StepsRecord("j", 1, 3, 10, 20)  # type: ignore[misc]
    with pytest.raises(TypeError):
        records_gen.StepsRecord(job_id="j", rank=1)  # type: ignore[call-arg]
