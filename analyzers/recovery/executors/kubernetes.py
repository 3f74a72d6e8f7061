"""Cordon a node, evict a rank's pod: the ``kubernetes`` executor.

It acts through the Kubernetes API with the official client (``pip install "ranklens[kubernetes]"``),
as the ServiceAccount of ``deploy/kubernetes/components/recovery-rbac`` (or the kubeconfig named in
the policy). How a finding's ranks and hosts become pods and nodes:

- a job is the pods labelled ``<job_label>=<job id>`` in ``namespace``: ranklens' job id is
  ``RANKLENS_JOB_ID``, which ``deploy/kubernetes/examples/training-job.yaml`` sets from the label
  ``batch.kubernetes.io/job-name`` (Kubeflow's PyTorchJob: ``training.kubeflow.org/job-name``);
- a host is what the ranks recorded as ``host`` (heartbeats, ``ranks``): ``RANKLENS_HOST``, which
  the training pods set to their node's name (``spec.nodeName``), so a host *is* a node, and a
  rank's pod is the job's pod on that node. Where the pods left ``RANKLENS_HOST`` unset, the host is
  the pod's own host name, and the pod whose ``spec.hostname`` or name it is stands for it (and
  its ``spec.nodeName`` for the node);
- a rank's host is its newest heartbeat's in the finding's attempt (the store), else the node the
  finding names for it.

Levels:

- ``replace_node``: cordon each suspect node (what ``kubectl cordon`` does: a strategic-merge
  PATCH of ``spec.unschedulable``, with an annotation ``ranklens.io/cordoned-by`` naming the
  finding; a node already cordoned is left as it is), then, unless ``drain_job_pods = false``,
  evict (or delete) the job's pods on it, so that their controller (Job, JobSet, PyTorchJob) makes
  new ones, which the scheduler can no longer put there. Other workloads on the node stay: draining
  the whole node is a decision for its operator (``kubectl drain``).
- ``restart_rank``: evict the rank's pod; its controller recreates it, on any schedulable node,
  and the job's other pods see their peer leave (torchrun's rendezvous restarts the worker group,
  which resumes from its checkpoint). One pod per node is the usual layout (torchrun with
  ``--nproc-per-node`` = the node's GPUs); when several of the job's pods share the rank's node and
  none is named by the host, which one holds the rank is not recorded: ``skipped``, with that
  reason (``replace_node`` moves them all).
- ``restart_job``: evict every pod of the job; the controller recreates them all and the job
  restarts from its last checkpoint.
- ``notify``: nothing (``skipped``).

A pod without a controller (no ``ownerReferences`` with ``controller: true``) is never removed:
nothing would recreate it. A pod already terminating is left to finish. Every eviction and deletion
carries the listed pod's UID as a precondition, so a newer pod of the same name is not touched.
The job's controller must treat the removal as a disruption, not a failure: a Job with
``backoffLimit: 0`` fails when one of its pods is deleted, unless a ``podFailurePolicy`` rule
ignores pods with the ``DisruptionTarget`` condition (which an eviction sets); see
``docs/kubernetes.md``.

``execute`` never raises for the cluster: an API error is a ``failed`` result naming the call, the
object, the HTTP status and the API server's message (a PodDisruptionBudget that forbids the
eviction: 429); an unreachable server or missing credentials are ``failed`` too. Tested against
:mod:`.kubernetes_fake` (no API server runs where ranklens is tested), with the real client.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ranklens.analyzers.recovery.api import Decision, Level
from ranklens.analyzers.recovery.executors.api import ExecContext, ExecResult, ExecutorSpec, Option
from ranklens.store.api import sql_escape as _esc

__all__ = ["CORDON_ANNOTATION", "ENV_IN_CLUSTER", "INSTALL_HINT", "KubernetesExecutor"]

#: the extra that brings the official client
INSTALL_HINT = 'pip install "ranklens[kubernetes]"'
#: set by the kubelet in every container: the executor runs in a pod and uses its ServiceAccount
ENV_IN_CLUSTER = "KUBERNETES_SERVICE_HOST"
#: the annotation a cordoned node gets: which finding cordoned it
CORDON_ANNOTATION = "ranklens.io/cordoned-by"
_PAST = {"evict": "evicted", "delete": "deleted"}
_LABEL_VALUE = re.compile(r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")
_DNS_LABEL = re.compile(r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?")
_LABEL_KEY = re.compile(r"(?:[a-z0-9](?:[-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")


def _short(host: str) -> str:
    return host.split(".", 1)[0]


class _Unreachable(Exception):
    """The API server did not answer (connection refused, timeout, TLS): stop at once."""


class _ApiError(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status, self.text = status, text


@dataclass
class _Run:
    """What one execution did: the steps done, what was left alone and why, the errors."""

    done: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    cordoned: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)


def _api_error(e: Any) -> str:
    """``HTTP 403 Forbidden: <the Status's message>`` of an ``ApiException``."""
    reason, message = str(getattr(e, "reason", "") or ""), ""
    try:
        status = json.loads(getattr(e, "body", "") or "")
        reason = status.get("reason") or reason
        message = status.get("message") or ""
        causes = [c.get("message", "") for c in (status.get("details") or {}).get("causes", []) if c.get("message")]
        if causes:
            message += f" ({'; '.join(causes)})"
    except (ValueError, AttributeError):
        message = str(getattr(e, "body", "") or "")[:300]
    return f"HTTP {e.status} {reason}: {message}".rstrip(": ")


class KubernetesExecutor:
    """Cordons nodes and evicts (or deletes) a job's pods through the Kubernetes API.

    Args:
        spec: the ``[[executor]]`` table (``kind = "kubernetes"``); its options are :attr:`OPTIONS`.
        api_client: makes the ``kubernetes.client.ApiClient`` for one execution (default: from
            ``kubeconfig``, else in-cluster when ``$KUBERNETES_SERVICE_HOST`` is set, else
            ``~/.kube/config``); it is closed after the execution.
        in_cluster: whether the executor runs in a pod (default: ``$KUBERNETES_SERVICE_HOST`` is set).
    """

    OPTIONS: ClassVar[Mapping[str, Option]] = {
        "namespace": Option("string", "default", help="the namespace of the job's pods"),
        "job_label": Option(
            "string",
            "batch.kubernetes.io/job-name",
            help="the pod label whose value is the ranklens job id (RANKLENS_JOB_ID)",
        ),
        "pod_action": Option(
            "string",
            "evict",
            choices=("evict", "delete"),
            help="evict (honours PodDisruptionBudgets) or delete the pods",
        ),
        "grace_period_s": Option(
            "integer", -1, lo=-1, hi=86400, help="the pods' termination grace period; -1: each pod's own"
        ),
        "drain_job_pods": Option(
            "boolean", True, help="replace_node: also evict the job's pods on the cordoned node (false: cordon only)"
        ),
        "kubeconfig": Option(
            "string", "", help="a kubeconfig file; empty: the pod's ServiceAccount in a cluster, else ~/.kube/config"
        ),
        "request_timeout_s": Option("number", 10.0, lo=0.1, hi=300, help="per API request"),
    }

    def __init__(
        self,
        spec: ExecutorSpec,
        *,
        api_client: Callable[[], Any] | None = None,
        in_cluster: bool | None = None,
    ) -> None:
        self.spec = spec
        o = spec.options
        self.namespace = str(o.get("namespace", "default"))
        self.job_label = str(o.get("job_label", "batch.kubernetes.io/job-name"))
        self.pod_action = str(o.get("pod_action", "evict"))
        self.grace_period_s = int(o.get("grace_period_s", -1))
        self.drain_job_pods = bool(o.get("drain_job_pods", True))
        self.kubeconfig = os.path.expanduser(str(o.get("kubeconfig", "")))
        self.request_timeout_s = float(o.get("request_timeout_s", 10.0))
        self._api_client = api_client
        self.in_cluster = bool(os.environ.get(ENV_IN_CLUSTER)) if in_cluster is None else in_cluster

    # -- what it would do ------------------------------------------------------------------------

    def _selector(self, job_id: str) -> str:
        return f"{self.job_label}={job_id}"

    def _problem(self, d: Decision) -> str:
        """Why nothing can be done for ``d`` whatever the cluster says (empty: nothing)."""
        if d.level is Level.NOTIFY:
            return "notify is delivered by webhooks and hooks; the Kubernetes executor has nothing to do"
        if not _DNS_LABEL.fullmatch(self.namespace):
            return f"namespace {self.namespace!r} is not a Kubernetes namespace name (a DNS-1123 label)"
        if not _LABEL_KEY.fullmatch(self.job_label):
            return f"job_label {self.job_label!r} is not a Kubernetes label key"
        if not _LABEL_VALUE.fullmatch(d.finding.job_id) or not d.finding.job_id:
            return (
                f"job id {d.finding.job_id!r} is not a label value (63 characters of [A-Za-z0-9._-]), so no pod "
                f"can carry it as {self.job_label}: set RANKLENS_JOB_ID from the job's label (docs/kubernetes.md)"
            )
        return ""

    def describe(self, d: Decision) -> str:
        problem = self._problem(d)
        if problem:
            return f"do nothing: {problem}"
        verb = self.pod_action
        job, where = d.finding.job_id, f"namespace {self.namespace}, label {self._selector(d.finding.job_id)}"
        if d.level is Level.REPLACE_NODE:
            nodes = (
                d.target.partition(":")[2] if d.target.startswith("node:") else f"of rank {d.target.partition(':')[2]}"
            )
            then = (
                f" and {verb} job {job}'s pods on it ({where}) so that their controller recreates them elsewhere"
                if self.drain_job_pods
                else " (its pods stay: drain_job_pods = false)"
            )
            return f"send requests to the Kubernetes API: cordon node {nodes}{then}"
        if d.level is Level.RESTART_RANK:
            ranks = d.target.partition(":")[2]
            return f"send requests to the Kubernetes API: {verb} the pod of job {job} running rank {ranks} ({where})"
        api = "send requests to the Kubernetes API"
        return f"{api}: {verb} every pod of job {job} ({where}); its controller recreates them"

    # -- doing it --------------------------------------------------------------------------------

    def execute(self, d: Decision, ctx: ExecContext) -> ExecResult:
        problem = self._problem(d)
        if problem:
            return ExecResult("skipped", problem)
        try:
            api_client = self._connect()
        except ImportError:
            return ExecResult("failed", f"the kubernetes client is not installed: {INSTALL_HINT}")
        except Exception as e:  # the client's ConfigException, a missing or bad kubeconfig, a token file
            where = self.kubeconfig or ("the pod's ServiceAccount" if self.in_cluster else "~/.kube/config")
            return ExecResult("failed", f"no Kubernetes API credentials from {where}: {type(e).__name__}: {e}")
        from kubernetes import client

        server = str(getattr(api_client.configuration, "host", ""))
        run = _Run()
        try:
            core = client.CoreV1Api(api_client)
            if d.level is Level.REPLACE_NODE:
                self._replace_node(d, ctx, core, run)
            elif d.level is Level.RESTART_RANK:
                self._restart_rank(d, ctx, core, run)
            else:
                self._restart_job(d, core, run)
        except _Unreachable as e:
            run.errors.append(f"cannot reach the Kubernetes API at {server}: {e}")
        finally:
            api_client.close()
        data: dict[str, Any] = {
            "api": server,
            "namespace": self.namespace,
            "cordoned": run.cordoned,
            _PAST[self.pod_action]: run.removed,
        }
        if run.errors:
            data["errors"] = run.errors
            return ExecResult("failed", "; ".join(run.errors + run.done + run.notes), data)
        if run.done:
            return ExecResult("acknowledged", "; ".join(run.done + run.notes), data)
        return ExecResult("skipped", "; ".join(run.notes) or "nothing to do", data)

    def _connect(self) -> Any:
        if self._api_client is not None:
            return self._api_client()
        import urllib3
        from kubernetes import client, config

        cfg = client.Configuration()
        if self.kubeconfig:
            config.load_kube_config(config_file=self.kubeconfig, client_configuration=cfg)
        elif self.in_cluster:
            config.load_incluster_config(client_configuration=cfg)
        else:
            config.load_kube_config(client_configuration=cfg)
        # one more try to connect, none to read: an eviction must not be sent twice by the transport
        cfg.retries = urllib3.Retry(total=1, connect=1, read=0, redirect=0, status=0, other=0)
        return client.ApiClient(cfg)

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One API call; an API error raises :class:`_ApiError`, no answer :class:`_Unreachable`."""
        import urllib3
        from kubernetes.client.exceptions import ApiException

        try:
            return fn(*args, _request_timeout=self.request_timeout_s, **kwargs)
        except ApiException as e:
            raise _ApiError(int(e.status or 0), _api_error(e)) from None
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise _Unreachable(str(getattr(e, "reason", None) or e)) from None

    def _job_pods(self, f_job: str, core: Any, run: _Run) -> list[Any] | None:
        try:
            pods = self._call(core.list_namespaced_pod, self.namespace, label_selector=self._selector(f_job))
        except _ApiError as e:
            run.errors.append(f"list pods of job {f_job} in namespace {self.namespace}: {e.text}")
            return None
        return list(pods.items or [])

    def _rank_hosts(self, d: Decision, ranks: list[int], ctx: ExecContext, run: _Run) -> dict[int, str]:
        """Each rank's host: its newest heartbeat of the finding's attempt, else the finding's suspect."""
        f = d.finding
        hosts: dict[int, str] = {}
        if ctx.store is not None and ranks:
            try:
                rows = ctx.store.query(
                    "SELECT rank, argMax(host, ts_ns) AS host FROM heartbeats "
                    f"WHERE job_id = '{_esc(f.job_id)}' AND attempt = {int(f.attempt)} "
                    f"AND rank IN ({', '.join(str(int(r)) for r in ranks)}) GROUP BY rank"
                ).to_pylist()
                hosts = {int(r["rank"]): str(r["host"]) for r in rows if r["host"]}
            except Exception as e:  # the store is down: the finding's own hosts will do
                run.notes.append(f"heartbeats unreadable ({type(e).__name__}: {e}); hosts from the finding")
        for s in f.suspects:
            if s.rank in ranks and s.rank not in hosts and s.node:
                hosts[s.rank] = s.node
        return hosts

    @staticmethod
    def _on_host(pod: Any, host: str) -> bool:
        return bool(pod.spec and pod.spec.node_name == host) or KubernetesExecutor._named_by(pod, host)

    @staticmethod
    def _named_by(pod: Any, host: str) -> bool:
        """Whether ``host`` is the pod's own host name (``RANKLENS_HOST`` unset in it)."""
        return _short(host) in {pod.metadata.name, getattr(pod.spec, "hostname", None)}

    def _replace_node(self, d: Decision, ctx: ExecContext, core: Any, run: _Run) -> None:
        f = d.finding
        kind, _, names = d.target.partition(":")
        if kind == "node":
            hosts = [h for h in names.split(",") if h]
        else:  # node-of-rank:<r>: the hosts of those ranks
            ranks = [int(r) for r in names.split(",") if r.strip().lstrip("-").isdigit()]
            by_rank = self._rank_hosts(d, ranks, ctx, run)
            hosts = sorted(set(by_rank.values()))
            for r in ranks:
                if r not in by_rank:
                    run.notes.append(f"rank {r}'s host is unknown (no heartbeat, no node in the finding)")
        pods = self._job_pods(f.job_id, core, run) or []
        for host in hosts:
            mine = [p for p in pods if self._on_host(p, host)]
            node = host
            if not any(p.spec and p.spec.node_name == host for p in mine):
                bound = sorted({p.spec.node_name for p in mine if p.spec and p.spec.node_name})
                if len(bound) == 1:  # the host is a pod's host name: its node
                    node = bound[0]
            if not self._cordon(node, d, core, run):
                continue
            if not self.drain_job_pods:
                continue
            on_node = [p for p in pods if p.spec and p.spec.node_name == node]
            if not on_node:
                run.notes.append(f"no pod of job {f.job_id} ({self._selector(f.job_id)}) runs on node {node}")
            for p in on_node:
                self._remove(p, core, run, f"job {f.job_id}, on node {node}")

    def _cordon(self, node: str, d: Decision, core: Any, run: _Run) -> bool:
        """Cordon ``node``; False when it cannot be (the error is in ``run``)."""
        try:
            current = self._call(core.read_node, node)
            if current.spec is not None and current.spec.unschedulable:
                run.notes.append(f"node {node} was already cordoned: left as it is")
                return True
            note = f"finding {d.finding.id} ({d.finding.kind}, job {d.finding.job_id}, rule {d.rule})"
            patch = {"metadata": {"annotations": {CORDON_ANNOTATION: note}}, "spec": {"unschedulable": True}}
            self._call(core.patch_node, node, patch)
        except _ApiError as e:
            run.errors.append(f"cordon node {node}: {e.text}")
            return False
        run.cordoned.append(node)
        run.done.append(f"cordoned node {node}")
        return True

    def _restart_rank(self, d: Decision, ctx: ExecContext, core: Any, run: _Run) -> None:
        f = d.finding
        names = d.target.partition(":")[2] if d.target.startswith("rank:") else ""
        ranks = [int(r) for r in names.split(",") if r.strip().lstrip("-").isdigit()]
        if not ranks:
            ranks = sorted({s.rank for s in f.suspects if s.rank >= 0})[:1]
        if not ranks:
            run.notes.append(f"no rank named by target {d.target} or the finding")
            return
        hosts = self._rank_hosts(d, ranks, ctx, run)
        pods = self._job_pods(f.job_id, core, run)
        if pods is None:
            return
        chosen: dict[str, Any] = {}
        for r in ranks:
            host = hosts.get(r)
            if host is None:
                run.notes.append(f"rank {r}'s host is unknown (no heartbeat, no node in the finding)")
                continue
            named = [p for p in pods if self._named_by(p, host)]
            on = named or [p for p in pods if self._on_host(p, host)]
            if not on:
                run.notes.append(
                    f"no pod of job {f.job_id} ({self._selector(f.job_id)}, namespace {self.namespace}) "
                    f"on {host}, where rank {r} ran"
                )
            elif len(on) > 1:
                run.notes.append(
                    f"{len(on)} pods of job {f.job_id} run on node {host} "
                    f"({', '.join(sorted(p.metadata.name for p in on))}) and which one holds rank {r} is not "
                    "recorded: none removed (replace_node moves them all)"
                )
            else:
                chosen.setdefault(on[0].metadata.name, (on[0], []))[1].append(r)
        for p, rs in chosen.values():
            self._remove(p, core, run, f"rank {', '.join(map(str, rs))} of job {f.job_id}")

    def _restart_job(self, d: Decision, core: Any, run: _Run) -> None:
        f = d.finding
        pods = self._job_pods(f.job_id, core, run)
        if pods is None:
            return
        if not pods:
            run.notes.append(f"no pod of job {f.job_id} ({self._selector(f.job_id)}) in namespace {self.namespace}")
        for p in sorted(pods, key=lambda p: p.metadata.name):
            self._remove(p, core, run, f"job {f.job_id}")

    def _remove(self, pod: Any, core: Any, run: _Run, why: str) -> None:
        """Evict or delete one pod (the one listed: its UID is a precondition)."""
        from kubernetes import client

        name, ns, uid = pod.metadata.name, pod.metadata.namespace or self.namespace, pod.metadata.uid
        ref = f"pod {ns}/{name}"
        if pod.metadata.deletion_timestamp is not None:
            run.notes.append(f"{ref} ({why}) is already terminating")
            return
        if not any(o.controller for o in pod.metadata.owner_references or []):
            run.notes.append(f"{ref} ({why}) has no controller that would recreate it: left alone")
            return
        grace = self.grace_period_s if self.grace_period_s >= 0 else None
        options = client.V1DeleteOptions(grace_period_seconds=grace, preconditions=client.V1Preconditions(uid=uid))
        try:
            if self.pod_action == "evict":
                body = client.V1Eviction(
                    api_version="policy/v1",
                    kind="Eviction",
                    metadata=client.V1ObjectMeta(name=name, namespace=ns),
                    delete_options=options,
                )
                self._call(core.create_namespaced_pod_eviction, name, ns, body)
            else:
                self._call(core.delete_namespaced_pod, name, ns, body=options)
        except _ApiError as e:
            if e.status == 404:
                run.notes.append(f"{ref} ({why}) was already gone")
            else:
                run.errors.append(f"{self.pod_action} {ref} ({why}): {e.text}")
            return
        run.removed.append(f"{ns}/{name}")
        run.done.append(f"{_PAST[self.pod_action]} {ref} ({why}): its controller recreates it")
