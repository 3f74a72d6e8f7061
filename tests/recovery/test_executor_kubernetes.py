"""The Kubernetes executor (analyzers/recovery/executors/kubernetes.py) with the official client against
the fake API server shipped beside it (no API server can run here), the fake holding the RBAC rules
of deploy/kubernetes/components/recovery-rbac: the calls, their bodies and content types, what the
manifest allows, API errors as ``failed`` rows, and the engine's ``actions`` rows end to end."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

pytest.importorskip("kubernetes")

from ranklens.analyzers.recovery import RecoveryEngine
from ranklens.analyzers.recovery.api import Decision, Level, PolicyError
from ranklens.analyzers.recovery.executors import ExecContext, ExecutorSpec, build_executor
from ranklens.analyzers.recovery.executors.kubernetes import CORDON_ANNOTATION, INSTALL_HINT, KubernetesExecutor
from ranklens.analyzers.recovery.executors.kubernetes_fake import FakeKubeAPI, rbac_rules
from ranklens.analyzers.recovery.policy import load_policy, parse_policy
from tests.recovery_helpers import finding

ROOT = Path(__file__).resolve().parents[2]
RBAC = ROOT / "deploy/kubernetes/components/recovery-rbac/rbac.yaml"
POLICY = ROOT / "deploy/policies/kubernetes-replace-node.toml"
JOB_LABEL = "batch.kubernetes.io/job-name"
NS = "training"
USER = "system:serviceaccount:ranklens:ranklens-recovery"


def _manifest_rules() -> list[dict]:
    return rbac_rules(yaml.safe_load_all(RBAC.read_text()))


def _cluster(api: FakeKubeAPI) -> FakeKubeAPI:
    """Three GPU nodes; job ``train`` with a pod on gpu-1 and gpu-2, another job's pod on gpu-2."""
    for n in ("gpu-1", "gpu-2", "gpu-3"):
        api.add_node(n)
    api.add_pod(NS, "train-0-x7k2p", node="gpu-1", labels={JOB_LABEL: "train"}, hostname="train-0")
    api.add_pod(NS, "train-1-q9z4m", node="gpu-2", labels={JOB_LABEL: "train"}, hostname="train-1")
    api.add_pod(NS, "other-0-aaaaa", node="gpu-2", labels={JOB_LABEL: "other"}, owner=("Job", "other"))
    return api


@pytest.fixture
def api():
    with FakeKubeAPI(rules=_manifest_rules()) as fake:
        yield _cluster(fake)


def _executor(api: FakeKubeAPI, tmp_path: Path, **options: object) -> KubernetesExecutor:
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    opts = {"namespace": NS, "kubeconfig": str(kubeconfig), "request_timeout_s": 5.0, **options}
    ex = build_executor(ExecutorSpec("k8s", "kubernetes", levels=tuple(Level), options=opts))
    assert isinstance(ex, KubernetesExecutor)
    return ex


def _decision(level: Level, target: str, *, rank: int = 1, node: str = "gpu-2", kind: str = "crash") -> Decision:
    f = finding(job_id="train", kind=kind, rank=rank, node=node)
    return Decision(f, level, target, "crashes", "test", False, "k", time.time_ns())


def _calls(api: FakeKubeAPI) -> list[tuple[str, str, int]]:
    return [(r.verb, r.path, r.status) for r in api.requests]


def test_replace_node_cordons_the_node_and_evicts_the_jobs_pods_on_it(api, tmp_path):
    ex = _executor(api, tmp_path)
    d = _decision(Level.REPLACE_NODE, "node:gpu-2")
    res = ex.execute(d, ExecContext())
    assert res.outcome == "acknowledged", res.detail
    assert _calls(api) == [
        ("list", f"/api/v1/namespaces/{NS}/pods", 200),
        ("get", "/api/v1/nodes/gpu-2", 200),
        ("patch", "/api/v1/nodes/gpu-2", 200),
        ("create", f"/api/v1/namespaces/{NS}/pods/train-1-q9z4m/eviction", 201),
    ]
    listing, _get, patch, evict = api.requests
    assert listing.query == {"labelSelector": f"{JOB_LABEL}=train"}
    assert patch.content_type == "application/strategic-merge-patch+json"  # what kubectl cordon sends
    assert patch.body["spec"] == {"unschedulable": True}
    assert d.finding.id in patch.body["metadata"]["annotations"][CORDON_ANNOTATION]
    assert evict.body["apiVersion"] == "policy/v1" and evict.body["kind"] == "Eviction"
    assert evict.body["metadata"] == {"name": "train-1-q9z4m", "namespace": NS}
    assert evict.body["deleteOptions"]["preconditions"]["uid"] == api.pod(NS, "train-1-q9z4m")["metadata"]["uid"]
    assert all(r.user == USER for r in api.requests)
    # the cluster as a real one would be afterwards
    node = api.node("gpu-2")
    assert node["spec"]["unschedulable"] is True and api.node("gpu-1")["spec"] == {}
    assert api.pod(NS, "train-1-q9z4m")["metadata"]["deletionTimestamp"]  # terminating, 30 s grace
    assert "deletionTimestamp" not in api.pod(NS, "other-0-aaaaa")["metadata"]  # another job's pod stays
    assert "deletionTimestamp" not in api.pod(NS, "train-0-x7k2p")["metadata"]  # the job's pod elsewhere too
    assert res.data["cordoned"] == ["gpu-2"] and res.data["evicted"] == [f"{NS}/train-1-q9z4m"]
    assert "cordoned node gpu-2; evicted pod training/train-1-q9z4m (job train, on node gpu-2)" in res.detail
    # again: the node is already cordoned (left as it is), the pod already terminating
    n = len(api.requests)
    res = ex.execute(d, ExecContext())
    assert res.outcome == "skipped", res.detail
    assert "node gpu-2 was already cordoned" in res.detail and "is already terminating" in res.detail
    assert [r.verb for r in api.requests[n:]] == ["list", "get"]


def test_restart_rank_deletes_that_ranks_pod_found_from_its_heartbeat(api, tmp_path, embedded_store):
    # the rank's newest heartbeat says gpu-1; the finding's node is older news
    embedded_store.write(
        "heartbeats",
        [{"job_id": "train", "attempt": 0, "rank": 1, "ts_ns": time.time_ns(), "pid": 7, "host": "gpu-1"}],
    )
    ex = _executor(api, tmp_path, pod_action="delete", grace_period_s=5)
    res = ex.execute(_decision(Level.RESTART_RANK, "rank:1", node="gpu-2"), ExecContext(store=embedded_store))
    assert res.outcome == "acknowledged", res.detail
    assert _calls(api) == [
        ("list", f"/api/v1/namespaces/{NS}/pods", 200),
        ("delete", f"/api/v1/namespaces/{NS}/pods/train-0-x7k2p", 200),
    ]
    delete = api.requests[1]
    assert delete.body["gracePeriodSeconds"] == 5 and delete.body["preconditions"]["uid"]
    assert api.pod(NS, "train-0-x7k2p")["metadata"]["deletionGracePeriodSeconds"] == 5
    assert "deletionTimestamp" not in api.pod(NS, "train-1-q9z4m")["metadata"]
    assert not any(r.path.startswith("/api/v1/nodes") for r in api.requests)  # no cordon for a rank
    assert res.data["deleted"] == [f"{NS}/train-0-x7k2p"] and "deleted pod training/train-0-x7k2p (rank 1" in res.detail


def test_restart_rank_with_a_pods_host_name_and_pods_it_must_not_touch(api, tmp_path):
    ex = _executor(api, tmp_path)
    # RANKLENS_HOST unset in the pod: the host is the pod's host name (an Indexed Job's <job>-<index>)
    res = ex.execute(_decision(Level.RESTART_RANK, "rank:0", rank=0, node="train-0"), ExecContext())
    assert res.outcome == "acknowledged" and res.data["evicted"] == [f"{NS}/train-0-x7k2p"], res.detail
    # two pods of the job on one node: which holds rank 3 is not recorded
    api.add_pod(NS, "train-2-bbbbb", node="gpu-3", labels={JOB_LABEL: "train"})
    api.add_pod(NS, "train-3-ccccc", node="gpu-3", labels={JOB_LABEL: "train"})
    res = ex.execute(_decision(Level.RESTART_RANK, "rank:3", rank=3, node="gpu-3"), ExecContext())
    assert res.outcome == "skipped"
    assert "2 pods of job train run on node gpu-3 (train-2-bbbbb, train-3-ccccc)" in res.detail
    # a bare pod: nothing would recreate it
    api.add_pod(NS, "train-4-ddddd", node="gpu-1", labels={JOB_LABEL: "train"}, owner=None)
    api.finish_terminating()
    n = len(api.requests)
    res = ex.execute(_decision(Level.RESTART_RANK, "rank:4", rank=4, node="gpu-1"), ExecContext())
    assert res.outcome == "skipped" and "has no controller that would recreate it: left alone" in res.detail
    assert [r.verb for r in api.requests[n:]] == ["list"]


def test_restart_job_evicts_every_pod_of_the_job(api, tmp_path):
    res = _executor(api, tmp_path).execute(_decision(Level.RESTART_JOB, "job:train"), ExecContext())
    assert res.outcome == "acknowledged", res.detail
    assert sorted(res.data["evicted"]) == [f"{NS}/train-0-x7k2p", f"{NS}/train-1-q9z4m"]
    assert "deletionTimestamp" not in api.pod(NS, "other-0-aaaaa")["metadata"]


def test_the_manifest_grants_the_calls_the_executor_makes_and_no_other_write(api, tmp_path):
    """Every call of every level, with both pod actions, is allowed by rbac.yaml (none got a 403);
    what the manifest grants beyond them is read-only."""
    for options in ({}, {"pod_action": "delete"}):
        ex = _executor(api, tmp_path, **options)
        for d in (
            _decision(Level.REPLACE_NODE, "node:gpu-2"),
            _decision(Level.RESTART_RANK, "rank:0", rank=0, node="gpu-1"),
            _decision(Level.RESTART_JOB, "job:train"),
        ):
            assert ex.execute(d, ExecContext()).outcome in ("acknowledged", "skipped")
            api.finish_terminating()
            for p in ("train-0-x7k2p", "train-1-q9z4m"):  # the controller's new pods, same names
                if api.pod(NS, p) is None:
                    api.add_pod(NS, p, node="gpu-3", labels={JOB_LABEL: "train"})
    assert all(r.status < 400 for r in api.requests), [r for r in api.requests if r.status >= 400]
    used = {(r.verb, _resource(r.path)) for r in api.requests}
    assert used == {
        ("list", "pods"),
        ("get", "nodes"),
        ("patch", "nodes"),
        ("create", "pods/eviction"),
        ("delete", "pods"),
    }
    granted = {(v, res) for rule in _manifest_rules() for v in rule["verbs"] for res in rule["resources"]}
    assert used <= granted
    assert {v for v, _ in granted - used} <= {"get", "list"}


def _resource(path: str) -> str:
    if path.endswith("/eviction"):
        return "pods/eviction"
    return "nodes" if path.startswith("/api/v1/nodes") else "pods"


def test_a_role_without_patch_nodes_is_a_failed_result_with_the_403(tmp_path):
    rules = [dict(r, verbs=[v for v in r["verbs"] if v != "patch"]) for r in _manifest_rules()]
    with FakeKubeAPI(rules=rules) as api:
        _cluster(api)
        res = _executor(api, tmp_path).execute(_decision(Level.REPLACE_NODE, "node:gpu-2"), ExecContext())
        assert res.outcome == "failed"
        assert (
            'cordon node gpu-2: HTTP 403 Forbidden: nodes "gpu-2" is forbidden: User '
            f'"{USER}" cannot patch resource "nodes" in API group "" at the cluster scope'
        ) in res.detail
        assert api.node("gpu-2")["spec"] == {}
        assert "deletionTimestamp" not in api.pod(NS, "train-1-q9z4m")["metadata"]  # not cordoned: not drained
        assert [r.status for r in api.requests] == [200, 200, 403]


def test_api_errors_are_failed_results_never_exceptions(api, tmp_path):
    ex = _executor(api, tmp_path)
    res = ex.execute(_decision(Level.REPLACE_NODE, "node:gpu-9"), ExecContext())
    assert res.outcome == "failed" and 'cordon node gpu-9: HTTP 404 NotFound: nodes "gpu-9" not found' in res.detail
    # a PodDisruptionBudget with no disruption left: the eviction is refused (429), the node stays cordoned
    api.add_pdb(NS, "train-pdb", match_labels={JOB_LABEL: "train"}, disruptions_allowed=0)
    res = ex.execute(_decision(Level.REPLACE_NODE, "node:gpu-2"), ExecContext())
    assert res.outcome == "failed"
    assert (
        "evict pod training/train-1-q9z4m (job train, on node gpu-2): HTTP 429 TooManyRequests: Cannot evict pod "
        "as it would violate the pod's disruption budget. (The disruption budget train-pdb needs"
    ) in res.detail
    assert "cordoned node gpu-2" in res.detail and res.data["cordoned"] == ["gpu-2"] and res.data["evicted"] == []
    assert "deletionTimestamp" not in api.pod(NS, "train-1-q9z4m")["metadata"]
    # a namespace the role may not list pods in would be a 403 too; an API server that is gone:
    api.stop()
    res = ex.execute(_decision(Level.RESTART_RANK, "rank:1"), ExecContext())
    assert res.outcome == "failed" and f"cannot reach the Kubernetes API at {api.url}" in res.detail
    assert "Connection refused" in res.detail
    # a kubeconfig that does not exist
    bad = build_executor(ExecutorSpec("k8s", "kubernetes", options={"kubeconfig": str(tmp_path / "nope")}))
    res = bad.execute(_decision(Level.RESTART_RANK, "rank:1"), ExecContext())
    assert res.outcome == "failed" and f"no Kubernetes API credentials from {tmp_path / 'nope'}" in res.detail


def test_without_the_client_it_is_a_failed_result_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # import kubernetes -> ImportError
    ex = KubernetesExecutor(ExecutorSpec("k8s", "kubernetes", options={"kubeconfig": str(tmp_path / "kc")}))
    res = ex.execute(_decision(Level.RESTART_RANK, "rank:1"), ExecContext())
    assert res == type(res)("failed", f"the kubernetes client is not installed: {INSTALL_HINT}")


def test_loading_a_kubernetes_policy_does_not_need_the_client():
    code = (
        "import sys; sys.modules['kubernetes'] = None\n"
        "from ranklens.analyzers.recovery.policy import load_policy\n"
        f"p = load_policy({str(POLICY)!r}); print(p.executors[0].kind)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "kubernetes", out.stderr


def _toml_policy(tmp_path: Path, api: FakeKubeAPI, *, dry_run: bool) -> Path:
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    p = tmp_path / "policy.toml"
    p.write_text(
        textwrap.dedent(
            f"""
            version = 1
            dry_run = {str(dry_run).lower()}

            [[rule]]
            name = "crashes"
            kinds = ["crash"]
            level = "replace_node"

            [[executor]]
            name = "k8s"
            kind = "kubernetes"
            levels = ["replace_node"]
            namespace = "{NS}"
            kubeconfig = "{kubeconfig}"
            """
        )
    )
    return p


def _actions(store, job: str) -> list[dict]:
    return store.query(f"SELECT target, outcome, detail FROM actions WHERE job_id = '{job}' ORDER BY ts_ns").to_pylist()


def test_the_engine_writes_the_executors_result_as_an_actions_row(api, tmp_path, embedded_store):
    policy = load_policy(_toml_policy(tmp_path, api, dry_run=False))
    with RecoveryEngine(policy, embedded_store, tmp_path / "outbox") as engine:
        report = engine.process([finding(job_id="train", kind="crash", rank=1, node="gpu-2")])
        assert [(x, r.outcome) for x, _f, r in report.executed] == [("k8s", "acknowledged")]
        api.stop()  # the next finding's executor finds no API server: a failed row, the loop goes on
        report = engine.process([finding(job_id="train", kind="crash", rank=0, node="gpu-1")])
        assert [(x, r.outcome) for x, _f, r in report.executed] == [("k8s", "failed")]
    rows = _actions(embedded_store, "train")
    assert [(r["target"], r["outcome"]) for r in rows] == [
        ("node:gpu-2", "decided"),
        ("executor:k8s", "acknowledged"),
        ("node:gpu-1", "decided"),
        ("executor:k8s", "failed"),
    ]
    done = json.loads(rows[1]["detail"])
    assert done["cordoned"] == ["gpu-2"] and done["evicted"] == [f"{NS}/train-1-q9z4m"]
    assert done["detail"].startswith("cordoned node gpu-2; evicted pod training/train-1-q9z4m")
    assert "cannot reach the Kubernetes API" in json.loads(rows[3]["detail"])["detail"]
    assert api.node("gpu-2")["spec"]["unschedulable"] is True


def test_dry_run_calls_nothing_and_says_what_it_would_do(api, tmp_path, embedded_store):
    policy = load_policy(_toml_policy(tmp_path, api, dry_run=True))
    with RecoveryEngine(policy, embedded_store, tmp_path / "outbox") as engine:
        engine.process([finding(job_id="train", kind="crash", rank=1, node="gpu-2")])
    assert api.requests == []
    rows = _actions(embedded_store, "train")
    assert [(r["target"], r["outcome"]) for r in rows] == [("node:gpu-2", "dry_run"), ("executor:k8s", "skipped")]
    assert (
        "dry run: would send requests to the Kubernetes API: cordon node gpu-2 and evict job train's pods on it "
        f"(namespace {NS}, label {JOB_LABEL}=train)"
    ) in rows[1]["detail"]


def _parse(**executor: object):
    return parse_policy(
        {
            "rule": [{"name": "crashes", "kinds": ["crash"], "level": "replace_node"}],
            "executor": [{"name": "k8s", "kind": "kubernetes", **executor}],
        }
    )


def test_kubernetes_executor_options_are_checked_when_the_policy_loads():
    (spec,) = _parse(levels=["replace_node"], namespace="training", grace_period_s=0).executors
    assert spec.options == {
        "namespace": "training",
        "job_label": JOB_LABEL,
        "pod_action": "evict",
        "grace_period_s": 0,
        "drain_job_pods": True,
        "kubeconfig": "",
        "request_timeout_s": 10.0,
    }
    for bad, says in [
        ({"pod_action": "drain"}, "executor[0] (k8s).pod_action: 'drain': one of 'evict', 'delete'"),
        ({"grace_period_s": -2}, "executor[0] (k8s).grace_period_s: -2 is out of range [-1, 86400]"),
        ({"drain_job_pods": "yes"}, "executor[0] (k8s).drain_job_pods: expected true or false, got 'yes'"),
        ({"request_timeout_s": 0}, "executor[0] (k8s).request_timeout_s: 0 is out of range [0.1, 300]"),
        ({"namespace": 3}, "executor[0] (k8s).namespace: expected a string, got 3"),
        ({"node_selector": "x"}, "unknown key(s) ['node_selector']"),
    ]:
        with pytest.raises(PolicyError) as e:
            _parse(**bad)
        assert says in str(e.value)


def test_the_shipped_policy_loads_and_is_a_dry_run():
    p = load_policy(POLICY)
    assert p.dry_run is True
    (spec,) = p.executors
    assert spec.kind == "kubernetes" and Level.REPLACE_NODE in spec.levels


def test_a_namespace_or_job_id_kubernetes_cannot_hold_is_skipped_before_any_call(api, tmp_path):
    res = _executor(api, tmp_path, namespace="Training_Jobs").execute(
        _decision(Level.RESTART_JOB, "job:train"), ExecContext()
    )
    assert res.outcome == "skipped" and "namespace 'Training_Jobs' is not a Kubernetes namespace name" in res.detail
    f = finding(job_id="demo job/1", kind="crash", rank=1, node="gpu-2")
    d = Decision(f, Level.RESTART_JOB, "job:demo job/1", "crashes", "t", False, "k", time.time_ns())
    res = _executor(api, tmp_path).execute(d, ExecContext())
    assert res.outcome == "skipped" and "job id 'demo job/1' is not a label value" in res.detail
    assert api.requests == []


def _raw(api: FakeKubeAPI, method: str, path: str, body: object = None, ctype: str = "", token: str | None = None):
    req = urllib.request.Request(
        api.url + path, method=method, data=None if body is None else json.dumps(body).encode()
    )
    req.add_header("Authorization", f"Bearer {api.token if token is None else token}")
    if ctype:
        req.add_header("Content-Type", ctype)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_fake_refuses_what_the_real_api_server_refuses(api):
    code, st = _raw(api, "GET", "/api/v1/nodes", token="wrong")
    assert (code, st["kind"], st["reason"]) == (401, "Status", "Unauthorized")
    code, st = _raw(api, "PATCH", "/api/v1/nodes/gpu-1", {"spec": {"unschedulable": True}}, "application/json")
    assert (code, st["reason"]) == (415, "UnsupportedMediaType")
    code, st = _raw(
        api, "PATCH", "/api/v1/nodes/gpu-1", {"spec": {"unschedulable": "yes"}}, "application/merge-patch+json"
    )
    assert (code, st["reason"]) == (422, "Invalid") and "spec.unschedulable" in st["message"]
    code, node = _raw(
        api,
        "PATCH",
        "/api/v1/nodes/gpu-1",
        [{"op": "add", "path": "/spec/unschedulable", "value": True}],
        "application/json-patch+json",
    )
    assert code == 200 and node["spec"]["unschedulable"] is True
    code, lst = _raw(
        api, "GET", f"/api/v1/pods?labelSelector={JOB_LABEL}%20in%20(train)&fieldSelector=spec.nodeName%3Dgpu-2"
    )
    assert (
        code == 200 and lst["kind"] == "PodList" and [p["metadata"]["name"] for p in lst["items"]] == ["train-1-q9z4m"]
    )
    code, st = _raw(api, "GET", f"/api/v1/namespaces/{NS}/pods?fieldSelector=spec.colour%3Dred")
    assert (code, st["reason"]) == (400, "BadRequest")
    code, st = _raw(api, "DELETE", f"/api/v1/namespaces/{NS}/pods/train-0-x7k2p", {"preconditions": {"uid": "nope"}})
    assert (code, st["reason"]) == (409, "Conflict")
    code, st = _raw(api, "DELETE", "/api/v1/nodes/gpu-1")  # the role may not delete nodes
    assert (code, st["reason"]) == (403, "Forbidden")
    assert 'cannot delete resource "nodes" in API group "" at the cluster scope' in st["message"]
