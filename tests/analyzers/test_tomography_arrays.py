"""The link detector's array helpers (issue 18: a 10,240-rank job's ~20k groups were two
``np.median`` calls each, and its ~385k cells a loop of dictionary updates) answer what the plain
loops answer."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from ranklens.analyzers.tomography import Link, _cells_of_links, _first_appearance, group_medians, value_codes


def test_group_medians_is_np_median_per_code():
    rng = np.random.default_rng(3)
    for case in range(300):
        n = int(rng.integers(0, 60))
        codes = rng.integers(0, 7, n)
        values = np.round(rng.normal(size=n), int(rng.integers(0, 3)))
        if n and case % 5 == 0:
            values[int(rng.integers(0, n))] = np.nan  # a NaN makes its code's median NaN
        got = group_medians(codes, values, 8)
        for c in range(8):
            sel = values[codes == c]
            want = float(np.median(sel)) if len(sel) else np.nan
            assert (np.isnan(got[c]) and np.isnan(want)) or got[c] == want, (case, c)


def test_cells_of_links_is_the_loop_over_cells():
    a, b, c = Link("node", ("n0",)), Link("node", ("n1",)), Link("pair", ("n0", "n1"))
    per_group = [(a, b, c), (a,), (), (b, a)]
    rng = np.random.default_rng(5)
    for case in range(200):
        n = int(rng.integers(0, 40))
        cell_links = [per_group[int(g)] for g in rng.integers(0, len(per_group), n)]
        verdict = rng.integers(-1, 2, n)
        slow, fast = verdict == 1, verdict == -1
        slow_of: dict[Link, list[int]] = defaultdict(list)
        decided_of: dict[Link, list[int]] = defaultdict(list)
        for i in np.flatnonzero(slow | fast):
            for lk in cell_links[i]:
                decided_of[lk].append(int(i))
                if slow[i]:
                    slow_of[lk].append(int(i))
        got_slow, got_decided = _cells_of_links(cell_links, slow, fast)
        assert list(got_slow.items()) == list(slow_of.items()), case  # the same links in the same order
        assert dict(got_decided) == dict(decided_of), case


def test_link_hash_is_cached_and_equal_links_hash_alike():
    x, y = Link("pair", ("n0", "n1")), Link("pair", ("n0", "n1"))
    assert x == y and hash(x) == hash(y) == hash(("pair", ("n0", "n1")))
    assert {x: 1}[y] == 1


def test_value_codes_number_values_by_first_appearance():
    rng = np.random.default_rng(3)
    words = ["all_reduce", "p2p", "", "12", "ü", "all_gather"]
    for n in (0, 1, 5, 300):
        for pool in (words, [1, 2, (3, 4)], ["a", None, "b"]):  # strings (Arrow), other values, a None
            values = np.empty(n, dtype=object)
            for k, i in enumerate(rng.integers(0, len(pool), n)):
                values[k] = pool[int(i)]
            seen: dict[object, int] = {}
            expected = [seen.setdefault(v, len(seen)) for v in values.tolist()]
            codes, distinct = value_codes(values)
            assert codes.dtype == np.int64 and codes.tolist() == expected and distinct == list(seen)


def test_first_appearance_numbers_keys_as_a_dictionary_loop():
    rng = np.random.default_rng(4)
    for n in (0, 1, 7, 500):
        keys = rng.integers(-5, 40, n) * 10**12  # ids are large
        seen: dict[int, int] = {}
        assert _first_appearance(keys).tolist() == [seen.setdefault(int(k), len(seen)) for k in keys]
