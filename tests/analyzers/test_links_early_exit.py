"""The slow-link analysis skips the detector only when the detector could not find anything."""

from __future__ import annotations

import numpy as np
import pytest

from ranklens.analyzers.links import GroupInfo, LinkMetrics, _could_be_slow, compute_link_metrics, find_slow_links
from ranklens.analyzers.tomography import SLOW, GroupTestingDetector
from tests.links_helpers import SimSpec, simulate


def _cells(rng: np.random.Generator, sigma: float) -> LinkMetrics:
    """Random cells: groups of 2-4 nodes (some within one node), two op families, three windows."""
    groups: dict[str, GroupInfo] = {}
    for g in range(int(rng.integers(3, 12))):
        k = int(rng.integers(1, 4))
        nodes = tuple(f"node{int(x)}" for x in sorted(rng.choice(8, size=k, replace=False)))
        groups[f"pg{g}"] = GroupInfo(f"pg{g}", tuple(range(2 * k)), nodes)
    rows = [(pg, fam, w) for pg in groups for fam in ("all_reduce", "all_gather") for w in range(3)]
    n = len(rows)
    xfer = rng.lognormal(-6.0, 0.3, n)
    bw = 1e10 * rng.lognormal(0.0, sigma, n)
    if rng.random() < 0.3:
        bw[int(rng.integers(n))] = np.nan
    ints = np.zeros(n, dtype=np.int64)
    return LinkMetrics(
        job_id="j",
        attempt=0,
        pg=np.array([r[0] for r in rows], dtype=object),
        family=np.array([r[1] for r in rows], dtype=object),
        size_bucket=ints + 10,
        window=np.array([r[2] for r in rows], dtype=np.int64),
        count=ints + 5,
        members=np.array([len(groups[r[0]].ranks) for r in rows], dtype=np.int64),
        bw_Bps=bw,
        xfer_s=xfer,
        sum_xfer_s=xfer * 5,
        sum_bus_bytes=bw * xfer * 5,
        spread_s=xfer / 10,
        first_ns=ints,
        last_ns=ints + 1,
        min_step=ints,
        max_step=ints,
        groups=groups,
        hosts={},
        window_steps=1,
        window_ns=0,
        sql="",
    )


@pytest.mark.parametrize("seed", range(4))
def test_no_slow_test_is_possible_when_the_check_says_so(seed: int) -> None:
    rng = np.random.default_rng(seed)
    skipped = judged = 0
    for _ in range(300):
        m = _cells(rng, float(rng.choice([0.02, 0.1, 0.2, 0.4])))
        for det in (GroupTestingDetector(), GroupTestingDetector(slow_ratio=1.2, fast_ratio=1.1, noise_k=0.0)):
            report = det.detect(m)
            if not _could_be_slow(m, det.slow_ratio):
                skipped += 1
                assert not (report.verdict == SLOW).any()
                assert report.links == [] and report.congestion == []
            else:
                judged += 1
    assert skipped > 50 and judged > 50  # both branches exercised


def test_a_healthy_job_is_skipped_and_a_slow_link_is_not(embedded_store) -> None:
    embedded_store.write_many(simulate(SimSpec(job_id="healthy", seed=1, noise=0.05)))
    embedded_store.write_many(simulate(SimSpec(job_id="faulty", slow_nodes={5: 2.0}, slow_from=3, steps=12)))
    healthy = compute_link_metrics(embedded_store, "healthy")
    assert len(healthy) > 0 and not _could_be_slow(healthy, GroupTestingDetector().slow_ratio)
    assert GroupTestingDetector().detect(healthy).links == []
    assert find_slow_links(embedded_store, "healthy") == []
    faulty = compute_link_metrics(embedded_store, "faulty")
    assert _could_be_slow(faulty, GroupTestingDetector().slow_ratio)
    assert [f.evidence["link"] for f in find_slow_links(embedded_store, "faulty")] == ["node5<->network"]
