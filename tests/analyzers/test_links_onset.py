"""A slow link's onset is where its groups became slow, not its first sporadic slow test.

Real data (tests/data/slow_link_onset/, see its PROVENANCE.md): the network drill's 3-node job,
node 2's link throttled to 40 Mbit/s at step 8. In step 1 (the pair groups' first 1 MiB exchange
after connecting) pg 3 = [1, 2] and pg 1 = [0, 1] ran at ~85 MB/s against ~270 MB/s for pg 2:
one slow test through node 2's link in the first window, in which pg 2 tested it fast, then four
windows of fast tests, then slow tests from step 9 on. The finding used to start at that first
slow test: "slow link node2<->network ... since step 1".
"""

from __future__ import annotations

import json
from pathlib import Path

from ranklens.analyzers.links import find_slow_links

DATA = Path(__file__).parent.parent / "data" / "slow_link_onset"
JOB = "drill-20261205-083806-6feba9"
ONSET_STEP = 8  # the drill's ground truth: tc applied when the ranks reported step 8
FIRST_SLOW_STEP = 9  # step 8's exchange ran ~30 ms before tc was in place (rows in the ledger)


def _load(store, upto_step: int | None = None) -> None:
    for table in ("ranks", "process_groups", "collectives"):
        rows = [json.loads(line) for line in (DATA / f"{table}.jsonl").read_text().splitlines()]
        if upto_step is not None and table == "collectives":
            rows = [r for r in rows if r["step"] <= upto_step]
        store.write(table, rows)


def _link(store):
    findings = [f for f in find_slow_links(store, JOB) if f.kind == "slow_link"]
    assert [f.evidence["link"] for f in findings] == ["node2<->network"], [f.title for f in findings]
    return findings[0]


def test_onset_is_the_change_not_an_early_sporadic_slow_test(embedded_store):
    _load(embedded_store)
    f = _link(embedded_store)
    # 2-step windows: window 4 (steps 8-9) straddles the onset and its medians are still fast; the
    # onset is then refined to the step: the first slow exchange
    assert f.evidence["window_steps"] > 1
    assert f.first_seen_step == FIRST_SLOW_STEP, f.title
    assert f.evidence["windows"][0] >= ONSET_STEP // f.evidence["window_steps"], f.evidence["windows"]
    assert f"since step {f.first_seen_step}" in f.title


def test_live_pass_onset(embedded_store):
    # a live pass at step 12 (1-step windows): the same link, from the first slow step
    _load(embedded_store, upto_step=12)
    f = _link(embedded_store)
    assert f.first_seen_step == FIRST_SLOW_STEP, f.title


def test_live_pass_where_the_slow_groups_lag_keeps_the_finding_open(embedded_store):
    """Live, the groups through the slow link report a window after the fast ones do (their
    exchange is what takes long). A pass that sees pg 0 and pg 1 up to step 16 but the slow pairs
    pg 2 and pg 3 only up to step 12 must not call the link's finding resolved: its groups were
    never measured fast since. (It was: the drill's live findings flapped to resolved.)"""
    for table in ("ranks", "process_groups", "collectives"):
        rows = [json.loads(line) for line in (DATA / f"{table}.jsonl").read_text().splitlines()]
        if table == "collectives":
            rows = [r for r in rows if r["step"] <= (12 if r["pg"] in ("2", "3") else 16)]
        embedded_store.write(table, rows)
    f = _link(embedded_store)
    assert f.state == "open", (f.title, f.evidence["windows"])


def test_a_link_whose_groups_ran_fast_again_is_resolved(embedded_store):
    """The other side: the slow pairs' exchanges of steps 20 on given the transfer time they had
    before the throttle (the link repaired): the finding ends, resolved."""
    rows = [json.loads(line) for line in (DATA / "collectives.jsonl").read_text().splitlines()]
    fast = {}  # (rank, pg) -> a transfer time (end - enter) of a pre-throttle exchange
    for r in rows:
        if r["pg"] in ("2", "3") and 3 <= r["step"] <= 6 and r["end_ns"] > 0:
            fast.setdefault((r["rank"], r["pg"]), r["end_ns"] - r["enter_ns"])
    for r in rows:
        if r["pg"] in ("2", "3") and r["step"] >= 20 and r["end_ns"] > 0:
            r["end_ns"] = r["enter_ns"] + fast[(r["rank"], r["pg"])]
    for table in ("ranks", "process_groups"):
        embedded_store.write(table, [json.loads(x) for x in (DATA / f"{table}.jsonl").read_text().splitlines()])
    embedded_store.write("collectives", rows)
    f = _link(embedded_store)
    assert f.state == "resolved" and f.last_seen_step < 22, (f.title, f.evidence["windows"])
