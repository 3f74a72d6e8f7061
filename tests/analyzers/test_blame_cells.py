"""analyzers.blame.union_lengths: the per-cell union of waits that compute_blame and the dashboards'
blame (blame_cells) share must equal union_length cell by cell."""

from __future__ import annotations

import numpy as np

from ranklens.analyzers.blame import union_length, union_lengths


def test_union_lengths_is_union_length_per_cell():
    rng = np.random.default_rng(7)
    cell = rng.integers(0, 40, 400)
    ends = 1.8e18 - 1e9 * cell + rng.uniform(0, 2e9, 400)  # epoch-sized ns, cells at different times
    lengths = rng.uniform(-1e6, 3e8, 400)  # overlapping, disjoint and negative waits
    got = union_lengths(cell, ends - 1.8e18, lengths, 42)
    want = [union_length(ends[cell == c] - 1.8e18, lengths[cell == c]) for c in range(42)]
    assert np.allclose(got, want, rtol=1e-9, atol=1.0) and got[40] == got[41] == 0.0


def test_union_lengths_small_cases():
    cell = np.array([0, 0, 1, 1, 2])
    ends = np.array([10.0, 11.0, 10.0, 30.0, 5.0])
    lengths = np.array([5.0, 5.0, 5.0, 5.0, -1.0])
    assert union_lengths(cell, ends, lengths, 3).tolist() == [6.0, 10.0, 0.0]
    assert union_lengths(np.array([], int), np.array([]), np.array([]), 2).tolist() == [0.0, 0.0]
