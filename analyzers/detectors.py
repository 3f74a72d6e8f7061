"""Detectors decide which ranks in a blame matrix are stragglers. Swap them freely.

A detector takes a :class:`~ranklens.analyzers.blame.BlameMatrix` and returns
:class:`Detection` values; it neither queries nor prints.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal, Protocol

import numpy as np

from ranklens.analyzers.blame import BlameMatrix

if TYPE_CHECKING:
    from ranklens.analyzers.compute import ComputeMatrix

__all__ = [
    "Detection",
    "PeerComputeDetector",
    "PeerDetection",
    "PeerDetector",
    "PersistentBlameDetector",
    "StragglerDetector",
]


@dataclass(frozen=True)
class Detection:
    rank: int
    onset_index: int  # index into BlameMatrix.steps
    last_index: int
    persistence: float  # share of steps since onset where the rank was the hot culprit
    hot_steps: int
    steps_since_onset: int


class StragglerDetector(Protocol):
    """Decides over the blame matrix (whom the others waited for); ``metric`` says which matrix a
    detector reads, so :func:`~ranklens.analyzers.straggler.find_stragglers` computes that one."""

    @property
    def name(self) -> str: ...  # read-only: frozen dataclasses satisfy it

    metric: ClassVar[Literal["blame"]]

    def detect(self, blame: BlameMatrix) -> list[Detection]: ...


class PeerDetector(Protocol):
    """Decides over the compute matrix (each rank's compute time against its peers')."""

    @property
    def name(self) -> str: ...

    metric: ClassVar[Literal["compute"]]

    def detect(self, cm: ComputeMatrix) -> list[PeerDetection]: ...


@dataclass(frozen=True)
class PersistentBlameDetector:
    """A rank is a straggler when, persistently, it is the rank the others wait for most, and
    that wait is a real share of the step.

    A step is *hot* for rank r when r caused the largest delay of the step, that delay is at least
    ``dominance`` of all the step's delay (one culprit, not everybody arriving late by turns), at
    least ``min_share`` of the step time and at least ``min_delay_s``. The finding spans the densest
    run of hot steps (at least ``persistence`` of its steps hot, at least ``min_hot_steps`` hot),
    trimmed to the steps at its level (:func:`_persistent_run`): its first step is the onset, its
    last step says whether the problem is still going on. Ranks that arrive last by noise (a busy
    host, a GC pause) spread hot steps across ranks and short runs: with four ranks, noise makes
    one rank the top culprit three times in a row often enough; five in a row it rarely does.
    """

    min_share: float = 0.05
    min_delay_s: float = 0.002
    persistence: float = 0.7
    min_hot_steps: int = 5
    dominance: float = 0.5
    name: str = "persistent_blame"
    metric: ClassVar[Literal["blame"]] = "blame"

    def __post_init__(self) -> None:
        if not 0 < self.persistence < 1:
            raise ValueError(f"persistence={self.persistence} must be in (0, 1)")
        if self.min_share < 0 or self.min_delay_s < 0 or self.min_hot_steps < 1:
            raise ValueError("min_share and min_delay_s must be >= 0, min_hot_steps >= 1")
        if not 0 <= self.dominance <= 1:
            raise ValueError(f"dominance={self.dominance} must be in [0, 1]")

    def detect(self, blame: BlameMatrix) -> list[Detection]:
        if blame.delay_s.size == 0:
            return []
        delay = blame.delay_s
        st = blame.step_time_s
        step_time = np.where(np.isfinite(st) & (st > 0), st, np.nan)
        top = np.argmax(delay, axis=0)
        total = delay.sum(axis=0)
        out = []
        runs: list[_Run] = []
        for i, rank in enumerate(blame.ranks):
            with np.errstate(all="ignore"):
                share = np.nan_to_num(delay[i] / step_time)
            hot = (
                (top == i)
                & (delay[i] >= self.min_delay_s)
                & (share >= self.min_share)
                & (delay[i] >= self.dominance * total)
            )
            seg = _persistent_run(hot, self.persistence, self.min_hot_steps, delay[i], step_time)
            if seg is None:
                continue
            start, end, n_hot = seg
            run = _Run(
                int(rank), start, end, float(np.median(delay[i, start : end + 1])), blame.hosts.get(int(rank), "")
            )
            runs.append(run)
            if n_hot < 0:  # a transient: not a finding, but evidence of a busy host
                continue
            length = end - start + 1
            out.append(Detection(int(rank), start, end, n_hot / length, n_hot, length))
        moved = _migrating(runs, [r for r in runs if r.rank in {d.rank for d in out}])
        return [d for d in out if d.rank not in moved]


LEVEL_TRIM = 0.5  # hot steps at the ends of a run below this share of the run's median level are left out
RESOLVED_AFTER_STEPS = 5  # a run that ended this many steps before the last one is over (resolved)...
MIN_RESOLVED_HOT = 8  # ...and is a straggler only when it lasted at least this many hot steps
# A run of fewer than MIN_RESOLVED_HOT hot steps must also last this long (wall clock) to be
# persistent: host noise (a scheduler hiccup, a GC pause) lasts a fraction of a second however many
# steps it spans, and step-free jobs count iterations of a few tens of ms (5 of them: 0.15 s).
MIN_SHORT_RUN_S = 0.5
ONSET_LOOKBACK = 10  # steps before a run's first hot step that may still be its own (at its level)


def _persistent_run(
    hot: np.ndarray,
    persistence: float,
    min_hot: int,
    level: np.ndarray | None = None,
    step_s: np.ndarray | None = None,
) -> tuple[int, int, int] | None:
    """The densest run of hot steps (start, end, hot steps in it) when it holds at least ``min_hot``.

    With ``level`` (the per-step size of what is measured: the delay, the excess), hot steps at
    either end of the run that are well below the run's median level are trimmed off: a 10 ms
    blip just before a 200 ms slowdown is noise, and the onset is where the level changed. With
    ``step_s`` (each step's duration), a run of fewer than ``MIN_RESOLVED_HOT`` hot steps that lasted
    under ``MIN_SHORT_RUN_S`` is a transient (negative count), not a straggler."""
    if hot.sum() < min_hot:
        return None
    seg = _densest_segment(hot, persistence)
    if seg is None:
        return None
    a, b = seg
    if level is not None:
        lv = np.nan_to_num(np.asarray(level, dtype=np.float64))
        a = _change_point(lv[: b + 1], a, max(a, b - min_hot + 1))
        idx = np.flatnonzero(hot[a : b + 1]) + a
        if len(idx) == 0:
            return None
        floor = LEVEL_TRIM * float(np.median(lv[idx]))
        keep = idx[lv[idx] >= floor]
        if len(keep) == 0:
            return None
        a, b = int(keep[0]), int(keep[-1])
    n_hot = int(hot[a : b + 1].sum())
    if n_hot < min_hot or n_hot < persistence * (b - a + 1):
        return None
    if level is not None:
        n = len(hot)
        rest = lv[b + 1 :]
        run_level = float(np.median(lv[a : b + 1][hot[a : b + 1]]))
        if len(rest) and float(rest.mean()) >= LEVEL_TRIM * run_level:
            b = n - 1  # still at its level to the end, a few steps lost in noise: it has not stopped
        a = _onset_before(lv[: b + 1], a, run_level)
        if b < n - RESOLVED_AFTER_STEPS and n_hot < MIN_RESOLVED_HOT:
            # it started and stopped within a few steps: a transient (a rank starved of CPU by a busy
            # host for half a second, a GC pause), not a straggler; a live pass saw it while it lasted
            return a, b, -n_hot
    if step_s is not None and n_hot < MIN_RESOLVED_HOT:
        d = np.asarray(step_s, dtype=np.float64)[a : b + 1]
        known = d[np.isfinite(d) & (d > 0)]
        # steps of unknown duration count at the known ones' mean; none known: no judgement
        if len(known) and float(known.mean()) * len(d) < MIN_SHORT_RUN_S:
            return a, b, -n_hot  # a sub-second blip over a few short steps: a transient
    return a, b, n_hot


@dataclass(frozen=True)
class _Run:
    rank: int
    a: int
    b: int
    level: float
    host: str


def _migrating(runs: list[_Run], keep: list[_Run]) -> set[int]:
    """Ranks of ``keep`` whose slowness moved to or from another rank of the same host: a run of
    another rank (a straggler run or a transient one) on that host, at a comparable level, that does
    not overlap it in time. A slow GPU or a sleeping rank stays slow; a busy host starves one of its
    ranks, then another (the kernel's scheduler favours the ranks that wait): host contention, not a
    straggler rank. Two stragglers at the same time are both kept."""
    out = set()
    for r in keep:
        for o in runs:
            if o.rank == r.rank or (o.host and r.host and o.host != r.host):
                continue
            apart = o.b < r.a or o.a > r.b
            if apart and o.level >= 0.5 * r.level and r.level >= 0.5 * o.level:
                out.add(r.rank)
                break
    return out


def _onset_before(lv: np.ndarray, a: int, level: float) -> int:
    """The onset ``a`` (a run's first hot step) moved back over the steps before it that are at the
    run's level (their median at least ``LEVEL_TRIM`` of it) but were not hot: on a busy host the
    bar a step must clear to be hot is the host's noise, and a slowdown's first steps can miss it
    by chance (a 50 ms straggler under two CPU hogs, ~30 ms of noise, was named 3-7 steps late).
    Where the level changed is the two-level fit's call (medians: one noisy step moves nothing),
    at most ``ONSET_LOOKBACK`` steps back."""
    lo = max(0, a - ONSET_LOOKBACK)
    if lo >= a or not level > 0:
        return a
    c = _change_point(lv, lo, a)
    if c < a and float(np.median(lv[c:a])) >= LEVEL_TRIM * level:
        return c
    return a


def _change_point(x: np.ndarray, lo: int, hi: int) -> int:
    """The onset in ``[lo, hi]``: where a two-level fit of ``x`` (one level before, one from the
    onset on; medians, absolute deviations, so one outlier step cannot move it) fits best. A rank
    that was a little late by noise before a real slowdown does not pull the onset early, as a
    first hot step would."""
    if hi <= lo:
        return lo
    best, best_c = np.inf, lo
    for c in range(lo, hi + 1):
        pre, post = x[:c], x[c:]
        cost = float(np.abs(post - np.median(post)).sum()) + (
            float(np.abs(pre - np.median(pre)).sum()) if len(pre) else 0.0
        )
        if cost < best - 1e-15:
            best, best_c = cost, c
    return best_c


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


LEAVE_ONE_OUT_BELOW = 16  # peer groups smaller than this use leave-one-out statistics


def _pooled_noise(excess: np.ndarray) -> np.ndarray:
    """Per row k, as a column: 1.4826 x the median of ``|excess|`` over every other row's finite
    entries (0 where there are none), i.e. ``np.nanmedian(np.abs(np.delete(excess, k, axis=0)))``.

    Computed from one sort instead of one median per row (a 1,280-rank peer group made that 1,280
    medians of 128k values, most of ``analyze`` at 10,240 ranks, issue 18), with the same values:
    the entries are sorted once, and row k's median is read at the positions it has in the sorted
    entries of the other rows (each row's own entries leave gaps at known positions)."""
    n, width = excess.shape
    out = np.zeros((n, 1))
    a = np.abs(excess)
    finite = np.isfinite(a)
    vals = a[finite]
    total = len(vals)
    if total == 0:
        return out
    order = np.argsort(vals, kind="stable")
    ordered = vals[order]
    pos = np.empty(total, dtype=np.int64)
    pos[order] = np.arange(total)
    # per row, the sorted positions of its own entries in `ordered` (padding past every index)
    mine = np.full((n, width), total + width + 1, dtype=np.int64)
    mine[finite] = pos
    mine.sort(axis=1)
    own = finite.sum(axis=1)
    # the j-th (0-based) of the other rows' entries sits at j + the number of the row's own entries
    # before it; own entry i is before it when (its position - i) <= j
    gaps = mine - np.arange(width)
    left = total - own

    def at(j: np.ndarray) -> np.ndarray:
        return ordered[np.minimum(j + (gaps <= j[:, None]).sum(axis=1), total - 1)]

    half = left // 2
    upper = at(half)
    lower = at(np.maximum(half - 1, 0))
    med = np.where(left % 2 == 1, upper, (lower + upper) / 2)
    out[:, 0] = np.where(left > 0, med * 1.4826, 0.0)
    return out


@dataclass(frozen=True)
class PeerDetection:
    rank: int
    onset_index: int  # into ComputeMatrix.steps
    last_index: int
    persistence: float
    hot_steps: int
    steps_since_onset: int
    excess_s: np.ndarray  # per step of the segment: compute above the peers' median
    ratio: float  # median compute / peers' median over the segment


@dataclass(frozen=True)
class PeerComputeDetector:
    """A rank is a straggler when it computes persistently longer than its peers.

    A step is *hot* for rank r when its compute time exceeds its peer group's median by at least
    ``min_excess_ratio`` of that median and ``min_excess_s``, by ``z`` robust deviations
    (MAD) of the group at that step, and by ``pooled_z`` robust deviations of the other ranks'
    deviations from their peers over all steps (the host's noise: on a busy host every rank's
    compute jitters by tens of ms, and three peers can agree by chance at one step). As for blame,
    the finding spans the densest run of hot steps (share ``persistence``, at least
    ``min_hot_steps``), its onset refined to the change of level. The run must then be a level
    shift the noise cannot explain: its mean excess, times the square root of its length, at
    least ``shift_z`` of that noise (a 50 ms straggler on a host whose noise is 25 ms needs a few
    more steps to be named than on a quiet host, and a burst of noise is never named). Waiting is not compute, so
    victims of a slow peer are never hot; a stage that is slower by design is compared with itself.
    """

    min_excess_ratio: float = 0.05
    min_excess_s: float = 0.002
    z: float = 3.0
    persistence: float = 0.7
    min_hot_steps: int = 3
    pooled_z: float = 1.0
    shift_z: float = 4.0
    name: str = "peer_compute"
    metric: ClassVar[Literal["compute"]] = "compute"

    def __post_init__(self) -> None:
        if not 0 < self.persistence < 1:
            raise ValueError(f"persistence={self.persistence} must be in (0, 1)")
        if self.min_excess_ratio < 0 or self.min_excess_s < 0 or self.z < 0 or self.min_hot_steps < 1:
            raise ValueError("thresholds must be >= 0 and min_hot_steps >= 1")

    def detect(self, cm: ComputeMatrix) -> list[PeerDetection]:
        if cm.empty:
            return []
        out: list[PeerDetection] = []
        runs: list[_Run] = []
        compute = cm.compute_s
        for label in np.unique(cm.peer_group):
            idx = np.flatnonzero(cm.peer_group == label)
            if len(idx) < 3:
                continue  # no robust baseline with fewer than three peers
            block = compute[idx]
            with np.errstate(all="ignore"), warnings.catch_warnings():
                # steps some ranks have not reported yet (live) are all-NaN columns: no baseline there
                warnings.simplefilter("ignore", RuntimeWarning)
                if len(idx) < LEAVE_ONE_OUT_BELOW:
                    # small groups: each rank is compared with the others only, so the suspect does
                    # not inflate the spread it is measured against
                    med = np.empty_like(block)
                    mad = np.empty_like(block)
                    for k in range(len(idx)):
                        others = np.delete(block, k, axis=0)
                        med[k] = np.nanmedian(others, axis=0)
                        mad[k] = np.nanmedian(np.abs(others - med[k]), axis=0) * 1.4826
                else:
                    med = np.broadcast_to(np.nanmedian(block, axis=0), block.shape)
                    mad = np.broadcast_to(np.nanmedian(np.abs(block - med), axis=0) * 1.4826, block.shape)
            excess = block - med
            # the group's noise over the whole window: a robust spread of every rank's deviation from
            # its peers at every step. A spread over three peers at one step is a poor estimate (on a
            # busy host the peers can agree by chance); pooled over the steps it is a stable one.
            # Each rank is measured against the others' noise only (a straggler's own excess would
            # inflate the spread it is measured against).
            pooled = _pooled_noise(excess)
            floor = np.maximum(self.min_excess_ratio * med, self.min_excess_s)
            # the spread of three peers at one step is noise itself (on a busy host it is often
            # larger than a real slowdown): small groups rely on the pooled noise alone
            spread = np.zeros_like(mad) if len(idx) < LEAVE_ONE_OUT_BELOW else self.z * mad
            threshold = np.maximum(np.maximum(floor, spread), self.pooled_z * np.nan_to_num(pooled))
            hot_all = np.nan_to_num(excess, nan=-1.0) >= threshold
            for k, i in enumerate(idx):
                seg = _persistent_run(hot_all[k], self.persistence, self.min_hot_steps, excess[k], cm.step_s[i])
                if seg is None:
                    continue
                a, b, n_hot = seg
                noise = float(pooled[k, 0])
                if noise > 0:
                    shift = float(np.nanmean(excess[k, a : b + 1])) * np.sqrt(b - a + 1) / noise
                    if not shift >= self.shift_z:
                        continue
                with np.errstate(all="ignore"), warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    lvl = float(np.nanmedian(excess[k, a : b + 1]))
                runs.append(_Run(int(cm.ranks[i]), a, b, lvl, cm.hosts.get(int(cm.ranks[i]), "")))
                if n_hot < 0:  # a transient: not a finding, but evidence of a busy host
                    continue
                ex = np.nan_to_num(excess[k, a : b + 1])
                with np.errstate(all="ignore"), warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    ratio = float(np.nanmedian(block[k, a : b + 1]) / np.nanmedian(med[k, a : b + 1]))
                if not ratio >= 1.0 + self.min_excess_ratio:
                    # hot steps, but over the run its compute is within the floor of its peers': the
                    # hot steps were the peers' dips or a few outliers (a drill on a loaded host named a
                    # rank at +2% this way), not a rank that computes longer
                    continue
                out.append(PeerDetection(int(cm.ranks[i]), a, b, n_hot / (b - a + 1), n_hot, b - a + 1, ex, ratio))
        moved = _migrating(runs, [r for r in runs if r.rank in {d.rank for d in out}])
        return [d for d in out if d.rank not in moved]
