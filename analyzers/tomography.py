"""Link detectors: decide from link cells which link is slow. Swap them freely.

A detector takes :class:`~ranklens.analyzers.links.LinkMetrics` and returns a
:class:`LinkReport`; it neither queries nor prints.

:class:`GroupTestingDetector` does network tomography by group testing. Every cell (a group's
collectives in a window) is a *test* of the links its traffic crosses: an inter-node group crosses
the network link of each of its nodes (and, for a group of two nodes, the link between them); a
group within one node crosses that node's intra-node link. A test is *slow* when the cell's
bandwidth is well below the baseline of comparable groups (same op family, group size, number of
nodes and message size: the ``baseline_quantile`` of their bandwidths, so that a minority of slow
groups does not drag it down), *fast* when it is close to it.

* A link common to the slow tests and absent from the fast ones is the suspect: its *purity* (slow
  tests / all decided tests through it, counted in the windows where it is slow, so an onset mid-job
  does not dilute it) must be high, and at least ``min_independent`` independent groups (different
  partner nodes, or different rank pairs for a pair link) must agree. Greedy set cover picks the
  link explaining most slow tests, removes what it explains, and repeats: several faulty links
  are found, and healthy nodes that merely share a group with the faulty one are exonerated by
  their other, fast groups.
* A window where most inter-node tests are slow and no single link explains them is a *congested
  period that hits everyone*: reported as such, and kept out of the localization.
* A compute straggler arrives late but transfers at full speed: the metric measures transfer
  after the last arrival, so its groups are not slow tests at all.
* A window where links that share no node with a suspect were slow far more often than usual (tests
  no suspect explains), and as slow as the suspect's, is a *transient* of the host or the fabric (a
  CPU-starved moment: every transfer running then was slow), not the link's: it does not count
  for the link. A fault stands out: on the network bed a throttled link ran 140-610x slower while
  the transient tests beside it ran 2-12x slower, as healthy windows' noise does.
* A suspect link's slow tests must be unlikely as the job's sporadic noise (``max_noise_p``): were
  each of its tests slow at the rate seen on the tests that do not cross it, the chance of as many
  slow ones as it had (from its first to its last slow window) must be small. On a small bed every
  node's link carries most groups, so a few noisy tests line up on one of them by chance; a fault
  makes nearly every test through its link slow, and at 10,000 GPUs the rate beside a link is tiny.
"""

from __future__ import annotations

import functools
import math
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from ranklens.analyzers.links import LinkMetrics

__all__ = [
    "CongestionDetection",
    "GroupTestingDetector",
    "Link",
    "LinkDetection",
    "LinkDetector",
    "LinkReport",
    "node_key",
    "value_codes",
]

SLOW, FAST, UNCLEAR = 1, -1, 0
_KIND_ORDER = {"pair": 2, "node": 1, "intra": 0}  # ties: the more specific explanation


@dataclass(frozen=True)
class Link:
    """A link that traffic crosses: a node's network link (``kind="node"``), the link between two
    nodes (``"pair"``), or a node's intra-node link (``"intra"``)."""

    kind: str
    nodes: tuple[str, ...]

    def __hash__(self) -> int:  # cached: a 10,240-rank job's cells look links up ~1M times
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.kind, self.nodes))
            object.__setattr__(self, "_hash", h)
        return int(h)

    @property
    def name(self) -> str:
        """``node3<->network``, ``node1<->node3`` or ``node3<->node3`` (intra-node)."""
        if self.kind == "node":
            return f"{self.nodes[0]}<->network"
        if self.kind == "intra":
            return f"{self.nodes[0]}<->{self.nodes[0]}"
        return "<->".join(self.nodes)

    def describe(self) -> str:
        """The link in words, for titles."""
        if self.kind == "node":
            return f"{self.nodes[0]}'s network link"
        if self.kind == "intra":
            return f"{self.nodes[0]}'s intra-node link"
        return f"the link between {self.nodes[0]} and {self.nodes[1]}"


@dataclass(frozen=True)
class LinkDetection:
    """A slow link: the slow tests it explains, the fast tests through it (in its slow windows),
    its purity, how many independent groups agree, and the resulting confidence."""

    link: Link
    slow_cells: tuple[int, ...]
    fast_cells: tuple[int, ...]
    purity: float
    independent_groups: int
    confidence: float


@dataclass(frozen=True)
class CongestionDetection:
    """A period (consecutive windows) in which most inter-node groups were slow, unexplained by one
    link: ``slow_share`` of the inter-node tests were slow, by a median ``slowdown``, over ``nodes``
    distinct nodes."""

    windows: tuple[int, ...]
    cells: tuple[int, ...]
    slow_share: float
    slowdown: float
    nodes: int


@dataclass(frozen=True)
class LinkReport:
    """What a detector decided, plus per cell its baseline, slowdown ratio and verdict."""

    links: list[LinkDetection]
    congestion: list[CongestionDetection]
    baseline_Bps: np.ndarray
    ratio: np.ndarray
    verdict: np.ndarray  # SLOW, FAST or UNCLEAR per cell
    window: np.ndarray
    cell_links: list[tuple[Link, ...]] = field(default_factory=list, repr=False)

    def reference_cells(self, d: LinkDetection, limit: int = 200) -> list[int]:
        """Up to ``limit`` fast cells in the detection's windows, of the same classes (same baseline)
        as its slow cells, that do not cross its link: healthy references."""
        wins = {int(self.window[i]) for i in d.slow_cells}
        bases = {float(self.baseline_Bps[i]) for i in d.slow_cells}
        out = []
        for i in np.flatnonzero(self.verdict == FAST):
            if (
                int(self.window[i]) in wins
                and float(self.baseline_Bps[i]) in bases
                and d.link not in self.cell_links[i]
            ):
                out.append(int(i))
                if len(out) >= limit:
                    break
        return out


class LinkDetector(Protocol):
    """Decides from link cells which links are slow and which periods are congested."""

    @property
    def name(self) -> str: ...  # read-only: frozen dataclasses satisfy it

    def detect(self, metrics: LinkMetrics) -> LinkReport: ...


@functools.lru_cache(maxsize=1 << 16)
def node_key(name: str) -> tuple[object, ...]:
    """Natural order of node names: node9 before node13 (cached: a 10,240-rank job sorts the
    nodes of ~20k groups by it)."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


@functools.lru_cache(maxsize=1 << 16)
def _links_of(nodes: tuple[str, ...]) -> tuple[Link, ...]:
    if len(nodes) == 1:
        return (Link("intra", nodes),)
    out = [Link("node", (n,)) for n in nodes]
    if len(nodes) == 2:
        out.append(Link("pair", tuple(sorted(nodes, key=node_key))))
    return tuple(out)


@dataclass(frozen=True)
class GroupTestingDetector:
    """Group testing over overlapping groups (see the module docstring).

    Args:
        slow_ratio: a test is slow when baseline / bandwidth >= this...
        min_excess_s: ...and its median transfer is at least this much longer than at baseline.
        fast_ratio: a test is fast when baseline / bandwidth <= this; in between it is unclear (no vote).
        baseline_quantile: quantile of comparable cells' bandwidths taken as the healthy baseline.
        min_class_groups: a class of comparable cells needs this many distinct groups to judge.
        min_purity: a suspect link's share of slow tests among its decided tests.
        min_slow_tests: a suspect link explains at least this many slow tests...
        min_independent: ...from at least this many independent groups...
        min_windows: ...in at least this many windows...
        min_persistence: ...and in at least this share of the windows it was tested in, between its
            first and its last slow window (noise is sporadic, a fault persists or flaps).
        noise_k: in a class whose groups' bandwidth varies over time by sigma (log scale), a test
            is slow only when also >= exp(noise_k * sigma) below baseline (fast: proportionally).
        congestion_share: a window whose inter-node tests are at least this share slow, and still
            are after removing what single links clearly explain, is congested.
        transient_k: a suspect link's slow tests in a window do not count when, on links sharing no
            node with it, more than this many times the job's usual share of sporadic slow tests
            were slow then, and the suspect's were less than this many times slower than those
            (medians; 0: off).
        max_noise_p: a suspect link's slow tests must be unlikely as the job's sporadic noise: the
            chance that its decided tests (from its first to its last slow window) held that many
            slow ones, each slow at the rate seen on the tests that do not cross it, is at most this
            (binomial tail; 1: off; no such tests: not applied).
    """

    slow_ratio: float = 1.5
    min_excess_s: float = 0.0002
    fast_ratio: float = 1.25
    baseline_quantile: float = 0.75
    min_class_groups: int = 2
    min_purity: float = 0.8
    min_slow_tests: int = 3
    min_independent: int = 2
    min_windows: int = 2
    min_persistence: float = 0.5
    congestion_share: float = 0.5
    noise_k: float = 3.0
    transient_k: float = 2.0
    max_noise_p: float = 1e-3
    name: str = "group_testing"

    def __post_init__(self) -> None:
        if not 1.0 <= self.fast_ratio <= self.slow_ratio or self.slow_ratio <= 1.0:
            raise ValueError(
                f"need 1 <= fast_ratio ({self.fast_ratio}) <= slow_ratio ({self.slow_ratio}), 1 < slow_ratio"
            )
        if self.noise_k < 0 or self.min_excess_s < 0:
            raise ValueError("noise_k and min_excess_s must be >= 0")
        if self.transient_k != 0 and self.transient_k < 1:
            raise ValueError(f"GroupTestingDetector.transient_k={self.transient_k} must be 0 (off) or >= 1")
        for name in ("baseline_quantile", "min_purity", "congestion_share", "min_persistence", "max_noise_p"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"GroupTestingDetector.{name}={getattr(self, name)} must be in (0, 1]")
        if min(self.min_slow_tests, self.min_independent, self.min_windows, self.min_class_groups) < 1:
            raise ValueError("min_slow_tests, min_independent, min_windows and min_class_groups must be >= 1")

    def thresholds(self) -> dict[str, float]:
        """The parameters, for a finding's evidence."""
        return {k: v for k, v in asdict(self).items() if k != "name"}

    # -------------------------------------------------------------------------------- verdicts

    def _baselines(self, m: LinkMetrics, n_nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per cell: the healthy bandwidth of its class, and its class's noise (sigma of log bandwidth
        over time within a group, the median over the class's groups). On arrays: a 10,240-rank
        job's ~20k groups were two ``np.median`` calls each (issue 18)."""
        n = len(m)
        base = np.full(n, np.nan)
        noise = np.zeros(n)
        if n == 0:
            return base, noise
        cls = cell_classes(m, n_nodes)
        grp = _codes_of_columns(cls, _codes(m.pg))  # a group within its class
        n_cls, n_grp = int(cls.max()) + 1, int(grp.max()) + 1
        cls_of_grp = np.zeros(n_grp, dtype=np.int64)
        cls_of_grp[grp] = cls
        groups_per_cls = np.bincount(cls_of_grp, minlength=n_cls)
        log_bw = np.log(np.maximum(m.bw_Bps, 1e-9))
        # a persistently slow group varies little over time; noise varies: the median group's
        # robust spread over windows is the class's measurement noise
        med = group_medians(grp, log_bw, n_grp)
        spread = 1.4826 * group_medians(grp, np.abs(log_bw - med[grp]), n_grp)
        enough = np.bincount(grp, minlength=n_grp) >= 3
        cls_noise = group_medians(cls_of_grp[enough], spread[enough], n_cls)
        has_spread = np.bincount(cls_of_grp[enough], minlength=n_cls) > 0
        order = np.argsort(cls, kind="stable")
        bounds = np.searchsorted(cls[order], np.arange(n_cls + 1))
        for c in np.flatnonzero(groups_per_cls >= self.min_class_groups):
            sel = order[bounds[c] : bounds[c + 1]]
            base[sel] = float(np.quantile(m.bw_Bps[sel], self.baseline_quantile))
            noise[sel] = float(cls_noise[c]) if has_spread[c] else 0.0
        return base, noise

    def detect(self, metrics: LinkMetrics) -> LinkReport:
        """Verdict per cell, congested periods, then slow links by greedy group testing."""
        m = metrics
        n = len(m)
        nodes_by_pg = {pg: g.nodes for pg, g in m.groups.items()}
        pg_code, pgs = value_codes(m.pg)  # per distinct group, not per cell
        nodes_of = [nodes_by_pg.get(p, ()) for p in pgs]  # type: ignore[call-overload]
        cell_nodes = [nodes_of[i] for i in pg_code.tolist()]
        n_nodes = np.array([len(x) for x in nodes_of], dtype=np.int64)[pg_code] if n else np.zeros(0, np.int64)
        base, noise = self._baselines(m, n_nodes)
        # noisy measurements (CPU-bound transfers of a few ms) need a larger slowdown to count
        slow_limit = np.maximum(self.slow_ratio, np.exp(self.noise_k * noise))
        fast_limit = np.maximum(self.fast_ratio, slow_limit ** (np.log(self.fast_ratio) / np.log(self.slow_ratio)))
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(np.isfinite(base) & (m.bw_Bps > 0), base / m.bw_Bps, np.nan)
            excess = m.xfer_s - m.xfer_s / ratio
        known = np.isfinite(ratio) & (n_nodes > 0)
        slow = known & (ratio >= slow_limit) & (excess >= self.min_excess_s)
        fast = known & ~slow & (ratio <= fast_limit)
        verdict = np.where(slow, SLOW, np.where(fast, FAST, UNCLEAR)).astype(np.int8)
        by_pg: dict[str, tuple[Link, ...]] = {}
        for pg, g in m.groups.items():
            by_pg[pg] = _links_of(g.nodes) if g.nodes else ()
        cell_links = [by_pg.get(p, ()) for p in m.pg.tolist()]

        congested, congestion = self._congestion(m, cell_links, cell_nodes, n_nodes, slow, fast, ratio)
        usable = ~np.isin(m.window, list(congested)) if congested else np.ones(n, dtype=bool)
        links = self._localize(m, cell_links, slow & usable, fast & usable, ratio)
        return LinkReport(links, congestion, base, ratio, verdict, m.window, cell_links)

    # ------------------------------------------------------------------------------ congestion

    def _residual_share(
        self, idx: np.ndarray, cell_links: list[tuple[Link, ...]], slow: np.ndarray, fast: np.ndarray
    ) -> float:
        """Share of a window's decided tests still slow after removing what single links clearly
        explain: a link (pure enough) that covers more slow tests than any link sharing no node with
        it. When everyone is slow, unrelated links tie and nothing is removed."""
        left = {int(i) for i in idx if slow[i]}
        decided = int((slow[idx] | fast[idx]).sum())
        for _ in range(3):
            s_count: dict[Link, int] = defaultdict(int)
            f_count: dict[Link, int] = defaultdict(int)
            for i in idx:
                for lk in cell_links[i]:
                    if int(i) in left:
                        s_count[lk] += 1
                    elif fast[i]:
                        f_count[lk] += 1
            good = [(c, lk) for lk, c in s_count.items() if c / (c + f_count[lk]) >= self.min_purity]
            if not good:
                break
            good.sort(key=lambda x: (-x[0], -_KIND_ORDER[x[1].kind], x[1].name))
            best_c, best = good[0]
            rival = max((c for c, lk in good[1:] if not set(lk.nodes) & set(best.nodes)), default=0)
            if best_c <= rival:
                break
            left -= {int(i) for i in idx if best in cell_links[i]}
        return len(left) / max(1, decided)

    def _congestion(
        self,
        m: LinkMetrics,
        cell_links: list[tuple[Link, ...]],
        cell_nodes: list[tuple[str, ...]],
        n_nodes: np.ndarray,
        slow: np.ndarray,
        fast: np.ndarray,
        ratio: np.ndarray,
    ) -> tuple[set[int], list[CongestionDetection]]:
        congested: list[int] = []
        for w in np.unique(m.window):
            idx = np.flatnonzero((m.window == w) & (n_nodes >= 2) & (slow | fast))
            if len(idx) == 0 or slow[idx].mean() < self.congestion_share:
                continue
            if self._residual_share(idx, cell_links, slow, fast) >= self.congestion_share:
                congested.append(int(w))
        out = []
        for run in _runs(sorted(congested)):
            if len(run) < self.min_windows:
                continue
            sel = np.isin(m.window, run) & (n_nodes >= 2)
            decided = sel & (slow | fast)
            cells = np.flatnonzero(sel & slow)
            nodes = {x for i in cells for x in cell_nodes[i]}
            out.append(
                CongestionDetection(
                    windows=tuple(run),
                    cells=tuple(int(i) for i in cells),
                    slow_share=float(len(cells) / max(1, decided.sum())),
                    slowdown=float(np.median(ratio[cells])) if len(cells) else 1.0,
                    nodes=len(nodes),
                )
            )
        return set(congested), out

    # ---------------------------------------------------------------------------- localization

    def _localize(
        self,
        m: LinkMetrics,
        cell_links: list[tuple[Link, ...]],
        slow: np.ndarray,
        fast: np.ndarray,
        ratio: np.ndarray,
    ) -> list[LinkDetection]:
        slow_of, decided_of = _cells_of_links(cell_links, slow, fast)
        counts = (int(slow.sum()), int((slow | fast).sum()))
        candidates = self._candidates(m, slow_of, decided_of, fast, counts)
        if candidates and self.transient_k > 0:
            through = [i for c in candidates for i in decided_of[c[0]]]
            kept = self._without_transients(m, slow, fast, ratio, candidates, through)
            candidates = self._candidates(m, kept, decided_of, fast, counts)
        return self._cover(m, slow, fast, decided_of, candidates)

    def _without_transients(
        self,
        m: LinkMetrics,
        slow: np.ndarray,
        fast: np.ndarray,
        ratio: np.ndarray,
        candidates: list[tuple[Link, list[int], list[int], float]],
        through: list[int],
    ) -> dict[Link, list[int]]:
        """Each suspect's slow tests without its windows of transients (see the module docstring):
        among the window's tests on links sharing no node with this one, none through a suspect, a larger
        share was slow than ``transient_k`` times the job's share of such sporadic slow tests, and
        they were at least 1 / ``transient_k`` as slow as the suspect's (medians). A large job
        always has a few sporadic slow tests somewhere; a transient makes many slow at once.
        Array work per suspect (a 10,240-rank job has ~370k cells)."""
        others = np.ones(len(slow), dtype=bool)
        others[through] = False  # every decided test through a suspect link
        decided = others & (slow | fast)
        sporadic = others & slow
        if not sporadic.any():
            return {lk: cells for lk, cells, _f, _p in candidates}
        usual = float(sporadic.sum()) / float(decided.sum())
        wins, win_of = np.unique(m.window, return_inverse=True)
        win_of = win_of.reshape(-1)
        code: dict[str, int] = {}
        group_of = np.fromiter((code.setdefault(str(p), len(code)) for p in m.pg), dtype=np.int64, count=len(m))
        out: dict[Link, list[int]] = {}
        for lk, cells, _f, _p in candidates:
            nodes = set(lk.nodes)
            near = [c for pg, c in code.items() if pg in m.groups and nodes & set(m.groups[pg].nodes)]
            apart = ~np.isin(group_of, np.asarray(near, dtype=np.int64))
            tested = np.bincount(win_of[decided & apart], minlength=len(wins))
            beside = sporadic & apart
            n_beside = np.bincount(win_of[beside], minlength=len(wins))
            by_win: dict[int, list[int]] = defaultdict(list)
            for c in cells:
                by_win[int(win_of[c])].append(c)
            keep: list[int] = []
            for w, here in by_win.items():
                if n_beside[w] and n_beside[w] > self.transient_k * usual * tested[w]:
                    theirs = float(np.median(ratio[beside & (win_of == w)]))
                    if float(np.median(ratio[here])) < self.transient_k * theirs:
                        continue
                keep += here
            out[lk] = sorted(keep)
        return out

    def _candidates(
        self,
        m: LinkMetrics,
        slow_of: dict[Link, list[int]],
        decided_of: dict[Link, list[int]],
        fast: np.ndarray,
        counts: tuple[int, int],
    ) -> list[tuple[Link, list[int], list[int], float]]:
        """Links whose slow tests pass the thresholds: enough of them, in enough windows, pure,
        persistent and unlikely as noise enough. ``counts``: the job's slow and decided tests."""
        candidates = []
        for lk, s_cells in slow_of.items():
            if len(s_cells) < self.min_slow_tests:
                continue
            wins = {int(m.window[i]) for i in s_cells}
            if len(wins) < self.min_windows:
                continue
            f_cells = [i for i in decided_of[lk] if fast[i] and int(m.window[i]) in wins]
            purity = len(s_cells) / (len(s_cells) + len(f_cells))
            if purity < self.min_purity:
                continue
            # persistence: slow in most windows it was tested in, from its first to its last slow one
            lo, hi = min(wins), max(wins)
            tested = {int(m.window[i]) for i in decided_of[lk] if lo <= int(m.window[i]) <= hi}
            if len(wins) < self.min_persistence * len(tested):
                continue
            if self.max_noise_p < 1 and self._noise_p(m, lk, s_cells, decided_of[lk], fast, counts) > self.max_noise_p:
                continue
            candidates.append((lk, s_cells, f_cells, purity))
        return candidates

    def _noise_p(
        self,
        m: LinkMetrics,
        link: Link,
        s_cells: list[int],
        through: list[int],
        fast: np.ndarray,
        counts: tuple[int, int],
    ) -> float:
        """How likely the job's sporadic noise alone gives ``link`` its slow tests: each of its decided
        tests from its first to its last slow window slow at the rate of the decided tests that do not
        cross it (a Laplace estimate: a short clean reference is no proof of a noise-free job), the
        chance of at least ``len(s_cells)`` slow among them. 0 when no test avoids the link (two
        nodes): nothing to compare with, the other rules decide.

        On the 2-core VM's network bed, transfers of ~7 ms on healthy veth links ran 2-3x slow now
        and then (the host's scheduler): in a 3-node job every node's link carries two of the three
        pair groups, so a few such tests in one-step windows, plus one borrowed from the real fault's
        onset, made a healthy node's link look slow in ~1 drill of 34. A fault is slow in almost every
        test through it; noise is as slow on the links beside it."""
        n_slow, n_decided = counts
        through_fast = int(fast[through].sum()) if through else 0
        ref_decided = n_decided - len(through)
        if ref_decided <= 0:
            return 0.0
        ref_slow = n_slow - (len(through) - through_fast)
        rate = (ref_slow + 1.0) / (ref_decided + 2.0)
        wins = [int(w) for w in m.window[s_cells]]
        lo, hi = min(wins), max(wins)
        tested = int(np.count_nonzero((m.window[through] >= lo) & (m.window[through] <= hi)))
        return binomial_tail(len(s_cells), tested, rate)

    def _cover(
        self,
        m: LinkMetrics,
        slow: np.ndarray,
        fast: np.ndarray,
        decided_of: dict[Link, list[int]],
        candidates: list[tuple[Link, list[int], list[int], float]],
    ) -> list[LinkDetection]:
        """Greedy set cover: the link explaining most slow tests first, then what is left."""
        remaining = slow.copy()
        out: list[LinkDetection] = []
        while candidates:
            scored = []
            for lk, s_cells, f_cells, purity in candidates:
                left = [i for i in s_cells if remaining[i]]
                k = _independent(m, lk, left)
                wins = {int(m.window[i]) for i in left}
                if len(left) < self.min_slow_tests or k < self.min_independent or len(wins) < self.min_windows:
                    continue
                scored.append((len(left) * purity, _KIND_ORDER[lk.kind], lk.name, lk, left, f_cells, purity, k))
            if not scored:
                break
            scored.sort(key=lambda x: (-x[0], -x[1], x[2]))
            _score, _o, _n, lk, left, f_cells, purity, k = scored[0]
            remaining[left] = False  # the link's sporadic earlier slow tests are explained too
            left, f_cells, purity, k = self._episode(m, lk, left, [i for i in decided_of[lk] if fast[i]])
            confidence = purity * (1.0 - 0.5 ** (k + 1))
            out.append(LinkDetection(lk, tuple(left), tuple(f_cells), purity, k, confidence))
            candidates = [c for c in candidates if c[0] != lk]
        return out

    def _episode(
        self, m: LinkMetrics, link: Link, slow_cells: list[int], fast_cells: list[int]
    ) -> tuple[list[int], list[int], float, int]:
        """The link's slow tests from its onset on: its fast tests, purity and independent groups.

        The onset is a change point, not the first slow test: the start of the run of windows up to
        the last slow one that maximises ``(1 - min_persistence) x slow tests - min_persistence x
        fast tests`` through the link (the persistence rule of :meth:`_localize`, as the stragglers'
        densest run), earliest on a tie, among the starts that still leave a detection
        (``min_slow_tests``, ``min_windows``, ``min_independent``). A sporadic slow test long before
        the fault (a connection's warm-up, a noisy first step), followed by windows where the link
        tested fast, is not its onset: it made the network drill's link slow "since step 1" when
        the throttle came at step 8."""
        p = self.min_persistence
        win = {i: int(m.window[i]) for i in (*slow_cells, *fast_cells)}
        gain: dict[int, float] = defaultdict(float)
        for i in slow_cells:
            gain[win[i]] += 1.0 - p
        last = max(win[i] for i in slow_cells)
        for i in fast_cells:
            if win[i] <= last:
                gain[win[i]] -= p
        slow_wins = {win[i] for i in slow_cells}
        best, onset, total = -np.inf, min(slow_wins), 0.0
        for w in sorted(gain, reverse=True):  # suffix sums, from the last slow window back
            total += gain[w]
            if w not in slow_wins:
                continue
            cells = [i for i in slow_cells if win[i] >= w]
            ok = (
                len(cells) >= self.min_slow_tests
                and len({win[i] for i in cells}) >= self.min_windows
                and _independent(m, link, cells) >= self.min_independent
            )
            if ok and total >= best:  # >=: the earliest start on a tie
                best, onset = total, w
        cells = [i for i in slow_cells if win[i] >= onset]
        wins = {win[i] for i in cells}
        fast = [i for i in fast_cells if win[i] in wins]
        return cells, fast, len(cells) / (len(cells) + len(fast)), _independent(m, link, cells)


def _independent(m: LinkMetrics, link: Link, cells: list[int]) -> int:
    """Independent groups among ``cells``: different partner nodes (a node link) or different rank
    sets (a pair or intra-node link). Two tensor-parallel ranks' groups to the same partners count once."""
    keys: set[frozenset[str] | frozenset[int]] = set()
    for i in cells:
        g = m.groups.get(str(m.pg[i]))
        if g is None:
            continue
        if link.kind == "node":
            keys.add(frozenset(set(g.nodes) - set(link.nodes)))
        else:
            keys.add(frozenset(g.ranks))
    return len(keys)


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), summed in log space (n up to a few thousand tests)."""
    if k <= 0:
        return 1.0
    if k > n or p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    lp, lq = math.log(p), math.log1p(-p)
    top = math.lgamma(n + 1)
    terms = [top - math.lgamma(j + 1) - math.lgamma(n - j + 1) + j * lp + (n - j) * lq for j in range(k, n + 1)]
    peak = max(terms)
    return min(1.0, math.exp(peak) * sum(math.exp(t - peak) for t in terms))


def _runs(ws: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for w in ws:
        if runs and w == runs[-1][-1] + 1:
            runs[-1].append(w)
        else:
            runs.append([w])
    return runs


def cell_classes(m: LinkMetrics, n_nodes: np.ndarray) -> np.ndarray:
    """Per cell, a dense number of its class of comparable cells: op family, group size, number of
    nodes (``n_nodes``, per cell) and size bucket."""
    members = np.asarray(m.members, np.int64)
    return _codes_of_columns(_codes(m.family), members, np.asarray(n_nodes, np.int64), m.size_bucket)


def _codes(values: np.ndarray) -> np.ndarray:
    """Dense codes of the values of an object array, in order of first appearance."""
    return value_codes(values)[0]


def value_codes(values: np.ndarray) -> tuple[np.ndarray, list[object]]:
    """Dense codes of the values of an object array in order of first appearance, and the distinct
    values in that order. Strings are encoded by Arrow (a 10,240-rank job's ~385k cells were a
    Python loop each time, ~0.3 s; issue 18); other values by a loop."""
    if len(values) and all(type(v) is str for v in values[:1].tolist()):
        import pyarrow as pa

        from ranklens.records import numpy_array

        try:
            enc = pa.array(values, type=pa.string()).dictionary_encode()
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            pass
        else:
            if enc.null_count == 0:
                return numpy_array(enc.indices).astype(np.int64), enc.dictionary.to_pylist()
    code: dict[object, int] = {}
    codes = np.fromiter((code.setdefault(v, len(code)) for v in values.tolist()), dtype=np.int64, count=len(values))
    return codes, list(code)


def _codes_of_columns(*cols: np.ndarray) -> np.ndarray:
    """Dense codes of the rows of integer columns (one code per distinct row)."""
    out = np.zeros(len(cols[0]), dtype=np.int64)
    for col in cols:
        values, code = np.unique(np.asarray(col, dtype=np.int64), return_inverse=True)
        _, out = np.unique(out * len(values) + code.reshape(-1), return_inverse=True)
        out = out.reshape(-1)
    return out


def group_medians(codes: np.ndarray, values: np.ndarray, n_codes: int) -> np.ndarray:
    """Per code ``c`` in ``0..n_codes-1``: ``np.median(values[codes == c])`` (NaN for a code without
    values or with a NaN among them), for all codes with one sort."""
    out = np.full(int(n_codes), np.nan)
    if len(values) == 0:
        return out
    order = np.lexsort((values, codes))
    v, c = values[order], codes[order]
    starts = np.flatnonzero(np.r_[True, c[1:] != c[:-1]])
    counts = np.diff(np.r_[starts, len(c)])
    out[c[starts]] = (v[starts + (counts - 1) // 2] + v[starts + counts // 2]) / 2.0
    out[np.unique(codes[np.isnan(values)])] = np.nan
    return out


def _cells_of_links(
    cell_links: list[tuple[Link, ...]], slow: np.ndarray, fast: np.ndarray
) -> tuple[dict[Link, list[int]], dict[Link, list[int]]]:
    """Per link, its slow cells and its decided (slow or fast) cells, ascending; the slow cells'
    links in order of their first slow cell (and their place in its group's links), as a loop over
    the cells would add them. Built per group, not per cell (~1M dictionary updates at 10,240 ranks)."""
    decided = np.flatnonzero(slow | fast)
    slow_of: dict[Link, list[int]] = {}
    decided_of: dict[Link, list[int]] = defaultdict(list)
    if len(decided) == 0:
        return slow_of, decided_of
    links = [cell_links[i] for i in decided.tolist()]
    code = _link_codes(links)
    order = np.argsort(code, kind="stable")
    cells, codes = decided[order], code[order]
    starts = np.flatnonzero(np.r_[True, codes[1:] != codes[:-1]])
    ends = np.r_[starts[1:], len(codes)]
    parts: dict[Link, list[np.ndarray]] = defaultdict(list)
    for a, b in zip(starts.tolist(), ends.tolist()):
        for lk in cell_links[int(cells[a])]:
            parts[lk].append(cells[a:b])
    first: list[tuple[int, int, Link]] = []
    for lk, arrs in parts.items():
        all_cells = np.sort(np.concatenate(arrs)) if len(arrs) > 1 else arrs[0]
        decided_of[lk] = all_cells.tolist()
        s_cells = all_cells[slow[all_cells]]
        if len(s_cells):
            i0 = int(s_cells[0])
            first.append((i0, cell_links[i0].index(lk), lk))
            slow_of[lk] = s_cells.tolist()
    slow_of = {lk: slow_of[lk] for _i, _k, lk in sorted(first, key=lambda x: (x[0], x[1]))}
    return slow_of, decided_of


def _link_codes(links: list[tuple[Link, ...]]) -> np.ndarray:
    """Dense codes of the cells' link tuples (the same tuple object for the cells of one group)."""
    return _first_appearance(np.fromiter(map(id, links), dtype=np.int64, count=len(links)))


def _first_appearance(keys: np.ndarray) -> np.ndarray:
    """Dense codes of integer keys, numbered in order of first appearance (a dictionary loop's
    numbering, on arrays)."""
    if len(keys) == 0:
        return np.zeros(0, dtype=np.int64)
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    rank = np.empty(len(first), dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first))
    return rank[inverse.reshape(-1)]
