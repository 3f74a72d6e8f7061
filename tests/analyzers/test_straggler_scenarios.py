"""The straggler analysis over a suite of simulated 3D-parallel jobs with ground truth.

Every straggler scenario must rank the culprit first with its onset within a few steps; stage
imbalance (slower by design), clock skew alone and healthy runs must name no faulty rank.
The suite's precision and recall are printed (pytest -s) and asserted.
"""

from __future__ import annotations

import pytest

from ranklens.analyzers import find_stragglers
from ranklens.analyzers.recovery.engine import target_for
from ranklens.analyzers.recovery.policy import Level
from ranklens.simulate import simulate

# (faults, pp, tp) — 64 ranks: 8 nodes of 8
SCENARIOS = {
    "slow_gpu": (["slow_gpu:21:1.25@10"], 2, 4),
    "slow_gpu_tp_only": (["slow_gpu:5:1.3@5"], 1, 8),
    "slow_node": (["slow_node:3:1.2@8"], 2, 4),
    "slow_data": (["slow_data:42:0.08@12"], 2, 4),
    "slow_gpu_with_clock_skew": (["slow_gpu:50:1.3@6", "clock_skew:2:40"], 2, 4),
    "stage_imbalance": (["stage_imbalance:1.3"], 4, 2),
    "clock_skew_only": (["clock_skew:5:25"], 2, 4),
    "healthy": ([], 2, 4),
}


def _named(findings):
    """Ranks named, first finding first: a node finding names the node's ranks (its evidence)."""
    return [
        r for f in findings for r in (f.evidence["ranks"] if f.suspects[0].rank < 0 else [s.rank for s in f.suspects])
    ]


def test_slow_node_is_one_finding_about_the_node(embedded_store):
    truth, findings = _run(embedded_store, "slow_node")
    (f,) = findings
    assert [(s.rank, s.node) for s in f.suspects] == [(-1, "node0003")], f.title
    assert f.evidence["ranks"] == sorted(truth["culprit_ranks"]) and "node node0003" in f.title
    assert f.to_json()["suspects"] == [{"rank": -1, "node": "node0003", "gpu": "", "link": ()}]
    # recovery acts on the node's ranks (restart) or on the node (replace), not on the whole job
    assert target_for(f, Level.RESTART_RANK) == f"rank:{','.join(map(str, f.evidence['ranks']))}"
    assert target_for(f, Level.REPLACE_NODE) == "node:node0003"


def _run(store, name):
    faults, pp, tp = SCENARIOS[name]
    sim = simulate(store, ranks=64, steps=40, pp=pp, tp=tp, faults=faults, seed=7, job_id=f"sim-{name}", step_ms=200)
    return sim.truth, find_stragglers(store, sim.job_id)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenario(embedded_store, name):
    truth, findings = _run(embedded_store, name)
    culprits = set(truth["culprit_ranks"])
    named = _named(findings)
    if not culprits:
        assert named == [], [f.title for f in findings]
        return
    assert named, f"{name}: nothing found"
    # the culprit (or, for a slow node, the node's ranks) come first, and nobody else is named
    assert set(named) <= culprits, [f.title for f in findings]
    assert named[0] in culprits
    onset = min(fa["onset_step"] for fa in truth["faults"] if fa.get("is_fault", True) and fa["ranks"])
    assert all(abs(f.first_seen_step - onset) <= 3 for f in findings), [f.first_seen_step for f in findings]


def test_suite_precision_recall(embedded_store, capsys):
    tp = fp = fn = 0
    for name in SCENARIOS:
        truth, findings = _run(embedded_store, name)
        culprits = set(truth["culprit_ranks"])
        named = set(_named(findings))
        tp += len(named & culprits)
        fp += len(named - culprits)
        fn += len(culprits - named)
    precision = tp / (tp + fp) if tp + fp else 1.0
    recall = tp / (tp + fn) if tp + fn else 1.0
    with capsys.disabled():
        print(f"\nstraggler suite: precision {precision:.3f}, recall {recall:.3f} (tp {tp}, fp {fp}, fn {fn})")
    assert precision >= 0.95 and recall >= 0.95


def test_a_live_pass_says_in_its_evidence_what_it_waited_for(embedded_store):
    # a false live finding is diagnosed from what the pass settled on (the network drill's flake)
    faults, pp, tp = SCENARIOS["slow_node"]
    sim = simulate(embedded_store, ranks=64, steps=40, pp=pp, tp=tp, faults=faults, seed=7, job_id="live", step_ms=200)
    (f,) = find_stragglers(embedded_store, sim.job_id, window_steps=500)
    live = f.evidence["live"]
    assert live["settled_on"] in ("own ledger", "every ledger") and live["last_step"] <= 39, live
    assert live["unsettled_rows"] >= 0
    (whole,) = find_stragglers(embedded_store, sim.job_id)
    assert "live" not in whole.evidence
