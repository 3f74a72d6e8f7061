"""The embedded store: chDB (in-process ClickHouse) over immutable Parquet parts.

chDB allows one process per data directory, but the collector, the analyzers and the dashboard
are separate processes working at the same time on a live job. So no process owns a database:

* Writers write each batch as a Parquet *part* (temporary name, then atomic rename) and commit
  parts by rewriting ``manifest.json`` (atomic rename) under an exclusive ``flock``. The manifest
  is the commit point: a part not named in it is invisible, so a crashed writer leaves nothing
  half-written, and one ``write_many`` call commits all its tables at once.
* Every reader runs its own in-memory chDB session with one view per table over the parts the
  current manifest names (``file('dir/{a,b}.parquet', Parquet, structure)``); views are refreshed
  when the manifest changes, so readers see new data at once and never lock anything.
* Small parts are merged by :meth:`EmbeddedStore.compact` (any process may call it; the lock
  serialises compactions). Replaced parts are deleted only after a grace period, so a reader
  that planned a query on the old manifest can still read them.

Layout::

    <root>/meta.json                    {"schema_version": N, "created_ns": ...}
    <root>/manifest.json                {"generation": k, "tables": {t: [part, ...]}, "garbage": [...]}
    <root>/.lock                        flock target for manifest updates
    <root>/parts/<table>/<part>.parquet immutable parts (and empty.parquet: the table's schema)
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ranklens.errors import ConfigError, SchemaVersionError, StoreError, StoreUnavailable
from ranklens.records import arrow_array, empty_arrow, repair_utf8
from ranklens.schema import SCHEMA_VERSION, TABLES, table
from ranklens.store.api import DEFAULT_BATCH_ROWS, QueryResult, _code_tokens, arrow_batch, check_batch_rows, rebatch
from ranklens.store.api import sql_string as _sql_quote

__all__ = ["EmbeddedStore"]

GC_GRACE_S = 120.0
COMPACT_MIN_PARTS = 16  # merge when a table has at least this many small parts
SMALL_PART_ROWS = 500_000  # parts smaller than this are merged together

# chDB error names of a query that failed reading the store's files (see query())
_IO_ERRORS = ("(FILE_DOESNT_EXIST)", "(CANNOT_OPEN_FILE)", "(CANNOT_READ_FROM_FILE_DESCRIPTOR)", "(CANNOT_STAT)")
_session_lock = threading.RLock()
_session: Any = None
_session_pid: int | None = None


def _chdb_session() -> Any:
    """One in-memory chDB session per process (re-created after fork)."""
    global _session, _session_pid
    if _session is None or _session_pid != os.getpid():
        try:
            from chdb import session as chdb_session
        except ImportError as e:  # pragma: no cover - depends on the install
            raise StoreUnavailable("the embedded store needs chDB: pip install 'ranklens[embedded]'") from e
        _session = chdb_session.Session()
        _session_pid = os.getpid()
    return _session


def _drain(session: Any) -> None:
    """After a query failed while executing, chDB (4.4) hands the next query on the session the
    remains of the failed one (an empty or invalid Arrow message: a spurious error for an innocent
    query, e.g. the first after the store's disk is back). Run throwaway queries until one is clean."""
    for _ in range(3):
        try:
            session.query("SELECT 1", "ArrowTable")
            return
        except Exception:
            continue


def _one_statement(sql: str) -> str:
    """``sql`` without a trailing ``;`` (and the comments after it): what ``INTO OUTFILE`` can follow."""
    tokens = _code_tokens(sql)
    seps = [i for kind, i in tokens if kind == ";"]
    if seps and not any(kind != ";" for kind, i in tokens if i > seps[0]):
        return sql[: seps[0]]
    return sql


def _dictionary_columns(schema: Any) -> list[str]:
    """The columns a part writes dictionary-encoded: the strings (job ids, process groups, ops,
    hosts: a few values each). Numbers are written plain: Parquet's dictionary tried on a column of
    timestamps or sizes gives up after a page and cost ~35 % of the write (200k ledger rows: 0.079
    -> 0.052 s, 1.98 -> 1.62 MB with zstd)."""
    import pyarrow as pa

    return [f.name for f in schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)]


class EmbeddedStore:
    """A store in a local directory, safe for concurrent writer and reader processes.

    Args:
        root: the data directory.
        create: create the directory if it does not exist (else StoreUnavailable).
    """

    backend = "embedded"

    def __init__(self, root: str | os.PathLike[str], *, create: bool = True, check_version: bool = True) -> None:
        self.root = Path(root).expanduser().resolve()
        if "{" in str(self.root) or "}" in str(self.root):
            # chDB reads the parts through file('<root>/parts/t/{a,b}.parquet'): braces in the root
            # would be glob alternatives too, and the store would read nothing, silently
            raise ConfigError(
                f"the embedded store's directory {str(self.root)!r} contains '{{' or '}}', which chDB reads as "
                "a file glob (it would find none of the store's files): choose a directory without braces"
            )
        self.url = f"embedded://{self.root}"
        self._db = "rl_" + hashlib.sha1(str(self.root).encode()).hexdigest()[:12]
        self._views: dict[str, tuple[str, ...]] = {}
        self._manifest_stamp: tuple[int, int, int] | None = None
        self._lock = threading.RLock()
        meta = self.root / "meta.json"
        if not meta.exists():
            if not create:
                raise StoreUnavailable(
                    f"no ranklens store at {self.root} (meta.json missing); "
                    "run `ranklens demo` or `ranklens ingest` to create one, or pass the right --store"
                )
            self._init_dir()
        if check_version:
            self._check_version()

    # -- layout -------------------------------------------------------------------------
    def _init_dir(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with self._locked():
                if (self.root / "meta.json").exists():
                    return  # another process initialised it meanwhile
                for name in TABLES:
                    self._write_empty_part(name)
                self._write_json("manifest.json", {"generation": 0, "tables": {n: [] for n in TABLES}, "garbage": []})
                self._write_json("meta.json", {"schema_version": SCHEMA_VERSION, "created_ns": time.time_ns()})
        except OSError as e:
            raise StoreUnavailable(f"cannot create the embedded store at {self.root}: {e}") from e

    def _check_version(self) -> None:
        try:
            meta = json.loads((self.root / "meta.json").read_text())
        except (OSError, ValueError) as e:
            raise StoreUnavailable(f"cannot read {self.root / 'meta.json'}: {e}") from e
        found = meta.get("schema_version")
        if found != SCHEMA_VERSION:
            if isinstance(found, int) and found < SCHEMA_VERSION:
                hint = f"upgrade it (every row is kept) with `ranklens schema --migrate --store {self.url}`"
            else:
                hint = "use a ranklens release of that schema version"
            raise SchemaVersionError(
                f"the store at {self.root} has schema version {found}, this ranklens expects "
                f"{SCHEMA_VERSION}; {hint}, or a new store directory (--store embedded:///new/dir)"
            )

    def _write_json(self, name: str, obj: Any) -> None:
        tmp = self.root / f".{name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "w") as f:
            json.dump(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.root / name)

    def _write_part(self, table_name: str, data: Any) -> str:
        """Write ``data`` as a new immutable part of ``table_name`` (temporary name, then rename);
        returns the part's file name. Not committed: the caller names it in the manifest."""
        import pyarrow.parquet as pq

        part = f"part-{time.time_ns():020d}-{os.getpid()}-{uuid.uuid4().hex[:8]}.parquet"
        d = self.root / "parts" / table_name
        tmp = d / f".{part}.tmp"
        pq.write_table(data, tmp, compression="zstd", use_dictionary=_dictionary_columns(data.schema))
        os.replace(tmp, d / part)
        return part

    def _write_empty_part(self, table_name: str) -> None:
        """``empty.parquet``: the table's schema, read when it has no parts."""
        import pyarrow.parquet as pq

        d = self.root / "parts" / table_name
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".empty-{uuid.uuid4().hex}.tmp"
        pq.write_table(empty_arrow(table_name), tmp)
        os.replace(tmp, d / "empty.parquet")

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock, open(self.root / ".lock", "a+") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def _read_manifest(self) -> dict[str, Any]:
        try:
            return json.loads((self.root / "manifest.json").read_text())
        except FileNotFoundError as e:
            raise StoreUnavailable(f"the embedded store at {self.root} has no manifest.json") from e
        except ValueError as e:
            raise StoreError(f"{self.root / 'manifest.json'} is corrupt: {e}") from e

    # -- writing ------------------------------------------------------------------------
    def write(self, table_name: str, data: Any) -> int:
        return self.write_many({table_name: data})[table_name]

    def write_many(self, batches: Mapping[str, Any]) -> dict[str, int]:
        staged: list[tuple[str, Path, int]] = []
        counts: dict[str, int] = {}
        try:
            for name, data in batches.items():
                t, data = arrow_batch(name, data)
                counts[t.name] = counts.get(t.name, 0) + data.num_rows
                if data.num_rows == 0:
                    continue
                part = self._write_part(t.name, data)
                staged.append((t.name, self.root / "parts" / t.name / part, data.num_rows))
            if staged:
                with self._locked():
                    m = self._read_manifest()
                    for name, path, rows in staged:
                        m["tables"].setdefault(name, []).append([path.name, rows])
                    m["generation"] += 1
                    self._write_json("manifest.json", m)
        except OSError as e:
            for _, path, _ in staged:
                with contextlib.suppress(OSError):
                    path.unlink()
            raise StoreUnavailable(f"cannot write to the embedded store at {self.root}: {e}") from e
        except BaseException:
            for _, path, _ in staged:
                with contextlib.suppress(OSError):
                    path.unlink()
            raise
        return counts

    def compact(self, *, min_parts: int = COMPACT_MIN_PARTS) -> dict[str, int]:
        """Merge small parts of every table; return how many parts each table lost."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        merged: dict[str, int] = {}
        with self._locked():
            m = self._read_manifest()
            now = time.time()
            changed = False
            for name, parts in m["tables"].items():
                small = [p for p in parts if p[1] < SMALL_PART_ROWS]
                if len(small) < min_parts:
                    continue
                d = self.root / "parts" / name
                data = pa.concat_tables([pq.read_table(d / p[0]) for p in small])
                part = self._write_part(name, data)
                names = {p[0] for p in small}
                m["tables"][name] = [p for p in parts if p[0] not in names] + [[part, data.num_rows]]
                m["garbage"].extend([f"{name}/{p}", now] for p in names)
                merged[name] = len(small) - 1
                changed = True
            keep = []
            for path, ts in m["garbage"]:
                if now - ts > GC_GRACE_S:
                    with contextlib.suppress(FileNotFoundError):
                        (self.root / "parts" / path).unlink()
                    changed = True
                else:
                    keep.append([path, ts])
            m["garbage"] = keep
            if changed:
                m["generation"] += 1
                self._write_json("manifest.json", m)
        return merged

    def discard_ingest(self, table_name: str, ingest_ids: Iterable[int]) -> int:
        """Remove the rows of the given ``ingest_id`` batches (a collector re-sending a batch the
        store holds in part); returns how many rows went. One commit; old parts are garbage."""
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        name = table(table_name).name
        ids = arrow_array(pa.uint64(), sorted({int(i) for i in ingest_ids}))
        removed = 0
        with self._locked():
            m = self._read_manifest()
            d = self.root / "parts" / name
            now = time.time()
            kept = []
            for part in m["tables"].get(name, []):
                data = pq.read_table(d / part[0])
                mask = pc.is_in(data.column("ingest_id"), value_set=ids)
                drop = pc.sum(mask).as_py() or 0
                if not drop:
                    kept.append(part)
                    continue
                removed += drop
                rest = data.filter(pc.invert(mask))
                m["garbage"].append([f"{name}/{part[0]}", now])
                if rest.num_rows:
                    kept.append([self._write_part(name, rest), rest.num_rows])
            if removed:
                m["tables"][name] = kept
                m["generation"] += 1
                self._write_json("manifest.json", m)
        return removed

    def ingest_rows(self, table_name: str, ingest_ids: Iterable[int]) -> dict[int, int]:
        """Rows per ``ingest_id`` of ``ingest_ids`` that the table holds, from its parts' Parquet
        footers: a written part's row groups hold one batch each (min = max of ``ingest_id`` says
        which, and the row count how many), and only a row group of several batches (a compacted
        part) whose range holds an id asked for is read, that column only. No chDB query: a one-shot
        ``ranklens ingest`` never starts chDB (~250 MB and ~0.3 s of the command)."""
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        want = {int(i) for i in ingest_ids}
        found: dict[int, int] = {}
        if not want:
            return found
        name = table(table_name).name
        lo_w, hi_w = min(want), max(want)
        d = self.root / "parts" / name
        try:
            for part, _rows in self._read_manifest()["tables"].get(name, []):
                f = pq.ParquetFile(d / part)
                md = f.metadata
                col = f.schema_arrow.get_field_index("ingest_id")
                for g in range(md.num_row_groups):
                    rg = md.row_group(g)
                    st = rg.column(col).statistics
                    if st is not None and st.has_min_max:
                        lo, hi = int(st.min), int(st.max)
                        if hi < lo_w or lo > hi_w:
                            continue
                        if lo == hi:
                            if lo in want:
                                found[lo] = found.get(lo, 0) + rg.num_rows
                            continue
                    vc = pc.value_counts(f.read_row_group(g, columns=["ingest_id"]).column(0))
                    for v, n in zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist(), strict=True):
                        if v in want:
                            found[v] = found.get(v, 0) + n
        except OSError as e:
            raise StoreUnavailable(f"cannot read the embedded store at {self.root}: {e}") from e
        return found

    # -- reading ------------------------------------------------------------------------
    def parts(self, table_name: str) -> list[str]:
        """Names of the committed parts of a table (for tools and tests)."""
        return [p[0] for p in self._read_manifest()["tables"].get(table(table_name).name, [])]

    def _refresh_views(self, session: Any) -> None:
        try:
            st = os.stat(self.root / "manifest.json")
        except FileNotFoundError as e:
            raise StoreUnavailable(f"the embedded store at {self.root} is gone") from e
        stamp = (st.st_mtime_ns, st.st_ino, st.st_size)
        if stamp == self._manifest_stamp and getattr(session, "_ranklens_db", None) == self._db:
            return
        m = self._read_manifest()
        if getattr(session, "_ranklens_db", None) != self._db:
            session.query(f"CREATE DATABASE IF NOT EXISTS {self._db}")
            session.query(f"USE {self._db}")
            session._ranklens_db = self._db
            self._views = getattr(session, "_ranklens_views", {}).setdefault(self._db, {})
        for name, t in TABLES.items():
            parts = tuple(p[0] for p in m["tables"].get(name, [])) or ("empty.parquet",)
            if self._views.get(name) == parts:
                continue
            d = self.root / "parts" / name
            if len(parts) == 1:
                path = str(d / parts[0])
            else:
                path = f"{d}/{{{','.join(parts)}}}"
            session.query(
                f"CREATE OR REPLACE VIEW {self._db}.{name} AS SELECT * FROM "
                f"file({_sql_quote(path)}, Parquet, {_sql_quote(t.structure())})"
            )
            self._views[name] = parts
        self._manifest_stamp = stamp

    def query(self, sql: str) -> QueryResult:
        return QueryResult(repair_utf8(self._run(sql)))  # stored bytes that are not UTF-8: U+FFFD, not a crash

    def iter_query(self, sql: str, *, batch_rows: int = DEFAULT_BATCH_ROWS) -> Iterator[QueryResult]:
        """Yield the rows of ``sql`` ``batch_rows`` at a time.

        chDB writes the result to a temporary Arrow file (``INTO OUTFILE``, in ``$TMPDIR``) that is
        then read batch by batch: the process holds one batch, not the result, and the chDB
        session is free for other queries while the iterator is open (a chDB streaming query is
        cancelled by the next query on its session). The file is unlinked as soon as it is open,
        so nothing is left behind whatever becomes of the iterator."""
        check_batch_rows(batch_rows)
        return self._iter_query(sql, batch_rows)

    def _iter_query(self, sql: str, batch_rows: int) -> Iterator[QueryResult]:
        import pyarrow as pa

        stmt = _one_statement(sql)
        tmp = tempfile.mkdtemp(prefix="ranklens-iter-")
        try:
            path = os.path.join(tmp, "result.arrow")
            # on a line of its own: a trailing `-- comment` in `sql` does not swallow it
            self._run(f"{stmt}\nINTO OUTFILE {_sql_quote(path)} FORMAT Arrow")
            source = pa.OSFile(path)  # read (copied) batch by batch: no batch outlives a mapping
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # the open file keeps the data until it is closed
        with source:
            reader = pa.ipc.open_file(source)
            chunks = (reader.get_batch(i) for i in range(reader.num_record_batches))
            yield from rebatch((repair_utf8(pa.Table.from_batches([b])) for b in chunks), batch_rows)

    def _run(self, sql: str) -> Any:
        """``sql``'s result as a ``pyarrow.Table``, on this process's chDB session."""
        with _session_lock:
            session = _chdb_session()
            if not hasattr(session, "_ranklens_views"):
                session._ranklens_views = {}
            self._refresh_views(session)
            try:
                # the Arrow file read here: chDB's "ArrowTable" does the same after importing pandas
                # (~0.5 s of a one-shot `ranklens ingest`, issue 18)
                return _arrow_result(session.query(sql, "Arrow"))
            except Exception as e:  # chdb raises RuntimeError subclasses
                _drain(session)
                if any(code in str(e) for code in _IO_ERRORS):
                    # a part file it cannot read is the store's disk failing, not a bad query: callers
                    # retry (the shipper keeps its segments) instead of blaming what they asked about
                    raise StoreUnavailable(f"cannot read the embedded store at {self.root}: {e}") from e
                raise StoreError(f"query failed on the embedded store: {e}") from e

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"EmbeddedStore({str(self.root)!r})"


def _arrow_result(res: Any) -> Any:
    """A chDB result in the Arrow file format as a ``pyarrow.Table`` (an empty one has no schema)."""
    import pyarrow as pa

    if len(res) == 0:
        return pa.Table.from_batches([], schema=pa.schema([]))
    return pa.RecordBatchFileReader(res.get_memview().view()).read_all()
