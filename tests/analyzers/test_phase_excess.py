"""analyzers.compute.excess_by_phase, the straggler's phase attribution on arrays (issue 18: a
loop over Python tuples at 10,240 ranks), must answer what the plain definition answers: per phase,
the median over the steps of the rank's compute minus the median of its peers' in that step and
phase (a row given twice: the later counts)."""

from __future__ import annotations

import numpy as np

from ranklens.analyzers.compute import excess_by_phase


def _by_definition(rank, step, phase, names, compute, who, steps):
    want = {int(s) for s in steps}
    by: dict[tuple[str, int], dict[int, float]] = {}
    for rk, st, ph, c in zip(rank, step, phase, compute):
        if int(st) in want:
            by.setdefault((names[ph], int(st)), {})[int(rk)] = float(c)
    out: dict[str, list[float]] = {}
    for (p, _st), vals in by.items():
        if who in vals and len(vals) > 1:
            others = [v for k, v in vals.items() if k != who]
            out.setdefault(p, []).append(vals[who] - float(np.median(others)))
    return {p: float(np.median(xs)) for p, xs in out.items()}


def test_excess_by_phase_is_the_definition_on_random_rows():
    rng = np.random.default_rng(11)
    names = ["forward", "backward", "optimizer"]
    for case in range(2000):
        n = int(rng.integers(1, 80))
        rank = rng.integers(0, int(rng.integers(1, 6)), n)
        step = rng.integers(0, 6, n)
        phase = rng.integers(0, 3, n)
        compute = np.round(rng.normal(size=n), int(rng.integers(0, 3)))  # ties in the medians too
        who = int(rng.integers(0, 5))
        steps = np.unique(rng.integers(0, 6, int(rng.integers(0, 6))))
        got = excess_by_phase(rank, step, phase, names, compute, who, steps)
        assert got == _by_definition(rank, step, phase, names, compute, who, steps), case


def test_excess_by_phase_small_case():
    # rank 0 is 30 ms slower in backward than the median of its two peers, equal in forward
    rank = np.array([0, 1, 2, 0, 1, 2, 0, 1, 2])
    step = np.array([5, 5, 5, 5, 5, 5, 6, 6, 6])
    phase = np.array([1, 1, 1, 0, 0, 0, 1, 1, 1])
    compute = np.array([0.08, 0.05, 0.05, 0.02, 0.02, 0.03, 0.09, 0.06, 0.06])
    got = excess_by_phase(rank, step, phase, ["forward", "backward"], compute, 0, np.array([5, 6]))
    assert set(got) == {"forward", "backward"}
    assert np.isclose(got["backward"], 0.03) and np.isclose(got["forward"], -0.005)
    assert excess_by_phase(rank, step, phase, ["forward", "backward"], compute, 7, np.array([5])) == {}
    assert excess_by_phase(rank, step, phase, ["forward", "backward"], compute, 0, np.array([9])) == {}
