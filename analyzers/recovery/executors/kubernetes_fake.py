"""A fake kube-apiserver for the Kubernetes executor: the API boundary, on 127.0.0.1, in a thread.

No API server can run on the machines ranklens is developed and tested on, so the executor's calls
are checked against this stand-in (issue 15). It is small, but faithful where the executor and the
official ``kubernetes`` client meet it: the same paths, JSON shapes, content types and ``Status``
error objects as the real server, and RBAC enforced from the rules it is given (the test gives it
those of ``deploy/kubernetes/components/recovery-rbac/rbac.yaml``), so a call the manifest does not
allow fails with the 403 the real server would send::

    with FakeKubeAPI(rules=rbac_rules(yaml.safe_load_all(rbac_yaml))) as api:
        api.add_node("gpu-1")
        api.add_pod("training", "train-0", node="gpu-1", labels={"batch.kubernetes.io/job-name": "train"})
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")   # the real client loads it
        ...
        assert [r.verb for r in api.requests] == ["get", "patch", "list", "create"]

What it serves (core/v1 and the eviction subresource, JSON only):

- ``GET /api/v1/nodes`` (list; ``labelSelector``, ``fieldSelector`` on ``metadata.name`` and
  ``spec.unschedulable``), ``GET``/``PATCH /api/v1/nodes/{name}``;
- ``GET /api/v1/pods`` and ``/api/v1/namespaces/{ns}/pods`` (list; label selectors with ``=``,
  ``==``, ``!=``, ``in``, ``notin``, ``key``, ``!key``; field selectors on ``metadata.name``,
  ``metadata.namespace``, ``spec.nodeName``, ``spec.restartPolicy``, ``spec.serviceAccountName``,
  ``status.phase``), ``GET``/``DELETE /api/v1/namespaces/{ns}/pods/{name}`` (``DeleteOptions``:
  ``gracePeriodSeconds`` in the query or the body, a ``preconditions.uid``);
- ``POST /api/v1/namespaces/{ns}/pods/{name}/eviction`` (``policy/v1`` ``Eviction``), refused with
  429 ``TooManyRequests`` when a PodDisruptionBudget of the pod (:meth:`FakeKubeAPI.add_pdb`) has no
  disruption left, 500 when two select it, as the real eviction handler does.

PATCH takes ``application/strategic-merge-patch+json`` and ``application/merge-patch+json`` (both
applied as an RFC 7386 merge) and ``application/json-patch+json`` (RFC 6902 ``add``, ``replace``,
``remove``); any other content type is 415, as the real server answers. Errors are ``Status``
objects with the real reasons and messages: 401 ``Unauthorized`` (no or a wrong bearer token), 403
``Forbidden`` (RBAC), 404 ``NotFound``, 400 ``BadRequest``, 409 ``Conflict`` (a UID precondition),
415, 422 ``Invalid`` (a patch that renames the object or makes ``spec.unschedulable`` a non-boolean),
429, 500.

What it does NOT model: watches, other resources and API groups, server-side apply
(``application/apply-patch+yaml``: 415 here), strategic merge's list merge keys and directives
(``$patch``; a list in a patch replaces the list), admission (Pod Security, webhooks), the
scheduler, the kubelet and controllers (a pod deleted with a grace period stays ``Terminating``, with
``deletionTimestamp`` set, until :meth:`FakeKubeAPI.finish_terminating`; nothing recreates it; a
PDB's ``disruptionsAllowed`` is what the test set, less the evictions since), ``resourceVersion``
conflicts on PATCH, aggregated RBAC roles, TLS (plain http on loopback), pagination (``limit`` is
ignored), and protobuf/CBOR.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = ["FakeKubeAPI", "Request", "rbac_rules"]

#: the user the fake's default token authenticates as (the recovery component's ServiceAccount)
DEFAULT_USER = "system:serviceaccount:ranklens:ranklens-recovery"
DEFAULT_TOKEN = "ranklens-fake-token-0123456789"
_PATCH_TYPES = (
    "application/json-patch+json",
    "application/merge-patch+json",
    "application/strategic-merge-patch+json",
    "application/apply-patch+yaml",
)
_POD_FIELDS = {
    "metadata.name": ("metadata", "name"),
    "metadata.namespace": ("metadata", "namespace"),
    "spec.nodeName": ("spec", "nodeName"),
    "spec.restartPolicy": ("spec", "restartPolicy"),
    "spec.serviceAccountName": ("spec", "serviceAccountName"),
    "status.phase": ("status", "phase"),
}
_NODE_FIELDS = {"metadata.name": ("metadata", "name"), "spec.unschedulable": ("spec", "unschedulable")}


@dataclass(frozen=True)
class Request:
    """One request the fake answered: ``verb`` as RBAC names it (``get``, ``list``, ``patch``,
    ``delete``, ``create``, ...), the path, its query, the request's content type and JSON body,
    the authenticated user and the HTTP status sent back."""

    method: str
    verb: str
    path: str
    query: Mapping[str, str]
    content_type: str
    body: Any
    user: str
    status: int


class _Error(Exception):
    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details


def _status(code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success" if code < 400 else "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details is not None:
        out["details"] = details
    if code < 400:
        del out["message"], out["reason"]
    return out


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def rbac_rules(
    documents: Iterable[Mapping[str, Any] | None], service_account: str = "ranklens/ranklens-recovery"
) -> list[dict[str, Any]]:
    """The RBAC rules a ServiceAccount (``namespace/name``) holds in a set of manifests (parsed YAML
    documents): those of every ClusterRole or Role that a ClusterRoleBinding or RoleBinding grants
    it. Rules granted by a RoleBinding carry the binding's ``namespace`` (they apply there only)."""
    docs = [d for d in documents if d]
    sa_ns, _, sa_name = service_account.partition("/")
    roles = {(d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]): d for d in docs}
    out: list[dict[str, Any]] = []
    for b in docs:
        if b.get("kind") not in ("ClusterRoleBinding", "RoleBinding"):
            continue
        if not any(
            s.get("kind") == "ServiceAccount" and s.get("name") == sa_name and s.get("namespace") == sa_ns
            for s in b.get("subjects", [])
        ):
            continue
        ns = b["metadata"].get("namespace", "") if b["kind"] == "RoleBinding" else ""
        ref = b["roleRef"]
        role = roles.get((ref["kind"], ns if ref["kind"] == "Role" else "", ref["name"]))
        for rule in (role or {}).get("rules", []):
            out.append({**rule, "namespace": ns} if ns else dict(rule))
    return out


def _allowed(rules: Sequence[Mapping[str, Any]], verb: str, group: str, resource: str, name: str, ns: str) -> bool:
    for r in rules:
        if r.get("namespace") and r["namespace"] != ns:
            continue
        if not ({"*", verb} & set(r.get("verbs", []))):
            continue
        if not ({"*", group} & set(r.get("apiGroups", []))):
            continue
        if not ({"*", resource} & set(r.get("resources", []))):
            continue
        names = r.get("resourceNames") or []
        if names and name not in names:
            continue
        return True
    return False


def _merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = _merge(out.get(k), v)
    return out


def _json_patch(doc: dict[str, Any], ops: Any) -> dict[str, Any]:
    """RFC 6902, the ``add``, ``replace`` and ``remove`` operations on objects."""
    if not isinstance(ops, list):
        raise _Error(400, "BadRequest", "json: cannot unmarshal object into Go value of type jsonpatch.Patch")
    out = json.loads(json.dumps(doc))
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in str(op.get("path", "")).split("/")[1:]]
        if not parts:
            raise _Error(422, "Invalid", f"the server rejected our request due to an error in our request: {op}")
        parent = out
        for p in parts[:-1]:
            if not isinstance(parent.get(p), dict):
                raise _Error(422, "Invalid", f"the server rejected our request due to an error in our request: {op}")
            parent = parent[p]
        kind = op.get("op")
        if kind in ("add", "replace"):
            if kind == "replace" and parts[-1] not in parent:
                raise _Error(422, "Invalid", f"replace operation does not apply: doc is missing key: {op['path']}")
            parent[parts[-1]] = op.get("value")
        elif kind == "remove":
            if parts[-1] not in parent:
                raise _Error(422, "Invalid", f"remove operation does not apply: doc is missing key: {op['path']}")
            del parent[parts[-1]]
        else:
            raise _Error(422, "Invalid", f"Unexpected kind: {kind}")
    return out


def _parse_label_selector(sel: str) -> list[tuple[str, str, set[str]]]:
    reqs: list[tuple[str, str, set[str]]] = []
    for term in re.split(r",(?![^(]*\))", sel):
        term = term.strip()
        if not term:
            continue
        m = re.fullmatch(r"([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)", term)
        if m:
            reqs.append((m[1], m[2], {v.strip() for v in m[3].split(",") if v.strip()}))
            continue
        m = re.fullmatch(r"([\w./-]+)\s*(==|!=|=)\s*([\w.-]*)", term)
        if m:
            reqs.append((m[1], "!=" if m[2] == "!=" else "=", {m[3]}))
            continue
        m = re.fullmatch(r"(!?)([\w./-]+)", term)
        if m:
            reqs.append((m[2], "!exists" if m[1] else "exists", set()))
            continue
        raise _Error(400, "BadRequest", f"unable to parse requirement: found '{term}', expected: identifier")
    return reqs


def _labels_match(reqs: list[tuple[str, str, set[str]]], labels: Mapping[str, str]) -> bool:
    for key, op, values in reqs:
        has, v = key in labels, labels.get(key)
        ok = {
            "=": has and v in values,
            "!=": not has or v not in values,
            "in": has and v in values,
            "notin": not has or v not in values,
            "exists": has,
            "!exists": not has,
        }[op]
        if not ok:
            return False
    return True


def _fields_match(sel: str, obj: Mapping[str, Any], fields: Mapping[str, tuple[str, str]], kind: str) -> bool:
    for term in (t.strip() for t in sel.split(",") if t.strip()):
        m = re.fullmatch(r"([\w.]+)\s*(==|!=|=)\s*(.*)", term)
        if not m:
            raise _Error(400, "BadRequest", f"invalid selector: '{sel}'; can't understand '{term}'")
        if m[1] not in fields:
            raise _Error(400, "BadRequest", f'"{m[1]}" is not a known field selector: only "{kind}" fields')
        a, b = fields[m[1]]
        value = obj.get(a, {}).get(b)
        text = "" if value is None else (str(value).lower() if isinstance(value, bool) else str(value))
        if (text == m[3]) == (m[2] == "!="):
            return False
    return True


class FakeKubeAPI:
    """The fake API server. ``rules``: RBAC rules of the user the token authenticates as
    (:func:`rbac_rules`); ``None`` allows everything (a cluster admin). Start it with :meth:`start`
    or ``with``; :attr:`url` is where it listens, :attr:`requests` what it was asked."""

    def __init__(
        self,
        *,
        rules: Sequence[Mapping[str, Any]] | None = None,
        token: str = DEFAULT_TOKEN,
        user: str = DEFAULT_USER,
    ) -> None:
        self.rules = None if rules is None else [dict(r) for r in rules]
        self.token = token
        self.user = user
        self.requests: list[Request] = []
        self._nodes: dict[str, dict[str, Any]] = {}
        self._pods: dict[tuple[str, str], dict[str, Any]] = {}
        self._pdbs: dict[tuple[str, str], dict[str, Any]] = {}
        self._rv = 1000
        self._lock = threading.RLock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()

    # -- objects ---------------------------------------------------------------------------------

    def _meta(self, name: str, namespace: str | None, labels: Mapping[str, str] | None) -> dict[str, Any]:
        self._rv += 1
        meta: dict[str, Any] = {
            "name": name,
            "uid": str(uuid.uuid4()),
            "resourceVersion": str(self._rv),
            "creationTimestamp": _now(),
            "labels": dict(labels or {}),
        }
        if namespace is not None:
            meta["namespace"] = namespace
        return meta

    def add_node(
        self, name: str, *, labels: Mapping[str, str] | None = None, unschedulable: bool = False
    ) -> dict[str, Any]:
        with self._lock:
            spec: dict[str, Any] = {"unschedulable": True} if unschedulable else {}
            ready = {
                "type": "Ready",
                "status": "True",
                "reason": "KubeletReady",
                "message": "kubelet is posting ready status",
            }
            self._nodes[name] = {
                "kind": "Node",
                "apiVersion": "v1",
                "metadata": self._meta(name, None, {"kubernetes.io/hostname": name, **(labels or {})}),
                "spec": spec,
                "status": {"conditions": [ready]},
            }
            return self._nodes[name]

    def add_pod(
        self,
        namespace: str,
        name: str,
        *,
        node: str,
        labels: Mapping[str, str] | None = None,
        owner: tuple[str, str] | None = ("Job", "train"),
        hostname: str = "",
        grace_period_s: int = 30,
        phase: str = "Running",
    ) -> dict[str, Any]:
        """A pod bound to ``node``; ``owner`` (kind, name) is its controller (``None``: a bare pod)."""
        with self._lock:
            meta = self._meta(name, namespace, labels)
            if owner is not None:
                api = "batch/v1" if owner[0] == "Job" else "apps/v1"
                meta["ownerReferences"] = [
                    {
                        "apiVersion": api,
                        "kind": owner[0],
                        "name": owner[1],
                        "uid": str(uuid.uuid4()),
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ]
            spec: dict[str, Any] = {
                "nodeName": node,
                "containers": [{"name": "train", "image": "train:latest"}],
                "restartPolicy": "Never",
                "serviceAccountName": "default",
                "terminationGracePeriodSeconds": grace_period_s,
            }
            if hostname:
                spec["hostname"] = hostname
            pod = {"kind": "Pod", "apiVersion": "v1", "metadata": meta, "spec": spec, "status": {"phase": phase}}
            self._pods[(namespace, name)] = pod
            return pod

    def add_pdb(
        self, namespace: str, name: str, *, match_labels: Mapping[str, str], disruptions_allowed: int = 0
    ) -> dict[str, Any]:
        """A PodDisruptionBudget; its status's ``disruptionsAllowed`` is what the disruption
        controller would have computed (set here, lowered by each eviction)."""
        with self._lock:
            pdb = {
                "kind": "PodDisruptionBudget",
                "apiVersion": "policy/v1",
                "metadata": self._meta(name, namespace, None),
                "spec": {"selector": {"matchLabels": dict(match_labels)}},
                "status": {"disruptionsAllowed": disruptions_allowed, "currentHealthy": 0, "desiredHealthy": 0},
            }
            self._pdbs[(namespace, name)] = pdb
            return pdb

    def node(self, name: str) -> dict[str, Any] | None:
        with self._lock:
            n = self._nodes.get(name)
            return json.loads(json.dumps(n)) if n else None

    def pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        with self._lock:
            p = self._pods.get((namespace, name))
            return json.loads(json.dumps(p)) if p else None

    def finish_terminating(self) -> list[str]:
        """What a kubelet would do: remove the pods being deleted; their ``namespace/name``."""
        with self._lock:
            gone = [k for k, p in self._pods.items() if p["metadata"].get("deletionTimestamp")]
            for k in gone:
                del self._pods[k]
            return [f"{ns}/{n}" for ns, n in gone]

    # -- server ----------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("the fake API server is not started")
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> FakeKubeAPI:
        fake = self

        class Handler(_Handler):
            api = fake

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), name="fake-kube-api", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening and drop open connections (a client then gets connection refused)."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            for c in list(self._conns):
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> FakeKubeAPI:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def write_kubeconfig(self, path: str | Path, *, namespace: str = "default", token: str | None = None) -> Path:
        """A kubeconfig file whose current context is this server with its bearer token (JSON,
        which YAML loaders read)."""
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": self.token if token is None else token}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": namespace}}],
            "current-context": "fake",
        }
        p = Path(path)
        p.write_text(json.dumps(doc, indent=2))
        return p

    # -- requests --------------------------------------------------------------------------------

    def handle(
        self, method: str, raw_path: str, headers: Mapping[str, str], body: bytes
    ) -> tuple[int, dict[str, Any], Request]:
        parts = urlsplit(raw_path)
        path = unquote(parts.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        headers = {k.lower(): v for k, v in headers.items()}
        ctype = (headers.get("content-type") or "").split(";")[0].strip().lower()
        parsed: Any = None
        user, verb = "", method.lower()
        try:
            if body:
                try:
                    parsed = json.loads(body)
                except ValueError as e:
                    raise _Error(400, "BadRequest", f"the body of the request was not valid JSON: {e}") from None
            auth = headers.get("authorization") or ""
            if auth != f"Bearer {self.token}":
                raise _Error(401, "Unauthorized", "Unauthorized")
            user = self.user
            code, out, verb = self._route(method, path, query, ctype, parsed)
        except _Error as e:
            code, out = e.code, _status(e.code, e.reason, e.message, e.details)
        req = Request(method, verb, path, query, ctype, parsed, user, code)
        with self._lock:
            self.requests.append(req)
        return code, out, req

    def _authorize(self, verb: str, resource: str, name: str, ns: str, sub: str = "") -> None:
        res = f"{resource}/{sub}" if sub else resource
        if self.rules is None or _allowed(self.rules, verb, "", res, name, ns):
            return
        who = f'{resource} "{name}"' if name else resource
        where = f'in the namespace "{ns}"' if ns else "at the cluster scope"
        raise _Error(
            403,
            "Forbidden",
            f'{who} is forbidden: User "{self.user}" cannot {verb} resource "{res}" in API group "" {where}',
            {"name": name, "kind": resource} if name else {"kind": resource},
        )

    def _route(
        self, method: str, path: str, query: Mapping[str, str], ctype: str, body: Any
    ) -> tuple[int, dict[str, Any], str]:
        m = re.fullmatch(r"/api/v1/nodes(?:/([^/]+))?", path)
        if m:
            name = m[1] or ""
            verb = self._verb(method, bool(name))
            self._authorize(verb, "nodes", name, "")
            if verb == "list":
                return 200, self._list("NodeList", self._nodes.values(), query, _NODE_FIELDS, "Node"), verb
            if verb == "get":
                return 200, self._get_node(name), verb
            if verb == "patch":
                return 200, self._patch_node(name, ctype, body), verb
            raise self._not_modelled(method, path)
        m = re.fullmatch(r"/api/v1(?:/namespaces/([^/]+))?/pods(?:/([^/]+))?(?:/(eviction))?", path)
        if m and (m[1] or not m[2]):
            ns, name, sub = m[1] or "", m[2] or "", m[3] or ""
            verb = "create" if sub and method == "POST" else self._verb(method, bool(name))
            self._authorize(verb, "pods", name, ns, sub)
            with self._lock:
                if sub:
                    if method != "POST":
                        raise self._not_modelled(method, path)
                    if ctype not in ("", "application/json"):  # no Content-Type: the server reads JSON
                        raise _Error(415, "UnsupportedMediaType", f"{ctype}: the fake API server reads JSON only")
                    return 201, self._evict(ns, name, body), verb
                if verb == "list":
                    pods = [p for (pns, _), p in self._pods.items() if not ns or pns == ns]
                    return 200, self._list("PodList", pods, query, _POD_FIELDS, "Pod"), verb
                if verb == "get":
                    return 200, self._get_pod(ns, name), verb
                if verb == "delete":
                    return 200, self._delete_pod(ns, name, query, body), verb
            raise self._not_modelled(method, path)
        raise _Error(404, "NotFound", "the server could not find the requested resource", {})

    @staticmethod
    def _verb(method: str, named: bool) -> str:
        if method == "GET":
            return "get" if named else "list"
        if method == "DELETE":
            return "delete" if named else "deletecollection"
        return {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, method.lower())

    @staticmethod
    def _not_modelled(method: str, path: str) -> _Error:
        return _Error(405, "MethodNotAllowed", f"{method} {path}: the fake API server does not model this call")

    def _list(
        self,
        kind: str,
        objs: Iterable[dict[str, Any]],
        query: Mapping[str, str],
        fields: Mapping[str, tuple[str, str]],
        item_kind: str,
    ) -> dict[str, Any]:
        if query.get("watch") in ("1", "true"):
            raise _Error(405, "MethodNotAllowed", "watch: the fake API server does not model watches")
        reqs = _parse_label_selector(query.get("labelSelector", ""))
        fsel = query.get("fieldSelector", "")
        items = []
        with self._lock:
            for o in objs:
                if _labels_match(reqs, o["metadata"].get("labels") or {}) and _fields_match(fsel, o, fields, item_kind):
                    items.append({k: v for k, v in o.items() if k not in ("kind", "apiVersion")})
            return {"kind": kind, "apiVersion": "v1", "metadata": {"resourceVersion": str(self._rv)}, "items": items}

    def _get_node(self, name: str) -> dict[str, Any]:
        with self._lock:
            if name not in self._nodes:
                raise _Error(404, "NotFound", f'nodes "{name}" not found', {"name": name, "kind": "nodes"})
            return self._nodes[name]

    def _patch_node(self, name: str, ctype: str, body: Any) -> dict[str, Any]:
        if ctype not in _PATCH_TYPES or ctype == "application/apply-patch+yaml":
            accepted = ", ".join(_PATCH_TYPES[:3])
            raise _Error(
                415,
                "UnsupportedMediaType",
                f"the body of the request was in an unknown format - accepted media types include: {accepted}",
            )
        with self._lock:
            node = self._get_node(name)
            if ctype == "application/json-patch+json":
                new = _json_patch(node, body)
            else:
                if not isinstance(body, dict):
                    raise _Error(
                        400, "BadRequest", "json: cannot unmarshal array into Go value of type map[string]interface {}"
                    )
                new = _merge(node, body)
            if new.get("metadata", {}).get("name") != name:
                raise _Error(
                    422,
                    "Invalid",
                    f'Node "{name}" is invalid: metadata.name: Invalid value: '
                    f'"{new.get("metadata", {}).get("name")}": field is immutable',
                    {
                        "name": name,
                        "kind": "Node",
                        "causes": [{"reason": "FieldValueInvalid", "field": "metadata.name"}],
                    },
                )
            unsched = new.get("spec", {}).get("unschedulable")
            if unsched is not None and not isinstance(unsched, bool):
                raise _Error(
                    422,
                    "Invalid",
                    f'Node "{name}" is invalid: spec.unschedulable: Invalid value: {json.dumps(unsched)}: '
                    "must be a boolean",
                    {
                        "name": name,
                        "kind": "Node",
                        "causes": [{"reason": "FieldValueInvalid", "field": "spec.unschedulable"}],
                    },
                )
            self._rv += 1
            new["metadata"]["resourceVersion"] = str(self._rv)
            self._nodes[name] = new
            return new

    def _get_pod(self, ns: str, name: str) -> dict[str, Any]:
        if (ns, name) not in self._pods:
            raise _Error(404, "NotFound", f'pods "{name}" not found', {"name": name, "kind": "pods"})
        return self._pods[(ns, name)]

    def _delete_pod(self, ns: str, name: str, query: Mapping[str, str], body: Any) -> dict[str, Any]:
        pod = self._get_pod(ns, name)
        opts = body if isinstance(body, dict) else {}
        uid = (opts.get("preconditions") or {}).get("uid")
        if uid and uid != pod["metadata"]["uid"]:
            raise _Error(
                409,
                "Conflict",
                f"Precondition failed: UID in precondition: {uid}, UID in object meta: {pod['metadata']['uid']}",
                {"name": name, "kind": "pods"},
            )
        grace = opts.get("gracePeriodSeconds")
        if "gracePeriodSeconds" in query:
            grace = int(query["gracePeriodSeconds"])
        if grace is None:
            grace = int(pod["spec"].get("terminationGracePeriodSeconds", 30))
        if grace <= 0:
            del self._pods[(ns, name)]
            return pod
        if not pod["metadata"].get("deletionTimestamp"):
            self._rv += 1
            pod["metadata"].update(
                deletionTimestamp=_now(), deletionGracePeriodSeconds=grace, resourceVersion=str(self._rv)
            )
        return pod

    def _evict(self, ns: str, name: str, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict) or body.get("kind") != "Eviction":
            raise _Error(400, "BadRequest", "the body of the request was not a policy/v1 Eviction")
        if (body.get("metadata") or {}).get("name") != name:
            raise _Error(400, "BadRequest", "name in URL does not match name in Eviction object")
        pod = self._get_pod(ns, name)
        labels = pod["metadata"].get("labels") or {}
        pdbs = [
            p
            for (pns, _), p in self._pdbs.items()
            if pns == ns
            and _labels_match([(k, "=", {v}) for k, v in p["spec"]["selector"]["matchLabels"].items()], labels)
        ]
        if len(pdbs) > 1:
            raise _Error(
                500,
                "InternalError",
                "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support.",
            )
        if pdbs and not pod["metadata"].get("deletionTimestamp"):
            pdb = pdbs[0]
            if pdb["status"]["disruptionsAllowed"] <= 0:
                raise _Error(
                    429,
                    "TooManyRequests",
                    "Cannot evict pod as it would violate the pod's disruption budget.",
                    {
                        "causes": [
                            {
                                "reason": "DisruptionBudget",
                                "message": f"The disruption budget {pdb['metadata']['name']} needs "
                                f"{pdb['status']['desiredHealthy']} healthy pods and has "
                                f"{pdb['status']['currentHealthy']} currently",
                            }
                        ]
                    },
                )
            pdb["status"]["disruptionsAllowed"] -= 1
        self._delete_pod(ns, name, {}, body.get("deleteOptions") or {})
        return _status(201, "", "")


class _Handler(BaseHTTPRequestHandler):
    api: FakeKubeAPI
    protocol_version = "HTTP/1.1"  # keep-alive, as urllib3 pools connections

    def setup(self) -> None:
        super().setup()
        with self.api._lock:
            self.api._conns.add(self.connection)

    def finish(self) -> None:
        with self.api._lock:
            self.api._conns.discard(self.connection)
        super().finish()

    def _serve(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else b""
        code, out, _ = self.api.handle(self.command, self.path, dict(self.headers.items()), body)
        data = json.dumps(out).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve

    def log_message(self, format: str, *args: Any) -> None:  # quiet: tests read api.requests
        pass
