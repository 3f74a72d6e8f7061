"""The non-finite gradient check before DDP's all-reduce (tracing/_nonfinite.py), on CPU tensors."""

from __future__ import annotations

from collections import Counter

import torch

from ranklens.tracing._nonfinite import CLASS, MAX_REPORTS, NonFiniteCheck


class _Tracer:
    job_id, attempt, _host, rank = "j", 0, "node1", 3

    def __init__(self) -> None:
        self._step = 0
        self.drops: Counter[str] = Counter()

    def count_drop(self, what: str, n: int = 1) -> None:
        self.drops[what] += n


def test_a_nan_bucket_is_one_row_per_step_with_the_step_and_rank():
    t = _Tracer()
    c = NonFiniteCheck(t)
    c.bucket(torch.ones(10_000), 0)
    assert c.rows() == []
    t._step = 7
    bad = torch.ones(10_000)
    bad[:] = float("nan")
    c.bucket(bad, 0)
    c.bucket(bad, 1)  # the same step's second bucket: still one row
    inf = torch.ones(3)
    inf[1] = float("inf")
    t._step = 8
    c.bucket(inf, 0)
    rows = c.rows()
    assert [(r["klass"], r["rank"], r["severity"]) for r in rows] == [(CLASS, 3, "error")] * 2
    assert "at step 7" in rows[0]["message"] and "bucket 0" in rows[0]["message"]
    assert "at step 8" in rows[1]["message"]


def test_reports_are_capped_and_the_rest_counted():
    t = _Tracer()
    c = NonFiniteCheck(t)
    for step in range(MAX_REPORTS + 4):
        t._step = step
        c.bucket(torch.full((5,), float("nan")), 0)
    assert len(c.rows()) == MAX_REPORTS
    assert t.drops["nonfinite:steps_not_reported"] == 4


def test_something_that_is_not_a_tensor_turns_the_check_off_quietly():
    c = NonFiniteCheck(_Tracer())
    c.bucket(object(), 0)
    assert c.off and c.rows() == []
    c.bucket(torch.full((5,), float("nan")), 0)  # off: not checked any more
    assert c.rows() == []


def test_the_sample_sees_a_bad_region_anywhere_and_stays_inside_the_bucket():
    from ranklens.tracing._nonfinite import BLOCKS, SAMPLE

    t = _Tracer()
    c = NonFiniteCheck(t)
    n = 1_000_003  # not a multiple of anything: the last run must end inside the bucket
    w = SAMPLE // BLOCKS
    region = (n - w) // (BLOCKS - 1) + w  # a bad region this long always holds a sampled run
    for start in (0, 12_345, n // 2 + 7, n - region):
        t._step = start
        g = torch.ones(n)
        g[start : start + region] = float("nan")
        c.bucket(g, 0)
    assert len(c.rows()) == MAX_REPORTS and t.drops["nonfinite:steps_not_reported"] == 1
    # a view into a larger buffer (DDP's bucket buffers are slices of one flat tensor): the sample is
    # taken from the view, not from its storage's start
    t2 = _Tracer()
    c2 = NonFiniteCheck(t2)
    storage = torch.full((3 * n,), float("nan"))
    storage[n : 2 * n] = 1.0
    c2.bucket(storage[n : 2 * n], 0)
    inf_tail = torch.ones(n)
    inf_tail[-(w + BLOCKS) :] = float("inf")  # the last run ends fewer than BLOCKS elements before the end
    c2.bucket(inf_tail, 1)
    rows = c2.rows()
    assert len(rows) == 1 and "bucket 1" in rows[0]["message"]
