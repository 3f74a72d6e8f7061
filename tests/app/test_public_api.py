"""The public surface is what we mean it to be, and the light tracing part stays light."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import ranklens.analyzers
import ranklens.collector
import ranklens.store
import ranklens.tracing
from ranklens.schema import render_cluster_ddl, render_server_ddl

ROOT = Path(__file__).resolve().parents[2]


def test_public_names():
    assert set(ranklens.tracing.__all__) == {
        "Tracer",
        "allreduce_hook",
        "get_tracer",
        "init",
        "instrument_ddp",
        "phase",
        "shutdown",
        "step",
    }
    assert {"open_store", "Store", "QueryResult"} <= set(ranklens.store.__all__)
    assert {"find_stragglers", "Finding", "PersistentBlameDetector"} <= set(ranklens.analyzers.__all__)
    for mod in (ranklens.tracing, ranklens.store, ranklens.analyzers, ranklens.collector):
        for name in mod.__all__:
            assert hasattr(mod, name), (mod.__name__, name)


def test_tracing_imports_nothing_heavy():
    code = (
        "import sys, ranklens.tracing as t; "
        "bad = [m for m in ('pyarrow', 'chdb', 'clickhouse_driver', 'click', 'pandas') if m in sys.modules]; "
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


def test_no_generic_top_level_modules_installed():
    import importlib.util

    for generic in ("tracing", "collector", "analyzers", "dashboards"):
        spec = importlib.util.find_spec(generic)
        # only the repository checkout itself (on sys.path in tests) may provide these names
        assert spec is None or str(ROOT) in str(spec.origin or spec.submodule_search_locations)


def test_deploy_ddl_is_generated_and_current():
    assert (ROOT / "deploy/clickhouse/single.sql").read_text() == render_server_ddl()
    assert (ROOT / "deploy/clickhouse/cluster.sql").read_text() == render_cluster_ddl()


def test_ingest_doc_is_current():
    import runpy

    render = runpy.run_path(str(ROOT / "scripts/gen_ingest_doc.py"))["render"]
    assert (ROOT / "docs/ingest-format.md").read_text() == render()
