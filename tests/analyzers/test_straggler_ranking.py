"""Findings are ranked by what they cost the job (issue 21 #5): a rank that computes longer but
that nobody waits for is not "critical" ahead of a rank the others wait 17 ms/step for."""

from __future__ import annotations

from ranklens.analyzers import find_stragglers
from tests.helpers import synthetic_job


def test_cost_not_compute_excess_ranks_the_findings(store):
    rows = synthetic_job(ranks=8, steps=30, slow_rank=3, slow_from=5, extra_s=0.017, step_s=0.1, noise_s=0.0005)
    # rank 6 starts each step 40 ms early from step 5 (its own step is longer: more "compute"), yet
    # arrives at every collective on time: nobody waits for it
    for r in rows["steps"]:
        if r["rank"] == 6 and r["step"] >= 5:
            r["start_ns"] -= 40_000_000
    store.write_many(rows)
    found = find_stragglers(store, "job-synth")
    by_rank = {f.suspects[0].rank: f for f in found}
    assert set(by_rank) == {3, 6}, [f.title for f in found]
    assert [f.suspects[0].rank for f in found] == [3, 6]  # the costly one first
    slow, idle = by_rank[3], by_rank[6]
    assert slow.evidence["cost_per_step_s"] > 0.012 and slow.evidence["cost_basis"] == "others_waited"
    assert idle.evidence["excess_per_step_s"] > 0.03  # it does compute longer...
    assert idle.evidence["cost_per_step_s"] < 0.002  # ...but costs the job (almost) nothing
    assert idle.severity.value == "warning" and idle.step_time_pct < 2 and idle.impact_s < 0.05
    assert slow.impact_s > 10 * idle.impact_s
