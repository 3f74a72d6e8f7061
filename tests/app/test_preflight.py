"""``ranklens preflight`` as a user runs it: the console command on this machine, bad input, an
unreachable node, GPU faults through the shipped fake NVML, the store, and (on the network-namespace
bed) a throttled node named by the cross-node check."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

RANKLENS = str(Path(sys.executable).with_name("ranklens"))


def _run(
    args: list[str], *, env: dict[str, str] | None = None, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k not in ("RANKLENS_STORE", "RANKLENS_FAKE_NVML")}
    return subprocess.run(
        [RANKLENS, "preflight", *args], capture_output=True, text=True, env={**full, **(env or {})}, timeout=timeout
    )


def _json(r: subprocess.CompletedProcess[str]) -> dict:
    assert r.stdout.strip(), r.stderr
    return json.loads(r.stdout)


def _results(doc: dict, node: str | None = None) -> list[dict]:
    return [x for n in doc["nodes"] if node in (None, n["node"]) for x in n["results"]]


def _by_check(doc: dict, check: str) -> list[dict]:
    return [x for x in _results(doc) if x["check"] == check]


@pytest.mark.e2e
def test_this_machine_runs_every_group_and_skips_the_gpu_checks_without_a_gpu(tmp_path):
    r = _run(["--json", "--checkpoint-path", str(tmp_path), "--burn", "0.2"])
    doc = _json(r)
    assert r.returncode == doc["exit_code"] and r.returncode in (0, 10, 11), r.stderr
    assert len(doc["nodes"]) == 1
    checks = {x["check"] for x in _results(doc)}
    assert len(checks) >= 25
    groups = {c.partition(".")[0] for c in checks}
    assert {"host", "storage", "env", "software", "gpu", "fleet", "net"} <= groups
    ran = [x for x in _results(doc) if x["status"] != "skip"]
    assert len({x["check"] for x in ran}) >= 20, [x["check"] for x in ran]
    gpu = _by_check(doc, "gpu.count") + _by_check(doc, "gpu.ecc_uncorrected")
    assert gpu and all(x["status"] == "skip" and "no GPU" in x["message"] for x in gpu)
    ar = _by_check(doc, "net.allreduce")
    assert ar and ar[0]["status"] == "pass", ar
    write = _by_check(doc, "storage.checkpoint_write")[0]
    assert write["status"] in ("pass", "warn") and write["value"] > 0
    # every warn or fail says what to do
    assert all(x["fix"] for x in _results(doc) if x["status"] in ("warn", "fail"))
    # the table a person reads
    t = _run(["--checks", "host.cpus,host.memory,software.python"])
    assert t.returncode in (0, 10, 11)
    assert "host.cpus" in t.stdout and "node " in t.stdout and "3 checks" in t.stdout


def test_bad_input_is_a_clear_error_and_the_other_checks_still_run(tmp_path):
    r = _run(["--checks", "host.cpus,gpu.eccc"])
    assert r.returncode == 2 and "gpu.eccc" in r.stderr and "--list" in r.stderr
    r = _run(["--nodes", str(tmp_path / "missing.txt")])
    assert r.returncode == 2 and "no such file" in r.stderr
    missing = tmp_path / "nope" / "ckpt"
    r = _run(["--json", "--checks", "storage,host.cpus,software.python", "--checkpoint-path", str(missing)])
    doc = _json(r)
    assert r.returncode == 11
    cp = _by_check(doc, "storage.checkpoint_path")[0]
    assert cp["status"] == "fail" and str(missing) in cp["message"] and cp["fix"]
    assert _by_check(doc, "host.cpus")[0]["status"] in ("pass", "warn")
    assert _by_check(doc, "software.python")[0]["status"] == "pass"
    lst = _run(["--list"])
    assert lst.returncode == 0 and "gpu.xid" in lst.stdout and "net.pair_bandwidth" in lst.stdout


def _launcher(tmp_path: Path) -> str:
    """A launcher like ssh: runs the command 'on' the node, and cannot reach the node ``ghost``."""
    script = tmp_path / "fake-ssh"
    script.write_text(
        "#!/bin/sh\nnode=$1; shift\n"
        'if [ "$node" = ghost ]; then echo "ssh: connect to host ghost port 22: No route to host" >&2; exit 255; fi\n'
        'exec "$@"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return f"{script} {{node}}"


@pytest.mark.e2e
def test_an_unreachable_node_fails_and_lands_on_the_blacklist_while_the_others_are_checked(tmp_path):
    bl, bl_json = tmp_path / "bad.txt", tmp_path / "bad.json"
    args = ["--nodes", "a,ghost,b", "--launcher", _launcher(tmp_path), "--checks", "host.cpus,software,net"]
    args += ["--address", "a=127.0.0.1", "--address", "b=127.0.0.1"]  # what the other nodes dial
    r = _run([*args, "--json", "--blacklist", str(bl), "--bytes", "1MiB", "--iters", "2"])
    doc = _json(r)
    assert r.returncode == 11, r.stderr
    verdict = {n["node"]: n["verdict"] for n in doc["nodes"]}
    assert verdict["ghost"] == "fail" and verdict["a"] != "fail" and verdict["b"] != "fail"
    ghost = _results(doc, "ghost")
    assert [x["check"] for x in ghost] == ["net.reachable"] and "No route to host" in ghost[0]["message"]
    assert bl.read_text() == "ghost\n"
    # the two reachable nodes still ran their checks and the probe between them
    assert {x["status"] for x in _results(doc, "a") if x["check"] == "software.python"} == {"pass"}
    assert [x["status"] for x in _results(doc, "b") if x["check"] == "net.allreduce"] == ["pass"]
    r = _run([*args, "--blacklist", str(bl_json), "--bytes", "1MiB", "--iters", "2"])
    assert r.returncode == 11 and "node ghost: FAIL" in r.stdout
    got = json.loads(bl_json.read_text())
    assert got["nodes"] == ["ghost"] and "unreachable" in got["reasons"]["ghost"][0]


@pytest.mark.e2e
def test_a_launcher_that_lingers_after_the_report_does_not_lose_it_or_hold_the_run(tmp_path):
    import time

    script = tmp_path / "sticky-ssh"  # an ssh whose session stays open after the remote command ended
    script.write_text('#!/bin/sh\nnode=$1; shift\n"$@"\nexec sleep 60\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    t0 = time.monotonic()
    r = _run(
        ["--nodes", "n1", "--launcher", f"{script} {{node}}", "--checks", "host.cpus", "--json", "--timeout", "50"]
    )
    took = time.monotonic() - t0
    doc = _json(r)
    assert [(x["check"], x["status"]) for x in _results(doc, "n1")] == [("host.cpus", "pass")], doc
    assert took < 40, took  # the report's 5 s grace, not the 50 s timeout or the launcher's 60 s


def _spec(tmp_path: Path, gpus: list[dict], xids: list[list[int]] | None = None) -> str:
    p = tmp_path / "gpus.json"
    p.write_text(json.dumps({"gpus": gpus, "xids": xids or []}))
    return str(p)


def test_gpu_faults_through_the_fake_nvml_fail_the_right_checks_and_are_stored(tmp_path):
    healthy = {"uuid": "GPU-0"}
    spec = _spec(
        tmp_path,
        [
            healthy,
            {"uuid": "GPU-1", "ecc_aggregate": {"0": 0, "1": 3}},
            {"uuid": "GPU-2", "throttle_reasons": 0x8},  # HW slowdown
            {"uuid": "GPU-3"},
        ],
        xids=[[3, 79]],
    )
    store = f"embedded://{tmp_path / 'store'}"
    r = _run(
        ["--json", "--checks", "gpu", "--gpus", "4", "--store", store, "--job-id", "j1"],
        env={"RANKLENS_FAKE_NVML": spec},
    )
    doc = _json(r)
    assert r.returncode == 11, r.stderr
    failed = {(x["check"], x["subject"]) for x in _results(doc) if x["status"] == "fail"}
    assert ("gpu.ecc_uncorrected", "gpu1") in failed
    assert ("gpu.throttle", "gpu2") in failed
    assert any(c == "gpu.xid" for c, _ in failed)
    xid = [x for x in _by_check(doc, "gpu.xid") if x["status"] == "fail"]
    assert "79" in xid[0]["message"]
    # only the faulty GPUs fail
    assert not {s for c, s in failed if c in ("gpu.ecc_uncorrected", "gpu.throttle")} & {"gpu0"}
    node = doc["nodes"][0]["node"]
    q = subprocess.run(
        [RANKLENS, "sql", "--store", store, "--json",
         f"SELECT check_name, subject, status, verdict FROM preflight "
         f"WHERE run_id = '{doc['run_id']}' AND status = 'fail'"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert q.returncode == 0, q.stderr
    rows = json.loads(q.stdout)
    assert {(x["check_name"], x["subject"]) for x in rows} == failed and {x["verdict"] for x in rows} == {"fail"}
    f = subprocess.run(
        [RANKLENS, "sql", "--store", store, "--json", "SELECT kind, suspect_hosts, job_id FROM findings"],
        capture_output=True, text=True,
    )  # fmt: skip
    found = json.loads(f.stdout)
    assert [(x["kind"], x["suspect_hosts"], x["job_id"]) for x in found] == [("preflight_failed", [node], "j1")]
    # a healthy fake: the same checks pass (skip where the fake has nothing, e.g. no NVLink)
    ok = _run(
        ["--json", "--checks", "gpu", "--gpus", "2"],
        env={"RANKLENS_FAKE_NVML": _spec(tmp_path, [healthy, {"uuid": "GPU-1"}])},
    )
    statuses = {x["check"]: x["status"] for x in _results(_json(ok)) if x["status"] not in ("pass", "skip")}
    assert statuses == {}, statuses


def test_a_store_that_is_down_fails_before_the_checks(tmp_path):
    r = _run(["--store", "clickhouse://default@127.0.0.1:1", "--checks", "host.cpus"], timeout=120)
    assert r.returncode == 4 and "127.0.0.1:1" in r.stderr


@pytest.mark.e2e
def test_on_the_netbed_the_cross_node_check_names_the_throttled_node(tmp_path):
    from ranklens.analyzers.netbed import NetBed, unavailable_reason

    why = unavailable_reason()
    if why:
        pytest.skip(why)
    bed = NetBed(4, prefix=f"rlp{uuid.uuid4().hex[:5]}", subnet="10.79.0")
    with bed:
        bed.throttle(2, "40mbit")
        nodes = [bed.namespace(k) for k in range(4)]
        args = ["--nodes", ",".join(nodes), "--launcher", "ip netns exec {node} env GLOO_SOCKET_IFNAME=veth0"]
        for k, n in enumerate(nodes):
            args += ["--address", f"{n}={bed.address(k)}"]
        r = _run([*args, "--checks", "net,software.python", "--bytes", "1MiB", "--iters", "3", "--json"])
    doc = _json(r)
    assert r.returncode == 11, r.stdout + r.stderr
    pb = {x["node"]: x for x in _by_check(doc, "net.pair_bandwidth")}
    assert pb[nodes[2]]["status"] == "fail" and "culprit" in pb[nodes[2]]["message"], pb
    assert all(pb[n]["status"] != "fail" for n in nodes if n != nodes[2]), pb
    assert doc["blacklist"] == [nodes[2]]
    assert all(x["status"] == "pass" for x in _by_check(doc, "net.allreduce"))


def test_run_with_preflight_does_not_start_the_command_on_a_failed_node(tmp_path):
    marker = tmp_path / "started"
    cmd = [sys.executable, "-c", f"open({str(marker)!r}, 'w').write('x')"]
    base = [RANKLENS, "run", "--no-collect", "--spool", str(tmp_path / "spool"), "--preflight"]
    env = {k: v for k, v in os.environ.items() if k != "RANKLENS_STORE"}
    bad = subprocess.run(
        [*base, "--preflight-checks", "storage.checkpoint_path,host.cpus", "--", *cmd],
        capture_output=True, text=True, timeout=120, env={**env, "RANKLENS_CHECKPOINT_PATH": str(tmp_path / "nope")},
    )  # fmt: skip
    assert bad.returncode == 11 and not marker.exists(), bad.stderr
    assert "pre-flight FAILED" in bad.stderr and "does not exist" in bad.stderr
    good = subprocess.run(
        [*base, "--preflight-checks", "storage.checkpoint_path,host.cpus", "--", *cmd],
        capture_output=True, text=True, timeout=120, env={**env, "RANKLENS_CHECKPOINT_PATH": str(tmp_path)},
    )  # fmt: skip
    assert good.returncode == 0 and marker.exists(), good.stderr
    assert "pre-flight" in good.stderr


def test_the_results_are_prometheus_metrics_for_the_textfile_collector(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    prom = tmp_path / "preflight.prom"
    spec = _spec(tmp_path, [{"uuid": "GPU-0"}, {"uuid": "GPU-1", "temp_c": 99}])
    r = _run(
        ["--checks", "gpu,host.cpus", "--metrics-file", str(prom)],
        env={"RANKLENS_FAKE_NVML": spec, "RANKLENS_HOST": "n7"},
    )
    assert r.returncode == 11, r.stderr
    fams = {f.name: f for f in text_string_to_metric_families(prom.read_text())}
    (verdict,) = fams["ranklens_preflight_node_verdict"].samples
    assert verdict.labels == {"node": "n7"} and verdict.value == 2
    status = {
        (s.labels["check"], s.labels["subject"]): s.value for s in fams["ranklens_preflight_check_status"].samples
    }
    assert status[("gpu.temperature", "gpu1")] == 2 and status[("gpu.temperature", "gpu0")] == 0
    assert status[("gpu.compute_burn", "")] == -1  # no CUDA: skip, never a pass
    temps = {
        s.labels["subject"]: s.value
        for s in fams["ranklens_preflight_value"].samples
        if s.labels["check"] == "gpu.temperature"
    }
    assert temps == {"gpu0": 35.0, "gpu1": 99.0}
    assert fams["ranklens_preflight_last_run_timestamp_seconds"].samples[0].value > 1.7e9
