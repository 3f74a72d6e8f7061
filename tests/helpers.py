"""Builders of synthetic ledgers with known ground truth (for analyzer tests)."""

from __future__ import annotations

import random

T0 = 1_790_000_000_000_000_000  # an epoch in 2026, ns


def synthetic_job(
    *,
    job_id: str = "job-synth",
    ranks: int = 4,
    steps: int = 20,
    slow_rank: int | None = 2,
    slow_from: int = 5,
    extra_s: float = 0.05,
    step_s: float = 0.2,
    noise_s: float = 0.002,
    collectives_per_step: int = 3,
    seed: int = 0,
) -> dict[str, list[dict]]:
    """A job whose ranks arrive at each collective after their compute; the slow rank's compute
    is ``extra_s`` longer from step ``slow_from``. Returns rows per table."""
    rng = random.Random(seed)
    rows: dict[str, list[dict]] = {"collectives": [], "steps": [], "ranks": [], "process_groups": []}
    for r in range(ranks):
        rows["ranks"].append({"job_id": job_id, "rank": r, "world_size": ranks, "host": f"node{r // 2}"})
    rows["process_groups"].append({"job_id": job_id, "pg": "0", "ranks": list(range(ranks)), "backend": "gloo"})
    t = T0
    seq = 0
    for s in range(steps):
        step_start = t
        chunk = step_s / collectives_per_step
        for _c in range(collectives_per_step):
            seq += 1
            arrivals = {}
            for r in range(ranks):
                work = chunk + rng.uniform(0, noise_s)
                if r == slow_rank and s >= slow_from:
                    work += extra_s / collectives_per_step
                arrivals[r] = t + int(work * 1e9)
            last = max(arrivals.values())
            end = last + int(0.001 * 1e9)
            for r, a in arrivals.items():
                rows["collectives"].append(
                    {
                        "job_id": job_id,
                        "rank": r,
                        "pg": "0",
                        "seq": seq,
                        "op": "all_reduce",
                        "nbytes": 4096,
                        "dtype": "float32",
                        "step": s,
                        "enter_ns": a,
                        "end_ns": end,
                    }
                )
            t = end
        for r in range(ranks):
            rows["steps"].append({"job_id": job_id, "rank": r, "step": s, "start_ns": step_start, "end_ns": t})
    return rows


def cpu_rows(job: str, delay_rate: dict[int, float], cpu_rate: float = 0.3, seconds: int = 10) -> list[dict]:
    """Cumulative samples every 0.5 s: rank r waits ``delay_rate[r]`` s/s for a CPU."""
    rows = []
    for r, rate in delay_rate.items():
        for k in range(2 * seconds + 1):
            t = k * 500_000_000
            rows.append(
                {
                    "job_id": job, "rank": r, "host": f"node{r // 2}", "ts_ns": T0 + t,
                    "cpu_ns": int(cpu_rate * t), "run_delay_ns": int(rate * t),
                    "proc_cpu_ns": int(cpu_rate * t), "proc_run_delay_ns": int(rate * t),
                }
            )  # fmt: skip
    return rows
