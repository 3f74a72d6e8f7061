"""THE compute metric's wait (compute_sql's ``wait_ns``), the time a rank was blocked in
collectives within its step, in SQL on both backends, against its definition in plain Python: from
each entry until the last completion before the next entry (or the window's end), entries and
completions clipped to the window, a completion before an entry at a tie. Random windows of sync
and async calls, ties, calls crossing the window's edges and calls with no duration."""

from __future__ import annotations

import numpy as np
import pytest

from ranklens.analyzers.compute import compute_sql


def _by_definition(start: int, end: int, enters: list[int], ends: list[int]) -> int:
    pairs = [(e, x) for e, x in zip(enters, ends) if start <= e < end]
    done = [(min(max(x, e), end), 0) for e, x in pairs if min(max(x, e), end) > e]
    events = sorted(done + [(e, 1) for e, _ in pairs])
    total, anchor = 0, 0
    for k, (t, kind) in enumerate(events):
        if kind == 1:
            anchor = t
        elif k + 1 == len(events) or events[k + 1][1] == 1:
            total += t - anchor
    return total


@pytest.mark.parametrize("store", ["embedded", "server"], indirect=True)
def test_wait_is_the_definition_on_random_windows(store):
    rng = np.random.default_rng(17)
    cases = []
    for _ in range(150):
        n = int(rng.integers(0, 12))
        base = 1_790_000_000_000_000_000  # epoch nanoseconds, as stored
        enters = sorted(int(x) for x in base + rng.integers(0, 1000, n) * int(rng.choice([1, 1000])))
        lengths = rng.integers(-5, 400, n) * int(rng.choice([1, 1000]))  # async overlaps, none, negative
        ends = [e + int(d) for e, d in zip(enters, lengths)]
        order = rng.permutation(n)  # the ledger's rows come in any order
        enters, ends = [enters[i] for i in order], [ends[i] for i in order]
        start = base + int(rng.integers(-50, 300)) * int(rng.choice([1, 1000]))
        end = start + int(rng.integers(1, 1200)) * int(rng.choice([1, 1000]))
        cases.append((start, end, enters, ends))
    # one rank a case: its step is the window, its collectives the calls
    steps = [{"job_id": "w", "rank": k, "step": 0, "start_ns": c[0], "end_ns": c[1]} for k, c in enumerate(cases)]
    colls = [
        {"job_id": "w", "rank": k, "step": 0, "pg": "0", "seq": i, "op": "all_reduce", "enter_ns": e, "end_ns": x}
        for k, (_s, _e, en, ex) in enumerate(cases)
        for i, (e, x) in enumerate(zip(en, ex))
    ]
    store.write("steps", steps)
    store.write("collectives", colls)
    r = store.query(compute_sql("w", 0))  # whole: 18.16 prunes a column a lambda reads when wrapped
    got = sorted(zip(r.column("rank").tolist(), r.column("wait_ns").tolist()))
    assert [int(w) for _, w in got] == [_by_definition(*c) for c in cases]
