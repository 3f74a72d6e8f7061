"""Slow links on a real throttled network: network namespaces as nodes, gloo over TCP between them.

4 nodes x 2 ranks (tests/links_bed_job.py), traced with ranklens.tracing, shipped into an embedded
store. One start of the 8 ranks runs three scenarios: healthy, node 3's link throttled with tbf,
and a compute-slowed rank on a healthy network. Needs root and iproute2: skipped with the reason
otherwise.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from ranklens.analyzers import find_stragglers
from ranklens.analyzers.links import find_slow_links
from ranklens.analyzers.netbed import NetBed, unavailable_reason
from ranklens.analyzers.probe import attach_probe, plan_probe, run_probe
from ranklens.collector import Shipper
from ranklens.store import open_store
from tests.links_bed import start_bed_job

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]
# Readiness deadlines of the bed job's phases: 8 ranks on a loaded 2-core machine can take minutes
# per phase; what the analyzers decide from the phases keeps its own assertions.
PHASE_S = 600

RATE = "40mbit"
NODES = 4
# rank 5 (node 2) computes 150 ms longer from step 1. The healthy run is the longest: "no finding" needs
# enough windows that a burst of CPU contention on this 2-core VM (8 ranks) cannot look persistent.
SCENARIOS = "healthy:10,throttled:5,straggler:7:5"


def _wait(path: Path, procs: list[subprocess.Popen], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        dead = [p for p in procs if p.poll() is not None and p.returncode != 0]
        if dead or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            outs = [p.communicate()[0][-1500:] for p in procs]
            why = "a rank failed" if dead else f"timed out after {timeout_s} s"
            pytest.fail(f"bed job: {why} waiting for {path.name}: {outs}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def bed_run(tmp_path_factory):
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("bed")
    bed = NetBed(NODES, prefix=f"rlt{uuid.uuid4().hex[:6]}")
    bed.up()
    ctl = tmp / "ctl"
    ctl.mkdir()
    job = f"bed-{uuid.uuid4().hex[:6]}"
    t0 = time.monotonic()
    try:
        procs = start_bed_job(bed, job=job, ctl=ctl, spool=tmp / "spool", scenarios=SCENARIOS, port=29533)
        _wait(ctl / "done-healthy", procs, PHASE_S)
        bed.throttle(3, RATE)
        (ctl / "go-throttled").write_text("")
        _wait(ctl / "done-throttled", procs, PHASE_S)
        store = open_store(f"embedded://{tmp / 'store'}")
        bed.unthrottle(3)
        (ctl / "go-straggler").write_text("")
        _wait(ctl / "done-straggler", procs, PHASE_S)
        outs = [p.communicate(timeout=300)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs), [o[-1500:] for o in outs]
        Shipper(tmp / "spool", store).ship_all()  # every scenario: a pass takes 2000 segments
        job_s = time.monotonic() - t0
        yield {"store": store, "job": job, "bed": bed, "job_s": job_s}
    finally:
        bed.down()


def test_throttled_node3_link_is_named_not_healthy_ranks_not_a_straggler(bed_run):
    store, job = bed_run["store"], bed_run["job"]
    findings = find_slow_links(store, f"{job}-throttled")
    links = [f for f in findings if f.kind == "slow_link"]
    assert [f.evidence["link"] for f in links] == ["node3<->network"], [f.title for f in findings]
    (f,) = links
    assert sorted(s.rank for s in f.suspects) == [6, 7] and {s.node for s in f.suspects} == {"node3"}
    assert f.evidence["slowdown"] > 5 and f.evidence["independent_groups"] >= 2
    assert f.evidence["p2p_pairs"]  # node 3's pipeline sends measured the link directly
    assert find_stragglers(store, f"{job}-throttled") == [] or all(
        s.node != "node3" for g in find_stragglers(store, f"{job}-throttled") for s in g.suspects
    )


def _explain(findings) -> str:
    """A false link finding's evidence, for the next person to diagnose (seen once in a quiet CI run:
    a false node2<->node3 at 2.2x on the healthy bed, 8 ranks on 2 cores)."""
    keep = ("slowdown", "windows", "slow_groups", "exonerating_groups", "transfer_vs_arrival", "purity")
    return json.dumps(
        [{"title": f.title, "state": f.state, **{k: f.evidence.get(k) for k in keep}} for f in findings],
        default=str,
        indent=1,
    )


def test_unthrottled_bed_has_no_link_finding(bed_run):
    findings = find_slow_links(bed_run["store"], f"{bed_run['job']}-healthy")
    links = [f for f in findings if f.kind == "slow_link"]
    assert links == [], _explain(links)


def test_compute_slowed_rank_is_a_straggler_not_a_link(bed_run):
    store, job = bed_run["store"], f"{bed_run['job']}-straggler"
    links = [f for f in find_slow_links(store, job) if f.kind == "slow_link"]
    assert links == [], _explain(links)
    stragglers = find_stragglers(store, job)
    assert [s.rank for f in stragglers[:1] for s in f.suspects] == [5], [f.title for f in stragglers]


def test_probe_confirms_the_throttled_link(bed_run):
    store, job, bed = bed_run["store"], bed_run["job"], bed_run["bed"]
    (f,) = [x for x in find_slow_links(store, f"{job}-throttled") if x.kind == "slow_link"]
    nodes = [bed.hostname(k) for k in range(NODES)]
    pairs = plan_probe(f, nodes)
    assert [(p.a, p.b, p.role) for p in pairs] == [("node3", "node0", "suspect"), ("node1", "node2", "reference")]
    index = {bed.hostname(k): k for k in range(NODES)}
    bed.throttle(3, RATE)
    try:
        report = run_probe(
            pairs,
            {n: bed.address(k) for n, k in index.items()},
            launcher=lambda n, argv: bed.command(index[n], argv),
            env=lambda n: bed.env(index[n]),
            nbytes=1 << 20,
            iters=2,
            port=29544,
            timeout_s=300,  # a bound on the probe job's life, not on what it measures
        )
    finally:
        bed.unthrottle(3)
    assert report.confirmed and report.ratio > 5, report.to_evidence()
    g = attach_probe(f, report)
    assert g.evidence["probe"]["confirmed"] and g.confidence >= 0.95 and "probe confirmed" in g.title
