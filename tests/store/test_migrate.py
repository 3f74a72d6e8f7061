"""`ranklens schema --migrate`: stores made by schema version 4 (tests/data/schema_v4) come up to
this version with every row kept, on the embedded store and on a real ClickHouse server."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from ranklens.cli import cli
from ranklens.errors import SchemaVersionError
from ranklens.schema import SCHEMA_VERSION
from ranklens.store import open_store
from ranklens.store.migrate import migrate

V4 = Path(__file__).parent.parent.joinpath("data") / "schema_v4"


def test_embedded_store_of_version_4_is_migrated_keeping_every_row(tmp_path):
    root = tmp_path / "store"
    shutil.copytree(V4 / "embedded", root)
    url = f"embedded://{root}"
    with pytest.raises(SchemaVersionError) as ei:
        open_store(url)
    assert "ranklens schema --migrate" in str(ei.value)
    r = CliRunner().invoke(cli, ["schema", "--migrate", "--store", url])
    assert r.exit_code == 0, r.output
    assert f"schema version 4 -> {SCHEMA_VERSION}" in r.output and "added host, ingest_id" in r.output
    store = open_store(url)
    rows = store.query("SELECT rank, seq, enter_ns, end_ns, ingest_id FROM collectives ORDER BY seq, rank").rows()
    assert len(rows) == 7 and rows[0] == (0, 0, 0, 9, 0) and rows[-1] == (0, 9, 100, 0, 0)
    (g,) = store.query("SELECT util_pct, retired_pages_sbe, pcie_tx_bytes_per_s, ingest_id FROM gpu_samples").rows()
    assert g[:2] == (50.0, -1) and math.isnan(g[2]) and g[3] == 0
    assert store.query("SELECT pid_ns, pg_entered FROM heartbeats").rows() == [(0, [2])]
    store.write("collectives", [{"job_id": "new", "rank": 0, "pg": "0", "seq": 1, "op": "x", "enter_ns": 1}])
    assert store.query("SELECT count() FROM collectives").scalar() == 8
    assert migrate(url) == []  # a second time: nothing to do


def test_server_store_of_version_4_is_migrated_keeping_every_row(server_db_url):
    from ranklens.store.server import ServerConfig, ServerStore

    cfg = ServerConfig.from_url(server_db_url)
    db = cfg.database
    raw = ServerStore(cfg, create=False, check_version=False)
    ddl = (V4 / "single.sql").read_text().replace("EXISTS ranklens;", f"EXISTS {db};").replace("ranklens.", f"{db}.")
    for stmt in ddl.split(";\n"):
        stmt = "\n".join(line for line in stmt.splitlines() if not line.startswith("--")).strip()
        if stmt:
            raw._execute(stmt, database=False)
    raw._execute(f"INSERT INTO {db}.ranklens_meta (key, value, updated_ns) VALUES", [("schema_version", "4", 1)])
    raw._execute(
        f"INSERT INTO {db}.collectives (job_id, rank, pg, seq, op, enter_ns, end_ns) VALUES",
        [("old", r, "0", q, "all_reduce", 10 * q + r, 10 * q + 9) for r in range(2) for q in range(3)],
    )
    raw._execute(f"INSERT INTO {db}.gpu_samples (host, gpu_index, ts_ns, util_pct) VALUES", [("n1", 0, 5, 50.0)])
    raw._execute(f"INSERT INTO {db}.ranks (job_id, rank, host) VALUES", [("old", 0, "n1")])
    raw.close()
    with pytest.raises(SchemaVersionError) as ei:
        open_store(server_db_url)
    assert "ranklens schema --migrate" in str(ei.value)
    done = migrate(server_db_url)
    assert any("collectives: ADD COLUMN host String DEFAULT '' AFTER async_op" in d for d in done), done
    assert any("collectives: ADD COLUMN ingest_id UInt64 DEFAULT 0 AFTER host" in d for d in done), done
    assert any("collective_arrivals: created, filled from 6 rows of collectives" in d for d in done), done
    assert any("heartbeats: ADD COLUMN pid_ns Int64 DEFAULT 0 AFTER host" in d for d in done), done
    assert done[-1].endswith(f"schema version 4 -> {SCHEMA_VERSION}")
    store = open_store(server_db_url)
    got = store.query("SELECT count(), sum(end_ns), max(ingest_id) FROM collectives").rows()
    assert got == [(6, 2 * (0 + 10 + 20) + 6 * 9, 0)]
    # the rollup holds the rows stored before it existed, each with its host from the ranks table
    rolled = store.query(
        "SELECT seq, host, countMerge(rows), maxMerge(last_enter_ns) FROM collective_arrivals "
        "GROUP BY seq, host ORDER BY seq, host"
    ).rows()
    assert rolled == [(q, h, 1, 10 * q + r) for q in range(3) for h, r in (("", 1), ("n1", 0))], rolled
    (g,) = store.query("SELECT util_pct, retired_pages_sbe, pcie_tx_bytes_per_s FROM gpu_samples").rows()
    assert g[:2] == (50.0, -1) and math.isnan(g[2])
    # what this version writes fits the migrated tables
    store.write("heartbeats", [{"job_id": "new", "rank": 0, "ts_ns": 1, "pid_ns": 42, "ingest_id": 7}])
    assert store.query("SELECT pid_ns, ingest_id FROM heartbeats").rows() == [(42, 7)]
    store.close()
    assert migrate(server_db_url) == []
