"""Bring a store of an older ranklens schema version up to this one (``ranklens schema --migrate``).

Schema changes are additive (new tables, new columns with defaults), so a migration adds what is
missing and keeps every row: on a ClickHouse server ``ALTER TABLE … ADD COLUMN … DEFAULT …``
(cheap: existing parts are not rewritten); on an embedded store every part is rewritten with the
new columns at their defaults, then committed with one manifest update under the store's lock.
A column whose type changed cannot be migrated: that is reported and nothing is changed.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from ranklens.errors import ConfigError, SchemaVersionError, StoreError
from ranklens.schema import META_TABLE, ROLLUPS, SCHEMA_VERSION, TABLES, Column, Rollup
from ranklens.store.api import sql_string

__all__ = ["migrate"]


def migrate(url: str) -> list[str]:
    """Migrate the store at ``url`` to :data:`SCHEMA_VERSION`; returns what was done (one line each).

    Raises:
        SchemaVersionError: the store is newer than this ranklens, or a column changed type.
        StoreUnavailable / StoreError: the store cannot be reached or changed.
    """
    if url.startswith("embedded://"):
        return _migrate_embedded(Path(url[len("embedded://") :]).expanduser())
    if url.startswith(("clickhouse://", "clickhouses://")):
        return _migrate_server(url)
    if "://" not in url:
        return _migrate_embedded(Path(url).expanduser())
    raise ConfigError(f"cannot migrate {url!r}: not an embedded:// or clickhouse:// store")


def _literal(c: Column) -> str:
    v = c.default_value()
    if c.is_array:
        return "[]"
    if isinstance(v, str):
        return sql_string(v)
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    return repr(v)


def _too_new(found: int, where: str) -> SchemaVersionError:
    return SchemaVersionError(
        f"{where} has schema version {found}, newer than this ranklens ({SCHEMA_VERSION}): upgrade ranklens instead"
    )


def _migrate_server(url: str) -> list[str]:
    from ranklens.config import ENV_STORE_PASSWORD
    from ranklens.store.server import ServerConfig, ServerStore

    cfg = ServerConfig.from_url(url, password_env=os.environ.get(ENV_STORE_PASSWORD))
    store = ServerStore(cfg, create=False, check_version=False)
    try:
        db = cfg.database
        rows = store._execute(f"SELECT argMax(value, updated_ns) FROM {db}.{META_TABLE} WHERE key = 'schema_version'")
        found = int(rows[0][0] or 0) if rows else 0
        if found > SCHEMA_VERSION:
            raise _too_new(found, f"database {db} on {store.url}")
        existing: dict[str, dict[str, str]] = {}
        for t, c, typ in store._execute(f"SELECT table, name, type FROM system.columns WHERE database = '{db}'"):
            existing.setdefault(t, {})[c] = typ
        plan: list[tuple[str, str]] = []
        done: list[str] = []
        for t in TABLES.values():
            have = existing.get(t.name)
            if have is None:
                continue  # a new table: created below
            prev = None
            for c in t.columns:
                if c.name in have:
                    if have[c.name] != c.type:
                        raise SchemaVersionError(
                            f"{db}.{t.name}.{c.name} is {have[c.name]} on the server, {c.type} in this ranklens: "
                            "not an additive change, cannot migrate"
                        )
                else:
                    after = f" AFTER {prev}" if prev else ""
                    plan.append((t.name, f"ADD COLUMN {c.name} {c.type} DEFAULT {_literal(c)}{after}"))
                prev = c.name
        for name, clause in plan:
            store._execute(f"ALTER TABLE {db}.{name} {clause}")
            done.append(f"{db}.{name}: {clause}")
        missing = [t.name for t in TABLES.values() if t.name not in existing]
        new_rollups = [r for r in ROLLUPS.values() if r.name not in existing]
        store.create_schema(upgrading=True)  # new tables and rollups (IF NOT EXISTS); the meta row below
        done.extend(f"{db}.{n}: created" for n in missing)
        for r in new_rollups:
            # the rows stored before the rollup existed; rows inserted meanwhile are counted twice
            # there, which the analyzers see (rows != ranks) and read the raw table for
            n = int(store._execute(f"SELECT count() FROM {db}.{r.source}")[0][0])
            store._execute(f"INSERT INTO {db}.{r.name} {r.select(_backfill_source(db, r))}")
            done.append(f"{db}.{r.name}: created, filled from {n} rows of {r.source}")
        if found != SCHEMA_VERSION:
            store._execute(
                f"INSERT INTO {db}.{META_TABLE} (key, value, updated_ns) VALUES",
                [("schema_version", str(SCHEMA_VERSION), time.time_ns())],
            )
            done.append(f"{db}: schema version {found} -> {SCHEMA_VERSION}")
        return done
    finally:
        store.close()


def _backfill_source(db: str, r: Rollup) -> str:
    """The rollup's source rows for a backfill: rows written before schema 11 name no host, the
    ``ranks`` table does (the analyzers align clocks by it)."""
    cols = [c.name for c in TABLES[r.source].columns if c.name != "host"]
    return (
        f"(SELECT {', '.join(cols)}, if(host = '', rank_host, host) AS host FROM {db}.{r.source} "
        f"ANY LEFT JOIN (SELECT job_id, attempt, rank, any(host) AS rank_host FROM {db}.ranks "
        "GROUP BY job_id, attempt, rank) USING (job_id, attempt, rank))"
    )


def _migrate_embedded(root: Path) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ranklens.records import arrow_schema
    from ranklens.store.embedded import EmbeddedStore

    root = root.resolve()
    meta_path = root / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise StoreError(f"no ranklens store at {root} (meta.json missing)") from None
    found = int(meta.get("schema_version") or 0)
    if found > SCHEMA_VERSION:
        raise _too_new(found, f"the store at {root}")
    if found == SCHEMA_VERSION:
        return []
    store = EmbeddedStore(root, create=False, check_version=False)
    done: list[str] = []
    with store._locked():
        m = store._read_manifest()
        now = time.time()
        for name, t in TABLES.items():
            d = root / "parts" / name
            target = arrow_schema(name)
            store._write_empty_part(name)
            parts = m["tables"].setdefault(name, [])
            new_parts = []
            for part_name, rows in parts:
                data = pq.read_table(d / part_name)
                added = []
                for c, f in zip(t.columns, target):
                    if c.name in data.column_names:
                        if data.schema.field(c.name).type != f.type:
                            try:
                                data = data.set_column(
                                    data.column_names.index(c.name), c.name, data.column(c.name).cast(f.type)
                                )
                            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                                raise SchemaVersionError(
                                    f"{root}: {name}.{c.name} cannot become {c.type} ({e}): cannot migrate"
                                ) from None
                        continue
                    data = data.append_column(f, pa.array([c.default_value()] * data.num_rows, type=f.type))
                    added.append(c.name)
                data = data.select(t.column_names).cast(target)
                new_parts.append([store._write_part(name, data), data.num_rows])
                m["garbage"].append([f"{name}/{part_name}", now])
                if added:
                    done.append(f"{name}/{part_name}: {rows} rows, added {', '.join(added)}")
            m["tables"][name] = new_parts
        m["generation"] += 1
        store._write_json("manifest.json", m)
        meta["schema_version"] = SCHEMA_VERSION
        meta["migrated_from"] = found
        store._write_json("meta.json", meta)
    done.append(f"{root}: schema version {found} -> {SCHEMA_VERSION}")
    return done
