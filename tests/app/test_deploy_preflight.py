"""`ranklens preflight` in the schedulers: the Slurm prolog (deploy/slurm/preflight-prolog.sh), the
job script's cross-node step (train.sbatch, RANKLENS_PREFLIGHT=1) and the Kubernetes component
(deploy/kubernetes/components/preflight).

The scripts' exit-status mapping is run against a stand-in `ranklens` that exits with each code
the command documents (0 pass, 10 warnings, 11 a node failed, 2 bad usage, 4 store unavailable),
and once against the real one. The job script runs without Slurm as tests/app/test_deploy_slurm.py
runs it (SLURM_* by hand, `srun`/`scontrol` stand-ins). The component is rendered with
``kubectl kustomize`` into a training kustomization, validated strictly like every other manifest,
and its initContainer's own shell script is run with a stand-in `ranklens` on PATH.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from ranklens.store import open_store
from tests._sync import free_port
from tests.app.test_deploy_kubernetes import K8S, K8S_VERSIONS, _one, _render, _validate
from tests.app.test_deploy_slurm import FAKE_SCONTROL, FAKE_SRUN, RANKLENS, ROOT, SLURM

PROLOG = SLURM / "preflight-prolog.sh"
SBATCH = SLURM / "train.sbatch"
COMPONENT = K8S / "components" / "preflight"
NODE_CHECKS = "host,storage,env,software,gpu"
LAUNCHER = "srun --nodes=1 --ntasks=1 --overlap -w {node} --"

# A stand-in `ranklens` (a boundary fake of the command): records its argv and the store variables
# it was given (one JSON line per call in $FAKE_CALLS), prints a report shaped like
# `ranklens preflight --json`'s, writes --blacklist, and exits $FAKE_RC. $FAKE_STORE_RC: the exit
# status when given a store (--store or RANKLENS_STORE). `run ...` exits 0.
FAKE_RANKLENS = textwrap.dedent(
    """\
    #!{python}
    import json, os, sys, time
    argv = sys.argv[1:]
    with open(os.environ["FAKE_CALLS"], "a") as f:
        names = ("RANKLENS_STORE", "RANKLENS_STORE_PASSWORD", "RANKLENS_HOST", "LD_PRELOAD")
        env = {{k: os.environ.get(k) for k in names}}
        f.write(json.dumps({{"argv": argv, "env": env}}) + "\\n")
    if argv[:1] != ["preflight"]:
        sys.exit(0)
    if os.environ.get("FAKE_SLEEP"):
        time.sleep(float(os.environ["FAKE_SLEEP"]))
    stored = "--store" in argv or bool(os.environ.get("RANKLENS_STORE"))
    rc = int(os.environ["FAKE_STORE_RC"] if stored and os.environ.get("FAKE_STORE_RC") else os.environ["FAKE_RC"])
    if rc in (2, 4):
        print("Error: " + ("no such option" if rc == 2 else "store unavailable: connection refused"), file=sys.stderr)
        sys.exit(rc)
    verdict = {{0: "pass", 10: "warn", 11: "fail"}}.get(rc, "fail")
    reasons = {{"pass": [], "warn": ["host.load: load 3.1 per CPU"], "fail": ["gpu.ecc_uncorrected[GPU 3]: 2 errors"]}}
    node = {{"node": "node-a", "verdict": verdict, "reasons": reasons[verdict], "results": []}}
    if "--blacklist" in argv:
        with open(argv[argv.index("--blacklist") + 1], "w") as f:
            f.write("node-a\\n" if verdict == "fail" else "")
    doc = {{"run_id": "r1", "exit_code": rc, "counts": {{"pass": 30, "fail": int(rc == 11)}}, "nodes": [node]}}
    print(json.dumps(doc))
    sys.exit(rc)
    """
).format(python=sys.executable)

# logger(1) stand-in: one JSON line per call in $FAKE_LOG (tag, priority, message); exits $FAKE_LOGGER_RC
FAKE_LOGGER = textwrap.dedent(
    """\
    #!{python}
    import json, os, sys
    a = sys.argv[1:]
    msg = a[a.index("--") + 1 :]
    with open(os.environ["FAKE_LOG"], "a") as f:
        f.write(json.dumps({{"tag": a[a.index("-t") + 1], "prio": a[a.index("-p") + 1], "msg": " ".join(msg)}}) + "\\n")
    sys.exit(int(os.environ.get("FAKE_LOGGER_RC", "0")))
    """
).format(python=sys.executable)


def _exe(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANKLENS_", "SLURM_", "FAKE_"))}
    env.update(extra)
    return env


class Prolog:
    """The prolog as slurmd runs it (SLURM_JOB_ID set, an environment file), with the stand-ins."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.bin = tmp / "bin"
        self.bin.mkdir()
        self.ranklens = _exe(self.bin / "ranklens", FAKE_RANKLENS)
        _exe(self.bin / "logger", FAKE_LOGGER)
        self.calls, self.log = tmp / "calls.jsonl", tmp / "log.jsonl"
        self.env_file = tmp / "collector.env"
        self.checkpoints = tmp / "checkpoints"
        self.checkpoints.mkdir()

    def run(self, env_file: str | None = None, **env: str) -> subprocess.CompletedProcess:
        if env_file is not None:
            self.env_file.write_text(env_file)
        full = _clean_env(
            PATH=f"{self.bin}{os.pathsep}{os.environ['PATH']}",
            SLURM_JOB_ID="77",
            RANKLENS_ENV_FILE=str(self.env_file),
            RANKLENS_BIN=str(self.ranklens),
            FAKE_CALLS=str(self.calls),
            FAKE_LOG=str(self.log),
            FAKE_RC="0",
        )
        full.update(env)
        full = {k: v for k, v in full.items() if v != "<unset>"}
        return subprocess.run(["bash", str(PROLOG)], env=full, capture_output=True, text=True, timeout=120)

    def logged(self) -> list[dict[str, Any]]:
        entries = _lines(self.log)
        assert all(e["tag"] == "ranklens-preflight" for e in entries), entries
        return entries


@pytest.fixture
def prolog(tmp_path: Path) -> Prolog:
    return Prolog(tmp_path)


# --- the Slurm prolog ----------------------------------------------------------------------------


def test_the_scripts_are_valid_bash_and_pass_shellcheck():
    for script in (PROLOG, SBATCH):
        r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert r.returncode == 0, f"{script.name}: {r.stderr}"
    assert os.access(PROLOG, os.X_OK), "slurmd executes the prolog: it must be executable"
    shellcheck = shutil.which("shellcheck")
    if shellcheck is not None:  # not a skip: bash -n above is the check every machine runs
        for script, severity in ((PROLOG, "style"), (SBATCH, "warning")):  # train.sbatch: one old SC2016 info
            r = subprocess.run([shellcheck, f"--severity={severity}", str(script)], capture_output=True, text=True)
            assert r.returncode == 0, r.stdout


@pytest.mark.parametrize(
    ("ranklens_rc", "prolog_rc", "prio", "verdict"),
    [(0, 0, "user.info", "pass"), (10, 0, "user.warning", "warn"), (11, 1, "user.err", "fail")],
)
def test_the_prolog_maps_the_verdict_to_slurms_exit_status(prolog, ranklens_rc, prolog_rc, prio, verdict):
    env_file = (
        "# the collector's environment file, with what the prolog reads\n"
        "RANKLENS_STORE=clickhouse://ranklens@ch.example:9000/ranklens\n"
        "RANKLENS_STORE_PASSWORD='s3cret with spaces'\n"
        f'RANKLENS_CHECKPOINT_PATH="{prolog.checkpoints}"\n'
        "RANKLENS_PREFLIGHT_ARGS=--gpus 8\n"
    )
    r = prolog.run(env_file, FAKE_RC=str(ranklens_rc), SLURM_RESTART_COUNT="2")
    assert r.returncode == prolog_rc, r.stderr
    (call,) = _lines(prolog.calls)
    argv = call["argv"]
    assert argv[:4] == ["preflight", "--checks", NODE_CHECKS, "--json"]
    # the store, checkpoint path and job id (train.sbatch's RANKLENS_JOB_ID) from the file and Slurm
    assert argv[argv.index("--store") + 1] == "clickhouse://ranklens@ch.example:9000/ranklens"
    assert argv[argv.index("--checkpoint-path") + 1] == str(prolog.checkpoints)
    assert argv[argv.index("--job-id") + 1] == "slurm-77-r2"
    assert argv[argv.index("--gpus") + 1] == "8"
    assert call["env"]["RANKLENS_STORE_PASSWORD"] == "s3cret with spaces"  # quotes stripped, never on argv
    # one line to syslog, at the verdict's priority, naming the node, its verdict and reasons
    (entry,) = prolog.logged()
    assert entry["prio"] == prio and f"node node-a: verdict {verdict}" in entry["msg"], entry
    if verdict == "fail":
        assert "gpu.ecc_uncorrected[GPU 3]" in entry["msg"] and "drains" in entry["msg"]
    assert entry["msg"] in r.stderr  # and to stderr, for a person running it by hand


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize(
    ("case", "env", "why"),
    [
        ("usage error", {"FAKE_RC": "2"}, r"could not run \(exit 2: Error: no such option"),
        ("crash", {"FAKE_RC": "1"}, r"could not run \(exit 1"),
        ("no ranklens", {"RANKLENS_BIN": "/nonexistent/ranklens"}, r"ranklens not found \(RANKLENS_BIN=/nonexistent"),
        (
            "timeout",
            {"FAKE_SLEEP": "30", "RANKLENS_PREFLIGHT_TIMEOUT": "1"},
            r"more than RANKLENS_PREFLIGHT_TIMEOUT=1s",
        ),
        ("bad timeout", {"RANKLENS_PREFLIGHT_TIMEOUT": "2m"}, r"RANKLENS_PREFLIGHT_TIMEOUT=2m: expected whole seconds"),
    ],
)
def test_a_check_that_cannot_run_does_not_drain_the_node_unless_strict(prolog, strict, case, env, why):
    r = prolog.run("", **env, **({"RANKLENS_PREFLIGHT_STRICT": "1"} if strict else {}))
    assert r.returncode == (1 if strict else 0), f"{case}: {r.stderr}"
    (entry,) = prolog.logged()
    assert re.search(why, entry["msg"]), entry
    assert entry["prio"] == ("user.err" if strict else "user.warning")
    assert ("drains the node" if strict else "the node is not judged") in entry["msg"]


def test_an_unavailable_store_is_retried_without_it(prolog):
    # exit 4 with the store; without it, the node's own verdict (here: failed) stands
    r = prolog.run("RANKLENS_STORE=clickhouse://u@down.example:9000/db\n", FAKE_STORE_RC="4", FAKE_RC="11")
    assert r.returncode == 1, r.stderr
    first, second = _lines(prolog.calls)
    assert "--store" in first["argv"]
    assert "--store" not in second["argv"] and second["env"]["RANKLENS_STORE"] is None
    warning, verdict = prolog.logged()
    assert (
        warning["prio"] == "user.warning" and "store is unavailable (exit 4: Error: store unavailable" in warning["msg"]
    )
    assert verdict["prio"] == "user.err" and "verdict fail" in verdict["msg"]
    # down both times (exit 4 without a store too): a check that cannot run
    prolog.calls.unlink()
    prolog.log.unlink()
    assert prolog.run(FAKE_STORE_RC="4", FAKE_RC="4").returncode == 0
    assert len(_lines(prolog.calls)) == 2 and "the node is not judged" in prolog.logged()[-1]["msg"]


def test_the_environment_file_is_read_not_sourced_and_the_environment_wins(prolog):
    marker = prolog.tmp / "sourced"
    env_file = (
        "  # comment\n"
        "; another comment\n"
        f"RANKLENS_HOST=$(touch {marker})\n"
        "not a line\n"
        f"LD_PRELOAD={prolog.tmp}/evil.so\n"
        "RANKLENS_STORE=clickhouse://file@ch:9000/db\n"
    )
    r = prolog.run(env_file, RANKLENS_STORE="clickhouse://env@ch:9000/db")
    assert r.returncode == 0, r.stderr
    (call,) = _lines(prolog.calls)
    assert call["argv"][call["argv"].index("--store") + 1] == "clickhouse://env@ch:9000/db"
    assert call["env"]["RANKLENS_HOST"] == f"$(touch {marker})" and not marker.exists()
    assert call["env"]["LD_PRELOAD"] is None  # only RANKLENS_* names: the prolog runs as root
    # no file (a node without the collector): the defaults; no store, no checkpoint path
    prolog.calls.unlink()
    r = prolog.run(RANKLENS_ENV_FILE=str(prolog.tmp / "missing.env"), SLURM_JOB_ID="<unset>")
    assert r.returncode == 0, r.stderr
    (call,) = _lines(prolog.calls)
    assert call["argv"] == ["preflight", "--checks", NODE_CHECKS, "--json"]


def test_the_verdict_reaches_stderr_when_logger_fails(prolog):
    r = prolog.run("", FAKE_RC="11", FAKE_LOGGER_RC="1")
    assert r.returncode == 1
    assert "ranklens-preflight: node node-a: verdict fail" in r.stderr


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("gpus", ["this machine's", "a bad GPU"])
def test_the_prolog_with_the_real_ranklens_stores_and_logs_the_verdict(prolog, tmp_path, gpus):
    """The real `ranklens preflight` with an embedded store, on this machine as it is and with a
    GPU that had uncorrected ECC errors (NVML through the fake that ships with ranklens): the
    prolog's exit status follows the verdict it logged, and the results are in the store."""
    store = tmp_path / "store"
    env_file = f"RANKLENS_STORE=embedded://{store}\nRANKLENS_CHECKPOINT_PATH={prolog.checkpoints}\n"
    env = {"RANKLENS_BIN": RANKLENS, "RANKLENS_HOST": "node-under-test", "SLURM_JOB_ID": "9001"}
    if gpus == "a bad GPU":
        nvml = tmp_path / "nvml.json"
        nvml.write_text(json.dumps({"gpus": [{"uuid": "GPU-0"}, {"uuid": "GPU-1", "ecc_aggregate": {"0": 0, "1": 3}}]}))
        env["RANKLENS_FAKE_NVML"] = str(nvml)
    r = prolog.run(env_file, **env)
    (entry,) = prolog.logged()
    m = re.search(r"node node-under-test: verdict (pass|warn|fail)", entry["msg"])
    assert m, (entry, r.stderr[-3000:])
    assert r.returncode == (1 if m[1] == "fail" else 0), r.stderr[-3000:]
    assert entry["prio"] == {"pass": "user.info", "warn": "user.warning", "fail": "user.err"}[m[1]]
    if gpus == "a bad GPU":
        assert m[1] == "fail" and "gpu.ecc_uncorrected[gpu1]" in entry["msg"], entry
    rows = (
        open_store(f"embedded://{store}", create=False)
        .query(
            "SELECT check_name, status, verdict FROM preflight WHERE job_id = 'slurm-9001' AND host = 'node-under-test'"
        )
        .to_pylist()
    )
    checks = {row["check_name"] for row in rows}
    assert {"host.memory", "storage.checkpoint_write", "software.torch", "gpu.count"} <= checks, checks
    assert not any(c.startswith(("net.", "fleet.")) for c in checks)  # node-local only
    assert {row["verdict"] for row in rows} == {m[1]}
    assert any(row["check_name"] == "storage.checkpoint_write" and row["status"] != "skip" for row in rows)


# --- train.sbatch's cross-node step --------------------------------------------------------------


def _sbatch(tmp: Path, ranklens: str, srun: str = FAKE_SRUN, **extra: str) -> subprocess.CompletedProcess:
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    _exe(bin_dir / "srun", srun)
    _exe(bin_dir / "scontrol", FAKE_SCONTROL)
    (tmp / "train.py").write_text('print("training", flush=True)\n')
    (tmp / "logs").mkdir(exist_ok=True)
    env = _clean_env(
        PATH=os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]]),
        SLURM_JOB_ID="4242",
        SLURM_NNODES="1",
        SLURM_JOB_NODELIST="node-a,node-b",
        SLURM_SUBMIT_DIR=str(tmp),
        RANKLENS=ranklens,
        GPUS_PER_NODE="1",
        LOG_DIR=str(tmp / "logs"),
        RANKLENS_SPOOL=str(tmp / "spool"),
        RDZV_PORT=str(free_port()),
        OMP_NUM_THREADS="1",
        FAKE_CALLS=str(tmp / "calls.jsonl"),
        FAKE_RC="0",
    )
    env.update(extra)
    return subprocess.run(
        ["bash", str(SBATCH), str(tmp / "train.py"), "--lr", "0.1"],
        env=env,
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.parametrize(
    ("ranklens_rc", "strict", "job_rc", "trains"),
    [(0, False, 0, True), (10, False, 0, True), (11, False, 11, False), (2, False, 0, True), (2, True, 2, False)],
)
def test_the_job_scripts_preflight_step_stops_the_job_on_a_failed_node(tmp_path, ranklens_rc, strict, job_rc, trains):
    fake = _exe(tmp_path / "ranklens", FAKE_RANKLENS)
    r = _sbatch(
        tmp_path,
        str(fake),
        RANKLENS_PREFLIGHT="1",
        FAKE_RC=str(ranklens_rc),
        **({"RANKLENS_PREFLIGHT_STRICT": "1"} if strict else {}),
    )
    assert r.returncode == job_rc, r.stderr
    calls = _lines(tmp_path / "calls.jsonl")
    pre = calls[0]["argv"]
    blacklist = tmp_path / "preflight-blacklist-4242.txt"
    # every node of the allocation, each checked through srun, under the job's id
    assert pre[:3] == ["preflight", "--nodes", "node-a,node-b"]
    assert pre[pre.index("--launcher") + 1] == LAUNCHER
    assert pre[pre.index("--blacklist") + 1] == str(blacklist)
    assert pre[pre.index("--job-id") + 1] == "slurm-4242"
    assert [c["argv"][0] for c in calls[1:]] == (["run"] if trains else [])
    if ranklens_rc == 11:
        assert "node-a" in r.stderr and "sbatch --exclude=node-a " in r.stderr and "train.py --lr 0.1" in r.stderr
    if ranklens_rc == 2:
        assert "ranklens preflight could not run (exit 2)" in r.stderr


def test_the_job_script_runs_no_preflight_unless_asked(tmp_path):
    fake = _exe(tmp_path / "ranklens", FAKE_RANKLENS)
    r = _sbatch(tmp_path, str(fake))
    assert r.returncode == 0, r.stderr
    assert [c["argv"][0] for c in _lines(tmp_path / "calls.jsonl")] == ["run"]


# srun for one node: the job script's own step (--kill-on-bad-exit, --output) and the preflight
# launcher's (--nodes=1 --ntasks=1 --overlap -w NODE --), which it records in $SRUN_NODES
FAKE_SRUN_W = r"""#!/bin/bash
set -eu
out=
while [ $# -gt 0 ]; do
  case "$1" in
    --kill-on-bad-exit=* | --nodes=1 | --ntasks=1 | --overlap) shift ;;
    --output=*) out=${1#--output=}; shift ;;
    -w) echo "$2" >> "$SRUN_NODES"; shift 2 ;;
    --) shift; break ;;
    -*) echo "fake srun: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
[ -z "$out" ] && exec "$@"
out=${out//%j/$SLURM_JOB_ID}
out=${out//%N/$(hostname -s)}
exec "$@" > "$out" 2>&1
"""


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_the_job_scripts_preflight_step_with_the_real_ranklens(tmp_path):
    """The real cross-node check over the job's one node, through the srun launcher template."""
    nodes = tmp_path / "srun-nodes.txt"
    r = _sbatch(
        tmp_path,
        RANKLENS,
        srun=FAKE_SRUN_W,
        SLURM_JOB_NODELIST="localhost",
        RANKLENS_PREFLIGHT="1",
        RANKLENS_PREFLIGHT_ARGS="--burn 0.1",
        SRUN_NODES=str(nodes),
    )
    # the node's checks (and the link probe) ran through `srun ... -w localhost --`
    assert nodes.read_text().split() and set(nodes.read_text().split()) == {"localhost"}, r.stderr[-3000:]
    assert "net.allreduce" in r.stdout and "node localhost: " in r.stdout
    failed = (tmp_path / "preflight-blacklist-4242.txt").read_text().split()
    logs = list((tmp_path / "logs").glob("slurm-4242-*.log"))
    if failed:  # this machine failed a check: the job stops before training
        assert failed == ["localhost"] and r.returncode == 11 and not logs, r.stderr[-3000:]
        assert "node localhost: FAIL" in r.stdout
    else:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert "training" in logs[0].read_text()


# --- the Kubernetes component --------------------------------------------------------------------


def _training_kustomization(tmp: Path) -> Path:
    """A training job's kustomization like docs/preflight-deploy.md's: the example Job (labelled),
    an unlabelled Job, the component, and the training image set once with `images:`."""
    kdir = tmp / "my-training"
    kdir.mkdir()
    shutil.copy(K8S / "examples" / "training-job.yaml", kdir / "training-job.yaml")
    docs = [d for d in yaml.safe_load_all((K8S / "examples" / "training-job.yaml").read_text()) if d]
    other = next(d for d in docs if d["kind"] == "Job")
    other = json.loads(json.dumps(other))
    other["metadata"]["name"] = "unchecked"
    del other["metadata"]["labels"]
    (kdir / "unchecked-job.yaml").write_text(yaml.safe_dump(other))
    (kdir / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": ["training-job.yaml", "unchecked-job.yaml"],
                "components": [os.path.relpath(COMPONENT, kdir)],
                "images": [
                    {"name": "my-registry.example/train", "newName": "registry.example.com/train", "newTag": "1.0"}
                ],
            }
        )
    )
    return kdir


@pytest.fixture(scope="module")
def training_render(tmp_path_factory) -> list[dict[str, Any]]:
    return _render(_training_kustomization(tmp_path_factory.mktemp("k8s")))


def _init(docs: list[dict[str, Any]], job: str = "train-demo") -> tuple[dict[str, Any], dict[str, Any]]:
    spec = _one(docs, "Job", job)["spec"]["template"]["spec"]
    (init,) = [c for c in spec.get("initContainers", []) if c["name"] == "ranklens-preflight"]
    return spec, init


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_component_renders_into_a_training_kustomization_and_validates_strictly(training_render, version):
    for doc in training_render:
        _validate(doc, version)
    assert _render(K8S / "overlays" / "preflight") == _render(K8S / "base")  # the collector: unchanged


def test_the_init_container_checks_the_pods_node_with_the_training_image(training_render):
    spec, init = _init(training_render)
    (train,) = spec["containers"]
    # one `images:` entry sets both: the init container runs the training environment (torch)
    assert init["image"] == train["image"] == "registry.example.com/train:1.0"
    assert init["command"][:2] == ["sh", "-c"]
    script = init["command"][2]
    assert f"ranklens preflight --checks {NODE_CHECKS} --json" in script
    assert "[ $rc -eq 10 ] && exit 0" in script and script.rstrip().endswith("exit $rc")
    env = {e["name"]: e["valueFrom"] for e in init["env"]}
    assert env["RANKLENS_HOST"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    # the training container's job id, and the collector's store secret, optional here
    assert env["RANKLENS_JOB_ID"] == next(e["valueFrom"] for e in train["env"] if e["name"] == "RANKLENS_JOB_ID")
    collector = _one(_render(K8S / "base"), "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    for name in ("RANKLENS_STORE", "RANKLENS_STORE_PASSWORD"):
        ref = env[name]["secretKeyRef"]
        theirs = next(e["valueFrom"]["secretKeyRef"] for e in collector["env"] if e["name"] == name)
        assert (ref["name"], ref["key"]) == (theirs["name"], theirs["key"]) and ref["optional"] is True
    store_secret = yaml.safe_load((K8S / "store-secret.example.yaml").read_text())
    assert {env[n]["secretKeyRef"]["key"] for n in ("RANKLENS_STORE", "RANKLENS_STORE_PASSWORD")} == set(
        store_secret["stringData"]
    )
    # small, unprivileged, read-only root with a scratch /tmp; the training container's GPUs
    sc = init["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]} and not sc.get("privileged")
    (tmp_mount,) = [m for m in init["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert "emptyDir" in next(v for v in spec["volumes"] if v["name"] == tmp_mount["name"])
    limits = init["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == train["resources"]["limits"]["nvidia.com/gpu"]
    assert init["resources"]["requests"]["cpu"] == "1" and limits["memory"] == "8Gi"
    # a Job without the label is left as it is
    unchecked = _one(training_render, "Job", "unchecked")["spec"]["template"]["spec"]
    assert "initContainers" not in unchecked and len(unchecked["volumes"]) == 1


FAKE_RANKLENS_SH = """#!/bin/sh
echo "$*|${RANKLENS_STORE:-}" >> "$FAKE_CALLS"
if [ -n "${RANKLENS_STORE:-}" ] && [ -n "${FAKE_STORE_RC:-}" ]; then exit "$FAKE_STORE_RC"; fi
exit "$FAKE_RC"
"""


@pytest.mark.parametrize(
    ("ranklens_rc", "store_rc", "pod_rc", "calls"),
    [
        (0, None, 0, 1),
        (10, None, 0, 1),
        (11, None, 11, 1),
        (2, None, 2, 1),
        (10, 4, 0, 2),
        (11, 4, 11, 2),
        (4, 4, 4, 2),
    ],
)
def test_the_init_container_script_fails_the_pod_only_on_a_failed_node(
    training_render, tmp_path, ranklens_rc, store_rc, pod_rc, calls
):
    """The rendered container's own `sh -c` script, run by /bin/sh with a stand-in ranklens."""
    _, init = _init(training_render)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _exe(bin_dir / "ranklens", FAKE_RANKLENS_SH)
    log = tmp_path / "calls.txt"
    env = _clean_env(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        FAKE_CALLS=str(log),
        FAKE_RC=str(ranklens_rc),
        RANKLENS_JOB_ID="train-demo",
        RANKLENS_STORE="clickhouse://ranklens@ch:9000/ranklens",
        **({"FAKE_STORE_RC": str(store_rc)} if store_rc else {}),
    )
    r = subprocess.run(["/bin/sh", *init["command"][1:]], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == pod_rc, r.stderr
    lines = log.read_text().splitlines()
    assert len(lines) == calls
    assert (
        lines[0]
        == f"preflight --checks {NODE_CHECKS} --json --job-id train-demo|clickhouse://ranklens@ch:9000/ranklens"
    )
    if calls == 2:  # the store was down: once more, without it
        assert lines[1].endswith("|") and "store is unavailable" in r.stderr


def test_the_docs_kustomization_example_renders_and_validates(tmp_path):
    text = (ROOT / "docs" / "preflight-deploy.md").read_text()
    block = text.split("# my-training/kustomization.yaml, beside deploy/\n", 1)[1].split("```", 1)[0]
    kdir = tmp_path / "my-training"
    kdir.mkdir()
    (kdir / "kustomization.yaml").write_text(block.replace("../deploy/kubernetes", os.path.relpath(K8S, kdir)))
    shutil.copy(K8S / "examples" / "training-job.yaml", kdir / "training-job.yaml")
    docs = _render(kdir)
    for doc in docs:
        _validate(doc, K8S_VERSIONS[-1])
    spec, init = _init(docs)
    assert init["image"] == spec["containers"][0]["image"] == "registry.example.com/train:1.0"


def test_the_docs_show_what_the_scripts_do():
    """docs/preflight-deploy.md (linked from docs/preflight.md) names the exit mapping, the
    variables and the files as the scripts have them."""
    text = (ROOT / "docs" / "preflight-deploy.md").read_text()
    assert "Running it in the scheduler" in text
    shipped = "".join(p.read_text() for p in (PROLOG, SBATCH, COMPONENT / "kustomization.yaml"))
    shipped += (ROOT / "ranklens" / "config.py").read_text() + (
        ROOT / "collector" / "preflight" / "runner.py"
    ).read_text()
    for var in sorted(set(re.findall(r"RANKLENS_[A-Z_]*[A-Z]", text))):
        assert var in shipped, f"{var}: in the docs, not in the scripts"
    for needle in ("preflight-prolog.sh", "components/preflight", "ranklens.io/preflight", "PrologFlags=Alloc"):
        assert needle in text, needle
    assert "preflight-deploy.md" in (ROOT / "docs" / "preflight.md").read_text()
