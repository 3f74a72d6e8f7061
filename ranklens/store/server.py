"""The server store: a ClickHouse server or cluster over the native protocol (clickhouse-driver).

* One ``Client`` per thread (clickhouse-driver's client is not thread-safe).
* Inserts are columnar, one block per table batch, so each batch is atomic on the server.
* Connection failures are retried with exponential backoff; a failure after the block may have
  reached the server is *not* retried blindly (it could duplicate rows): it raises
  :class:`StoreUnavailable` and the caller (the collector) keeps the data and retries the part.
* Minimum server version: 18.16 (Debian's). The SQL the analyzers use avoids newer features.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from ranklens.errors import ConfigError, SchemaVersionError, StoreAuthError, StoreError, StoreUnavailable
from ranklens.records import arrow_array, decode_replacing
from ranklens.schema import (
    META_TABLE,
    SCHEMA_VERSION,
    is_current_server,
    parse_retention,
    parse_server_version,
    render_ddl_for,
    table,
)
from ranklens.store.api import DEFAULT_BATCH_ROWS, QueryResult, arrow_batch, check_batch_rows, rebatch

__all__ = ["ServerConfig", "ServerStore", "hint_url", "redact_url"]

log = logging.getLogger("ranklens.store")


def hint_url(printable_url: str) -> str:
    """A store's printable URL (password shown as ``***``) as a hint can carry it: without the
    password, which the store then takes from ``$RANKLENS_STORE_PASSWORD``."""
    return printable_url.replace(":***@", "@", 1)


def redact_url(url: str) -> str:
    """``url`` with its password (if any) shown as ``***``: what messages and logs may print."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        password = None
        parts = None
    if parts is None or password is None:
        # not parseable, or no password: still hide anything between "//" and "@"
        head, sep, tail = url.partition("://")
        if sep and "@" in tail.split("/", 1)[0]:
            userinfo, _, rest = tail.partition("@")
            return f"{head}://{userinfo.split(':', 1)[0]}:***@{rest}" if ":" in userinfo else url
        return url
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user = userinfo.split(":", 1)[0]
    return parts._replace(netloc=f"{user}:***@{hostport}").geturl()


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 9000
    user: str = "default"
    password: str = ""
    database: str = "ranklens"
    secure: bool = False
    verify: bool = True
    ca_certs: str | None = None
    connect_timeout_s: float = 5.0
    send_receive_timeout_s: float = 300.0
    retries: int = 3
    # days rows are kept, per table, on a current server (``?retention=collectives:7,heartbeats:3``);
    # the others keep ranklens.schema.DEFAULT_RETENTION_DAYS
    retention: tuple[tuple[str, int], ...] = ()

    @classmethod
    def from_url(cls, url: str, *, password_env: str | None = None) -> ServerConfig:
        """Parse ``clickhouse://user:password@host:port/database?verify=false&ca_certs=...``.

        ``clickhouses://`` means TLS (default port 9440). A password absent from the URL is
        taken from ``password_env`` when given. ``retention=TABLE:DAYS[,TABLE:DAYS...]`` sets how
        long a current server (21.8+) keeps each table's rows when the store creates its tables.
        """
        parts = urlsplit(url)
        if parts.scheme not in ("clickhouse", "clickhouses"):
            raise ConfigError(f"not a ClickHouse URL: {redact_url(url)!r} (expected clickhouse:// or clickhouses://)")
        secure = parts.scheme == "clickhouses"
        q = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        database = parts.path.lstrip("/") or "ranklens"
        if not database.replace("_", "").isalnum():
            raise ConfigError(f"database name {database!r} in {redact_url(url)!r}: use letters, digits and _")
        try:
            port = parts.port or (9440 if secure else 9000)
        except ValueError as e:
            raise ConfigError(f"bad port in store URL: {e}") from None
        allowed = {"verify", "ca_certs", "connect_timeout", "send_receive_timeout", "retries", "retention"}
        unknown = set(q) - allowed
        if unknown:
            raise ConfigError(f"unknown store URL option(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
        password = unquote(parts.password) if parts.password is not None else (password_env or "")
        keep = q.get("retention", "")
        try:
            retention = parse_retention([x.strip().replace(":", "=", 1) for x in keep.split(",") if x.strip()])
        except ConfigError as e:
            raise ConfigError(
                f"store URL option retention={keep!r}: expected TABLE:DAYS[,TABLE:DAYS...] ({e})"
            ) from None
        try:
            return cls(
                host=parts.hostname or "127.0.0.1",
                port=port,
                user=unquote(parts.username) if parts.username else "default",
                password=password,
                database=database,
                secure=secure,
                verify=q.get("verify", "true").lower() not in ("0", "false", "no"),
                ca_certs=q.get("ca_certs"),
                connect_timeout_s=float(q.get("connect_timeout", 5.0)),
                send_receive_timeout_s=float(q.get("send_receive_timeout", 300.0)),
                retries=int(q.get("retries", 3)),
                retention=tuple(sorted(retention.items())),
            )
        except ValueError as e:
            raise ConfigError(f"bad option value in store URL {redact_url(url)!r}: {e}") from None

    def redacted_url(self) -> str:
        scheme = "clickhouses" if self.secure else "clickhouse"
        auth = f"{self.user}:***@" if self.password else f"{self.user}@"
        return f"{scheme}://{auth}{self.host}:{self.port}/{self.database}"


class ServerStore:
    """A store on a ClickHouse server. Creates the database and tables when ``create``."""

    backend = "server"

    def __init__(self, config: ServerConfig, *, create: bool = True, check_version: bool = True) -> None:
        try:
            _import_driver()
        except ImportError as e:  # pragma: no cover
            raise StoreUnavailable("the server store needs clickhouse-driver: pip install 'ranklens[store]'") from e
        self.config = config
        self.url = config.redacted_url()
        self._local = threading.local()
        self._clients: list[Any] = []
        self._clients_lock = threading.Lock()
        try:
            if create:
                self.create_schema()
            if check_version:
                self._check_version()
        except BaseException:
            self.close()
            raise

    # -- connection -------------------------------------------------------------------
    def _client(self, *, database: bool = True) -> Any:
        key = "client_db" if database else "client_nodb"
        c = getattr(self._local, key, None)
        if c is None:
            cfg = self.config
            c = self._new_client(cfg.host, cfg.port, cfg.database if database else "default")
            setattr(self._local, key, c)
            with self._clients_lock:
                self._clients.append(c)
        return c

    def _connect(self, client: Any) -> None:
        """Open ``client``'s connection with the whole handshake bounded by ``connect_timeout``.

        clickhouse-driver waits for the server's hello with the (long) send/receive timeout: a server
        that accepts and never answers held every attempt for 300 s (issue 22 #10)."""
        conn = client.connection
        if conn.connected:
            if conn.ping():  # bounded by sync_request_timeout; the driver's own reconnect is not
                return
            conn.disconnect()
        receive = conn.send_receive_timeout
        conn.send_receive_timeout = self.config.connect_timeout_s
        try:
            conn.connect()
        finally:
            conn.send_receive_timeout = receive
        if conn.socket is not None:
            conn.socket.settimeout(receive)

    def _execute(self, sql: str, params: Any = None, *, database: bool = True, **kw: Any) -> Any:
        """Run one statement. Reads and DDL are retried on network errors; an insert only while
        connecting (once its block may have reached the server, a retry could duplicate rows).

        A server that does not answer in time is retried once (it is seldom faster the next time),
        a refused connection ``retries`` times; refused credentials are not retried."""
        return self._run(lambda c: c.execute(sql, params, **kw), idempotent=params is None, database=database)

    def _run(self, op: Callable[[Any], Any], *, idempotent: bool, database: bool = True, client: Any = None) -> Any:
        """``op(client)`` on a connected client (this thread's, or ``client``), with the retries and
        the error messages of :meth:`_execute`."""
        from clickhouse_driver import errors as ch_errors

        cfg = self.config
        network = (ch_errors.NetworkError, ch_errors.SocketTimeoutError, EOFError, OSError)
        timeouts = (ch_errors.SocketTimeoutError, TimeoutError)
        delay = 0.2
        timed_out = 0
        own_client = client
        for attempt in range(cfg.retries + 1):
            client = own_client if own_client is not None else self._client(database=database)
            connecting = True
            try:
                self._connect(client)
                connecting = False
                return op(client)
            except network as e:
                client.disconnect()
                timeout = isinstance(e, timeouts)
                timed_out += timeout
                if connecting:
                    what = (
                        f"did not answer the connection handshake: timed out after {cfg.connect_timeout_s:g} s "
                        "(connect_timeout; is this a ClickHouse native-protocol port?)"
                        if timeout
                        else f"is unavailable: {_one_line(str(e))}"
                    )
                else:
                    what = (
                        f"did not answer the query: timed out after {cfg.send_receive_timeout_s:g} s "
                        "(send_receive_timeout)"
                        if timeout
                        else f"is unavailable: {_one_line(str(e))}"
                    )
                    if not idempotent:
                        what = f"failed during an insert (not retried): {what}"
                give_up = (
                    attempt == cfg.retries
                    or (not idempotent and not connecting)
                    or timed_out > 1
                    or (timeout and not connecting)
                )
                if give_up:
                    hint = (
                        "; store URL options ?connect_timeout=S&send_receive_timeout=S set the limits"
                        if timeout
                        else ""
                    )
                    raise StoreUnavailable(
                        f"ClickHouse server {self.url} {what} ({attempt + 1} attempt(s)){hint}"
                    ) from e
                time.sleep(delay)
                delay *= 2
            except ch_errors.ServerException as e:
                msg = _server_message(e)
                if connecting:  # refused during the handshake: the half-open connection is useless
                    client.disconnect()
                if e.code in _AUTH_CODES:
                    raise StoreAuthError(
                        f"ClickHouse server {self.url} refused the credentials of user {cfg.user!r}: {msg}; "
                        f"check the user and password in the store URL (or ${_password_env()})"
                    ) from None
                if _unavailable(e.code, msg):
                    # the server is up but could not reach its cluster (a replica or shard down,
                    # ZooKeeper gone): the store is unavailable, not the query wrong. A read is
                    # retried; an insert is not (part of it may be stored: the shipper asks first)
                    what = f"could not complete the query on its cluster: {msg}"
                    if not idempotent:
                        raise StoreUnavailable(
                            f"ClickHouse server {self.url} failed during an insert (not retried): {what}"
                        ) from None
                    if attempt == cfg.retries:
                        raise StoreUnavailable(
                            f"ClickHouse server {self.url} {what} ({attempt + 1} attempt(s))"
                        ) from None
                    time.sleep(delay)
                    delay *= 2
                    continue
                raise StoreError(f"ClickHouse server {self.url} rejected the query: {msg}") from None
            except ch_errors.Error as e:
                raise StoreError(f"ClickHouse client error against {self.url}: {_one_line(str(e))}") from e
        raise AssertionError("unreachable")  # pragma: no cover

    # -- schema -----------------------------------------------------------------------
    def create_schema(self, *, upgrading: bool = False) -> None:
        """Create the database and every table if missing; record the schema version.

        A store of another schema version is left as it is (its version check says how to migrate
        it): this version's views read columns its tables may not have yet. ``upgrading``: the
        migration, which has added them, creates what is missing."""
        if not upgrading and self._stored_version() not in ("", str(SCHEMA_VERSION)):
            return
        # the DDL for this server's version: 18.16 (the floor) as ever, a current one with day
        # partitions, TTL, codecs (ranklens.schema); tables that exist already keep theirs
        version = parse_server_version(str(self._execute("SELECT version()", database=False)[0][0]))
        if self.config.retention and not is_current_server(version):
            kept = ",".join(f"{t}:{d}" for t, d in self.config.retention)
            logging.getLogger("ranklens").warning(
                "store URL retention=%s is not applied: ClickHouse %d.%d has no TTL (21.8 or newer has); "
                "rows are kept until deleted",
                kept,
                *version,
            )
        for stmt in render_ddl_for(self.config.database, version, dict(self.config.retention)).split(";\n"):
            stmt = "\n".join(line for line in stmt.splitlines() if not line.startswith("--")).strip()
            if stmt:
                self._execute(stmt, database=False)
        rows = self._execute(f"SELECT value FROM {self.config.database}.{META_TABLE} WHERE key = 'schema_version'")
        if not rows:
            self._execute(
                f"INSERT INTO {self.config.database}.{META_TABLE} (key, value, updated_ns) VALUES",
                [("schema_version", str(SCHEMA_VERSION), time.time_ns())],
            )

    def _stored_version(self) -> str:
        """The schema version the store's meta table records; '' for a database without one."""
        db = self.config.database
        present = self._execute(
            f"SELECT count() FROM system.tables WHERE database = '{db}' AND name = '{META_TABLE}'", database=False
        )
        if not int(present[0][0]):
            return ""
        rows = self._execute(
            f"SELECT argMax(value, updated_ns) FROM {db}.{META_TABLE} WHERE key = 'schema_version'", database=False
        )
        return str(rows[0][0]) if rows else ""

    def _check_version(self) -> None:
        try:
            rows = self._execute(
                f"SELECT argMax(value, updated_ns) FROM {self.config.database}.{META_TABLE} "
                "WHERE key = 'schema_version'"
            )
        except StoreError as e:
            if isinstance(e, StoreUnavailable):
                raise
            raise SchemaVersionError(
                f"database {self.config.database} on {self.url} is not a ranklens store ({e}); "
                "open it with create=True or `ranklens schema --target server | clickhouse-client -n`"
            ) from e
        found = rows[0][0] if rows else ""
        if found != str(SCHEMA_VERSION):
            older = found.isdigit() and int(found) < SCHEMA_VERSION
            hint = (
                "upgrade it (every row is kept) with "
                f"`ranklens schema --migrate --store {hint_url(self.url)}`"
                + (f" (password from ${_password_env()})" if self.config.password else "")
                if older
                else "use a matching ranklens release"
            )
            raise SchemaVersionError(
                f"database {self.config.database} on {self.url} has ranklens schema version "
                f"{found or 'none'}, this ranklens expects {SCHEMA_VERSION}; {hint}, or another database "
                "(…/other_db in the store URL)"
            )

    # -- writing ------------------------------------------------------------------------
    def write(self, table_name: str, data: Any) -> int:
        return self.write_many({table_name: data})[table_name]

    def write_many(self, batches: Mapping[str, Any]) -> dict[str, int]:
        counts: dict[str, int] = {}
        prepared = []
        for name, data in batches.items():
            t, data = arrow_batch(name, data)
            counts[t.name] = counts.get(t.name, 0) + data.num_rows
            if data.num_rows:
                prepared.append((t, data))
        for t, data in prepared:
            # the driver's Python lists are built one column at a time as the block is written
            # (issue 18: all of a batch's columns as lists at once were ~4 M objects for 200k rows)
            columns = _ArrowColumns(data.column(c.name) for c in t.columns)
            self._execute(
                f"INSERT INTO {t.name} ({', '.join(t.column_names)}) VALUES",
                columns,
                columnar=True,
                # a Distributed table (cluster) answers only once every shard has the rows, so an
                # acknowledged batch is visible to the collector's "already stored?" question.
                # insert_deduplicate=0: a replicated table drops a block identical to one of its
                # last 100 inserts, also after those rows were deleted: the shard-1 share of a batch
                # stored in part (shard 2 died mid-insert) was discarded and, sent again, silently
                # dropped (docs/cluster.md). Exactly once is the ingest_id's job, not the hash's.
                settings={"insert_distributed_sync": 1, "insert_deduplicate": 0},
            )
        return counts

    def discard_ingest(self, table_name: str, ingest_ids: Iterable[int], *, timeout_s: float = 60.0) -> int:
        """Delete the rows of the given ``ingest_id`` batches (a collector re-sending a batch the
        server applied in part); return how many rows there were to delete (none: no mutation is run).

        The deletion is a mutation (``ALTER TABLE … DELETE``). Once the server has accepted it, the
        batch can be sent again at once: a ClickHouse mutation applies to the parts that existed
        when it was submitted, never to rows inserted after. This waits up to ``timeout_s`` for the
        rows to be gone from the node that ran it (so that readers see no duplicate) and then
        returns anyway, with a warning: a mutation on a replicated table waits for every part of
        the shard, and a part that only a dead replica holds keeps it pending until that replica is
        back; the collector must not stall meanwhile.

        On a cluster (the table is ``Distributed``), the rows are deleted from the local table on
        one replica of every shard, the first of the shard's replicas that accepts the mutation
        (replication carries it to the others, also to a replica that is down now, when it is back)."""
        name = table(table_name).name
        ids = ", ".join(str(int(i)) for i in sorted(set(ingest_ids)))
        if not ids:
            return 0
        db = self.config.database
        count = int(self._execute(f"SELECT count() FROM {db}.{name} WHERE ingest_id IN ({ids})")[0][0])
        if not count:
            return 0
        rows = self._execute(
            f"SELECT engine, engine_full FROM system.tables WHERE database = '{db}' AND name = '{name}'"
        )
        if not (rows and rows[0][0] == "Distributed"):
            self._execute(f"ALTER TABLE {db}.{name} DELETE WHERE ingest_id IN ({ids})")
            self._await_deleted(self._execute, self.url, db, name, ids, timeout_s)
            return count
        cluster, target_db, target = distributed_target(rows[0][1], db)
        replicas = self._execute(
            "SELECT shard_num, replica_num, host_address, port FROM system.clusters "
            f"WHERE cluster = '{cluster}' ORDER BY shard_num, replica_num"
        )
        if not replicas:
            raise StoreError(f"{db}.{name} is Distributed over cluster {cluster!r}, which this server does not know")
        shards: dict[int, list[tuple[str, int]]] = {}
        for shard, _replica, host, port in replicas:
            shards.setdefault(int(shard), []).append((str(host), int(port)))
        for shard, members in shards.items():
            self._discard_on_shard(shard, members, cluster, target_db, target, ids, timeout_s)
        return count

    def _discard_on_shard(
        self, shard: int, members: list[tuple[str, int]], cluster: str, db: str, name: str, ids: str, timeout_s: float
    ) -> None:
        """Run the deletion on the first replica of ``shard`` that accepts it, then wait for it there."""
        failed = []
        for host, port in members:
            client = self._new_client(host, port)
            try:
                try:
                    self._connect(client)  # a replica that accepts and never answers: connect_timeout, not 300 s
                    client.execute(f"ALTER TABLE {db}.{name} DELETE WHERE ingest_id IN ({ids})")
                except Exception as e:  # down, or read-only (lost ZooKeeper): the next replica may take it
                    failed.append(f"{host}:{port}: {_server_message(e)}")
                    continue

                def run(sql: str, _c: Any = client) -> Any:
                    return _c.execute(sql)

                try:
                    self._await_deleted(run, f"{host}:{port}", db, name, ids, timeout_s)
                except Exception as e:  # the mutation is submitted: the batch can be sent again regardless
                    log.warning(
                        "ranklens store: could not follow the deletion of a partly stored batch on %s:%s: %s",
                        host,
                        port,
                        e,
                    )
                return
            finally:
                client.disconnect()
        why = "; ".join(failed)
        raise StoreUnavailable(f"shard {shard} of cluster {cluster!r}: no replica could run the deletion: {why}")

    @staticmethod
    def _await_deleted(run: Any, where: str, db: str, name: str, ids: str, timeout_s: float) -> None:
        """Wait (up to ``timeout_s``) until ``run(sql)``'s node holds no row of ``ids`` in ``db.name``."""
        deadline = time.monotonic() + timeout_s
        while int(run(f"SELECT count() FROM {db}.{name} WHERE ingest_id IN ({ids})")[0][0]):
            if time.monotonic() > deadline:
                log.warning(
                    "ranklens store: %s: the deletion of a partly stored batch from %s.%s is still pending after "
                    "%.0f s (see system.mutations; a replica that is down holds back a replicated mutation); "
                    "sending the batch again, which the deletion does not touch. Until it is done, queries may "
                    "count part of that batch twice.",
                    where,
                    db,
                    name,
                    timeout_s,
                )
                return
            time.sleep(0.1)

    def _new_client(self, host: str, port: int, database: str = "default") -> Any:
        """A clickhouse-driver client with this store's credentials and TLS settings."""
        from clickhouse_driver import Client

        cfg = self.config
        kw: dict[str, Any] = {
            "host": host,
            "port": port,
            "user": cfg.user,
            "password": cfg.password,
            "database": database,
            "secure": cfg.secure,
            "verify": cfg.verify,
            "connect_timeout": cfg.connect_timeout_s,
            "send_receive_timeout": cfg.send_receive_timeout_s,
            "client_name": "ranklens",
        }
        if cfg.ca_certs:
            kw["ca_certs"] = cfg.ca_certs
        return _arrow_client_class(Client)(**kw)

    # -- reading ------------------------------------------------------------------------
    def query(self, sql: str) -> QueryResult:
        rows, types = self._execute(sql, with_column_types=True, columnar=True)
        return QueryResult(_arrow_table(types, rows))

    def iter_query(self, sql: str, *, batch_rows: int = DEFAULT_BATCH_ROWS) -> Iterator[QueryResult]:
        """Stream the rows of ``sql`` (clickhouse-driver's ``execute_iter``), ``batch_rows`` at a time.

        The query runs on a connection of its own (the thread's client stays free for other
        queries while the iterator is open); closing the iterator closes that connection. Errors
        before the first row are retried like :meth:`query`'s; a connection lost later raises
        :class:`StoreUnavailable` (a retry would send rows twice). The driver streams rows, not
        columns: a streamed read costs ~10x the CPU of :meth:`query` (bounded memory is the point)."""
        check_batch_rows(batch_rows)
        return self._iter_query(sql, batch_rows)

    def _iter_query(self, sql: str, batch_rows: int) -> Iterator[QueryResult]:
        from clickhouse_driver import errors as ch_errors

        cfg = self.config
        client = self._new_client(cfg.host, cfg.port, cfg.database)

        def start(c: Any) -> tuple[Any, Any]:
            # chunk_size: the driver hands rows over a list at a time (a Python loop per row here
            # took 5.8 s for 1 M rows, this 1.9 s; query()'s columnar read, which execute_iter lacks, 0.2 s)
            settings = {"max_block_size": batch_rows}
            it = c.execute_iter(sql, with_column_types=True, settings=settings, chunk_size=batch_rows)
            return it, next(it, [])  # the column types and the first rows, once the server answered

        def tables(it: Any, types: Any, rows: list[Any]) -> Iterator[Any]:
            while True:
                if rows:
                    yield _arrow_table(types, list(zip(*rows)))
                try:
                    rows = next(it, [])
                except ch_errors.ServerException as e:
                    raise StoreError(f"ClickHouse server {self.url} rejected the query: {_server_message(e)}") from None
                except (ch_errors.Error, EOFError, OSError) as e:
                    raise StoreUnavailable(
                        f"ClickHouse server {self.url} failed during a streamed read (not retried): {_one_line(str(e))}"
                    ) from e
                if not rows:
                    return

        try:
            it, first = self._run(start, idempotent=True, client=client)
            if first:  # the column types, then up to batch_rows - 1 rows
                yield from rebatch(tables(it, first[0], first[1:]), batch_rows)
        finally:
            client.disconnect()

    def drop_database(self) -> None:
        """Drop the whole database (tests and `ranklens` maintenance only)."""
        self._execute(f"DROP DATABASE IF EXISTS {self.config.database}", database=False)

    def close(self) -> None:
        with self._clients_lock:
            for c in self._clients:
                c.disconnect()
            self._clients.clear()
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"ServerStore({self.url!r})"


# clickhouse-driver's own switch (sic): its Date lookup table filled on demand, not 100k days at import
_LAZY_DATE_LUT = "CLICKHOUSE_DRIVER_LASY_DATE_LUT"


def _import_driver() -> None:
    """Import clickhouse-driver with its Date lookup table lazy (issue 18: building it was ~0.1-0.3 s
    of a one-shot ``ranklens ingest``; ranklens tables have no Date column, and a lazy table gives
    the same dates). The variable is set only for the import, and a user's own setting wins."""
    import os
    import sys

    if "clickhouse_driver" in sys.modules or _LAZY_DATE_LUT in os.environ:
        import clickhouse_driver

        return
    os.environ[_LAZY_DATE_LUT] = "1970-01-01:1970-01-01"
    try:
        import clickhouse_driver  # noqa: F401
    finally:
        os.environ.pop(_LAZY_DATE_LUT, None)


# UNKNOWN_USER, WRONG_PASSWORD, REQUIRED_PASSWORD, IP_ADDRESS_NOT_ALLOWED (18.16), AUTHENTICATION_FAILED (20+)
_AUTH_CODES = frozenset({192, 193, 194, 195, 516})

# The server's own network or coordination failed, not the query: SOCKET_TIMEOUT, NETWORK_ERROR,
# DNS_ERROR, TOO_MANY_SIMULTANEOUS_QUERIES, NO_FREE_CONNECTION, NO_ZOOKEEPER, TABLE_IS_READ_ONLY
# (a replica that lost ZooKeeper), TOO_MANY_PARTS, ALL_CONNECTION_TRIES_FAILED, TOO_FEW_LIVE_REPLICAS,
# UNSATISFIED_QUORUM_FOR_PREVIOUS_WRITE, UNKNOWN_STATUS_OF_INSERT, KEEPER_EXCEPTION. A fresh-clone CI
# run killed a replica mid-ingest: a Distributed insert failed with ALL_CONNECTION_TRIES_FAILED, taken
# for a refusal, and the shipper quarantined a good segment.
_UNAVAILABLE_CODES = frozenset({198, 202, 203, 209, 210, 225, 242, 252, 279, 285, 286, 319, 999})
_ATTEMPT_TO_READ_AFTER_EOF = 32


def _unavailable(code: int | None, msg: str) -> bool:
    """A server error that says the store (its cluster) is unavailable now, not that the query is wrong:
    one of :data:`_UNAVAILABLE_CODES`, or a read past the end of what another server sent (its
    connection dropped: "while receiving packet from host:port"; the same code on the server's own
    input is the query's data at fault)."""
    if code in _UNAVAILABLE_CODES:
        return True
    return code == _ATTEMPT_TO_READ_AFTER_EOF and "while receiving packet from" in msg


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _server_message(e: Any) -> str:
    """A server exception's message on one line, without the server's stack trace."""
    import re

    text = re.split(r"\s*Stack trace\b", str(getattr(e, "message", "") or e), maxsplit=1)[0]
    return _one_line(text).rstrip(".:") or f"code {getattr(e, 'code', '?')}"


def _password_env() -> str:
    from ranklens.config import ENV_STORE_PASSWORD

    return ENV_STORE_PASSWORD


class _ArrowColumns(tuple):
    """An insert's columns as Arrow arrays. A tuple, so the driver takes it for an insert's data;
    the client of :func:`_arrow_client_class` turns each into the driver's Python list only when
    the block writes that column, so one column's objects are alive at a time."""


_ARROW_CLIENT: dict[type, type] = {}


def _arrow_client_class(client_cls: type) -> type:
    """clickhouse-driver's ``Client`` with an insert path for :class:`_ArrowColumns`: the whole
    batch as one block (one part on the server: atomic, as the driver's own columnar insert of a
    batch under ``insert_block_size``), its columns converted to lists lazily. Other data goes the
    driver's own way."""
    cls = _ARROW_CLIENT.get(client_cls)
    if cls is not None:
        return cls
    from clickhouse_driver.block import ColumnOrientedBlock

    class _LazyBlock(ColumnOrientedBlock):
        def normalize(self, data: Any) -> Any:
            self._check_number_of_columns(data)
            if len({len(c) for c in data}) > 1:
                raise ValueError("the batch's columns differ in length")
            return data

        @property
        def num_rows(self) -> int:
            return len(self.data[0]) if self.data else 0

        def get_columns(self) -> list[Any]:
            return [_column_values(c) for c in self.data]

        def get_column_by_index(self, index: int) -> list[Any]:
            return _column_values(self.data[index])

    class _ArrowClient(client_cls):
        def send_data(self, sample_block: Any, data: Any, types_check: bool = False, columnar: bool = False) -> int:
            if not isinstance(data, _ArrowColumns) or not data:
                return int(super().send_data(sample_block, data, types_check=types_check, columnar=columnar))
            profile_events = getattr(self, "receive_profile_events", lambda: None)
            block = _LazyBlock(sample_block.columns_with_types, data, types_check=types_check)
            self.connection.send_data(block)
            profile_events()
            self.connection.send_data(ColumnOrientedBlock())  # the end of the data
            profile_events()
            return int(block.num_rows)

    _ARROW_CLIENT[client_cls] = _ArrowClient
    return _ArrowClient


def _column_values(col: Any) -> list[Any]:
    """An Arrow column as the list the driver's columnar insert packs (issue 18: ``to_pylist``
    was most of a server ingest). Numbers through numpy's ``tolist`` (~10x faster); strings
    dictionary-encoded first, so a value repeated over many rows (job, op, dtype...) is one
    Python string referenced from every row, not one string a row."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from ranklens.records import numpy_array

    if col.null_count == 0 and (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)):
        return numpy_array(col).tolist()
    if col.null_count == 0 and pa.types.is_string(col.type):
        enc = pc.dictionary_encode(col).combine_chunks()
        words = np.empty(len(enc.dictionary), dtype=object)
        words[:] = enc.dictionary.to_pylist()
        return words[numpy_array(enc.indices)].tolist()
    return col.to_pylist()


def distributed_target(engine_full: str, default_db: str) -> tuple[str, str, str]:
    """(cluster, database, local table) of a ``Distributed(cluster, db, table[, key])`` engine."""
    import re

    m = re.match(r"\s*Distributed\(\s*'?([^',\s]+)'?\s*,\s*'?([^',\s]*)'?\s*,\s*'?([^',\s)]+)'?", engine_full)
    if not m:
        raise StoreError(f"cannot read the Distributed engine {engine_full!r}")
    cluster, db, local = m.groups()
    if db in ("", "currentDatabase()"):
        db = default_db
    return cluster, db, local


def _arrow_table(types: list[tuple[str, str]], columns: Any) -> Any:
    """A ``pyarrow.Table`` of the driver's columnar result (``columns[i]``: column ``i``'s values)."""
    import pyarrow as pa

    arrays = {}
    for i, (name, ch_type) in enumerate(types):
        values = list(columns[i]) if columns else []
        t = _arrow_type(ch_type)
        try:
            # from buffers where the type allows (arrow_array): pa.array of a list imports pandas (issue 18)
            arrays[name] = arrow_array(t, values) if t is not None else pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            # the driver hands strings that are not UTF-8 over as bytes: U+FFFD, not a crash
            arrays[name] = pa.array(decode_replacing(values), type=t)
    return pa.table(arrays) if arrays else pa.table({})


def _arrow_type(ch_type: str) -> Any:
    import pyarrow as pa

    simple = {
        "Int8": pa.int8(),
        "Int16": pa.int16(),
        "Int32": pa.int32(),
        "Int64": pa.int64(),
        "UInt8": pa.uint8(),
        "UInt16": pa.uint16(),
        "UInt32": pa.uint32(),
        "UInt64": pa.uint64(),
        "Float32": pa.float32(),
        "Float64": pa.float64(),
        "String": pa.string(),
    }
    if ch_type in simple:
        return simple[ch_type]
    if ch_type.startswith("Nullable(") and ch_type[9:-1] in simple:
        return simple[ch_type[9:-1]]
    if ch_type.startswith("Array(") and ch_type[6:-1] in simple:
        return pa.list_(simple[ch_type[6:-1]])
    return None  # let Arrow infer (tuples, dates, ...)
