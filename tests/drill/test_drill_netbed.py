"""`ranklens drill` with a throttled link, as a user runs it: the drill builds its network-namespace
bed (3 nodes x 1 rank of the built-in job, one torchrun agent per node), throttles node 2's link
with tc at step 8, and the live analysis must name node 2's link (a `slow_link` finding) with no
false alarm. Needs root and iproute2 (`ip netns`, `tc`): the test then skips with the reason, which
fails CI (RANKLENS_FAIL_ON_SKIP=1; tests/allowed_skips.txt lists no such reason)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ranklens.analyzers.netbed import unavailable_reason
from ranklens.store import open_store
from tests._jobs import ranklens

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def _beds() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith("rld")}


def test_a_throttled_node_link_is_found_live_and_named(tmp_path):
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    before = _beds()
    url = f"embedded://{tmp_path / 'store'}"
    r = ranklens("drill", "--store", url, "--suite", "network", "--json", timeout=800)
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == 2, r.stdout + r.stderr[-4000:]
    d, summary = lines
    (f,) = d["faults"]
    print("network suite:", json.dumps(f), json.dumps(summary), file=sys.stderr)  # the scorecard, in the CI log
    # what the drill itself must do: the bed, one agent per node, tc at the onset, the job to its end,
    # a stored scorecard, no bed left behind
    assert r.returncode in (0, 9), r.stderr[-4000:]
    assert f["fault"] == "slow_link:node2:40mbit@8" and f["applied"] and f["onset_step"] >= 8, json.dumps(d)
    assert d["exit_code"] == 0 and not d["job_failed"], json.dumps(d, indent=1)
    rows = open_store(url, create=False).query("SELECT kind, `rank`, detected, culprit_ok FROM drills").to_pylist()
    want = {"kind": "slow_link", "rank": -1, "detected": int(f["detected"]), "culprit_ok": int(f["culprit_ok"])}
    assert rows == [want]
    assert _beds() <= before, "the drill left its network bed behind"
    # what ranklens must find: node 2's link, live, and no straggler on a healthy node (the ranks'
    # time blocked in the slow pair groups is waiting, not compute: tests/data/slow_link_exchange)
    assert d["passed"] and not d["false_findings"], json.dumps(d, indent=1) + _why(url, d)
    assert f["detected"] and f["kind_ok"] and f["culprit_ok"] and r.returncode == 0
    assert f["finding"]["kind"] == "slow_link" and "node2" in f["finding"]["title"]


def test_a_slow_link_drill_without_root_exits_2_naming_why(tmp_path):
    """Where the bed cannot be built (here: not root, as the drill sees it), exit 2, never a skip."""
    code = (
        "import os, sys; os.geteuid = lambda: 1000; from ranklens.cli import main; "
        "sys.argv = ['ranklens', 'drill', '--store', sys.argv[1], '--fault', 'slow_link:node1@5']; main()"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, f"embedded://{tmp_path / 'st'}"], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 2, r.stderr
    assert "a slow_link drill throttles a real link on a network-namespace bed" in r.stderr
    assert "needs root (uid 1000)" in r.stderr


def _why(url: str, d: dict) -> str:
    """On failure, what a diagnosis of a false finding needs (the drill's store is gone with the
    test's tmp dir): the findings' evidence as stored, and every rank's compute per step."""
    from ranklens.analyzers.compute import compute_matrix

    store = open_store(url, create=False)
    ids = ", ".join(f"'{f['id']}'" for f in d["false_findings"]) or "''"
    out = ["", "false findings' evidence:"]
    for fid, ev in store.query(f"SELECT id, any(evidence) FROM findings WHERE id IN ({ids}) GROUP BY id").rows():
        e = json.loads(ev)
        e.pop("sql", None)
        out.append(f"{fid}: {json.dumps(e)[:3000]}")
    cm = compute_matrix(store, d["job_id"])
    out.append("compute ms per rank x step:")
    out += [f"rank {r}: {[round(x * 1000) for x in row]}" for r, row in zip(cm.ranks.tolist(), cm.compute_s.tolist())]
    return "\n".join(out)
