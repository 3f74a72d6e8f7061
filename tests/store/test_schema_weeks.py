"""Schema for weeks (issue 19): a current server gets day partitions, TTL, codecs, LowCardinality and
a DateTime64(9) ``ts``; 18.16 (the floor) keeps its DDL byte for byte."""

from __future__ import annotations

import math
import time

import pytest

from ranklens.errors import ConfigError
from ranklens.schema import (
    DEFAULT_RETENTION_DAYS,
    GRAFANA_TS,
    ROLLUPS,
    TABLES,
    TIME_COLUMN,
    parse_retention,
    parse_server_version,
    render_ddl_for,
    render_server_ddl,
)


def _statements(ddl: str) -> list[str]:
    out = []
    for stmt in ddl.split(";\n"):
        stmt = "\n".join(line for line in stmt.splitlines() if not line.startswith("--")).strip()
        if stmt:
            out.append(stmt)
    return out


@pytest.mark.parametrize("version", [None, (18, 16), (19, 17), (21, 7)])
def test_floor_ddl_is_unchanged_below_the_gate(version):
    assert render_ddl_for("ranklens", version) == render_server_ddl("ranklens")
    assert "PARTITION" not in render_server_ddl() and "CODEC" not in render_server_ddl()


def test_version_and_retention_parsing():
    assert parse_server_version("18.16.1") == (18, 16)
    assert parse_server_version("26.9.2.1") == (26, 9)
    with pytest.raises(ConfigError, match=r"'eighteen'.*MAJOR.MINOR"):
        parse_server_version("eighteen")
    assert parse_retention(["collectives=7", "drills=0"]) == {"collectives": 7, "drills": 0}
    with pytest.raises(ConfigError, match=r"'collectives=-1'.*whole number >= 0"):
        parse_retention(["collectives=-1"])
    with pytest.raises(ConfigError, match=r"'ranks=3'.*TABLE one of collectives"):
        parse_retention(["ranks=3"])
    with pytest.raises(ConfigError, match=r"'collectives'.*TABLE=DAYS"):
        parse_retention(["collectives"])


def _literal(v) -> str:
    if isinstance(v, str):
        return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    if isinstance(v, list):
        return "[" + ", ".join(_literal(x) for x in v) + "]"
    return repr(v)


def test_current_ddl_runs_on_chdb():
    session = pytest.importorskip("chdb.session")
    # chDB's engine is one per process, opened by whoever came first (an embedded store: ':memory:'):
    # join it and work in a database of this test's own
    s = session.Session()
    db = f"rl_weeks_{time.time_ns()}"
    try:
        version = parse_server_version(str(s.query("SELECT version()", "CSV")).strip().strip('"'))
        ddl = render_ddl_for(db, version, {"collectives": 7})
        assert "CODEC(T64, ZSTD)" in ddl  # chDB embeds a current release
        for stmt in _statements(ddl):
            s.query(stmt)
        now_ns = time.time_ns()
        for t in TABLES.values():
            row = []
            for c in t.columns:
                v = c.default_value()
                if c.name.endswith("_ns") and c.type == "Int64":
                    v = now_ns
                elif c.type == "String":
                    v = f"{c.name}'x"
                row.append(_literal(v))
            # the server store's insert: its column list, which leaves the materialised ts out
            s.query(f"INSERT INTO {db}.{t.name} ({', '.join(t.column_names)}) VALUES ({', '.join(row)})")
            got = str(s.query(f"SELECT * FROM {db}.{t.name}", "TSV")).rstrip("\n").split("\t")
            assert len(got) == len(t.columns), t.name  # SELECT * does not see ts
            create = str(s.query(f"SHOW CREATE TABLE {db}.{t.name}", "TSVRaw"))
            time_col = TIME_COLUMN.get(t.name)
            if time_col is None:
                assert "PARTITION BY" not in create and "TTL" not in create, t.name
                continue
            ts = str(s.query(f"SELECT toUnixTimestamp64Nano({GRAFANA_TS}) FROM {db}.{t.name}", "TSV")).strip()
            assert int(ts) == now_ns, t.name
            assert f"PARTITION BY toYYYYMMDD(toDateTime(intDiv({time_col}, 1000000000)))" in create
            days = 7 if t.name == "collectives" else DEFAULT_RETENTION_DAYS[t.name]
            if days:
                assert f"toIntervalDay({days})" in create and "ttl_only_drop_parts = 1" in create, t.name
            else:
                assert "TTL" not in create, t.name
            part = str(s.query(f"SELECT partition FROM system.parts WHERE database = '{db}' AND table = '{t.name}'"))
            assert time.strftime("%Y%m%d", time.gmtime(now_ns / 1e9)) in part, t.name
        create = str(s.query(f"SHOW CREATE TABLE {db}.collectives", "TSVRaw"))
        assert "`job_id` LowCardinality(String)" in create and "`seq` Int64 CODEC(Delta(8), ZSTD(1))" in create
        # the rollup: filled by its view from the row inserted above, partitioned by day, kept 180 days
        day = now_ns // 86_400_000_000_000
        got = str(
            s.query(
                f"SELECT day, countMerge(rows), maxMerge(last_enter_ns), argMaxMerge(last_rank) "
                f"FROM {db}.collective_arrivals GROUP BY day",
                "TSV",
            )
        ).split()
        assert got == [str(day), "1", str(now_ns), "0"], got
        create = str(s.query(f"SHOW CREATE TABLE {db}.collective_arrivals", "TSVRaw"))
        assert "AggregatingMergeTree" in create and "PARTITION BY day" in create and "toIntervalDay(180)" in create
    finally:
        s.query(f"DROP DATABASE IF EXISTS {db}")
        s.close()


def test_cli_prints_the_ddl_for_a_version():
    from click.testing import CliRunner

    from ranklens.cli import cli

    floor = CliRunner().invoke(cli, ["schema", "--target", "server"])
    assert floor.exit_code == 0 and floor.output == render_server_ddl()
    current = CliRunner().invoke(cli, ["schema", "--server-version", "24.3", "--retention", "heartbeats=3"])
    assert current.exit_code == 0, current.output
    assert "INTERVAL 3 DAY" in current.output and "LowCardinality(String)" in current.output
    bad = CliRunner().invoke(cli, ["schema", "--server-version", "24.3", "--retention", "heartbeats=three"])
    assert bad.exit_code != 0 and "'heartbeats=three'" in bad.output


@pytest.mark.server
def test_the_floor_server_gets_the_floor_ddl(server_store):
    # CI's server is 18.16: the store must have picked the floor DDL (no partition, no codec)
    version = parse_server_version(str(server_store._execute("SELECT version()", database=False)[0][0]))
    create = server_store._execute(f"SHOW CREATE TABLE {server_store.config.database}.collectives")[0][0]
    if version < (21, 8):
        assert "PARTITION BY" not in create and "CODEC" not in create
    else:
        assert "PARTITION BY" in create and "CODEC" in create


def test_checked_in_current_ddl_is_up_to_date():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "deploy/clickhouse/single-current.sql"
    assert path.read_text() == render_ddl_for("ranklens", (24, 3)), (
        "regenerate: ranklens schema --server-version 24.3 > deploy/clickhouse/single-current.sql"
    )


def test_cluster_ddl_is_the_floor_below_the_gate_and_the_checked_in_current_one_is_up_to_date():
    from pathlib import Path

    from ranklens.schema import render_cluster_ddl, render_cluster_ddl_for

    assert render_cluster_ddl_for("ranklens", "ranklens", (18, 16)) == render_cluster_ddl()
    path = Path(__file__).resolve().parents[2] / "deploy/clickhouse/cluster-current.sql"
    assert path.read_text() == render_cluster_ddl_for("ranklens", "ranklens", (24, 3)), (
        "regenerate: ranklens schema --target cluster --server-version 24.3 > deploy/clickhouse/cluster-current.sql"
    )


def test_current_cluster_ddl_parses_and_its_local_tables_run_on_chdb():
    """A current server's own parser (chDB's formatQuery) takes every statement; the local tables,
    without ON CLUSTER and replication (chDB has no Keeper), are created, partitioned and expired
    as on one current server, and the Distributed tables keep the floor's shard keys."""
    import re

    from ranklens.schema import render_cluster_ddl_for

    session = pytest.importorskip("chdb.session")
    s = session.Session()
    db = f"rl_cweeks_{time.time_ns()}"
    try:
        version = parse_server_version(str(s.query("SELECT version()", "CSV")).strip().strip('"'))
        ddl = render_cluster_ddl_for(db, "ranklens", version, {"collectives": 7})
        stmts = _statements(ddl)
        assert len(stmts) == 2 + 2 * len(TABLES) + 3 * len(ROLLUPS)  # a rollup: local table, view, Distributed
        for stmt in stmts:
            parsed = str(s.query(f"SELECT formatQuery({_literal(stmt)})", "TSVRaw"))
            assert parsed.startswith("CREATE"), (stmt, parsed)
        s.query(f"CREATE DATABASE IF NOT EXISTS {db}")
        for stmt in stmts:
            if " AS " in stmt and "Distributed(" in stmt:
                assert "cityHash64" in stmt or "rand()" in stmt, stmt
                continue
            if stmt.startswith("CREATE DATABASE"):
                continue
            local = stmt.replace(" ON CLUSTER 'ranklens'", "")
            local = re.sub(r"Replicated(\w*)MergeTree\('[^']*', '\{replica\}'(, )?", r"\1MergeTree(", local)
            s.query(local)
        create = str(s.query(f"SHOW CREATE TABLE {db}.collectives_local", "TSVRaw"))
        assert "PARTITION BY toYYYYMMDD" in create and "toIntervalDay(7)" in create
        assert "`seq` Int64 CODEC(Delta(8), ZSTD(1))" in create and "`ts` DateTime64(9) MATERIALIZED" in create
        findings = str(s.query(f"SHOW CREATE TABLE {db}.findings_local", "TSVRaw"))
        assert "ReplacingMergeTree" in findings and "PARTITION BY" not in findings
        # the view on the local ledger fills the local rollup (on a cluster: on the replica a row lands on)
        cols = "job_id, rank, pg, seq, op, enter_ns, host"  # now: a 1970 part is expired and dropped at once
        s.query(f"INSERT INTO {db}.collectives_local ({cols}) VALUES ('j', 3, '0', 1, 'x', {time.time_ns()}, 'h')")
        got = str(s.query(f"SELECT host, countMerge(rows) FROM {db}.collective_arrivals_local GROUP BY host", "TSV"))
        assert got.split() == ["h", "1"], got
    finally:
        s.query(f"DROP DATABASE IF EXISTS {db}")
        s.close()


def test_retention_from_the_store_url():
    from ranklens.store.server import ServerConfig

    c = ServerConfig.from_url("clickhouse://h/db?retention=collectives:7,heartbeats:3")
    assert dict(c.retention) == {"collectives": 7, "heartbeats": 3}
    assert ServerConfig.from_url("clickhouse://h/db").retention == ()
    with pytest.raises(ConfigError, match=r"retention='ranks:3'.*TABLE:DAYS"):
        ServerConfig.from_url("clickhouse://h/db?retention=ranks:3")
    with pytest.raises(ConfigError, match=r"retention='collectives:a week'"):
        ServerConfig.from_url("clickhouse://h/db?retention=collectives:a week")


@pytest.mark.server
def test_url_retention_on_the_floor_server_is_said_not_applied(server_db_url, caplog):
    import logging

    from ranklens.store import open_store

    with caplog.at_level(logging.WARNING, logger="ranklens"):
        s = open_store(server_db_url + "?retention=collectives:7")
    try:
        version = parse_server_version(str(s._execute("SELECT version()", database=False)[0][0]))
        create = s._execute(f"SHOW CREATE TABLE {s.config.database}.collectives")[0][0]
        if version < (21, 8):  # CI's 18.16: no TTL, and the store says so instead of dropping it silently
            assert "TTL" not in create
            assert "retention=collectives:7 is not applied" in caplog.text
        else:
            assert "toIntervalDay(7)" in create and "not applied" not in caplog.text
    finally:
        s.close()
