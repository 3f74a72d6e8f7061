"""Issue 21: a rank its host starves of CPU is not a straggler.

Unit tests of the scheduler sampler (tracing/_cpu.py) and the decision
(analyzers/contention.py), and real 4-rank gloo jobs (tests/zero_code_job.py under ``ranklens run``)
with two CPU hogs, where the host's scheduler gives rank 3 a smaller CPU share than its peers
(tests/cpu_starvation_job.py): the starved rank is not named; a rank slowed in forward under the
hogs still is.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ranklens.analyzers.contention import CpuWindow, explains
from ranklens.tracing._cpu import CpuSampler, make_sampler, read_schedstat
from tests._jobs import analyze_report, ranklens_run
from tests.helpers import cpu_rows
from tests.zero_code_helpers import TORCHRUN, cpu_hogs

ROOT = Path(__file__).resolve().parents[2]


# -------------------------------------------------------------------------------------- sampler


def _fake_proc(root: Path, threads: dict[int, tuple[int, int]]) -> None:
    for t in list((root / "task").glob("*")) if (root / "task").exists() else []:
        (t / "schedstat").unlink()
        t.rmdir()
    for tid, (cpu, delay) in threads.items():
        d = root / "task" / str(tid)
        d.mkdir(parents=True, exist_ok=True)
        (d / "schedstat").write_text(f"{cpu} {delay} 7\n")


def test_sampler_reads_the_training_thread_and_keeps_process_totals_monotone(tmp_path):
    _fake_proc(tmp_path, {10: (100, 5), 11: (50, 1)})
    s = CpuSampler({"job_id": "j", "attempt": 0, "rank": 2}, "h", tid=10, proc_root=str(tmp_path))
    a = s.sample(1)
    assert a is not None
    assert (a["cpu_ns"], a["run_delay_ns"], a["proc_cpu_ns"], a["proc_run_delay_ns"]) == (100, 5, 150, 6)
    assert (a["rank"], a["host"], a["ts_ns"], a["threads"]) == (2, "h", 1, 2)
    # thread 11 ended, thread 12 started: the totals keep what 11 had, and add 12's whole life
    _fake_proc(tmp_path, {10: (130, 25), 12: (9, 3)})
    b = s.sample(2)
    assert (b["cpu_ns"], b["run_delay_ns"], b["proc_cpu_ns"], b["proc_run_delay_ns"]) == (130, 25, 189, 29)


def test_sampler_without_schedstat_is_off_and_counted(tmp_path):
    drops: list[str] = []
    s = CpuSampler({"job_id": "j", "attempt": 0, "rank": 0}, "h", tid=99, proc_root=str(tmp_path))
    assert s.sample(1) is None and "schedstat" in s.disabled
    assert s.sample(2) is None  # stays off: one try only
    assert read_schedstat(str(tmp_path / "nothing")) is None
    (tmp_path / "bad").write_text("garbage\n")
    assert read_schedstat(str(tmp_path / "bad")) is None
    # the tracer's constructor path: no sampler, one drop counted
    import ranklens.tracing._cpu as cpu_mod

    real = cpu_mod.CpuSampler
    cpu_mod.CpuSampler = lambda ident, host: real(ident, host, tid=99, proc_root=str(tmp_path))  # type: ignore[misc]
    try:
        assert make_sampler({"job_id": "j", "attempt": 0, "rank": 0}, "h", drops.append) is None
    finally:
        cpu_mod.CpuSampler = real  # type: ignore[misc]
    assert drops == ["cpu:unavailable"]


def test_sampler_sees_this_threads_cpu_and_run_delay_on_linux():
    if read_schedstat(f"/proc/self/task/{threading.get_native_id()}/schedstat") is None:
        pytest.fail("this Linux host has no /proc/self/task/<tid>/schedstat: the test bed needs schedstats")
    s = make_sampler({"job_id": "j", "attempt": 0, "rank": 0}, "h", lambda what: None)
    assert s is not None
    a = s.sample(1)
    t_end = time.thread_time_ns() + 30_000_000
    while time.thread_time_ns() < t_end:  # 30 ms of this thread's CPU
        pass
    b = s.sample(2)
    assert b["cpu_ns"] - a["cpu_ns"] >= 25_000_000
    assert b["proc_cpu_ns"] >= b["cpu_ns"] and b["run_delay_ns"] >= a["run_delay_ns"] >= 0


# ------------------------------------------------------------------------------------- decision


def _cw(delay: list[float], cpu: list[float], proc_delay: list[float] | None = None) -> CpuWindow:
    n = len(delay)
    pd = np.array(proc_delay if proc_delay is not None else delay)
    return CpuWindow(np.arange(n), {r: "h" for r in range(n)}, np.array(cpu), np.array(delay), np.array(cpu), pd, "")


def test_a_starved_rank_is_explained_a_sleeping_or_busy_one_is_not():
    step = 0.1
    # rank 3 waited 0.5 s/s more than its peers (their median) for a CPU: 50 ms/step of the 60 ms it was behind
    starved = _cw([0.1, 0.1, 0.12, 0.6], [0.3, 0.3, 0.3, 0.3])
    assert explains(starved, 3, 0.06, step) == pytest.approx((0.05, 0.0), abs=1e-9)
    # a sleeping rank: no more run delay than its peers
    sleeping = _cw([0.1, 0.1, 0.12, 0.1], [0.3, 0.3, 0.3, 0.2])
    assert explains(sleeping, 3, 0.06, step) is None
    # a busy rank on a busy host: some run delay, but it did more work (CPU time) than its peers
    busy = _cw([0.1, 0.1, 0.12, 0.5], [0.3, 0.3, 0.3, 0.7])
    assert explains(busy, 3, 0.08, step) is None
    # the training thread waited 18 ms/step more (under half the 60 ms), its process's threads (the
    # backend's I/O threads carry the collective too) 45 ms more: explained by the process's wait
    both = _cw([0.1, 0.1, 0.12, 0.28], [0.3, 0.3, 0.3, 0.3], [0.5, 0.5, 0.6, 0.95])
    assert explains(both, 3, 0.06, step) == pytest.approx((0.045, 0.0), abs=1e-9)
    # ...also when the training thread waited little and the others (gloo's I/O threads) most: a CI
    # run named rank 1 of a healthy job at 9.3 ms/iteration, its thread 1.7 ms and its process 6.7 ms
    # above its peers', no extra CPU
    others = _cw([0.1, 0.1, 0.12, 0.14], [0.3, 0.3, 0.3, 0.3], [0.5, 0.5, 0.6, 0.9])
    assert explains(others, 3, 0.06, step) == pytest.approx((0.04, 0.0), abs=1e-9)
    # ...but not when the process did more CPU work than its peers' (its own extra thread)
    busy_proc = CpuWindow(np.arange(4), {r: "h" for r in range(4)}, np.array([0.3] * 4),
                          np.array([0.1, 0.1, 0.12, 0.14]), np.array([0.4, 0.4, 0.4, 0.8]),
                          np.array([0.5, 0.5, 0.6, 0.9]), "")  # fmt: skip
    assert explains(busy_proc, 3, 0.06, step) is None
    # ...nor when the process did not wait for half the excess either
    thread_only = _cw([0.1, 0.1, 0.12, 0.28], [0.3, 0.3, 0.3, 0.3], [0.5, 0.5, 0.6, 0.7])
    assert explains(thread_only, 3, 0.06, step) is None
    # a compute excess (the peer detector's): the process's threads explain it only with the whole
    # excess. The demo's rank 1 slept 20 ms/step in forward under four CPU hogs: its process waited
    # 12.7 ms/step more than its peers' (its gloo threads, in the all-reduces it reached last), its
    # training thread 1.9 ms; CI's run discounted it as contention and the demo named nobody
    demo = _cw([0.1, 0.1, 0.1, 0.114], [0.3, 0.3, 0.3, 0.3], [0.5, 0.5, 0.5, 0.5 + 0.127 / 1.36])
    assert explains(demo, 3, 0.0214, 0.136, compute=True) is None
    assert explains(demo, 3, 0.0214, 0.136) is not None  # as a lateness (the blame detector's) it would be
    # ...while a process that waited the whole excess more (here 2.2x: the starved rank of the
    # step-free job below, measured) still explains a compute excess
    starved_proc = _cw([0.1, 0.1, 0.1, 0.1], [0.3, 0.3, 0.3, 0.3], [0.5, 0.5, 0.5, 0.5 + 0.0556 / 0.0562])
    assert explains(starved_proc, 3, 0.0256, 0.0562, compute=True) == pytest.approx((0.0256, 0.0), abs=1e-6)
    # no samples of the rank, or too few peers to compare with: nothing is discounted
    assert explains(starved, 7, 0.06, step) is None
    assert explains(_cw([0.1, 0.6], [0.3, 0.3]), 1, 0.06, step) is None


# ----------------------------------------------------------------------------------- real jobs

NICE = 6  # rank 3's CPU weight under the hogs: about a third of its peers' share of a core


def _run(tmp_path: Path, name: str, *, slow_rank: int, optimizer: bool, nice: int = NICE, steps: int = 16) -> dict:
    """tests/zero_code_job.py under ``ranklens run`` with two CPU hogs, rank 3 given less CPU by
    the scheduler (``nice``; 0: no rank is favoured); ``ranklens analyze --json``'s report."""

    store = f"embedded://{tmp_path}/store"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "ZC_STEPS": str(steps),
        "ZC_SLOW_RANK": str(slow_rank),
        "ZC_SLOW_PHASE": "forward",
        "ZC_SLOW_S": "0.05",
        "ZC_SLOW_FROM": "6",
        "ZC_NO_OPTIMIZER": "0" if optimizer else "1",
        "CS_NICE_RANK": "3",
        "CS_NICE": str(nice),
    }
    env.pop("RANKLENS_JOB_ID", None)
    env.pop("RANKLENS_STORE", None)
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "4", str(ROOT / "tests" / "cpu_starvation_job.py")]
    with cpu_hogs(2):
        run = ranklens_run(store, tmp_path / "spool", cmd, job_id=name, timeout=600, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    return {"store": store, "job": name, "report": analyze_report(store, name, timeout=300, env=env, cwd=tmp_path)}


def _named(report: dict) -> set[int]:
    out: set[int] = set()
    for f in report["findings"]:
        if f["kind"] == "straggler":
            out |= {int(s["rank"]) for s in f["suspects"] if int(s["rank"]) >= 0}
            out |= {int(r) for r in f["evidence"].get("ranks", [])}
    return out


def _run_delay_rates(store_url: str, job: str) -> dict[int, float]:
    from ranklens.store import open_store

    s = open_store(store_url, create=False)
    sql = (
        "SELECT rank, (max(run_delay_ns) - min(run_delay_ns)) / (max(ts_ns) - min(ts_ns)) AS rate "
        f"FROM cpu WHERE job_id = '{job}' GROUP BY rank ORDER BY rank"
    )
    return {int(r): float(x) for r, x in s.query(sql).rows()}


@pytest.mark.e2e
def test_a_healthy_step_free_job_with_a_starved_rank_names_nobody(tmp_path, monkeypatch):
    """No optimizer (no steps: the ledger alone), nobody slowed; rank 3 waits for a CPU."""
    o = _run(tmp_path, "cs-healthy", slow_rank=-1, optimizer=False)
    report = o["report"]
    assert report["step_source"] == "none"
    rates = _run_delay_rates(o["store"], o["job"])
    assert sorted(rates) == [0, 1, 2, 3], rates  # every rank sampled its scheduler counters
    assert rates[3] > 2 * max(rates[r] for r in (0, 1, 2)), rates  # the scheduler starved rank 3
    # on failure, what a diagnosis needs: every rank's run-delay rate, the contention notes, and the
    # named finding's evidence (a loaded CI run once named rank 0 here: 11 ms/iteration from iteration 4)
    why = " | ".join(  # short: pytest cuts a long assertion message (a CI failure lost its numbers)
        [f"rates { ({r: round(x, 3) for r, x in rates.items()}) }"]
        + [
            f"{f['title'][:80]}: excess {f['evidence'].get('excess_per_step_s', f['evidence'].get('delay_per_step_s'))}"
            f" step {f['evidence'].get('mean_step_time_s')} cpu {f['evidence'].get('cpu')}"
            for f in report["findings"]
            if f["kind"] == "straggler"
        ]
        + [f"note {n['ranks']} {n['run_delay_ms_per_step']}ms" for n in report.get("host_cpu_contention", [])]
    )
    assert _named(report) == set(), why
    assert not [f for f in report["findings"] if f["kind"] in ("straggler", "slow_link")], why
    for note in report.get("host_cpu_contention", []):
        assert note["ranks"] == [3] and note["run_delay_ms_per_step"] > 0, note
    # what the analysis says without the scheduler's counters (how strongly the host starves rank 3
    # varies with the host's own load): every rank it would name is in a contention note instead
    import ranklens.analyzers.straggler as straggler
    from ranklens.store import open_store

    monkeypatch.setattr(straggler, "explains", lambda *a, **k: None)
    before = straggler.find_stragglers(open_store(o["store"], create=False), o["job"])
    noted = {r for n in report.get("host_cpu_contention", []) for r in n["ranks"]}
    assert {s.rank for f in before for s in f.suspects} <= noted, ([f.title for f in before], noted)


@pytest.mark.e2e
def test_a_rank_slowed_in_forward_is_still_named_under_cpu_hogs(tmp_path):
    """Inferred steps; rank 1 sleeps 50 ms in forward from step 6, with two CPU hogs: sleeping adds
    no run-queue delay, so the scheduler's counters do not explain it away. 24 steps: under the hogs
    the sleep shows as ~35 ms of excess against ~20 ms of host noise, which the detector names only
    after enough steps to tell a level shift from noise (10 were too few on a busy CI host)."""
    o = _run(tmp_path, "cs-forward-50ms", slow_rank=1, optimizer=True, nice=0, steps=24)
    report = o["report"]
    stragglers = [f for f in report["findings"] if f["kind"] == "straggler"]
    titles = [f["title"] for f in stragglers]
    assert _named(report) == {1}, (titles, report.get("host_cpu_contention"))
    (f,) = stragglers
    # the onset under two hogs is known only as well as the noise allows: ~40 ms of excess against
    # 10-20 ms of host noise (sd) per step. `python bench/onset_noise.py` (the detector's rule on
    # synthetic series, a 35 ms shift at step 6 of 24): at sd 15 ms within 1 step 87-92% of the
    # time, within 3 95-98%; at sd 20 within 1 68-83%. Three measured runs (sd ~12 ms) were exact; a
    # loaded CI run said step 3 (stop 32).
    assert abs(int(f["first_seen_step"]) - 6) <= 3, titles
    assert f["evidence"].get("phase") == "forward", (titles, f["evidence"].get("phase_excess_s"))
    cpu = f["evidence"]["cpu"]  # what the counters said: no run delay worth its 50 ms
    assert cpu["run_delay_above_peers_per_step_s"] < 0.025, cpu


# ------------------------------------------------------------------- metric + discount in a store

T0 = 1_790_000_000_000_000_000


def _finding(kind: str, ranks: list[int], **evidence):
    from ranklens.analyzers.findings import Finding, Severity, Suspect

    return Finding(
        id=f"{kind}-{ranks}", job_id="j", attempt=0, kind=kind, severity=Severity.WARNING, confidence=0.9,
        title=f"{kind} {ranks}", suspects=tuple(Suspect(rank=r, node=f"node{r // 2}") for r in ranks),
        first_seen_step=2, last_seen_step=8, first_seen_ns=T0 + 2_000_000_000, last_seen_ns=T0 + 8_000_000_000,
        impact_s=1.0, impact_gpu_s=3.0, step_time_pct=30.0, evidence=dict(evidence),
    )  # fmt: skip


def test_cpu_metric_and_discounts_on_both_backends(store):
    from ranklens.analyzers.contention import cpu_window, discount_links
    from ranklens.analyzers.straggler import discount_cpu_contention

    store.write("cpu", cpu_rows("j", {0: 0.05, 1: 0.05, 2: 0.06, 3: 0.65}))
    cw = cpu_window(store, "j", 0, T0 + 2_000_000_000, T0 + 8_000_000_000)
    assert cw.ranks.tolist() == [0, 1, 2, 3] and cw.hosts[3] == "node1"
    assert cw.delay_rate.tolist() == pytest.approx([0.05, 0.05, 0.06, 0.65], abs=1e-6)
    assert cw.cpu_rate.tolist() == pytest.approx([0.3] * 4, abs=1e-6)
    # rank 3, 60 ms/step behind with steps of 100 ms: its 60 ms/step of run delay above its peers explains it
    starved = _finding("straggler", [3], excess_per_step_s=0.06, mean_step_time_s=0.1)
    sleeper = _finding("straggler", [1], excess_per_step_s=0.06, mean_step_time_s=0.1)
    notes: list = []
    kept = discount_cpu_contention(store, [starved, sleeper], notes)
    assert [f.suspects[0].rank for f in kept] == [1]
    assert kept[0].evidence["cpu"]["run_delay_above_peers_per_step_s"] == pytest.approx(-0.001, abs=1e-6)
    (n,) = notes
    assert (n.kind, n.node, n.ranks) == ("straggler", "node1", (3,))
    assert n.run_delay_per_step_s == pytest.approx(0.06, abs=1e-6) and "node1" in n.line()
    assert n.to_json()["run_delay_ms_per_step"] == pytest.approx(60.0, abs=0.01)
    # a slow link of node1 (ranks 2, 3), 30% of the job's time: rank 3's threads waited 0.6 s/s for a CPU
    link = _finding("slow_link", [2, 3])
    link_notes: list = []
    assert discount_links(store, [link], link_notes) == []
    assert link_notes[0].kind == "slow_link" and link_notes[0].ranks == (3,)
    # node0's link (ranks 0, 1): nothing waited for a CPU there, the link is reported
    other = _finding("slow_link", [0, 1])
    assert discount_links(store, [other], []) == [other]
    # no samples for the job: nothing is discounted
    assert discount_cpu_contention(store, [dataclasses_replace(starved, job_id="other")], []) != []


def dataclasses_replace(f, **kw):
    import dataclasses

    return dataclasses.replace(f, **kw)
