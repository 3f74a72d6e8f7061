"""The CLI as a user drives it: help everywhere, machine output, documented exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from ranklens.cli import cli

COMMANDS = [
    "demo",
    "analyze",
    "ingest",
    "sql",
    "collect",
    "collector",
    "schema",
    "version",
    "run",
    "simulate",
    "dashboard",
    "deliver",
    "alerts-receiver",
    "logs",
]


def run(*args, env=None):
    return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)


@pytest.mark.parametrize("cmd", [[], *[[c] for c in COMMANDS]])
def test_help_everywhere(cmd):
    r = run(*cmd, "--help")
    assert r.exit_code == 0 and "Usage:" in r.output


def test_version():
    r = run("version")
    assert r.exit_code == 0 and r.output.startswith("ranklens 0.")


def test_ingest_sql_analyze_roundtrip(tmp_path):
    store = f"embedded://{tmp_path}/s"
    src = tmp_path / "collectives.jsonl"
    src.write_text(
        "\n".join(
            json.dumps(
                {
                    "job_id": "j",
                    "rank": r,
                    "pg": "0",
                    "seq": 1,
                    "op": "all_reduce",
                    "step": 0,
                    "enter_ns": 100 + r,
                }
            )
            for r in range(3)
        )
    )
    r = run("ingest", "--store", store, str(src))
    assert r.exit_code == 0, r.output
    assert "collectives: 3 rows" in r.output
    r = run("sql", "--store", store, "--json", "SELECT rank FROM collectives ORDER BY rank")
    assert json.loads(r.output) == [{"rank": 0}, {"rank": 1}, {"rank": 2}]
    r = run("sql", "--store", store, "SELECT count() AS n FROM collectives")
    assert "n" in r.output and "3" in r.output
    r = run("analyze", "--store", store, "--json")
    assert r.exit_code == 0 and json.loads(r.output)["findings"] == []


def test_store_from_environment(tmp_path):
    env = {"RANKLENS_STORE": f"embedded://{tmp_path}/env"}
    r = run("sql", "SELECT 1 AS one", env=env)
    assert r.exit_code == 4 and "no ranklens store" in r.output  # sql never creates a store
    assert run("schema").exit_code == 0
    from ranklens.store import open_store

    open_store(env["RANKLENS_STORE"])
    r = run("sql", "--json", "SELECT 1 AS one", env=env)
    assert r.exit_code == 0 and json.loads(r.output) == [{"one": 1}]


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["sql", "--store", "ftp://x", "SELECT 1"], 2, "unknown store URL"),
        (["ingest", "--store", "{store}", "{missing}"], 6, "no such file"),
        (["ingest", "--store", "{store}", "{bad}"], 6, "line 1: not valid JSON"),
        (["sql", "--store", "{store}", "SELECT nope FROM collectives"], 3, "query failed"),
        (["analyze", "--store", "{store}"], 8, "holds no job yet"),
        (["analyze", "--store", "{store}", "--job", "nope"], 8, "no records of job 'nope'"),
        (["demo", "--store", "{store}", "--slow-rank", "9"], 2, "is not a rank"),
    ],
)
def test_errors_have_clear_messages_and_exit_codes(tmp_path, args, code, message):
    bad = tmp_path / "collectives.jsonl"
    bad.write_text("{oops\n")
    subs = {
        "{store}": f"embedded://{tmp_path}/s",
        "{missing}": str(tmp_path / "nope.jsonl"),
        "{bad}": str(bad),
    }
    from ranklens.store import open_store

    open_store(subs["{store}"])  # exists, empty
    proc = subprocess.run(
        [sys.executable, "-m", "ranklens.cli", *[subs.get(a, a) for a in args]],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == code, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_server_unavailable_exit_code():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ranklens.cli",
            "sql",
            "--store",
            "clickhouse://default@127.0.0.1:1/x?retries=0",
            "SELECT 1",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 4 and "unavailable" in proc.stderr and "Traceback" not in proc.stderr


def test_schema_targets():
    for target in ("server", "cluster", "embedded"):
        r = run("schema", "--target", target)
        assert r.exit_code == 0 and "collectives" in r.output


DATA = __import__("pathlib").Path(__file__).parent.parent.joinpath("data") / "flight_recorder"


@pytest.mark.parametrize(("scenario", "kind", "rank"), [("desync", "desync", 2), ("crashed_rank", "crash", 1)])
def test_analyze_flight_recorder_cli(scenario, kind, rank):
    r = run("analyze", "--flight-recorder", str(DATA / scenario / "fr_pickle"), "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert [(f["kind"], [s["rank"] for s in f["suspects"]]) for f in out["findings"]] == [(kind, [rank])]
    text = run("analyze", "--flight-recorder", str(DATA / scenario / "fr_json")).output
    assert f"rank {rank}" in text and "recommended:" in text


def test_ingest_flight_recorder_detected(tmp_path):
    store = f"embedded://{tmp_path}/s"
    r = run("ingest", "--store", store, "--job", "fr-desync", str(DATA / "desync" / "fr_pickle"))
    assert r.exit_code == 0, r.output
    r = run(
        "sql",
        "--store",
        store,
        "--json",
        "SELECT count() AS n, uniqExact(rank) AS ranks FROM collectives WHERE job_id = 'fr-desync'",
    )
    (row,) = json.loads(r.output)
    assert row["ranks"] == 4 and row["n"] > 100


def test_analyze_act_sends_a_signed_webhook(tmp_path, monkeypatch):
    from ranklens.analyzers.recovery.testing import WebhookReceiver
    from ranklens.store import open_store
    from tests.helpers import synthetic_job

    store_url = f"embedded://{tmp_path}/s"
    open_store(store_url).write_many(synthetic_job(slow_rank=2))
    secret = "s3cret-s3cret-s3cret-s3cret"
    monkeypatch.setenv("RANKLENS_WEBHOOK_SECRET", secret)
    with WebhookReceiver(secret) as rx:
        policy = tmp_path / "policy.toml"
        policy.write_text(
            'version = 1\n[[rule]]\nname = "stragglers"\nkinds = ["straggler"]\nlevel = "notify"\n'
            f'[[endpoint]]\nname = "oncall"\nurl = "{rx.url}"\nsecret_env = "RANKLENS_WEBHOOK_SECRET"\n'
            'levels = ["notify"]\nkinds = ["*"]\n'
        )
        args = ["analyze", "--store", store_url, "--act", "--policy", str(policy), "--outbox", str(tmp_path / "ob")]
        r = run(*args, "--json")
        assert r.exit_code == 0, r.output
        out = json.loads(r.output)
        assert out["recovery"]["decisions"], out
        assert len(rx.accepted) == 1
        assert rx.accepted[0].payload["finding"]["suspects"][0]["rank"] == 2
        r = run(*args)  # the same finding again: nothing is sent twice
        assert r.exit_code == 0 and len(rx.accepted) == 1
    rows = open_store(store_url).query("SELECT count() FROM actions WHERE finding_id != ''").scalar()
    assert rows >= 1


def test_act_needs_a_policy(tmp_path):
    r = run("analyze", "--store", f"embedded://{tmp_path}/s", "--act")
    assert r.exit_code == 2 and "--act needs --policy" in r.output
