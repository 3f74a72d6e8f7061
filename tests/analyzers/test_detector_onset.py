"""The detectors' run rules on matrices built by hand: where a straggler's onset is when its first
steps miss the noise bar, and that a run of hot steps whose compute is, over the run, no more than
its peers' is not a straggler."""

from __future__ import annotations

import numpy as np

from ranklens.analyzers.compute import ComputeMatrix
from ranklens.analyzers.detectors import PeerComputeDetector, _persistent_run


def _matrix(compute: np.ndarray) -> ComputeMatrix:
    ranks, steps = compute.shape
    return ComputeMatrix(
        "j", 0, np.arange(ranks), np.arange(steps), compute, compute + 0.01,
        np.arange(steps, dtype=np.int64) * 10**9, np.zeros(ranks, dtype=np.int64), {}, "",
    )  # fmt: skip


def test_first_steps_at_the_level_but_not_hot_are_the_onset() -> None:
    # a 45 ms slowdown from step 6; on a busy host steps 6-8 missed the noise bar (not hot)
    level = np.array([2, -3, 4, 1, -2, 3, 44, 40, 47, 45, 43, 46, 44, 42, 45, 47], dtype=float) / 1000
    hot = level > 0.02
    hot[6:9] = False
    a, b, n_hot = _persistent_run(hot, 0.7, 3, level)
    assert (a, b, n_hot) == (6, 15, 7)


def test_a_blip_before_the_onset_is_not_pulled_in() -> None:
    # a 10 ms blip at step 5 before a 200 ms slowdown from step 6; a step at half the level three
    # steps before, with a quiet one between, is not pulled in either
    level = np.array([0, 0, 0, 110, 0, 10, 200, 190, 210, 205, 200, 195, 198, 202], dtype=float) / 1000
    hot = level > 0.05
    a, _, _ = _persistent_run(hot, 0.7, 3, level)
    assert a == 6
    # and when nothing before is at the level, the first hot step stays the onset
    level[3] = 0.0
    assert _persistent_run(level > 0.05, 0.7, 3, level)[0] == 6


def test_the_peer_detector_names_the_onset_of_a_slowdown_whose_first_steps_hid_in_noise() -> None:
    # the peers jitter by +-18 ms (the bar a step must clear: 27 ms); rank 2 computes 26 ms longer
    # from step 6 and 45 ms from step 9: steps 6-8 are not hot, yet the slowdown began at step 6
    jitter = np.array([[18, -18, 0], [-18, 0, 18], [0, 18, -18]]) / 1000
    c = np.full((4, 20), 0.05)
    for t in range(20):
        c[[0, 1, 3], t] += jitter[t % 3]
    c[2, 6:9] += 0.026
    c[2, 9:] += 0.045
    (d,) = PeerComputeDetector().detect(_matrix(c))
    assert (d.rank, d.onset_index, d.hot_steps) == (2, 6, 11), d


def test_hot_steps_whose_run_computes_no_more_than_its_peers_are_not_a_straggler() -> None:
    # rank 0 computes 6% more than its peers on 7 of every 10 steps (hot: above the 5% floor) and far
    # less on the other 3, where the peers compute 5 s: over the run it computes less than they do
    m = np.tile(np.array([1.0, 1.1, 1.2, 5.0, 1.3, 1.4, 5.0, 1.5, 1.6, 5.0]), 3)
    c = np.vstack([np.where(m < 5, 1.06 * m, 0.1), m, m, m])
    assert PeerComputeDetector().detect(_matrix(c)) == []
    c[0] = np.where(m < 5, 1.06 * m, m)  # at the peers' level on the other steps: a 6% straggler
    (d,) = PeerComputeDetector().detect(_matrix(c))
    assert d.rank == 0 and d.ratio >= 1.05
