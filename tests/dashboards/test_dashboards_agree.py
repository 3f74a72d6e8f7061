"""A page's worst ranks and slowest link are the finding's suspects (issue 13): the dashboards
aggregate the analyzers' own SQL (blame, compute, transfer), so on the same job they cannot name
someone else than the finding beside them.

Simulated jobs (``ranklens.simulate``), on both store backends: a straggler beside a node whose clock
is off (blame must align clocks, as the analyzer does, not to blame that node), a slow node link, and
a pipeline job (blame leaves point-to-point transfers out, as the analyzer does).
"""

from __future__ import annotations

import pytest

from ranklens.analyzers.job import analyze_job
from ranklens.dashboards import queries as q
from ranklens.simulate import simulate

STRAGGLER, SLOW_NODE = 13, 2


def _suspect_ranks(finding) -> list[int]:
    return sorted({s.rank for s in finding.suspects if s.rank >= 0})


def _the_finding(store, kind: str, faults: list[str], job_id: str):
    """A simulated 32-rank job (pp 2 x dp 4 x tp 4, 4 ranks a node) with ``faults``, and the one
    finding of ``kind`` the analyzers make of it."""
    job = simulate(store, ranks=32, steps=12, pp=2, tp=4, ranks_per_node=4, faults=faults, job_id=job_id)
    found = [f for f in analyze_job(store, job.job_id, 0) if f.kind == kind]
    assert len(found) == 1, [f.title for f in found]
    return job, found[0]


def test_worst_ranks_are_the_straggler_findings_suspects(store):
    # rank 13 computes 1.3x slower from step 4; node 0's clock runs 200 ms ahead, so on raw clocks
    # ranks 0..3 seem to arrive last at every collective they share with another node: only the
    # analyzer's aligned blame keeps them innocent
    job, f = _the_finding(store, "straggler", [f"slow_gpu:{STRAGGLER}:1.3@4", "clock_skew:0:200"], "agree-straggler")
    suspects = _suspect_ranks(f)
    assert suspects == [STRAGGLER]
    lo, hi = int(f.first_seen_step), int(f.last_seen_step)
    b = q.job_bounds(store, job.job_id, 0)
    # the timeline page's culprits table
    worst = q.worst_ranks(store, job.job_id, 0, lo, hi, len(suspects), b.first_ns)
    assert sorted(int(r) for r in worst["culprit"]) == suspects
    # the heat-map page's hottest rows (blame and compute) over the finding's steps
    for metric in ("blame", "compute"):
        heat = q.heatmap(store, job.job_id, 0, metric, lo, hi, axis="rank", t0_ns=b.first_ns)
        hottest = heat.groupby("row_key")["value"].sum().sort_values(ascending=False)
        assert sorted(int(r) for r in hottest.index[: len(suspects)]) == suspects, metric
    node = job.host(STRAGGLER)
    by_node = q.heatmap(store, job.job_id, 0, "blame", lo, hi, axis="node", t0_ns=b.first_ns)
    assert by_node.groupby("row_key")["value"].sum().idxmax() == node == f.suspects[0].node


def test_slowest_link_is_the_slow_link_findings_suspect(store):
    job, f = _the_finding(store, "slow_link", [f"slow_link:{SLOW_NODE}:3@2"], "agree-link")
    nodes = sorted({s.node for s in f.suspects})
    assert nodes == [job.host(SLOW_NODE * 4)]
    lo, hi = int(f.first_seen_step), int(f.last_seen_step)
    # the links page, per node: bus bytes over transfer time of every collective a node's ranks were in
    info = q.rank_info(store, job.job_id, 0)
    node_of = dict(zip(info["rank"].astype(int), info["node"]))
    per_rank = q.rank_bandwidth(store, job.job_id, 0, lo, hi)
    per_rank["node"] = [node_of[int(r)] for r in per_rank["rank"]]
    agg = per_rank.groupby("node")[["total_bytes", "total_xfer_ns"]].sum()
    bps = (agg["total_bytes"] / agg["total_xfer_ns"]).sort_values()
    assert list(bps.index[: len(nodes)]) == nodes
    # the links page, per group: the groups much slower than their kind's fastest all go through
    # the finding's node, and it is the only node they all share
    groups = q.group_bandwidth(store, job.job_id, 0, lo, hi)
    members = {
        str(pg): {node_of[int(r)] for r in ranks}
        for pg, ranks in store.query(
            f"SELECT pg, any(ranks) FROM process_groups WHERE job_id = '{job.job_id}' GROUP BY pg"
        ).rows()
    }
    for pg in groups["pg"]:
        if "/p2p:" in pg:
            members[pg] = {node_of[int(x)] for x in pg.rsplit(":", 1)[1].split("->")}
    inter = groups[[len(members[pg]) > 1 for pg in groups["pg"]]]
    fastest = inter.groupby("op_kind")["bytes_per_s"].transform("max")
    slow = inter[inter["bytes_per_s"] < 0.5 * fastest]
    assert len(slow) >= 2
    assert sorted(set.intersection(*(members[pg] for pg in slow["pg"]))) == nodes


def test_blame_heat_map_is_the_analyzers_blame(store):
    """Cell for cell, the heat map's blame is the analyzer's blame matrix: point-to-point transfers
    left out (a pipeline's receiver waits for its sender by design), clocks aligned, steps only."""
    from ranklens.analyzers.blame import compute_blame

    job = simulate(
        store,
        ranks=16,
        steps=6,
        pp=2,
        tp=2,
        ranks_per_node=4,
        faults=["slow_gpu:5:1.3@2", "clock_skew:1:2"],
        job_id="agree-blame",
    )
    assert store.query(
        "SELECT countIf(position(pg, '/p2p:') > 0) FROM collectives WHERE job_id = 'agree-blame'"
    ).scalar()
    b = q.job_bounds(store, job.job_id, 0)
    heat = q.heatmap(store, job.job_id, 0, "blame", 0, 5, axis="rank", t0_ns=b.first_ns)
    got = {(int(r), int(st)): float(v) for r, st, v in heat.itertuples(index=False)}
    m = compute_blame(store, job.job_id, 0)
    want = {(int(r), int(st)): float(m.delay_s[i, j]) for i, r in enumerate(m.ranks) for j, st in enumerate(m.steps)}
    keys = {k for k, v in {**got, **want}.items() if v > 1e-9}
    assert keys and {k for k in keys if got.get(k, 0.0) > 1e-9} == {k for k in keys if want.get(k, 0.0) > 1e-9}
    assert all(got.get(k, 0.0) == pytest.approx(want.get(k, 0.0), rel=1e-6, abs=1e-9) for k in keys)
