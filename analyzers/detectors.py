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
    ``min_share`` of the step time and at least ``min_delay_s``. The onset is the earliest hot
    step from which at least ``persistence`` of the steps are hot (and at least ``min_hot_steps``).
    Ranks that arrive last by noise spread hot steps across ranks and never persist.
    """

    min_share: float = 0.05
    min_delay_s: float = 0.002
    persistence: float = 0.7
    min_hot_steps: int = 3
    name: str = "persistent_blame"

    def __post_init__(self) -> None:
        if not 0 < self.persistence <= 1:
            raise ValueError(f"persistence={self.persistence} must be in (0, 1]")
        if self.min_share < 0 or self.min_delay_s < 0 or self.min_hot_steps < 1:
            raise ValueError("min_share and min_delay_s must be >= 0, min_hot_steps >= 1")

    def detect(self, blame: BlameMatrix) -> list[Detection]:
        if blame.delay_s.size == 0:
            return []
        delay = blame.delay_s
        step_time = np.where(np.isfinite(blame.step_time_s) & (blame.step_time_s > 0), blame.step_time_s, np.nan)
        top = np.argmax(delay, axis=0)
        out = []
        for i, rank in enumerate(blame.ranks):
            share = delay[i] / step_time
            hot = (top == i) & (delay[i] >= self.min_delay_s) & (np.nan_to_num(share) >= self.min_share)
            n = hot.size
            # suffix share of hot steps; onset = earliest hot step whose suffix persists
            suffix_hot = np.cumsum(hot[::-1])[::-1]
            suffix_len = np.arange(n, 0, -1)
            ok = hot & (suffix_hot / suffix_len >= self.persistence) & (suffix_hot >= self.min_hot_steps)
            if not ok.any():
                continue
            onset = int(np.argmax(ok))
            last = int(n - 1 - np.argmax(hot[::-1]))
            out.append(
                Detection(int(rank), onset, last, float(suffix_hot[onset] / suffix_len[onset]),
                          int(suffix_hot[onset]), int(suffix_len[onset]))  # fmt: skip
            )
        return out
