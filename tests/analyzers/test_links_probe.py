"""The active link probe: planning, verdicts, evidence, and a real run over loopback (the real
throttled-link confirmation is in tests/analyzers/test_links_netbed.py)."""

from __future__ import annotations

import pytest

import ranklens.analyzers.correlate
import ranklens.analyzers.links
import ranklens.analyzers.netbed
import ranklens.analyzers.probe
import ranklens.analyzers.tomography
from ranklens.analyzers.findings import Finding, Severity, Suspect
from ranklens.analyzers.netbed import NetBed
from ranklens.analyzers.probe import ProbePair, ProbeReport, ProbeResult, attach_probe, plan_probe, run_probe


def _finding(kind: str, nodes: list[str]) -> Finding:
    return Finding(
        id="x",
        job_id="j",
        attempt=0,
        kind="slow_link",
        severity=Severity.WARNING,
        confidence=0.8,
        title="slow link",
        suspects=tuple(Suspect(rank=i, node=n) for i, n in enumerate(nodes)),
        first_seen_step=0,
        last_seen_step=5,
        evidence={"link_kind": kind, "nodes": nodes},
    )


def test_plan_probe_pairs_suspects_with_healthy_nodes_and_a_healthy_reference():
    nodes = ["node0", "node1", "node2", "node3"]
    assert plan_probe(_finding("node", ["node3"]), nodes) == [
        ProbePair("node3", "node0"),
        ProbePair("node1", "node2", "reference"),
    ]
    assert plan_probe(_finding("pair", ["node1", "node3"]), nodes) == [
        ProbePair("node1", "node3"),
        ProbePair("node0", "node2", "reference"),
    ]
    with pytest.raises(ValueError):
        ProbePair("a", "a")


def test_report_verdict_and_attached_evidence():
    slow = ProbeResult("node3", "node0", "suspect", 1 << 20, (0.2, 0.21, 0.5))
    ref = ProbeResult("node1", "node2", "reference", 1 << 20, (0.002, 0.002))
    report = ProbeReport((slow, ref))
    assert report.ratio == pytest.approx(0.21 / 0.002) and report.confirmed
    g = attach_probe(_finding("node", ["node3"]), report)
    assert g.confidence == 0.95 and "probe confirmed" in g.title and g.evidence["probe"]["confirmed"]
    same = ProbeReport((ProbeResult("a", "b", "suspect", 100, (1.0,)), ProbeResult("c", "d", "reference", 100, (0.9,))))
    h = attach_probe(_finding("node", ["a"]), same)
    assert not same.confirmed and h.confidence == 0.4 and "did not confirm" in h.title


@pytest.mark.e2e
def test_probe_runs_as_separate_gloo_processes_over_loopback():
    pairs = [ProbePair("a", "b"), ProbePair("b", "c", "reference")]
    report = run_probe(pairs, dict.fromkeys("abc", "127.0.0.1"), nbytes=1 << 20, iters=2, timeout_s=120)
    assert sorted((r.src, r.dst, r.role) for r in report.results) == [
        ("a", "b", "suspect"),
        ("b", "a", "suspect"),
        ("b", "c", "reference"),
        ("c", "b", "reference"),
    ]
    assert all(r.bandwidth_Bps > 1e6 and len(r.iter_seconds) == 2 for r in report.results)


def test_netbed_commands_run_inside_a_node_with_its_hostname():
    bed = NetBed(4, prefix="rlx")
    assert (
        bed.address(3) == "10.77.0.4" and bed.namespace(3) == "rlx-n3" and bed.env(3)["GLOO_SOCKET_IFNAME"] == "veth0"
    )
    cmd = bed.command(3, ["python", "x.py"])
    assert cmd[:4] == ["ip", "netns", "exec", "rlx-n3"] and "node3" in cmd and cmd[-2:] == ["python", "x.py"]


def test_public_names():
    # Spelt out, not read from the modules: this pins the public surface, so widening or narrowing
    # an ``__all__`` is a deliberate edit here too (reading ``__all__`` back would check nothing).
    assert set(ranklens.analyzers.links.__all__) == {
        "BUS_FACTORS",
        "GroupInfo",
        "LinkMetrics",
        "compute_link_metrics",
        "find_slow_links",
        "link_metric_sql",
        "transfer_sql",
        "to_findings",
    }
    assert set(ranklens.analyzers.tomography.__all__) == {
        "CongestionDetection",
        "GroupTestingDetector",
        "Link",
        "LinkDetection",
        "LinkDetector",
        "LinkReport",
        "node_key",
        "value_codes",
    }
    assert set(ranklens.analyzers.correlate.__all__) == {
        "RelatedEvent",
        "correlate_findings",
        "gpu_event_severity",
        "related_events",
    }
    assert {"run_probe", "plan_probe", "attach_probe", "ProbeReport"} <= set(ranklens.analyzers.probe.__all__)
    assert {"NetBed", "unavailable_reason"} <= set(ranklens.analyzers.netbed.__all__)
    for mod in (
        ranklens.analyzers.links,
        ranklens.analyzers.tomography,
        ranklens.analyzers.correlate,
        ranklens.analyzers.probe,
        ranklens.analyzers.netbed,
    ):
        for name in mod.__all__:
            assert getattr(mod, name).__doc__ or not callable(getattr(mod, name)), f"{mod.__name__}.{name}"


@pytest.mark.e2e  # `ranklens probe` runs its gloo processes over loopback
def test_probe_cli_plans_from_a_stored_finding_runs_and_attaches(tmp_path):
    import json

    from click.testing import CliRunner

    from ranklens.analyzers.findings import load_finding, save_findings
    from ranklens.cli import cli
    from ranklens.store import open_store

    url = f"embedded://{tmp_path / 'store'}"
    store = open_store(url)
    store.write("ranks", [{"job_id": "j", "rank": r, "host": f"node{r // 2}", "world_size": 8} for r in range(8)])
    f = _finding("node", ["node3"])
    save_findings(store, [f])
    runner = CliRunner()
    r = runner.invoke(cli, ["probe", "--store", url, "--finding", f.id[:6], "--bytes", "1MiB", "--iters", "2",
                            "--attach", "--json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    pairs = sorted({(x["src"], x["dst"], x["role"]) for x in report["results"]})
    assert pairs == [("node0", "node3", "suspect"), ("node1", "node2", "reference"),
                     ("node2", "node1", "reference"), ("node3", "node0", "suspect")]  # fmt: skip
    assert all(x["bandwidth_MBps"] > 1 for x in report["results"])
    # the stored finding carries the very report printed, and its verdict (all four "nodes" are
    # this machine, so the verdict is loopback noise: mostly "not confirmed", now and then not)
    got = load_finding(store, f.id)
    assert got is not None and got.evidence["probe"] == report
    if report["confirmed"]:
        assert "probe confirmed" in got.title and got.confidence == pytest.approx(0.95)
    else:
        assert "probe did not confirm" in got.title and got.confidence == pytest.approx(0.4)
    assert got.evidence["nodes"] == ["node3"]  # the original evidence is kept


@pytest.mark.e2e
def test_probe_cli_pairs_and_errors(tmp_path):
    import json

    from click.testing import CliRunner

    from ranklens.cli import cli

    runner = CliRunner()
    r = runner.invoke(
        cli, ["probe", "--pair", "a:b", "--reference", "c:d", "--bytes", "1MiB", "--iters", "2", "--json"]
    )
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.stdout)["results"]) == 4
    url = f"embedded://{tmp_path / 'store'}"
    for args, code, needle in [
        ([], 2, "give --finding ID or at least one --pair"),
        (["--pair", "a-b"], 2, "a pair is NODE_A:NODE_B"),
        (["--pair", "a:a"], 2, "two different nodes"),
        (["--pair", "a:b", "--launcher", "rsh"], 2, "template with {node}"),
        (["--pair", "a:b", "--attach"], 2, "--attach needs --finding"),
        (["--store", url, "--finding", "nope"], 4, "no ranklens store"),
    ]:
        r = runner.invoke(cli, ["probe", *args])
        assert r.exit_code == code and needle in r.output, (args, r.exit_code, r.output)
    from ranklens.store import open_store

    open_store(url)
    r = runner.invoke(cli, ["probe", "--store", url, "--finding", "nope"])
    assert r.exit_code == 8 and "no finding 'nope'" in r.output


def test_findings_round_trip_through_the_store_with_their_links(embedded_store):
    from ranklens.analyzers.findings import load_finding, save_findings

    f = _finding("node", ["node3"])
    f = Finding(**{**f.__dict__, "suspects": (Suspect(rank=6, node="node3", link=("node3", "network")),
                                             Suspect(rank=7, node="node3", link=("node3", "network")))})  # fmt: skip
    save_findings(embedded_store, [f])
    assert embedded_store.query("SELECT suspect_links FROM findings").rows() == [(["node3<->network"],)]
    got = load_finding(embedded_store, f.id)
    assert got is not None and [(s.rank, s.node, s.link) for s in got.suspects] == [
        (6, "node3", ("node3", "network")),
        (7, "node3", ("node3", "network")),
    ]
    assert (got.kind, got.severity, got.confidence, got.evidence) == (f.kind, f.severity, f.confidence, f.evidence)


@pytest.mark.e2e
def test_probe_across_hosts_each_with_its_own_network_and_tmp(tmp_path):
    """issue 22 #11: with a remote launcher (ssh, srun) each worker is on another host, with its own
    /tmp and its own ports. Here every node is a network namespace of a real bed and the launcher
    template also hides the caller's TMPDIR from each worker (a private, empty tmpfs): the plan
    must reach the workers inline, the results come back over their stdout, and the rendezvous
    port is bound on the first node (the caller's ports mean nothing there). Before, the workers failed with
    ``FileNotFoundError: .../plan.json``."""
    import json
    import subprocess
    import sys
    import uuid

    from ranklens.analyzers.netbed import unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    import os
    import shutil
    import tempfile

    # The caller's temporary directory (TMPDIR) is hidden from every worker by a private, empty
    # tmpfs mounted over it, as another host's /tmp would be. Not /tmp itself: the interpreter
    # (a checkout's .venv) may live under /tmp, and a worker must still be able to start it.
    caller_tmp = tempfile.mkdtemp(prefix="ranklens-probe-caller-", dir="/var/tmp")
    bed = NetBed(3, prefix=f"rlp{uuid.uuid4().hex[:5]}", subnet="10.79.0").up()
    try:
        template = (
            f"ip netns exec {bed.prefix}-{{node}} env GLOO_SOCKET_IFNAME=veth0 "
            "unshare --mount --propagation private "
            f'sh -c \'mount -t tmpfs ranklens-probe-tmp {caller_tmp} && test -z "$(ls -A {caller_tmp})" '
            '&& exec "$@"\' {node}'
        )
        addresses = [f"--address=n{k}={bed.address(k)}" for k in range(3)]
        r = subprocess.run(
            [sys.executable, "-m", "ranklens.cli", "probe", "--pair", "n0:n1", "--reference", "n1:n2",
             *addresses, "--launcher", template, "--bytes", "1MiB", "--iters", "2", "--timeout", "150", "--json"],
            capture_output=True, text=True, timeout=200, cwd=tmp_path, env={**os.environ, "TMPDIR": caller_tmp},
        )  # fmt: skip
    finally:
        bed.down()
        shutil.rmtree(caller_tmp, ignore_errors=True)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert sorted((x["src"], x["dst"], x["role"]) for x in report["results"]) == [
        ("n0", "n1", "suspect"),
        ("n1", "n0", "suspect"),
        ("n1", "n2", "reference"),
        ("n2", "n1", "reference"),
    ]
    assert all(x["bandwidth_MBps"] > 1 and len(x["iter_seconds"]) == 2 for x in report["results"])
