"""A window in which unrelated links were as slow as a suspect's is a transient, not the suspect's.

Cells laid out as the network bed's job (tests/links_bed_job.py): 4 nodes x 2 ranks, tensor-parallel
pairs within a node, data-parallel pairs across the nodes of a stage ({0,2}, {1,3} on node0-node1;
{4,6}, {5,7} on node2-node3) and pipeline p2p pairs between the stages; one cell per group and
window. On the real bed a healthy run had both stage-2 DP groups 2-3x slow in two windows while a
DP or TP group of the other stage was as slow in the same windows (8 ranks on 2 cores: a CPU-starved
moment), one step from a false ``slow_link node2<->node3``.
"""

from __future__ import annotations

from ranklens.analyzers.links import GroupInfo, LinkMetrics
from ranklens.analyzers.tomography import GroupTestingDetector
from tests.links_helpers import cell_metrics

WINDOWS = 10
NODE = {r: f"node{r // 2}" for r in range(8)}


def _groups() -> dict[str, GroupInfo]:
    out = {}
    for k in range(4):  # tensor parallel: within node k
        out[f"tp{k}"] = GroupInfo(f"tp{k}", (2 * k, 2 * k + 1), (f"node{k}",))
    for a, b in ((0, 2), (1, 3), (4, 6), (5, 7)):  # data parallel: across the nodes of a stage
        out[f"dp{a}{b}"] = GroupInfo(f"dp{a}{b}", (a, b), tuple(sorted({NODE[a], NODE[b]})))
    for r in range(4):  # pipeline: stage 1 <-> stage 2, both directions
        for src, dst in ((r, r + 4), (r + 4, r)):
            pg = f"0/p2p:{src}->{dst}"
            out[pg] = GroupInfo(pg, (src, dst), tuple(sorted({NODE[src], NODE[dst]})), f"p2p {src}->{dst}")
    return out


def _metrics(slowdowns: dict[tuple[str, int], float], seed: int = 0) -> LinkMetrics:
    """Every group's cell in every window at ~1 GB/s (2 % noise), ``slowdowns[(pg, window)]`` times slower."""
    return cell_metrics(_groups(), NODE, slowdowns, WINDOWS, seed=seed)


# the other stage's groups, as slow in the same windows: a DP group (node0-node1) and a TP pair (node0)
TRANSIENTS = {("dp02", 4): 3.0, ("tp0", 5): 3.0}


def _names(m: LinkMetrics, **kw: float) -> list[str]:
    return [d.link.name for d in GroupTestingDetector(**kw).detect(m).links]


def test_a_suspect_as_slow_as_unrelated_links_in_the_same_windows_is_a_transient():
    stage2 = {(pg, w): 2.6 for pg in ("dp46", "dp57") for w in (4, 5)}
    m = _metrics({**stage2, **TRANSIENTS})
    assert _names(m, transient_k=0.0) == ["node2<->node3"]  # without the rule: the false finding
    assert _names(m) == []


def test_a_real_fault_stands_out_of_the_transients_beside_it():
    fault = {(pg, w): 40.0 for pg in ("dp46", "dp57") for w in range(3, WINDOWS)}
    (d,) = GroupTestingDetector().detect(_metrics({**fault, **TRANSIENTS})).links
    assert d.link.name == "node2<->node3"
    m = _metrics({**fault, **TRANSIENTS})
    assert sorted({int(m.window[i]) for i in d.slow_cells}) == list(range(3, WINDOWS))


def test_a_fault_as_slow_as_the_transients_loses_only_their_windows():
    fault = {(pg, w): 3.0 for pg in ("dp46", "dp57") for w in range(2, WINDOWS)}
    m = _metrics({**fault, **TRANSIENTS})
    (d,) = GroupTestingDetector().detect(m).links
    assert d.link.name == "node2<->node3"
    assert sorted({int(m.window[i]) for i in d.slow_cells}) == [2, 3, 6, 7, 8, 9]


def test_a_slow_test_through_the_suspects_nodes_is_not_a_transient_beside_it():
    # node2's p2p pair to node0 slow in window 4 shares node2 with the suspect: it is not "unrelated"
    stage2 = {(pg, w): 2.6 for pg in ("dp46", "dp57") for w in (4, 5, 6)}
    m = _metrics({**stage2, ("0/p2p:4->0", 4): 3.0})
    assert _names(m) == ["node2<->node3"]
