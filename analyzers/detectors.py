"""Detectors decide which ranks in a blame matrix are stragglers. Swap them freely.

A detector takes a :class:`~ranklens.analyzers.blame.BlameMatrix` and returns
:class:`Detection` values; it neither queries nor prints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ranklens.analyzers.blame import BlameMatrix

__all__ = ["Detection", "PersistentBlameDetector", "StragglerDetector"]


@dataclass(frozen=True)
class Detection:
    rank: int
    onset_index: int  # index into BlameMatrix.steps
    last_index: int
    persistence: float  # share of steps since onset where the rank was the hot culprit
    hot_steps: int
    steps_since_onset: int


class StragglerDetector(Protocol):
    name: str

    def detect(self, blame: BlameMatrix) -> list[Detection]: ...


@dataclass(frozen=True)
class PersistentBlameDetector:
    """A rank is a straggler when, persistently, it is the rank the others wait for most, and
    that wait is a real share of the step.

    A step is *hot* for rank r when r caused the largest delay of the step, the delay is at least
    ``min_share`` of the step time and at least ``min_delay_s``. The finding spans the densest
    run of hot steps (at least ``persistence`` of its steps hot, at least ``min_hot_steps`` hot):
    its first step is the onset, its last step says whether the problem is still going on.
    Ranks that arrive last by noise spread hot steps across ranks and never persist.
    """

    min_share: float = 0.05
    min_delay_s: float = 0.002
    persistence: float = 0.7
    min_hot_steps: int = 3
    name: str = "persistent_blame"

    def __post_init__(self) -> None:
        if not 0 < self.persistence < 1:
            raise ValueError(f"persistence={self.persistence} must be in (0, 1)")
        if self.min_share < 0 or self.min_delay_s < 0 or self.min_hot_steps < 1:
            raise ValueError("min_share and min_delay_s must be >= 0, min_hot_steps >= 1")

    def detect(self, blame: BlameMatrix) -> list[Detection]:
        if blame.delay_s.size == 0:
            return []
        delay = blame.delay_s
        st = blame.step_time_s
        step_time = np.where(np.isfinite(st) & (st > 0), st, np.nan)
        top = np.argmax(delay, axis=0)
        out = []
        for i, rank in enumerate(blame.ranks):
            share = np.nan_to_num(delay[i] / step_time)
            hot = (top == i) & (delay[i] >= self.min_delay_s) & (share >= self.min_share)
            if hot.sum() < self.min_hot_steps:
                continue
            seg = _densest_segment(hot, self.persistence)
            if seg is None:
                continue
            start, end = seg
            n_hot = int(hot[start : end + 1].sum())
            length = end - start + 1
            if n_hot < self.min_hot_steps:
                continue
            out.append(Detection(int(rank), start, end, n_hot / length, n_hot, length))
        return out


def _densest_segment(hot: np.ndarray, persistence: float) -> tuple[int, int] | None:
    """The segment maximising ``hot steps - persistence * length`` (Kadane): its share of hot
    steps is >= ``persistence``, it starts and ends on hot steps, and isolated noisy hot steps
    before a real onset are not pulled in (each gap step costs ``persistence``)."""
    best, best_seg = 0.0, None
    cur, cur_start = 0.0, 0
    for j, h in enumerate(hot):
        gain = (1.0 - persistence) if h else -persistence
        if cur <= 0:
            cur, cur_start = gain, j
        else:
            cur += gain
        if h and cur > best:
            best, best_seg = cur, (cur_start, j)
    return best_seg
