"""Slow-link localization on synthetic 3D-parallel ledgers with known ground truth."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from ranklens.analyzers import compute_blame, latest_findings, save_findings
from ranklens.analyzers.links import BUS_FACTORS, compute_link_metrics, find_slow_links, link_metric_sql
from ranklens.analyzers.tomography import GroupTestingDetector, Link, LinkReport
from tests.helpers import T0
from tests.links_helpers import SimSpec, simulate


def _load(store, spec: SimSpec) -> None:
    store.write_many(simulate(spec))


def _links(findings):
    return [f for f in findings if f.kind == "slow_link"]


def test_slowed_node_link_is_named_with_onset_evidence_and_impact(store):
    _load(store, SimSpec(slow_nodes={5: 4.0}, slow_from=3, steps=12))
    findings = find_slow_links(store, "job-links")
    (f,) = findings
    assert f.kind == "slow_link"
    assert f.evidence["link"] == "node5<->network" and f.evidence["link_kind"] == "node"
    assert "node5<->network" in f.title and "not a late arriver" in f.title
    assert sorted(s.rank for s in f.suspects) == [10, 11] and {s.node for s in f.suspects} == {"node5"}
    assert f.first_seen_step == 3 and f.last_seen_step == 11 and f.state == "open"
    assert f.evidence["slowdown"] == pytest.approx(4.0, rel=0.2)
    assert f.evidence["purity"] >= 0.9 and f.evidence["independent_groups"] >= 3 and f.confidence > 0.9
    assert f.evidence["baseline_MBps"] == pytest.approx(2500, rel=0.2)
    # every group through node5 is slow; healthy groups are listed as references
    assert all("node5" in g["nodes"] for g in f.evidence["slow_groups"])
    assert f.evidence["fast_groups_through_other_links"]
    assert all("node5" not in g["nodes"] for g in f.evidence["fast_groups_through_other_links"])
    assert f.evidence["p2p_pairs"] and "FROM collectives" in f.evidence["sql"]
    assert f.impact_s > 0 and f.impact_gpu_s > f.impact_s
    # the finding round-trips through the store
    save_findings(store, findings)
    (row,) = latest_findings(store, "job-links")
    assert row["kind"] == "slow_link" and row["suspect_hosts"] == ["node5"]
    assert json.loads(row["evidence"])["suspect_links"] == ["node5<->network"]


def test_compute_straggler_is_a_late_arriver_not_a_link(store):
    _load(store, SimSpec(straggler_rank=11, straggler_s=0.01, straggler_from=2, compute_s=0.02))
    assert find_slow_links(store, "job-links") == []
    blame = compute_blame(store, "job-links")  # the others waited for rank 11: a straggler's signature
    assert int(blame.ranks[blame.delay_s.sum(axis=1).argmax()]) == 11


def test_congested_period_for_everyone_is_not_a_single_node_finding(embedded_store):
    _load(embedded_store, SimSpec(congestion=(4, 8), steps=12))
    findings = find_slow_links(embedded_store, "job-links")
    assert _links(findings) == []
    (c,) = findings
    assert c.kind == "network_congestion" and c.suspects == ()
    assert (c.first_seen_step, c.last_seen_step) == (4, 7)
    assert c.evidence["slowdown"] == pytest.approx(4.0, rel=0.2) and c.evidence["nodes"] == 16


def test_link_between_two_nodes_is_named_not_either_node(embedded_store):
    _load(embedded_store, SimSpec(slow_pairs={(5, 9): 4.0}))
    (f,) = find_slow_links(embedded_store, "job-links")
    assert f.evidence["link"] == "node5<->node9" and f.evidence["link_kind"] == "pair"
    assert {s.node for s in f.suspects} == {"node5", "node9"}


def test_two_faulty_nodes_and_a_straggler_elsewhere(embedded_store):
    _load(
        embedded_store,
        SimSpec(slow_nodes={5: 4.0, 12: 3.0}, straggler_rank=20, straggler_s=0.01, compute_s=0.02),
    )
    findings = find_slow_links(embedded_store, "job-links")
    assert sorted(f.evidence["link"] for f in findings) == ["node12<->network", "node5<->network"]
    assert all(f.kind == "slow_link" for f in findings)
    assert findings[0].evidence["link"] == "node5<->network"  # the slower link costs more


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_healthy_jobs_have_no_findings(embedded_store, seed):
    _load(embedded_store, SimSpec(seed=seed, noise=0.12))
    assert find_slow_links(embedded_store, "job-links") == []


def test_a_fault_that_stopped_is_resolved(embedded_store):
    spec = SimSpec(slow_nodes={3: 4.0}, steps=20)
    rows = simulate(spec)
    # the same job, healthy: keep the faulty run's first 10 steps and the healthy run's last 10
    healthy = simulate(SimSpec(steps=20, seed=spec.seed))

    first = rows["collectives"].filter(pc.less(rows["collectives"]["step"], 10))
    later = healthy["collectives"].filter(pc.greater_equal(healthy["collectives"]["step"], 10))
    embedded_store.write_many(
        {
            "collectives": first,
            "ranks": rows["ranks"],
            "process_groups": rows["process_groups"],
            "steps": rows["steps"],
        }
    )
    embedded_store.write("collectives", later)
    (f,) = find_slow_links(embedded_store, "job-links")
    assert f.evidence["link"] == "node3<->network" and f.state == "resolved" and f.last_seen_step == 9


def _ledger(op: str, n: int, nbytes: int, xfer_ns: int, *, pg: str = "g", seqs: int = 3) -> list[dict]:
    rows = []
    for s in range(1, seqs + 1):
        t = T0 + s * 10**9
        for r in range(n):
            rows.append(
                {
                    "job_id": "j",
                    "rank": r,
                    "pg": pg,
                    "seq": s,
                    "op": op,
                    "nbytes": nbytes,
                    "step": s,
                    "enter_ns": t + r * 1000,
                    "end_ns": t + (n - 1) * 1000 + xfer_ns,
                }
            )
    return rows


@pytest.mark.parametrize(
    ("op", "factor"),
    [("all_reduce", 2 * 3 / 4), ("all_gather_into_tensor", 3), ("reduce_scatter_tensor", 3 / 4), ("broadcast", 1)],
)
def test_effective_bandwidth_uses_bus_bytes_after_the_last_arrival(embedded_store, op, factor):
    embedded_store.write("collectives", _ledger(op, 4, 1 << 20, 10_000_000))  # 10 ms after the last arrival
    m = compute_link_metrics(embedded_store, "j", window_steps=100)
    assert len(m) == 1
    assert m.xfer_s[0] == pytest.approx(0.010)
    assert m.bw_Bps[0] == pytest.approx(factor * (1 << 20) / 0.010, rel=1e-6)
    assert m.spread_s[0] == pytest.approx(3e-6)  # arrival spread is kept apart from transfer
    assert set(BUS_FACTORS) >= {"all_reduce", "all_gather", "reduce_scatter", "p2p"}


def test_small_and_barrier_collectives_are_left_out(embedded_store):
    embedded_store.write("collectives", _ledger("all_reduce", 2, 1024, 10_000, pg="small"))
    embedded_store.write("collectives", _ledger("barrier", 2, 0, 10_000, pg="bar"))
    assert len(compute_link_metrics(embedded_store, "j")) == 0
    assert find_slow_links(embedded_store, "j") == []


def test_metric_sql_avoids_features_missing_on_clickhouse_18():
    sql = link_metric_sql("j", 0, window_steps=2).upper()
    assert " OVER " not in sql and "WITH " not in sql
    assert "AS ENTER_NS" not in sql and "AS END_NS" not in sql  # aliases never shadow columns


def test_detector_is_swappable_and_validates(embedded_store):
    _load(embedded_store, SimSpec(slow_nodes={5: 1.4}))

    class Nothing:
        name = "nothing"

        def detect(self, metrics):
            import numpy as np

            z = np.zeros(len(metrics))
            return LinkReport([], [], z, z, z.astype(np.int8), metrics.window, [])

    assert find_slow_links(embedded_store, "job-links", detector=Nothing()) == []
    assert find_slow_links(embedded_store, "job-links", detector=GroupTestingDetector(slow_ratio=3.0)) == []
    (f,) = find_slow_links(embedded_store, "job-links")  # a mild 1.4x degradation is still found
    assert f.evidence["link"] == "node5<->network" and f.detector == "group_testing"
    with pytest.raises(ValueError, match="fast_ratio"):
        GroupTestingDetector(slow_ratio=1.2, fast_ratio=1.5)


def test_link_names():
    assert Link("node", ("node3",)).name == "node3<->network"
    assert Link("pair", ("node1", "node3")).name == "node1<->node3"
    assert Link("intra", ("node3",)).describe() == "node3's intra-node link"


def test_a_job_without_steps_is_windowed_by_time(embedded_store):
    rows = simulate(SimSpec(slow_nodes={6: 4.0}, compute_s=0.2, steps=12))
    coll = rows["collectives"]
    no_step = pa.array(np.full(coll.num_rows, -1, dtype=np.int64))
    rows["collectives"] = coll.set_column(coll.schema.get_field_index("step"), "step", no_step)
    del rows["steps"]
    embedded_store.write_many(rows)
    m = compute_link_metrics(embedded_store, "job-links")
    assert m.window_steps == 0 and m.window_ns >= 100_000_000 and len(set(m.window.tolist())) >= 5
    (f,) = find_slow_links(embedded_store, "job-links")
    assert f.evidence["link"] == "node6<->network" and f.first_seen_step == -1 and "windows of" in f.title
