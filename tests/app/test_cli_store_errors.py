"""Store errors as the CLI reports them (issue 22 #9, #10), with real processes and real servers:
the password never printed (``schema --migrate`` included), refused credentials are exit 4 on one
line, a server that accepts and never answers times out in seconds and says so, ``ranklens sql``
refuses several statements and statements that write, and ``analyze --follow --metrics-port``
binds loopback unless told otherwise."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from ranklens.formats.process import stop_process
from tests._sync import free_port, wait_until
from tests.conftest import REQUIRE_SERVER, _need_server
from tests.helpers import synthetic_job

RANKLENS = [sys.executable, "-m", "ranklens.cli"]
PASSWORD = "s3cret-Pw-0451"


def ranklens(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*RANKLENS, *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


@pytest.fixture
def password_server(tmp_path):
    """A throw-away clickhouse-server whose user ``rl`` has a password (the shared test server's
    ``default`` user has none, so it cannot show a password being printed)."""
    if shutil.which("clickhouse-server") is None:
        msg = "clickhouse-server is not installed (apt-get install clickhouse-server)"
        if REQUIRE_SERVER:
            pytest.fail(msg)
        pytest.skip(msg)
    d = tmp_path / "ch"
    for sub in ("data", "tmp", "user_files", "log"):
        (d / sub).mkdir(parents=True)
    tcp, http = free_port(), free_port()
    (d / "config.xml").write_text(
        f"""<?xml version="1.0"?>
<yandex>
  <logger><level>warning</level><log>{d}/log/server.log</log><errorlog>{d}/log/error.log</errorlog></logger>
  <listen_host>127.0.0.1</listen_host><tcp_port>{tcp}</tcp_port><http_port>{http}</http_port>
  <path>{d}/data/</path><tmp_path>{d}/tmp/</tmp_path><user_files_path>{d}/user_files/</user_files_path>
  <users_config>{d}/users.xml</users_config>
  <default_profile>default</default_profile><default_database>default</default_database>
  <mark_cache_size>268435456</mark_cache_size>
</yandex>
"""
    )
    (d / "users.xml").write_text(
        f"""<?xml version="1.0"?>
<yandex>
  <profiles><default><max_memory_usage>4000000000</max_memory_usage></default></profiles>
  <users>
    <default><password></password><networks><ip>127.0.0.1</ip></networks><profile>default</profile><quota>default</quota></default>
    <rl><password>{PASSWORD}</password><networks><ip>127.0.0.1</ip></networks><profile>default</profile><quota>default</quota></rl>
  </users>
  <quotas><default><interval><duration>3600</duration><queries>0</queries><errors>0</errors><result_rows>0</result_rows><read_rows>0</read_rows><execution_time>0</execution_time></interval></default></quotas>
</yandex>
"""
    )
    with (d / "log" / "stdout.log").open("wb") as out:
        proc = subprocess.Popen(["clickhouse-server", f"--config-file={d}/config.xml"], stdout=out, stderr=out, cwd=d)
    try:

        def answers() -> bool:  # ready when it answers a query (not merely when the port is open)
            cmd = ["clickhouse-client", "--port", str(tcp), "--query", "SELECT 1"]
            return subprocess.run(cmd, capture_output=True).returncode == 0

        wait_until(
            answers,
            60,
            "the password server to answer a query",
            interval_s=0.3,
            procs=[proc],
            detail=lambda: (d / "log" / "stdout.log").read_text(),
        )
        yield tcp
    finally:
        stop_process(proc, timeout_s=30)


def test_schema_migrate_never_prints_the_password(password_server):
    url = f"clickhouse://rl:{PASSWORD}@127.0.0.1:{password_server}/rl_migrate"
    r = ranklens("sql", "--store", url, "SELECT 1 AS one")  # no store yet: refused, password not shown
    assert r.returncode == 5 and PASSWORD not in r.stdout + r.stderr, r.stderr
    subprocess.run(
        ["clickhouse-client", "--port", str(password_server), "--user", "rl", "--password", PASSWORD, "--query",
         "CREATE DATABASE rl_migrate"], check=True,
    )  # fmt: skip
    from ranklens.store import open_store

    open_store(url).close()  # a current store: --migrate has nothing to do and says where
    r = ranklens("schema", "--migrate", "--store", url)
    assert r.returncode == 0, r.stderr
    assert f"rl:***@127.0.0.1:{password_server}/rl_migrate is at schema version" in r.stderr
    assert PASSWORD not in r.stdout + r.stderr
    r = ranklens("schema", "--migrate", "--store", url.replace("/rl_migrate", "/rl_migrate?retries=x"))
    assert r.returncode == 2 and "rl:***@" in r.stderr and PASSWORD not in r.stderr, r.stderr
    # the same with the password from the environment
    env = {"RANKLENS_STORE_PASSWORD": PASSWORD}
    r = ranklens("schema", "--migrate", "--store", url.replace(f":{PASSWORD}", ""), env=env)
    assert r.returncode == 0 and PASSWORD not in r.stdout + r.stderr, r.stderr


def test_schema_migrate_embedded_names_the_store(tmp_path):
    from ranklens.store import open_store

    open_store(f"embedded://{tmp_path / 's'}").close()
    r = ranklens("schema", "--migrate", "--store", f"embedded://{tmp_path / 's'}")
    assert r.returncode == 0 and f"{tmp_path / 's'} is at schema version" in r.stderr, r.stderr


@pytest.mark.server
def test_wrong_password_is_exit_4_on_one_line_without_the_server_stack():
    base = _need_server().replace("clickhouse://default@", "clickhouse://default:wrong-password-77@")
    for args in (["sql", "SELECT 1"], ["analyze"], ["schema", "--migrate"]):
        r = ranklens(args[0], "--store", f"{base.rstrip('/')}/ranklens_wrongpw", *args[1:])
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 4, (args, r.returncode, r.stderr)
        assert len(lines) == 1 and "refused the credentials of user 'default'" in lines[0], r.stderr
        assert "Stack trace" not in r.stderr and "wrong-password-77" not in r.stderr
        assert "not a ranklens store" not in r.stderr


@pytest.mark.server
def test_collector_with_refused_credentials_stops_at_once(tmp_path):
    """A server that is down is waited for (LazyStore); refused credentials will not get better."""
    base = _need_server().replace("clickhouse://default@", "clickhouse://default:wrong-password-77@")
    r = ranklens("collector", "--store", f"{base.rstrip('/')}/ranklens_wrongpw", "--spool", str(tmp_path), timeout=60)
    assert r.returncode == 4 and "refused the credentials" in r.stderr, r.stderr


def test_wrong_password_on_a_password_server_is_exit_4(password_server):
    r = ranklens("sql", "--store", f"clickhouse://rl:not-it@127.0.0.1:{password_server}/x", "SELECT 1")
    assert r.returncode == 4 and len(r.stderr.strip().splitlines()) == 1 and "Stack trace" not in r.stderr


class SilentServer:
    """Accepts TCP connections and never sends a byte."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = int(self.sock.getsockname()[1])
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(c)

    def close(self) -> None:
        self.sock.close()
        for c in self.accepted:
            c.close()


@pytest.mark.slow  # waits out the client timeout by design
def test_silent_server_times_out_in_seconds_and_says_so():
    srv = SilentServer()
    try:
        t = time.monotonic()
        r = ranklens("sql", "--store", f"clickhouse://default@127.0.0.1:{srv.port}/x", "SELECT 1")  # default limits
        took = time.monotonic() - t
        assert r.returncode == 4, r.stderr
        assert "timed out after 5 s" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert took < 30, f"waited {took:.1f} s for a server that never answers"
        assert len(srv.accepted) == 2  # one retry, not four 300-s waits
        r = ranklens("sql", "--store", f"clickhouse://default@127.0.0.1:{srv.port}/x?connect_timeout=0.5", "SELECT 1")
        assert r.returncode == 4 and "timed out after 0.5 s" in r.stderr, r.stderr
    finally:
        srv.close()


@pytest.fixture(params=["embedded", pytest.param("server", marks=pytest.mark.server)])
def store_url(request, tmp_path):
    if request.param == "embedded":
        url = f"embedded://{tmp_path / 'store'}"
    else:
        url = request.getfixturevalue("server_db_url")
    from ranklens.store import open_store

    s = open_store(url)
    s.write_many(synthetic_job(ranks=4, steps=5))
    s.close()
    return url


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("SELECT 1 AS a; SELECT 2 AS b", "2 statements given"),
        ("SELECT count() FROM steps; DROP TABLE steps", "2 statements given"),
        ("DROP TABLE steps", "read statements only"),
        ("  insert into steps (job_id) values ('x')", "read statements only"),
        ("/* hello */ ALTER TABLE steps DELETE WHERE 1", "read statements only"),
        ("TRUNCATE TABLE steps", "read statements only"),
        ("SELECT 1 INTO OUTFILE '/tmp/x.tsv'", "INTO OUTFILE"),
        (" ; ", "no SQL statement"),
    ],
)
def test_sql_refuses_several_statements_and_writes(store_url, query, message):
    from ranklens.store import open_store

    r = ranklens("sql", "--store", store_url, query)
    assert r.returncode == 2 and message in r.stderr and r.stdout == "", (r.returncode, r.stderr)
    s = open_store(store_url, create=False)
    try:  # nothing was changed: the table is there with every row
        assert s.query("SELECT count() FROM steps").scalar() == 20
    finally:
        s.close()


def test_sql_still_runs_one_read_with_semicolons_in_strings_and_a_trailing_one(store_url):
    r = ranklens("sql", "--store", store_url, "--json", "SELECT 'a;b' AS s, count() AS n FROM steps; -- done")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == '[{"s": "a;b", "n": 20}]'


def _listeners(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp writes them) listening on ``port``."""
    out = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, p = local.split(":")
        if state == "0A" and int(p, 16) == port:
            out.add(addr)
    return out


@pytest.mark.parametrize(("addr", "hexaddr"), [(None, "0100007F"), ("0.0.0.0", "00000000")])
def test_follow_metrics_bind_loopback_unless_told(tmp_path, addr, hexaddr):
    from ranklens.store import open_store

    store = open_store(f"embedded://{tmp_path / 's'}")
    store.write_many(synthetic_job(slow_rank=3))
    args = [*RANKLENS, "analyze", "--store", store.url, "--follow", "--interval", "0.5", "--metrics-port", "0"]
    if addr:
        args += ["--metrics-addr", addr]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        m = re.match(r"metrics on http://([\d.]+):(\d+)/metrics", line)
        assert m, line
        assert m.group(1) == (addr or "127.0.0.1")
        port = int(m.group(2))
        assert _listeners(port) == {hexaddr}
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            assert resp.status == 200
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
