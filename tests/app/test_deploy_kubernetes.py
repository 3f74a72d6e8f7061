"""The Kubernetes manifests of the collector: what a cluster would run is what ranklens accepts."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from ranklens.collector.agent import load_config

K8S = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"


def _docs() -> dict[str, dict]:
    out = {}
    for name in yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]:
        for doc in yaml.safe_load_all((K8S / name).read_text()):
            out[doc["kind"]] = doc
    return out


def test_collector_daemonset_runs_unprivileged_with_a_valid_config(tmp_path):
    docs = _docs()
    assert set(docs) == {"Namespace", "ConfigMap", "DaemonSet"}
    ds = docs["DaemonSet"]["spec"]["template"]
    pod, (c,) = ds["spec"], ds["spec"]["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"] and sc["capabilities"]["drop"] == ["ALL"]
    assert "privileged" not in sc
    # the config the pod mounts is one `ranklens collector` accepts (the loader validates every key)
    toml_text = docs["ConfigMap"]["data"]["collector.toml"]
    cfg_path = tmp_path / "collector.toml"
    cfg_path.write_text(toml_text)
    cfg = load_config(cfg_path)
    args = c["args"]
    assert args[0] == "collector" and args[args.index("--config") + 1] == "/etc/ranklens/collector.toml"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["config"] == "/etc/ranklens"
    # the spool is the node's (hostPath) and writable; so is the collector's state under it
    spool = next(v for v in pod["volumes"] if v["name"] == "spool")
    assert "hostPath" in spool and mounts["spool"] == cfg.spool_dir
    assert all(m.get("readOnly") is not True for m in c["volumeMounts"] if m["name"] == "spool")
    # logs followed by the config are mounted
    assert all(src.glob.startswith(mounts["training-logs"]) for src in cfg.logs)
    # metrics: the port the config serves is the one declared and scraped
    assert (
        cfg.metrics_port == c["ports"][0]["containerPort"] == int(ds["metadata"]["annotations"]["prometheus.io/port"])
    )
    # SIGTERM flushes within shutdown_timeout_s, before Kubernetes kills the pod
    assert pod["terminationGracePeriodSeconds"] > cfg.shutdown_timeout_s
    # state survives pod restarts: the node's name, not the pod's
    env = {e["name"]: e for e in c["env"]}
    assert env["RANKLENS_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["RANKLENS_STORE"]["valueFrom"]["secretKeyRef"]["name"] == "ranklens-store"
    assert pod["hostPID"] is True  # liveness of the ranks' processes


def test_kustomization_renders_with_kubectl_when_installed():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (the manifests' content is checked by the test above)")
    r = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    kinds = [d["kind"] for d in yaml.safe_load_all(r.stdout)]
    assert sorted(kinds) == ["ConfigMap", "DaemonSet", "Namespace"]
