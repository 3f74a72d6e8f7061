"""SIGTERM (torch elastic tearing the group down, Slurm, Kubernetes) ends a traced rank only after
its last rows are written: also when the rank is blocked inside a collective, where Python signal
handlers do not run. A handler of the user's own wins; a forked child's SIGTERM stays the child's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests._sync import free_port, wait_until

JOB = Path(__file__).with_name("sigterm_job.py")


def _rows(spool: Path, table: str) -> list[dict]:
    rows = []
    for p in sorted(spool.rglob(f"{table}.*.jsonl")):
        rows += [json.loads(x) for x in p.read_text().splitlines()[1:]]
    return rows


def _start(tmp_path: Path, mode: str, world: int, **env: str) -> list[subprocess.Popen]:
    base = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world),
        "RANKLENS_SPOOL": str(tmp_path / "spool"),
        "RANKLENS_JOB_ID": f"sigterm-{mode}",
        "OMP_NUM_THREADS": "1",
        **env,
    }
    return [
        subprocess.Popen(
            [sys.executable, str(JOB), mode],
            env={**base, "RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]


def _line(p: subprocess.Popen, want: str, timeout_s: float = 120) -> None:
    got: list[str] = []

    def seen() -> bool:
        line = p.stdout.readline()
        got.append(line)
        return want in line or (not line and p.poll() is not None and _fail(got))

    def _fail(lines: list[str]) -> bool:
        raise AssertionError(f"exited {p.returncode} before {want!r}:\n{''.join(lines)}")

    wait_until(seen, timeout_s, f"{want!r} from the job", interval_s=0)


@pytest.mark.e2e
def test_a_rank_blocked_in_a_collective_writes_its_rows_then_dies_of_the_sigterm(tmp_path):
    r0, r1 = _start(tmp_path, "stuck", 2)
    try:
        _line(r1, "stopped")
        _line(r0, "entering")
        r0.send_signal(signal.SIGTERM)
        # readiness bound only: the flush is bounded at 2 s and a hard deadline at 10 s
        code = r0.wait(timeout=60)
    finally:
        r1.kill()
        r0.kill()
        r1.wait()
        out = r0.stdout.read()
        r0.stdout.close()
        r1.stdout.close()
    assert code == -signal.SIGTERM, out  # ended as SIGTERM ends a process: what the launcher reports
    mine = sorted((r["seq"], r["end_ns"]) for r in _rows(tmp_path / "spool", "collectives") if r["rank"] == 0)
    seqs = [s for s, _ in mine]
    # the three steps' all_reduces, then the one it was stopped inside: written as not completed
    assert len(seqs) >= 4 and seqs == sorted(set(seqs)), mine
    assert all(end > 0 for _, end in mine[:-1]) and mine[-1][1] == 0, mine
    assert {r["step"] for r in _rows(tmp_path / "spool", "steps") if r["rank"] == 0} >= {0, 1, 2}


@pytest.mark.e2e
def test_the_users_own_sigterm_handler_wins_and_rows_still_reach_the_spool(tmp_path):
    marker = tmp_path / "marker"
    (p,) = _start(tmp_path, "user", 1, MARKER=str(marker))
    _line(p, "ready")
    p.send_signal(signal.SIGTERM)
    code = p.wait(timeout=60)
    out = p.stdout.read()
    p.stdout.close()
    assert code == 0, out
    assert marker.read_text() == "user handler ran"
    assert len([r for r in _rows(tmp_path / "spool", "collectives") if r["rank"] == 0]) >= 3


@pytest.mark.e2e
def test_a_forked_childs_sigterm_ends_the_child_not_the_traced_parent(tmp_path):
    (p,) = _start(tmp_path, "fork", 1)
    out = p.communicate(timeout=120)[0]
    assert p.returncode == 0, out
    assert f"child status {-signal.SIGTERM}" in out and "parent alive" in out, out


@pytest.mark.e2e
def test_sigterm_flush_off_leaves_the_default(tmp_path):
    r0, r1 = _start(tmp_path, "stuck", 2, RANKLENS_SIGTERM_FLUSH="0")
    try:
        _line(r1, "stopped")
        _line(r0, "entering")
        r0.send_signal(signal.SIGTERM)
        assert r0.wait(timeout=60) == -signal.SIGTERM
    finally:
        r1.kill()
        r0.kill()
        r1.wait()
        r0.stdout.close()
        r1.stdout.close()
    # the periodic flush is 60 s away and SIGTERM's default skips atexit: nothing was written
    assert not _rows(tmp_path / "spool", "collectives")
