"""Clock alignment: host offsets recovered from collective completions; blame needs them, the
peer-compute detector does not."""

from __future__ import annotations

import pytest

from ranklens.analyzers import PersistentBlameDetector, compute_blame, find_stragglers
from ranklens.analyzers.clocks import clock_offsets
from tests.helpers import synthetic_job

SKEW_NS = 30_000_000  # node1's clock runs 30 ms ahead


def _skewed(slow_rank: int = 1):
    rows = synthetic_job(ranks=6, slow_rank=slow_rank, slow_from=3, extra_s=0.02, steps=25, noise_s=0.001)
    for table in ("collectives", "steps"):
        for r in rows[table]:
            if r["rank"] in (2, 3):  # node1 (hosts are node{rank // 2})
                for k in ("enter_ns", "end_ns", "start_ns"):
                    if r.get(k):
                        r[k] += SKEW_NS
    return rows


def test_offsets_are_recovered(store):
    store.write_many(_skewed())
    offs = clock_offsets(store, "job-synth")
    assert set(offs) == {"node0", "node1", "node2"}
    assert offs["node1"].offset_ns - offs["node0"].offset_ns == pytest.approx(SKEW_NS, abs=1_000_000)
    assert offs["node2"].offset_ns - offs["node0"].offset_ns == pytest.approx(0, abs=1_000_000)
    assert offs["node1"].samples >= 50 and offs["node1"].confidence > 0.5


def test_blame_needs_alignment_and_peer_compute_does_not(embedded_store):
    embedded_store.write_many(_skewed(slow_rank=1))
    det = PersistentBlameDetector()
    naive = {d.rank for d in det.detect(compute_blame(embedded_store, "job-synth", align=False))}
    aligned = {d.rank for d in det.detect(compute_blame(embedded_store, "job-synth"))}
    assert naive and naive <= {2, 3}  # the skewed node looks late at every collective
    assert aligned == {1}
    (f,) = find_stragglers(embedded_store, "job-synth")
    assert [s.rank for s in f.suspects] == [1]
