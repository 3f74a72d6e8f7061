"""Prometheus series of the node collectors for one big job, before and after issue 19 #4.

    python bench/metrics_series.py [--ranks 10240] [--ranks-per-node 8] [--attempts 3] [--top-k 3]
                                   [--before REV]

Each collector sees its node's ranks (one per GPU when ``--ranks-per-node`` <= 8, the fake NVML's
GPUs otherwise 8) through what it really gets: the rows it ships (``ranks``, ``steps``,
``collectives``, ``heartbeats``) and NVML readings (the package's fake NVML, GPU -> rank from the
processes' environments), for ``--attempts`` restarts of the job within the 30 minutes a silent
rank is remembered. Printed per collector and for the whole job (nodes x per collector; every node
is alike): the ranklens series on ``/metrics`` at the last scrape, and the distinct series seen over
all attempts (what Prometheus' head block holds: a series stays there for hours after it goes).

"before" runs ``collector/metrics.py`` as of ``--before`` (default: the commit before issue 19 #4's,
read with ``git show``); "after" runs the installed one. Prints numbers; times nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
GPUS_PER_NODE = 8
# the commit before issue 19 #4's metrics (GPU series with job_id/rank, rank series per attempt)
BEFORE = "aa864eb^"
Series = set[tuple[str, tuple[tuple[str, str], ...]]]


def _old_metrics(rev: str) -> Any | None:
    """collector/metrics.py as of ``rev``, imported as a module of its own (None without git)."""
    try:
        src = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{rev}:collector/metrics.py"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return None
    path = Path(tempfile.mkdtemp()) / "ranklens_metrics_before.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("ranklens_metrics_before", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _series(cm: Any) -> Series:
    text = generate_latest(cm.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items())))
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith("ranklens_") and not s.name.endswith("_created")
    }


def _rows(job: str, attempt: int, ranks: list[int], host: str) -> dict[str, list[dict[str, Any]]]:
    now = time.time_ns()
    return {
        "ranks": [{"job_id": job, "attempt": attempt, "rank": r, "host": host, "started_ns": now} for r in ranks],
        "steps": [
            {
                "job_id": job,
                "attempt": attempt,
                "rank": r,
                "step": s,
                "start_ns": now + s * 10**9,
                "end_ns": now + s * 10**9 + (1 + r % 7) * 10**8,
            }
            for r in ranks
            for s in range(3)
        ],
        "collectives": [
            {
                "job_id": job,
                "attempt": attempt,
                "rank": r,
                "pg": "0",
                "seq": 1,
                "op": "all_reduce",
                "enter_ns": now,
                "end_ns": now + 10**7,
            }
            for r in ranks
        ],
        "heartbeats": [{"job_id": job, "attempt": attempt, "rank": r, "host": host, "ts_ns": now} for r in ranks],
    }


def _kind(name: str) -> str:
    if name.startswith("ranklens_gpu_"):
        return "gpu"
    if name.startswith(("ranklens_rank_", "ranklens_node_")):
        return "rank"
    return "other"


def _by_kind(series: Series) -> dict[str, int]:
    out = {"gpu": 0, "rank": 0, "other": 0}
    for name, _ in series:
        out[_kind(name)] += 1
    return out


def one_collector(make: Any, *, ranks_per_node: int, attempts: int) -> tuple[Series, Series]:
    """(series at the last scrape, distinct series over every attempt) of node 0's collector."""
    from ranklens.collector.fake_nvml import fake_nvml
    from ranklens.collector.nvml import GpuSampler, RankResolver
    from ranklens.records import to_arrow

    host, job = "node-0", "big-job"
    gpus = min(GPUS_PER_NODE, ranks_per_node)
    ranks = list(range(ranks_per_node))  # node 0 holds ranks 0..ranks_per_node-1
    sampler = GpuSampler(
        fake_nvml(gpus), host=host, resolver=RankResolver(static={g: (job, ranks[g]) for g in range(gpus)})
    )
    assert sampler.start()
    cm = make()
    seen: Series = set()
    last: Series = set()
    for attempt in range(attempts):
        for table, rows in _rows(job, attempt, ranks, host).items():
            cm.observe_rows(table, to_arrow(table, rows))
        for _ in range(2):  # two readings: the NVLink/PCIe rates too
            r = sampler.sample()
            cm.observe_gpus(r.samples, r.extras)
        last = _series(cm)
        seen |= last
    sampler.close()
    return last, seen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=10240)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--attempts", type=int, default=3)
    p.add_argument("--top-k", type=int, default=3)
    p.add_argument("--before", default=BEFORE, help="git revision of collector/metrics.py to compare with")
    a = p.parse_args(argv)
    from ranklens.collector.metrics import CollectorMetrics

    nodes = -(-a.ranks // a.ranks_per_node)
    print(
        f"job: {a.ranks} ranks on {nodes} nodes ({a.ranks_per_node} ranks, "
        f"{min(GPUS_PER_NODE, a.ranks_per_node)} GPUs each), {a.attempts} attempts"
    )
    runs: list[tuple[str, Any]] = []
    old = _old_metrics(a.before)
    if old is not None:
        runs.append((f"before ({a.before})", old.CollectorMetrics))
    else:
        print(f"before: cannot read collector/metrics.py at {a.before} (no git?): skipped")
    runs.append((f"after (top_k={a.top_k})", lambda: CollectorMetrics(node="node-0", top_k=a.top_k)))
    print("series: gpu = ranklens_gpu_*; rank = ranklens_rank_* and ranklens_node_*; other = collector_*, build_info")
    for name, make in runs:
        last, seen = one_collector(make, ranks_per_node=a.ranks_per_node, attempts=a.attempts)
        for when, series in (("last scrape", last), ("all attempts", seen)):
            k = _by_kind(series)
            print(
                f"{name:>20} {when:>12}: per collector {len(series):>5} (gpu {k['gpu']:>4}, rank {k['rank']:>4}, "
                f"other {k['other']:>3}); job {len(series) * nodes:>7} (rank {k['rank'] * nodes:>6})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
