"""Slow-link analysis benchmark: time on a simulated 10,240-rank job, and precision/recall of the
faulty-link ranking over random simulated 3D-parallel jobs with link faults.

    python bench/links_bench.py [--ranks-job 10240] [--jobs 16] [--seed 0] [--server URL] [--max-noise-p P]

The 10,240-rank job: TP 8 (one node of 8 ranks), PP 8, DP 160 = 1,280 nodes, 20 steps, one node's
link 3x slow; rows are generated with numpy/pyarrow (tests/links_helpers.py). The accuracy jobs
vary shape, slowdown (1.6-6x), onset, fault kind (a node's link or the link between two nodes), and
add decoys (a compute straggler, a congested period, or both); a quarter are healthy. A link is
*found* when a slow_link finding names it; *ranked first* when it is the top finding. Prints one
line per measurement; nothing here runs in the test suite.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ranklens.analyzers.links import compute_link_metrics, find_slow_links
from ranklens.analyzers.tomography import GroupTestingDetector
from ranklens.store import open_store
from tests.links_helpers import SimSpec, simulate


def bench_scale(store, ranks: int) -> None:
    tp, pp = 8, 8
    dp = max(1, ranks // (tp * pp))
    spec = SimSpec(job_id="bench-links", tp=tp, pp=pp, dp=dp, ranks_per_node=tp, steps=20, slow_nodes={417: 3.0})
    t = time.perf_counter()
    rows = simulate(spec)
    t_gen = time.perf_counter() - t
    t = time.perf_counter()
    store.write_many(rows)
    if hasattr(store, "compact"):
        store.compact(min_parts=2)
    t_write = time.perf_counter() - t
    n = rows["collectives"].num_rows
    print(
        f"{store.backend:9s} job: {spec.world:,} ranks ({spec.world // tp:,} nodes), {n:,} collective rows; "
        f"generated in {t_gen:.1f} s, written in {t_write:.1f} s"
    )
    for run in range(3):
        t = time.perf_counter()
        m = compute_link_metrics(store, spec.job_id)
        t_metric = time.perf_counter() - t
        det = GroupTestingDetector()
        t = time.perf_counter()
        report = det.detect(m)
        t_detect = time.perf_counter() - t
        t = time.perf_counter()
        findings = find_slow_links(store, spec.job_id)
        t_all = time.perf_counter() - t
        print(
            f"{store.backend:9s} link analysis ({run + 1}/3): metric (SQL + shaping) {t_metric:.2f} s, "
            f"detector {t_detect:.2f} s over {len(m):,} cells, end to end with findings {t_all:.2f} s; "
            f"found {[f.evidence.get('link', f.kind) for f in findings]} (truth node417<->network); "
            f"{len(report.links)} link(s)"
        )


def _random_job(rng: random.Random, k: int) -> tuple[SimSpec, str | None]:
    tp = rng.choice([2, 4, 8])
    pp = rng.choice([2, 4])
    dp = rng.choice([4, 8, 16])
    nodes = pp * dp
    spec = SimSpec(
        job_id=f"acc-{k}",
        tp=tp,
        pp=pp,
        dp=dp,
        ranks_per_node=tp,
        steps=rng.choice([12, 20, 30]),
        noise=rng.uniform(0.04, 0.15),
        compute_s=0.03,
        seed=k,
    )
    truth: str | None = None
    kind = rng.random()
    div = rng.uniform(1.6, 6.0)
    if kind < 0.25:
        pass  # healthy
    elif kind < 0.7:
        node = rng.randrange(nodes)
        spec.slow_nodes = {node: div}
        truth = f"node{node}<->network"
    else:
        p = rng.randrange(pp - 1)
        d = rng.randrange(dp)
        a, b = p * dp + d, (p + 1) * dp + d
        spec.slow_pairs = {(a, b): div}
        truth = f"node{a}<->node{b}"
    spec.slow_from = rng.randrange(0, spec.steps // 2)
    decoy = rng.random()
    if decoy < 0.3:
        spec.straggler_rank = rng.randrange(spec.world)
        spec.straggler_s = 0.01
    elif decoy < 0.5:
        a = rng.randrange(0, spec.steps - 4)
        spec.congestion = (a, a + 3)
    return spec, truth


def bench_accuracy(store, jobs: int, seed: int, detector: GroupTestingDetector | None = None) -> None:
    rng = random.Random(seed)
    tp = fp = fn = first = faulty = healthy_clean = healthy = 0
    for k in range(jobs):
        spec, truth = _random_job(rng, k)
        store.write_many(simulate(spec))
        links = [f for f in find_slow_links(store, spec.job_id, detector=detector) if f.kind == "slow_link"]
        names = [f.evidence["link"] for f in links]
        if truth is None:
            healthy += 1
            healthy_clean += not names
        else:
            faulty += 1
            first += bool(names) and names[0] == truth
        tp += truth in names
        fp += sum(1 for x in names if x != truth)
        fn += truth is not None and truth not in names
        decoys = ("straggler " if spec.straggler_rank is not None else "") + ("congestion" if spec.congestion else "")
        print(
            f"  job {k:2d}: {spec.world:4d} ranks tp{spec.tp} pp{spec.pp} dp{spec.dp}, truth {truth}, "
            f"slowdown {max([*spec.slow_nodes.values(), *spec.slow_pairs.values(), 1.0]):.1f}x from step "
            f"{spec.slow_from}, decoys [{decoys.strip()}] -> {names}"
        )
    precision = tp / (tp + fp) if tp + fp else 1.0
    recall = tp / (tp + fn) if tp + fn else 1.0
    print(
        f"accuracy over {jobs} jobs: precision {precision:.2f}, recall {recall:.2f}, faulty link ranked first "
        f"in {first}/{faulty} faulty jobs, no link finding in {healthy_clean}/{healthy} healthy jobs"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks-job", type=int, default=10240)
    p.add_argument("--jobs", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server", default=os.environ.get("RANKLENS_BENCH_CLICKHOUSE", ""))
    p.add_argument("--skip-scale", action="store_true")
    p.add_argument(
        "--max-noise-p", type=float, default=None, help="the detector's noise rule for the accuracy jobs (1: off)"
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ranklens-links-bench-") as tmp:
        store = open_store(f"embedded://{tmp}/store")
        if not args.skip_scale:
            bench_scale(store, args.ranks_job)
        if args.server:
            import uuid

            server = open_store(f"{args.server.rstrip('/')}/links_bench_{uuid.uuid4().hex[:8]}")
            try:
                bench_scale(server, args.ranks_job)
            finally:
                server.drop_database()
                server.close()
        acc = open_store(f"embedded://{tmp}/acc")
        det = GroupTestingDetector(max_noise_p=args.max_noise_p) if args.max_noise_p is not None else None
        bench_accuracy(acc, args.jobs, args.seed, det)
    return 0


if __name__ == "__main__":
    sys.exit(main())
