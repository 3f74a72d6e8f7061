"""A finding about a node that was marginal at its last pre-flight says so (issue 16 #4): a real
pre-flight run on the shipped fake NVML (one GPU hot), stored an hour before a simulated job whose
rank on that node straggles, then `ranklens analyze`."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

from ranklens.collector.fake_nvml import from_spec
from ranklens.collector.preflight import Context, resolve_checks, run_node
from ranklens.preflight import PreflightReport
from ranklens.store import open_store

RANKLENS = str(Path(sys.executable).with_name("ranklens"))


def _store_preflight(url: str, node: str, spec: dict, age_s: float) -> PreflightReport:
    rep = run_node(Context(node=node, nvml=from_spec(json.dumps(spec))), resolve_checks("gpu"))
    started = time.time_ns() - int(age_s * 1e9)
    report = PreflightReport("run" + node, started, [node], list(rep.results))
    store = open_store(url)
    try:
        store.write("preflight", report.rows())
    finally:
        store.close()
    return report


def test_a_straggler_on_a_node_that_ran_hot_at_preflight_says_so(tmp_path):
    url = f"embedded://{tmp_path / 'store'}"
    hot = _store_preflight(url, "node0000", {"gpus": [{"uuid": "GPU-0", "temp_c": 88}, {"uuid": "GPU-1"}]}, 3600)
    assert hot.verdict("node0000").value == "warn"
    _store_preflight(url, "node0001", {"gpus": 2}, 3600)  # healthy: no note
    sim = subprocess.run(
        [RANKLENS, "simulate", "--store", url, "--ranks", "16", "--steps", "40", "--fault", "slow_gpu:5:1.5@10"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,  # its truth file lands in cwd
    )  # fmt: skip
    assert sim.returncode == 0, sim.stderr
    r = subprocess.run([RANKLENS, "analyze", "--store", url, "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    findings = json.loads(r.stdout)["findings"]
    straggler = next(f for f in findings if f["kind"] == "straggler")
    assert "node0000 was warn at pre-flight (gpu.temperature[gpu0])" in straggler["title"]
    note = straggler["evidence"]["preflight"]["node0000"]
    assert note["run_id"] == "runnode0000" and [m["check"] for m in note["marginal"]] == ["gpu.temperature"]
    assert "node0001" not in straggler["evidence"]["preflight"]


def test_a_preflight_after_the_finding_began_or_a_clean_one_adds_nothing(tmp_path):
    from ranklens.analyzers.findings import Finding, Severity, Suspect
    from ranklens.analyzers.preflight_notes import annotate_preflight

    url = f"embedded://{tmp_path / 'store'}"
    _store_preflight(url, "n1", {"gpus": [{"uuid": "GPU-0", "temp_c": 99}]}, 0)  # a fail, but now
    f = Finding("x", "j", 0, "straggler", Severity.WARNING, 0.9, "rank 1 is slow", (Suspect(1, "n1"),), 1, 5,
                first_seen_ns=time.time_ns() - 10**12)  # fmt: skip
    store = open_store(url)
    try:
        assert annotate_preflight(store, [f]) == [f]
        later = dataclasses.replace(f, first_seen_ns=time.time_ns() + 10**9)
        (got,) = annotate_preflight(store, [later])
        assert "n1 was fail at pre-flight (gpu.temperature[gpu0])" in got.title
    finally:
        store.close()


def test_a_node_named_by_its_fqdn_at_preflight_matches_its_short_name_and_the_lookback_is_per_finding(tmp_path):
    from ranklens.analyzers.findings import Finding, Severity, Suspect
    from ranklens.analyzers.preflight_notes import annotate_preflight

    url = f"embedded://{tmp_path / 'store'}"
    _store_preflight(url, "gpu017.cluster.local", {"gpus": [{"uuid": "GPU-0", "temp_c": 99}]}, 3600)
    now = time.time_ns()
    f = Finding("x", "j", 0, "straggler", Severity.WARNING, 0.9, "rank 1 is slow", (Suspect(1, "gpu017"),), 1, 5,
                first_seen_ns=now)  # fmt: skip
    old = dataclasses.replace(f, id="y", first_seen_ns=now - 3600 * 10**9 - 10**9)  # before that pre-flight
    late = dataclasses.replace(f, id="z", first_seen_ns=now + 3 * 86400 * 10**9)  # 3 days after it
    store = open_store(url)
    try:
        got, got_old, got_late = annotate_preflight(store, [f, old, late], lookback_s=86400)
        assert "gpu017 was fail at pre-flight (gpu.temperature[gpu0])" in got.title, got.title
        assert got.evidence["preflight"]["gpu017"]["run_id"] == "rungpu017.cluster.local"
        assert got_old == old  # the only run came after it began
        assert got_late == late  # the run is older than the lookback for this finding (not the earliest one's)
    finally:
        store.close()
