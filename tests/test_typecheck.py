"""scripts/typecheck.py: mypy sees every package under its installed name (issue 13).

The folders tracing/, collector/, analyzers/, dashboards/ are installed as ranklens.<name>; given
to mypy by path they would be checked as top-level modules and a cross-package import such as
``from ranklens.analyzers.findings import Finding`` would be ``Any`` (or missing).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _typecheck_module():
    spec = importlib.util.spec_from_file_location("_typecheck", ROOT / "scripts" / "typecheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_files_get_their_installed_module_names() -> None:
    names = dict((str(p.relative_to(ROOT)), m) for p, m in _typecheck_module().iter_modules(ROOT))
    assert names["tracing/tracer.py"] == "ranklens.tracing.tracer"
    assert names["tracing/__init__.py"] == "ranklens.tracing"
    assert names["analyzers/findings.py"] == "ranklens.analyzers.findings"
    assert names["analyzers/recovery/engine.py"] == "ranklens.analyzers.recovery.engine"
    assert names["dashboards/__init__.py"] == "ranklens.dashboards"
    assert names["ranklens/config.py"] == "ranklens.config"
    # a folder without __init__.py is not a package: its file is its own top-level module
    assert names["ranklens/_bootstrap/sitecustomize.py"] == "sitecustomize"
    assert not [m for m in names.values() if m.split(".")[0] in ("tracing", "collector", "analyzers", "dashboards")]


@pytest.mark.slow  # mypy over the whole tree: about a minute with a warm .mypy_cache, more without
def test_cross_package_names_are_real_types_and_the_tree_passes(tmp_path: Path) -> None:
    probe = tmp_path / "typecheck_probe.py"
    probe.write_text(
        "from ranklens.analyzers.findings import Finding\n"
        "from ranklens.tracing.tracer import Tracer\n"
        "from ranklens.collector import Shipper\n"
        "reveal_type(Finding)\n"
        "reveal_type(Tracer)\n"
        "reveal_type(Shipper)\n"
        "def kind_of(f: Finding) -> str:\n"
        "    return f.kind\n"
        "reveal_type(kind_of)\n"
    )
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "typecheck.py"), str(probe)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    revealed = [ln.split("Revealed type is ", 1)[1] for ln in out.splitlines() if "Revealed type is " in ln]
    assert len(revealed) == 4, out
    finding, tracer, shipper, kind_of = revealed
    assert finding.endswith('-> ranklens.analyzers.findings.Finding"'), finding
    assert tracer.endswith('-> ranklens.tracing.tracer.Tracer"'), tracer
    assert shipper.endswith('-> ranklens.collector.shipper.Shipper"'), shipper
    assert "ranklens.analyzers.findings.Finding" in kind_of and "Any" not in kind_of, kind_of
    assert proc.returncode == 0, f"the tree does not type-check:\n{out}"


def test_the_ground_floor_is_strict() -> None:
    from mypy.main import process_options

    _, options = process_options(["--config-file", str(ROOT / "pyproject.toml"), str(ROOT / "ranklens" / "errors.py")])
    strict = ("disallow_untyped_defs", "disallow_any_generics", "warn_return_any", "disallow_untyped_calls")
    ground = ("ranklens.errors", "ranklens.config", "ranklens.schema", "ranklens.records", "ranklens.formats.spool")
    for module in ground:
        per_module = options.clone_for_module(module)
        assert all(getattr(per_module, flag) for flag in strict), (module, {f: getattr(per_module, f) for f in strict})
    assert not options.clone_for_module("ranklens.cli").disallow_untyped_defs  # the app floors are not (yet)
