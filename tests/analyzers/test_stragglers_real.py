"""Real 4-rank gloo jobs with one rank slowed in forward, in backward or in data loading: the
finding names that rank and that phase, and never the ranks that only waited for it."""

from __future__ import annotations

import pytest

from ranklens.demo import run_demo

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(("phase", "slowdown"), [("forward", 1.6), ("backward", 1.6), ("data", 3.0)])
def test_slow_phase_names_rank_and_phase(embedded_store, phase, slowdown):
    result = run_demo(
        embedded_store, ranks=4, slow_rank=3, slowdown=slowdown, steps=20, slow_from_step=4, slow_phase=phase
    )
    stragglers = [f for f in result.findings if f.kind == "straggler"]
    assert [[s.rank for s in f.suspects] for f in stragglers] == [[3]], [f.title for f in stragglers]
    (f,) = stragglers
    assert f.evidence["phase"] == phase, f.evidence["phase_excess_s"]
    assert 3 <= f.first_seen_step <= 6
    # rank 2 shares a pair group with rank 3 and waits for it there: a victim, never a suspect
    assert f.evidence["others_waited_per_step_s"] > 0
