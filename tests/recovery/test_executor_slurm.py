"""The Slurm executor against a real Slurm (Debian's slurm-wlm + munge, started by scripts/slurm.sh
for this module): a finding about a node drains it (``sinfo``) and requeues the job, once, with the
policy's guards (dry run by default, idempotency, cool-down); failures are ``actions`` rows."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ranklens.analyzers.findings import Suspect
from ranklens.analyzers.recovery import RecoveryEngine
from ranklens.analyzers.recovery.api import Decision, Level, PolicyError
from ranklens.analyzers.recovery.executors import ExecContext, ExecutorSpec, build_executor
from ranklens.analyzers.recovery.executors.slurm import add_to_blacklist
from ranklens.analyzers.recovery.policy import parse_policy
from ranklens.config import slurm_job_name, slurm_job_of
from tests.recovery_helpers import finding

ROOT = Path(__file__).resolve().parents[2]
NODE = socket.gethostname().split(".", 1)[0]
TOOLS = ("munged", "slurmctld", "slurmd", "scontrol", "sinfo", "sbatch", "squeue")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A one-node Slurm for this module; SLURM_CONF points the clients (and the executor) at it."""
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("a real Slurm needs root (slurmd starts jobs as their users)")
    d = tmp_path_factory.mktemp("slurm")
    p = subprocess.run([str(ROOT / "scripts/slurm.sh"), "start", str(d)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(d / "slurm.conf")
    try:
        yield d
    finally:
        subprocess.run([str(ROOT / "scripts/slurm.sh"), "stop", str(d)], capture_output=True, timeout=60)
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=30).stdout.strip()


def _node() -> tuple[str, str]:
    """(state, reason) of this node as sinfo shows it."""
    out = _run("sinfo", "-h", "-n", NODE, "-o", "%T|%E")
    state, _, reason = out.partition("|")
    return state, reason


def _wait(pred, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _job(field: str, job: str) -> str:
    out = _run("scontrol", "show", "job", job, "--oneliner")
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)[field]


@pytest.fixture
def running_job(slurm):
    """A requeueable batch job running on the node; the node is idle again and every job gone after."""
    out = _run("sbatch", "--requeue", "--parsable", "-o", "/dev/null", "--wrap", "sleep 600")
    job = out.split(";")[0]
    _wait(lambda: _job("JobState", job) == "RUNNING", f"job {job} to run")
    yield job
    subprocess.run(["scancel", job], capture_output=True, timeout=30)
    subprocess.run(["scontrol", "update", f"nodename={NODE}", "state=resume"], capture_output=True, timeout=30)
    _wait(lambda: _node()[0].startswith("idle"), "the node to be idle again")


def _policy(tmp_path: Path, *, dry_run: bool | None = False, **executor: object):
    doc: dict[str, object] = {
        "guards": {"cooldown_s": 3600, "escalate_after": 0},
        "rule": [{"name": "bad-node", "kinds": ["gpu_error", "slow_link"], "level": "replace_node"}],
        "executor": [{"name": "slurm", "kind": "slurm", "levels": ["replace_node", "restart_job"], **executor}],
    }
    if dry_run is not None:
        doc["dry_run"] = dry_run
    return parse_policy(doc)


def _rows(store, finding_id: str) -> list[dict]:
    return store.query(
        f"SELECT target, outcome, detail FROM actions WHERE finding_id = '{finding_id}' ORDER BY ts_ns"
    ).to_pylist()


def test_a_node_finding_drains_the_node_and_requeues_the_job_once(slurm, running_job, embedded_store, tmp_path):
    blacklist = tmp_path / "blacklist.txt"
    policy = _policy(tmp_path, blacklist=str(blacklist))
    f = finding(job_id=f"slurm-{running_job}", kind="gpu_error", rank=3, node=NODE)
    ctx = ExecContext(store=embedded_store, host=NODE)
    with RecoveryEngine(policy, embedded_store, tmp_path / "outbox", context=ctx) as engine:
        report = engine.process([f])
    (name, fid, res) = report.executed[0]
    assert (name, fid, res.outcome) == ("slurm", f.id, "acknowledged"), res.detail
    state, reason = _node()
    assert state in ("draining", "drained"), state
    assert reason == f"ranklens gpu_error {f.id}"
    _wait(lambda: _job("Restarts", running_job) == "1", "the requeue")
    # its only node is drained: it waits for another (COMPLETING first while slurmd ends the old run)
    _wait(lambda: _job("JobState", running_job) == "PENDING", "the requeued job to be pending", timeout_s=60)
    assert blacklist.read_text() == f"{NODE}\n"
    rows = _rows(embedded_store, f.id)
    assert [(r["target"], r["outcome"]) for r in rows] == [
        ("node:" + NODE, "decided"),
        ("executor:slurm", "acknowledged"),
    ]
    detail = json.loads(rows[1]["detail"])
    assert detail["drained"] == [NODE] and detail["requeued"] is True and detail["job"] == running_job

    # once: the same finding again is already decided; a new finding about the node is in cool-down
    again = finding(job_id=f"slurm-{running_job}", kind="slow_link", rank=1, node=NODE)
    with RecoveryEngine(policy, embedded_store, tmp_path / "outbox", context=ctx) as engine:
        report = engine.process([f, again])
    assert report.already_decided == [f.id] and not report.executed
    assert [d.suppressed_by for d in report.decisions] == ["cooldown"]
    time.sleep(1)
    assert _job("Restarts", running_job) == "1"


def test_dry_run_is_the_default_and_changes_nothing(slurm, running_job, embedded_store, tmp_path):
    policy = _policy(tmp_path, dry_run=None)
    assert policy.dry_run
    f = finding(job_id=f"slurm-{running_job}", kind="gpu_error", rank=0, node=NODE)
    with RecoveryEngine(policy, embedded_store, tmp_path / "outbox", context=ExecContext(host=NODE)) as engine:
        report = engine.process([f])
    (_, _, res) = report.executed[0]
    assert res.outcome == "skipped"
    assert res.detail == (
        f"dry run: would drain {NODE} (reason 'ranklens gpu_error {f.id}'); requeue Slurm job {running_job}"
    )
    assert _node()[0].startswith("allocated"), _node()
    assert _job("Restarts", running_job) == "0" and _job("JobState", running_job) == "RUNNING"


def _decide(f, level: Level) -> Decision:
    return Decision(f, level, f"node:{NODE}", "r", "test", False, "k", time.time_ns())


def test_restart_job_requeues_and_restart_rank_is_not_slurms(slurm, running_job):
    ex = build_executor(ExecutorSpec("slurm", "slurm", options={"scontrol": "scontrol"}))
    f = finding(job_id=f"slurm-{running_job}-r0", kind="hang", rank=1, node=NODE)
    res = ex.execute(_decide(f, Level.RESTART_RANK), ExecContext())
    assert res.outcome == "skipped" and "torchrun executor" in res.detail
    res = ex.execute(_decide(f, Level.RESTART_JOB), ExecContext())
    assert res.outcome == "acknowledged" and res.detail == f"requeued Slurm job {running_job}", res.detail
    _wait(lambda: _job("Restarts", running_job) == "1", "the requeue")
    assert _node()[0] in ("idle", "allocated", "mixed", "completing")  # restart_job drains nothing
    # a finding of a job Slurm does not run is not guessed at
    res = ex.execute(_decide(finding(job_id="run-20261205-x", kind="hang"), Level.RESTART_JOB), ExecContext())
    assert res.outcome == "skipped" and "not a Slurm job" in res.detail


def test_failures_are_results_with_scontrols_message(slurm, running_job, embedded_store, tmp_path):
    # an unknown node: scontrol says so, the job is not requeued for a drain that did not happen
    ex = build_executor(ExecutorSpec("slurm", "slurm", options={}))
    f = finding(job_id=f"slurm-{running_job}", kind="gpu_error", rank=0, node="no-such-node")
    res = ex.execute(_decide(f, Level.REPLACE_NODE), ExecContext())
    assert res.outcome == "failed"
    assert "node no-such-node: scontrol show node no-such-node" in res.detail and "not found" in res.detail.lower()
    assert f"job {running_job} not requeued: no node was drained" in res.detail
    assert _job("Restarts", running_job) == "0"
    # a job that cannot be requeued (gone): scontrol's refusal is the row, the drain stays done
    gone = finding(job_id="slurm-999999", kind="gpu_error", rank=0, node=NODE)
    res = ex.execute(_decide(gone, Level.REPLACE_NODE), ExecContext())
    assert res.outcome == "failed" and res.data["drained"] == [NODE]
    assert "job 999999: scontrol requeue 999999 failed" in res.detail
    # no scontrol at all: a failed actions row through the engine, never an exception
    policy = _policy(tmp_path, scontrol="/nonexistent/scontrol")
    f2 = finding(job_id=f"slurm-{running_job}", kind="slow_link", rank=2, node=NODE)
    with RecoveryEngine(policy, embedded_store, tmp_path / "outbox", context=ExecContext(host=NODE)) as engine:
        report = engine.process([f2])
    (_, _, res) = report.executed[0]
    assert res.outcome == "failed" and "/nonexistent/scontrol not found" in res.detail
    assert [r["outcome"] for r in _rows(embedded_store, f2.id)] == ["decided", "failed"]


def test_nodes_come_from_the_ranks_table_when_the_finding_names_none(embedded_store):
    embedded_store.write(
        "ranks",
        [
            {"job_id": "slurm-7", "attempt": 0, "rank": r, "world_size": 4, "host": h}
            for r, h in enumerate(["a1.cluster.local", "a1.cluster.local", "a2.cluster.local", "a2.cluster.local"])
        ],
    )
    f = finding(job_id="slurm-7", kind="straggler", rank=2, node="")
    f = type(f)(**{**f.__dict__, "suspects": (Suspect(rank=2), Suspect(rank=3))})
    ex = build_executor(ExecutorSpec("slurm", "slurm", options={}))
    assert ex._nodes(_decide(f, Level.REPLACE_NODE), ExecContext(store=embedded_store)) == ["a2"]
    assert ex.describe(_decide(f, Level.REPLACE_NODE)).startswith("drain the suspect nodes")


def test_slurm_job_ids_round_trip():
    assert slurm_job_name({"SLURM_JOB_ID": "42"}) == "slurm-42"
    assert slurm_job_name({"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "0"}) == "slurm-42"
    assert slurm_job_name({"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "2"}) == "slurm-42-r2"
    assert slurm_job_name({}) is None
    assert [slurm_job_of(j) for j in ("slurm-42", "slurm-42-r2", "run-1", "slurm-x", "slurm-42-rx")] == [
        "42",
        "42",
        None,
        None,
        None,
    ]


def test_blacklist_files_merge_and_keep_their_format(tmp_path):
    plain = tmp_path / "bl.txt"
    plain.write_text("# from preflight\nn1\n")
    assert add_to_blacklist(str(plain), ["n2", "n1"], {}) == ["n1", "n2"]
    assert plain.read_text() == "n1\nn2\n"
    js = tmp_path / "bl.json"
    js.write_text(json.dumps({"nodes": ["n1"], "reasons": {"n1": "ecc"}}))
    add_to_blacklist(str(js), ["n3"], {"n3": "ranklens hang f1"})
    assert json.loads(js.read_text()) == {"nodes": ["n1", "n3"], "reasons": {"n1": "ecc", "n3": "ranklens hang f1"}}


def test_policy_options_are_checked(tmp_path):
    p = _policy(tmp_path, reason="{kind} on {job_id}", timeout_s=5, requeue=False)
    (spec,) = p.executors
    assert spec.options["reason"] == "{kind} on {job_id}" and spec.options["requeue"] is False
    for bad, says in [
        ({"reason": "{node}"}, "bad placeholder 'node'; allowed: {kind}, {finding_id}"),
        ({"timeout_s": 0}, "out of range"),
        ({"drain": "yes"}, "expected true or false"),
        ({"signal": "SIGKILL"}, "unknown key(s) ['signal']"),
    ]:
        with pytest.raises(PolicyError) as e:
            _policy(tmp_path, **bad)
        assert says in str(e.value) and "executor[0]" in str(e.value), str(e.value)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_sbatch_job_under_ranklens_run_recover_drains_its_node_when_a_rank_hangs(slurm, tmp_path):
    """The user's path: `sbatch` a script that runs `ranklens run --recover POLICY -- torchrun ...`
    (2 gloo ranks; rank 1 stops at step 6). The job is `slurm-<id>` without being told; the live
    hang finding drains the node (the policy's rule: hang -> replace_node) and requeues the job,
    which Slurm ends and keeps pending (its only node is drained); the rows are in the store. Once
    the node is back (here: resumed by hand, as an admin would after fixing it), the requeued run
    (`slurm-<id>-r1`) trains to the end from the checkpoint, and its `ranklens run` reports when
    training resumed after the requeue (MTTR across the two runs)."""
    policy = tmp_path / "policy.toml"
    text = (ROOT / "deploy/policies/slurm-drain.toml").read_text()
    assert "\ndry_run = true" in text  # the shipped policy is a dry run: this test makes it live
    text = text.replace("\ndry_run = true", "\ndry_run = false").replace(
        'kinds = ["hang", "crash"]\nmin_confidence = 0.8\nlevel = "restart_job"',
        'kinds = ["hang", "crash"]\nmin_confidence = 0.8\nlevel = "replace_node"',
    )
    policy.write_text(text)
    store = f"embedded://{tmp_path / 'store'}"
    script = tmp_path / "job.sh"
    python = sys.executable
    script.write_text(
        "#!/bin/bash\n"
        f"exec {python} -m ranklens.cli run --store {store} --spool {tmp_path / 'spool'} "
        f"--outbox {tmp_path / 'outbox'} --recover {policy} -- "
        f"{python} -m torch.distributed.run --standalone --nproc-per-node 2 {ROOT / 'tests/recover_hang_job.py'}\n"
    )
    script.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKLENS_")}
    env.update(HANG_RANK="1", HANG_STEP="6", CKPT=str(tmp_path / "ckpt.pt"), OMP_NUM_THREADS="1")
    out = subprocess.run(
        ["sbatch", "--requeue", "--parsable", "--open-mode=append", "-o", str(tmp_path / "out-%j.log"), str(script)],
        capture_output=True, text=True, check=True, env=env, timeout=30,
    ).stdout  # fmt: skip
    job = out.strip().split(";")[0]
    log = tmp_path / f"out-{job}.log"
    try:
        _wait(lambda: _job("Restarts", job) == "1", "the job to be requeued", timeout_s=240)
    except AssertionError:
        raise AssertionError(log.read_text()[-6000:] if log.exists() else "no job output") from None
    try:
        state, reason = _node()
        assert state in ("draining", "drained") and reason.startswith("ranklens hang "), (state, reason)
        _wait(lambda: _job("JobState", job) == "PENDING", "the requeued job to be pending", timeout_s=60)
        text = log.read_text()
        assert f"job slurm-{job}," in text  # ranklens run named the job after Slurm's id
        # Slurm's SIGTERM went to the job; ranklens run finished its last pass before it ended
        assert f"ranklens run: job slurm-{job} exited" in text
        assert f"executor slurm: acknowledged: drained {NODE} (reason '{reason}'); requeued Slurm job {job}" in text
        from ranklens.store import open_store

        rows = (
            open_store(store, create=False)
            .query(f"SELECT target, outcome, detail FROM actions WHERE job_id = 'slurm-{job}' ORDER BY ts_ns")
            .to_pylist()
        )
        assert [(r["target"], r["outcome"]) for r in rows] == [
            (f"node:{NODE}", "decided"),
            ("executor:slurm", "acknowledged"),
        ]
        assert json.loads(rows[1]["detail"])["requeued"] is True
        # the node is fixed: the requeued run starts, resumes from the checkpoint and ends
        subprocess.run(["scontrol", "update", f"nodename={NODE}", "state=resume"], check=True, timeout=30)
        subprocess.run(["scontrol", "update", f"jobid={job}", "starttime=now"], capture_output=True, timeout=30)
        try:
            _wait(lambda: _job("JobState", job) == "COMPLETED", "the requeued run to complete", timeout_s=240)
        except AssertionError:
            raise AssertionError(log.read_text()[-6000:] if log.exists() else "no job output") from None
        text = log.read_text()
        assert f"ranklens run: job slurm-{job}-r1 exited 0" in text, text[-3000:]
        assert f"training resumed (job slurm-{job}-r1's first step done)" in text, text[-3000:]
        resumed = (
            open_store(store, create=False)
            .query(f"SELECT detail FROM actions WHERE job_id = 'slurm-{job}' AND outcome = 'resumed'")
            .to_pylist()
        )
        assert len(resumed) == 1 and json.loads(resumed[0]["detail"])["resumed_job"] == f"slurm-{job}-r1"
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
        subprocess.run(["scontrol", "update", f"nodename={NODE}", "state=resume"], capture_output=True, timeout=30)
        _wait(lambda: _node()[0].startswith("idle"), "the node to be idle again")
