"""Live hang detection on real gloo jobs with injected faults, before gloo's own timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ranklens.analyzers.live_hangs import HangConfig, detect_live_hangs
from ranklens.collector import Shipper
from tests._sync import free_port, wait_for_file, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
SCRIPT = Path(__file__).parent.parent.joinpath("hang_job.py")
FAST = HangConfig(min_stall_s=2.0, heartbeat_stale_s=2.0)
# Readiness only: four ranks importing torch and joining a gloo group on a loaded 2-core machine can
# take minutes before the fault is injected. What is measured (detection latency) is timed from the
# fault's onset, not from the job's start, and keeps its own bound.
STARTUP_S = 300.0


class Job:
    def __init__(self, tmp_path: Path, mode: str, *, world: int = 4, rank: int = 1, step: int = 3, **extra: str):
        self.tmp_path, self.rank, self.step = tmp_path, rank, step
        self.faulty = step >= 0 and mode in ("sleep", "exit", "desync", "subgroup")  # these write the marker
        self.spool = tmp_path / "spool"
        self.marker = tmp_path / "fault"
        self.job_id = f"hang-{mode}"
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world),
               "RANKLENS_SPOOL": str(self.spool), "RANKLENS_JOB_ID": self.job_id, "OMP_NUM_THREADS": "1",
               "HANG_MODE": mode, "HANG_RANK": str(rank), "HANG_STEP": str(step), "HANG_MARKER": str(self.marker),
               "RANKLENS_FR_STUCK_S": "3",
               **extra}  # fmt: skip
        self.logs = [open(tmp_path / f"rank{r}.log", "w") for r in range(world)]
        self.procs = [
            subprocess.Popen(
                [sys.executable, str(SCRIPT)], env={**env, "RANK": str(r)}, stdout=log, stderr=subprocess.STDOUT
            )
            for r, log in enumerate(self.logs)
        ]

    def exit_codes(self) -> dict[int, int]:
        return {r: p.returncode for r, p in enumerate(self.procs) if p.poll() is not None}

    def log_tail(self) -> str:
        return "\n".join(
            f"rank {r}: " + (self.tmp_path / f"rank{r}.log").read_text()[-800:] for r in range(len(self.procs))
        )

    def wait_started(self, store, shipper: Shipper) -> None:
        """Until the fault is injected (the marker), or for a job without one, its first step is stored."""
        if self.faulty:
            what = f"rank {self.rank} to inject its fault at step {self.step} ({self.marker.name})"
            wait_for_file(self.marker, STARTUP_S, what, procs=self.procs, detail=self.log_tail, interval_s=0.2)
            return

        def stepping() -> bool:
            shipper.ship_once()
            q = f"SELECT count() FROM steps WHERE job_id = '{self.job_id}'"
            return bool(store.query(q).scalar())

        wait_until(stepping, STARTUP_S, "the job's first step in the store", procs=self.procs,
                   detail=self.log_tail, interval_s=0.5)  # fmt: skip

    def watch(self, store, *, timeout_s: float = 40.0, config: HangConfig = FAST, want=lambda fs: bool(fs)):
        """Once the job is under way (:meth:`wait_started`), ship and analyze every 0.5 s until
        ``want(findings)`` or ``timeout_s`` after the fault's onset; returns (findings, latency_s)."""
        shipper = Shipper(self.spool, store)
        self.wait_started(store, shipper)
        deadline = time.time() + timeout_s
        findings: list = []
        while time.time() < deadline:
            shipper.ship_once()
            findings = detect_live_hangs(store, self.job_id, config=config, exit_codes=self.exit_codes())
            if want(findings):
                onset = int(self.marker.read_text()) if self.marker.exists() else time.time_ns()
                return findings, (time.time_ns() - onset) / 1e9
            time.sleep(0.5)
        return findings, None

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for log in self.logs:
            log.close()


@pytest.fixture
def job(tmp_path):
    jobs = []

    def start(mode: str, **kw):
        j = Job(tmp_path, mode, **kw)
        jobs.append(j)
        return j

    yield start
    for j in jobs:
        j.kill()


def test_sleeping_rank_is_named_before_the_gloo_timeout(job, embedded_store):
    j = job("sleep", rank=2, step=3)

    # the ranks' rows reach the store a flush apart: the first pass may see only some of the ranks
    # that wait; the finding is checked once every waiting rank's arrival is stored
    def whole(fs) -> bool:
        return any(f.kind == "hang" and f.evidence.get("in_flight") == [0, 1, 3] for f in fs)

    findings, latency = j.watch(embedded_store, want=whole)
    assert latency is not None, f"no hang finding naming ranks 0, 1, 3 in flight within 40 s: {findings}"
    (f,) = [f for f in findings if f.kind == "hang"]
    assert [s.rank for s in f.suspects] == [2]
    ev = f.evidence
    assert ev["pg"] == "0" and ev["missing"] == [2] and ev["in_flight"] == [0, 1, 3]
    assert ev["cause"] == "never_arrived" and ev["last_activity"]["phase"] == "data"
    assert ev["action"] == "restart_rank"
    assert "rank 2 never entered all_reduce" in f.title
    assert latency < 10
    # every live rank dumped torch's flight recorder (the stuck ranks after RANKLENS_FR_STUCK_S, the
    # sleeping one on their signal), and the post-mortem analysis of those dumps agrees
    from ranklens.analyzers.hangs import analyze_flight_recorder
    from ranklens.collector.flight_recorder import load_dumps

    fr_dir = j.spool / j.job_id / "0" / "fr"
    wait_until(
        lambda: len(list(fr_dir.glob("fr_trace_rank_*.json"))) >= 4,
        120,
        "all 4 ranks' flight-recorder dumps",
        detail=lambda: f"{sorted(p.name for p in fr_dir.glob('*'))}\n{j.log_tail()}",
        interval_s=0.2,
    )
    dumps = load_dumps(fr_dir)
    assert sorted(d.rank for d in dumps) == [0, 1, 2, 3]
    post = analyze_flight_recorder(dumps)
    assert [(p.kind, [s.rank for s in p.suspects]) for p in post] == [("hang", [2])]
    # from the CLI, the dumps' place in the spool names the job, and the job's ledger in the store
    # gives the step the hang happened in (FR itself knows no steps)
    import json

    from click.testing import CliRunner

    from ranklens.cli import cli

    r = CliRunner().invoke(
        cli, ["analyze", "--flight-recorder", str(fr_dir), "--store", embedded_store.url, "--json", "--no-save"]
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert (out["job_id"], out["attempt"], out["missing_dumps"]) == (j.job_id, 0, [])
    [pf] = out["findings"]
    assert pf["job_id"] == j.job_id and pf["first_seen_step"] == pf["evidence"]["step"] == 3
    # the hung rank's Python stacks, written beside the dumps by its tracer, are on the finding: its
    # main thread was in the script's sleep (the cause, kept for after a restart)
    st = pf["evidence"]["stacks"]
    assert list(st) == ["2"], st
    main = next(t for t in st["2"]["threads"] if t["main"])
    inner = main["frames"][-1]
    assert inner["file"].endswith("hang_job.py") and inner["func"] == "main", main["frames"][-3:]
    assert inner["code"] == "time.sleep(secs)", inner
    args = ["analyze", "--flight-recorder", str(fr_dir), "--store", embedded_store.url, "--no-save"]
    r = CliRunner().invoke(cli, args)
    assert "rank 2's main thread at the dump" in r.output and "time.sleep(secs)" in r.output, r.output


def test_exited_rank_is_named_as_crashed(job, embedded_store):
    j = job("exit", rank=1, step=10)
    findings, latency = j.watch(
        embedded_store, want=lambda fs: any(f.kind == "crash" and f.evidence.get("exit_code") is not None for f in fs)
    )
    assert latency is not None
    (f,) = [f for f in findings if f.kind == "crash"]
    assert [s.rank for s in f.suspects] == [1]
    assert f.evidence["exit_code"] == 3 and "exited with code 3" in f.title


def test_desync_names_both_ops(job, embedded_store):
    j = job("desync", rank=3, step=2)
    findings, latency = j.watch(embedded_store, want=lambda fs: any(f.kind == "desync" for f in fs))
    assert latency is not None
    (f,) = [f for f in findings if f.kind == "desync"]
    assert [s.rank for s in f.suspects] == [3]
    assert "broadcast" in f.title and "all_reduce" in f.title


def test_hang_in_a_subgroup_names_the_origin_group(job, embedded_store):
    j = job("subgroup", rank=3, step=3)
    findings, latency = j.watch(embedded_store)
    assert latency is not None
    (f,) = [f for f in findings if f.kind == "hang"]
    assert [s.rank for s in f.suspects] == [3]
    assert f.evidence["origin_group"] == "pair_1" and f.evidence["missing"] == [3]
    assert [c["group"] for c in f.evidence["cascade"]] == ["default_pg"]


def test_slow_job_is_not_a_hung_job(job, embedded_store):
    # every step takes ~1 s and rank 1 keeps the others waiting 0.4 s in each all_reduce: collectives are
    # "in flight" for a while every step, but never for 5 median steps
    j = job("slow", rank=1, step=-1, HANG_STEPS="8")
    config = HangConfig(min_stall_s=0.2, heartbeat_stale_s=3.0)
    findings, _ = j.watch(embedded_store, timeout_s=9, config=config)
    assert findings == []


def test_node_collector_reports_a_dead_rank_to_an_analyzer_on_another_host(job, embedded_store):
    """The rank's process vanishes (os._exit, as a SIGKILL or the OOM killer would leave it): the
    analyzer runs "elsewhere" (cannot check pids, knows no exit codes), yet names a crash, because
    the node's collector saw the pid disappear and wrote the rank's last heartbeat with exited = 2."""
    from ranklens.collector.agent import Agent, AgentConfig

    j = job("exit", rank=1, step=10)
    cfg = AgentConfig(
        spool_dir=str(j.spool), nvml=False, ship_interval_s=0.1, liveness_interval_s=0.3, spool_max_bytes=0
    )
    with Agent(cfg, store=embedded_store):
        j.wait_started(embedded_store, Shipper(j.spool, embedded_store))  # the rank has exited by now
        deadline = time.time() + 60
        findings: list = []
        while time.time() < deadline:
            findings = detect_live_hangs(embedded_store, j.job_id, config=FAST, pid_alive=lambda h, p: None)
            if any(f.kind == "crash" for f in findings):
                break
            time.sleep(0.5)
    (f,) = [f for f in findings if f.kind == "crash"]
    assert [s.rank for s in f.suspects] == [1] and "process is gone" in f.title
    gone = embedded_store.query(
        f"SELECT rank FROM heartbeats WHERE job_id = '{j.job_id}' AND exited = 2 ORDER BY rank"
    ).rows()
    assert 1 in [r for (r,) in gone]
