"""The peer detector's pooled noise (one sort) equals the leave-one-out medians it replaces."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from ranklens.analyzers.detectors import _pooled_noise


def _one_median_per_row(excess: np.ndarray) -> np.ndarray:
    out = np.zeros((len(excess), 1))
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for k in range(len(excess)):
            others = np.delete(excess, k, axis=0)
            out[k, 0] = float(np.nanmedian(np.abs(others))) * 1.4826 if np.isfinite(others).any() else 0.0
    return out


@pytest.mark.parametrize("seed", range(6))
def test_pooled_noise_is_the_leave_one_out_median(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(200):
        n, w = int(rng.integers(1, 60)), int(rng.integers(1, 40))
        x = rng.normal(0.0, 0.01, size=(n, w))
        if rng.random() < 0.5:
            x = np.round(x, 3)  # ties
        if rng.random() < 0.7:
            x[rng.random((n, w)) < rng.random()] = np.nan  # steps not reported (live)
        if rng.random() < 0.1:
            x[int(rng.integers(n))] = np.nan  # a rank with no step at all
        if rng.random() < 0.05:
            x[:] = np.nan
        # bit for bit: the detector's thresholds compare against these values
        assert np.array_equal(_pooled_noise(x), _one_median_per_row(x))


def test_pooled_noise_of_a_straggler_row_leaves_it_out() -> None:
    x = np.full((5, 4), 0.001)
    x[2] = 1.0  # the straggler's own excess does not inflate the noise it is measured against
    got = _pooled_noise(x)[:, 0]
    assert got[2] == pytest.approx(0.001 * 1.4826)
    assert got[0] == pytest.approx(0.001 * 1.4826)  # median of 12 x 0.001 and 4 x 1.0
