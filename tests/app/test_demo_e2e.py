"""The README's first command, end to end: a real 4-rank gloo job, collected and diagnosed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def demo(*args: str, cwd) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "ranklens.cli", "demo", "--json", "--steps", "20", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
        env={**os.environ, "RANKLENS_STORE": ""},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_slowed_rank_is_named(tmp_path):
    out = demo("--slow-rank", "1", "--slowdown", "1.5", "--slow-from-step", "4", cwd=tmp_path)
    stragglers = [f for f in out["findings"] if f["kind"] == "straggler"]
    # a CI run named nobody: rank 1's finding was taken for host CPU contention (its notes say so)
    assert len(stragglers) == 1, (out["findings"], out["host_cpu_contention"])
    (f,) = stragglers
    assert [s["rank"] for s in f["suspects"]] == [1]
    assert 3 <= f["first_seen_step"] <= 6
    assert f["impact"]["seconds_lost"] > 0.2  # ~30 ms x 16 steps
    assert f["evidence"]["sql"]
    assert out["store"].endswith("/ranklens-store")  # the default, under the working directory
    assert out["rows"]["collectives"] > 100


def test_healthy_run_names_nobody(tmp_path):
    out = demo("--healthy", cwd=tmp_path)
    assert [f for f in out["findings"] if f["kind"] == "straggler"] == []


def test_demo_on_the_clickhouse_server(tmp_path, server_db_url):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ranklens.cli",
            "demo",
            "--store",
            server_db_url,
            "--ranks",
            "3",
            "--slow-rank",
            "2",
            "--steps",
            "15",
            "--slowdown",
            "2",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 2" in proc.stdout and "is a straggler" in proc.stdout
    again = subprocess.run(
        [sys.executable, "-m", "ranklens.cli", "analyze", "--store", server_db_url, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert [s["rank"] for f in json.loads(again.stdout)["findings"] for s in f["suspects"]] == [2]
