"""Shared fixtures: stores on both backends, a real ClickHouse server when there is one.

The server tests use ``$RANKLENS_TEST_CLICKHOUSE`` when it names a server. Otherwise, when Debian's
clickhouse-server is installed, the first server test starts a throw-away server for the session
on ports the OS picked free (tests/_clickhouse.py; ready once it answers a query), stopped when the
session ends; without one they try ``clickhouse://default@127.0.0.1:9000``. Locally, without a
server, they are skipped with the reason; with ``RANKLENS_REQUIRE_SERVER=1`` (set by ``.ci/run``) a
missing server fails them instead, so CI cannot pass without it.
"""

from __future__ import annotations

import os
import socket
import uuid
from urllib.parse import urlsplit

import pytest

NAMED_SERVER = os.environ.get("RANKLENS_TEST_CLICKHOUSE", "")
DEFAULT_SERVER = "clickhouse://default@127.0.0.1:9000"
REQUIRE_SERVER = os.environ.get("RANKLENS_REQUIRE_SERVER", "") == "1"
_session_server: dict = {}  # the throw-away server this session started: {"server": ..., "error": ...}


def server_base() -> str:
    """The test server's URL (no database): the named one, else this session's own (started on
    first use), else the default."""
    if NAMED_SERVER:
        return NAMED_SERVER
    from tests import _clickhouse

    if not _clickhouse.installed():
        return DEFAULT_SERVER
    if not _session_server:
        import tempfile
        from pathlib import Path

        server = _clickhouse.ClickHouseServer(Path(tempfile.mkdtemp(prefix="ranklens-test-clickhouse-")))
        _session_server["server"] = server
        try:
            server.start()
        except AssertionError as e:
            _session_server["error"] = str(e)
    if "error" in _session_server:
        raise RuntimeError(f"the session's clickhouse-server did not start: {_session_server['error']}")
    return _session_server["server"].url


def pytest_sessionfinish(session, exitstatus):
    server = _session_server.pop("server", None)
    if server is not None:
        import shutil

        server.stop()
        shutil.rmtree(server.dir, ignore_errors=True)


def _server_up(base: str) -> bool:
    parts = urlsplit(base)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 9000), timeout=1):
            return True
    except OSError:
        return False


def _need_server() -> str:
    """The test server's URL; skips the test (fails it under RANKLENS_REQUIRE_SERVER=1) without one."""
    try:
        base = server_base()
        msg = "" if _server_up(base) else f"no ClickHouse server at {base} (start one with scripts/clickhouse.sh start)"
    except RuntimeError as e:
        base, msg = "", str(e)
    if msg:
        if REQUIRE_SERVER:
            pytest.fail(msg + "; RANKLENS_REQUIRE_SERVER=1 makes this a failure")
        pytest.skip(msg)
    return base


def server_url(db: str | None = None) -> str:
    return f"{server_base().rstrip('/')}/{db or 'ranklens_test_' + uuid.uuid4().hex[:10]}"


@pytest.fixture
def server_store():
    _need_server()
    from ranklens.store import open_store

    store = open_store(server_url())
    yield store
    store.drop_database()
    store.close()


@pytest.fixture
def embedded_store(tmp_path):
    from ranklens.store import open_store

    return open_store(f"embedded://{tmp_path / 'store'}")


@pytest.fixture(params=["embedded", pytest.param("server", marks=pytest.mark.server)])
def store(request, tmp_path):
    """The same test on both backends."""
    if request.param == "embedded":
        yield request.getfixturevalue("embedded_store")
    else:
        yield request.getfixturevalue("server_store")


@pytest.fixture
def server_db_url():
    """A fresh database URL on the test server (dropped afterwards)."""
    _need_server()
    url = server_url()
    yield url
    from ranklens.store import open_store

    s = open_store(url)
    s.drop_database()
    s.close()


# --- a real cluster (issue 19) -------------------------------------------------------------------
# ZooKeeper + four clickhouse-server processes, 2 shards x 2 replicas (scripts/clickhouse_cluster.sh),
# started once per session on free ports, with the generated cluster DDL (`ON CLUSTER`) applied to
# CLUSTER_DB. Skipped locally without the packages; a failure under RANKLENS_REQUIRE_SERVER=1.
CLUSTER_DB = "ranklens_cluster_test"


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    from tests import _cluster

    why = _cluster.missing()
    if why:
        if REQUIRE_SERVER:
            pytest.fail(f"no ClickHouse cluster: {why}; RANKLENS_REQUIRE_SERVER=1 makes this a failure")
        pytest.skip(f"no ClickHouse cluster: {why}")
    c = _cluster.Cluster(tmp_path_factory.mktemp("clickhouse-cluster"))
    try:
        c.start()
        from clickhouse_driver import Client

        from ranklens.schema import render_cluster_ddl

        client = Client("127.0.0.1", port=c.tcp(1))
        for stmt in render_cluster_ddl(CLUSTER_DB, _cluster.CLUSTER).split(";\n"):
            stmt = "\n".join(line for line in stmt.splitlines() if not line.startswith("--")).strip()
            if stmt:
                client.execute(stmt)
        client.disconnect()
        yield c
    finally:
        c.stop()


# --- CI's skip gate -------------------------------------------------------------------------------
# A skip hides a test that did not run. Locally a missing tool (a ClickHouse server, chromium,
# promtool, iproute2, kubectl) skips with its reason; under ``RANKLENS_FAIL_ON_SKIP=1`` (set by
# ``.ci/run``, which installs every tool the suite needs) any skip whose reason is not listed in
# ``tests/allowed_skips.txt`` turns into a failure, so a green CI means every test ran.
FAIL_ON_SKIP = os.environ.get("RANKLENS_FAIL_ON_SKIP", "") == "1"


def _allowed_skips() -> list[str]:
    import pathlib

    path = pathlib.Path(__file__).with_name("allowed_skips.txt")
    lines = path.read_text().splitlines() if path.exists() else []
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def _gate_skip(report) -> None:
    if not FAIL_ON_SKIP or not report.skipped or hasattr(report, "wasxfail"):
        return
    import re

    reason = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)
    if any(re.search(pattern, reason) for pattern in _allowed_skips()):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"unexpected skip under RANKLENS_FAIL_ON_SKIP=1: {reason}\n"
        "(install what the test needs, or list the reason in tests/allowed_skips.txt with why)"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _gate_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    # a module-level importorskip skips the whole module at collection
    outcome = yield
    _gate_skip(outcome.get_result())


# --- marks that mean what they say ------------------------------------------------------------
# e2e: a real multi-process torch job; server: the ClickHouse server; browser: a real Chromium;
# slow: over ~10 s. A test that takes longer than SLOW_S without `slow` or `e2e` is listed in the
# summary (a warning, not a failure) so that `-m "not slow and not e2e"` stays the quick loop.
SLOW_S = 10.0  # the default of the ini option slow_test_s
_durations: dict[str, float] = {}
_unmarked: set[str] = set()


def pytest_runtest_logreport(report) -> None:
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration
    if not ({"slow", "e2e"} & set(report.keywords)):
        _unmarked.add(report.nodeid)


def pytest_addoption(parser) -> None:
    parser.addini("slow_test_s", "seconds over which a test must be marked slow or e2e", default=str(SLOW_S))


def pytest_terminal_summary(terminalreporter, config) -> None:
    limit = float(config.getini("slow_test_s"))
    over = sorted(((d, n) for n, d in _durations.items() if n in _unmarked and d > limit), reverse=True)
    if not over:
        return
    terminalreporter.write_sep("=", f"{len(over)} test(s) over {limit:g} s without a slow or e2e mark", yellow=True)
    for seconds, nodeid in over:
        terminalreporter.write_line(f"WARNING unmarked slow test: {nodeid} took {seconds:.1f} s (mark it slow or e2e)")
