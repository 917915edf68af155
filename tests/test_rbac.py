"""The RBAC in manifests/, derived from what the running operator asks the API server for.

`ember operator` runs as a subprocess against the in-process API server through a recording reverse
proxy written here; a scenario drives every code path that calls the API (children created and repaired,
scaling, a policy change, a roll, External mode through /scale, a pod and a Service changed by hand, a
router's Deployment, RoleBinding and ServiceAccount's labels changed and the router turned off, a quota
refusal, multi-node replicas as LeaderWorkerSets, deletion). Each request is mapped to (apiGroup,
resource[/subresource], verb, namespace) the way the Kubernetes API server's request-info resolver does,
and the result is compared with the rendered manifests both ways: every request must be granted, and every
grant must have been requested or be in `NOT_OBSERVABLE` with its reason. Each install is checked with the operator started with the
arguments of its own Deployment: `manifests/base` (`--all-namespaces`), `manifests/ha` (with `--peering`,
next to its ClusterKopfPeering) and `manifests/namespaced` (`--namespace`, against its Role and the
ClusterRole it keeps). Each takes about 10 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from operator_harness import NAMESPACE, PodRunner, crd_manifest, wait_for
from test_manifests import grants, render

from ember_localcluster.apiserver import APIServer
from ember_localcluster.leaderworkerset import KIND as LWS_KIND
from ember_localcluster.leaderworkerset import NAME as LWS_NAME
from ember_localcluster.leaderworkerset import crd_manifest as lws_crd_manifest
from ember_localcluster.leaderworkerset_controller import LeaderWorkerSetController
from ember_operator.desired import HASH_LABEL, ROLE_LABEL
from ember_operator.spec import GROUP, PLURAL, VERSION

API_VERSION = f"{GROUP}/{VERSION}"
LWS_API = "leaderworkerset.x-k8s.io/v1"
TICK = 0.25
RESYNC = 3.0
EMBER = Path(sys.executable).with_name("ember")

# Grants that no request can show, each with the reason it is needed all the same. Nothing else may be
# granted without being requested. In the namespaced install these belong in the Role.
NOT_OBSERVABLE = {
    # Every owner reference the operator sets has blockOwnerDeletion: true. With the
    # OwnerReferencesPermissionEnforcement admission plugin (OpenShift, hardened clusters) the API server
    # then requires the creator of the child to be allowed to update the owner's finalizers: it checks
    # that while admitting the pod, Service, ConfigMap or PodDisruptionBudget, so no request of its own
    # shows it (and the API server here has no such plugin).
    (GROUP, f"{PLURAL}/finalizers", "update"),
    # Creating a RoleBinding to the ember-router ClusterRole: the API server's escalation check lets the
    # operator do it because it may `bind` that role; the check is part of the create, not a request.
    ("rbac.authorization.k8s.io", "clusterroles", "bind"),
}

# Hop-by-hop headers, and the encodings the proxy would otherwise have to re-encode.
_UNFORWARDED = {"host", "connection", "keep-alive", "transfer-encoding", "content-length", "accept-encoding"}
_UNRETURNED = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding"}


# -- the recording proxy -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Access:
    """One request as RBAC sees it; `namespace` is None for cluster-scoped and all-namespaces requests."""

    group: str
    resource: str  # plural, or plural/subresource
    verb: str
    namespace: str | None

    @property
    def grant(self) -> tuple[str, str, str]:
        return (self.group, self.resource, self.verb)


_VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete", "GET": "get"}


def access(method: str, path: str, query: dict[str, str]) -> Access | None:
    """The RBAC attributes of a request, as the API server's request-info resolver derives them; None for
    a non-resource path (discovery, /version), which every authenticated client may read."""
    parts = [p for p in path.split("/") if p]
    if parts[:1] == ["api"] and len(parts) > 2:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) > 3:
        group, rest = parts[1], parts[3:]
    else:
        return None
    verb = _VERBS[method]
    if rest[0] == "watch":  # the deprecated /watch/ path prefix
        verb, rest = "watch", rest[1:]
    namespace = None
    if rest[0] == "namespaces" and len(rest) > 1:
        namespace = rest[1]
        # /api/v1/namespaces/NAME/status and .../finalize are subresources of the namespace itself.
        if len(rest) > 2 and rest[2] not in ("status", "finalize"):
            rest = rest[2:]
    assert len(rest) <= 3, f"unexpected path {path}"
    resource = "/".join([rest[0], *rest[2:]])
    if len(rest) == 1:  # a collection
        if verb == "get":
            verb = "watch" if query.get("watch") in ("true", "1") else "list"
        elif verb == "delete":
            verb = "deletecollection"
    return Access(group, resource, verb, namespace)


class RecordingProxy:
    """A reverse proxy on 127.0.0.1 that forwards every request to `upstream` and records its method, path
    and query; responses, watch streams included, are passed through as they arrive."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.requests: list[tuple[str, str, dict[str, str], int]] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="rbac-proxy", daemon=True)

    def __enter__(self) -> RecordingProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(timeout=30)
        return self

    def __exit__(self, *exc_info: object) -> None:
        async def stop() -> None:
            assert self._runner is not None and self._session is not None
            await self._runner.cleanup()
            await self._session.close()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()

    async def _serve(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False
        )
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        await web.SockSite(self._runner, self._sock).start()

    def accesses(self) -> set[Access]:
        with self._lock:
            requests = list(self.requests)
        return {a for method, path, query, _ in requests if (a := access(method, path, query)) is not None}

    def non_resource_paths(self) -> set[str]:
        with self._lock:
            return {path for method, path, query, _ in self.requests if access(method, path, query) is None}

    def saw(self, method: str, path: str, status: int | None = None) -> bool:
        with self._lock:
            return any((m, p) == (method, path) and status in (None, s) for m, p, _, s in self.requests)

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _UNFORWARDED}
        async with self._session.request(
            request.method, self.upstream + request.path_qs, data=body or None, headers=headers
        ) as upstream:
            with self._lock:
                self.requests.append((request.method, request.path, dict(request.query), upstream.status))
            response = web.StreamResponse(
                status=upstream.status,
                reason=upstream.reason,
                headers={k: v for k, v in upstream.headers.items() if k.lower() not in _UNRETURNED},
            )
            await response.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
            except (ConnectionError, aiohttp.ClientConnectionError):
                pass  # the operator went away mid-stream (a watch at shutdown)
            return response


# -- the operator and the scenario ---------------------------------------------------------------------


@contextlib.contextmanager
def running_operator(
    api: APIServer, proxy: RecordingProxy, args: tuple[str, ...], tmp: Path
) -> Iterator[Path]:
    """`ember operator ARGS` (ports off, a short tick) with a kubeconfig that points at the proxy, until
    the block ends, then SIGINT (kopf stops on it as on a pod's SIGTERM). Yields the operator's log."""
    config = api.kubeconfig()
    config["clusters"][0]["cluster"]["server"] = proxy.url
    kubeconfig = tmp / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
    env["KUBECONFIG"] = str(kubeconfig)
    # Later flags win: the manifest's ports would collide with whatever else runs here. Children edited by
    # hand are put back at the resync (60 s by default): a short one here, as the tick is.
    command = [
        str(EMBER),
        "operator",
        *args,
        "--health-port=0",
        "--metrics-port=0",
        f"--tick={TICK}",
        f"--resync={RESYNC}",
    ]
    log = tmp / "operator.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield log
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _service(name: str, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": {"name": name, "source": f"/models/{name}"}, "resources": {"gpus": 0}}
    return {
        "apiVersion": API_VERSION,
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {**body, **spec},
    }


def _patch_spec(api: APIServer, name: str, spec: dict[str, Any]) -> None:
    api.patch(API_VERSION, "InferenceService", NAMESPACE, name, {"spec": spec})


def _status(api: APIServer, name: str) -> dict[str, Any]:
    obj = api.get(API_VERSION, "InferenceService", NAMESPACE, name)
    return (obj or {}).get("status") or {}


def _condition(api: APIServer, name: str, kind: str) -> dict[str, Any]:
    return next((c for c in _status(api, name).get("conditions") or [] if c["type"] == kind), {})


def _pods(api: APIServer, name: str, role: str | None = None) -> list[dict[str, Any]]:
    selector = f"app.kubernetes.io/instance={name}" + (f",{ROLE_LABEL}={role}" if role else "")
    listed = api.list("v1", "Pod", NAMESPACE, label_selector=selector)
    return [p for p in listed if not p["metadata"].get("deletionTimestamp")]


def _ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _converged(api: APIServer, name: str, active: int, warm: int) -> bool:
    obj = api.get(API_VERSION, "InferenceService", NAMESPACE, name)
    if obj is None:
        return False
    status = obj.get("status") or {}
    shape = [sum(_ready(p) for p in _pods(api, name, role)) for role in ("active", "warm")]
    return (
        shape == [active, warm]
        and len(_pods(api, name)) == active + warm
        and status.get("observedGeneration") == obj["metadata"]["generation"]
        # The engines as status reports them: `Ready` also wants a Ready router pod, and no Deployment
        # controller runs here to make one.
        and (status.get("readyReplicas"), status.get("warmReplicas")) == (active, warm)
    )


def _policy(api: APIServer, name: str) -> str:
    cm = api.get("v1", "ConfigMap", NAMESPACE, f"{name}-policy")
    return str(((cm or {}).get("data") or {}).get("policy.yaml", ""))


def _write_scale(api: APIServer, name: str, replicas: int) -> None:
    """What an HPA or `kubectl scale` sends: a patch of the scale subresource (straight to the API server:
    it is not the operator's request)."""
    url = f"{api.url}/apis/{GROUP}/{VERSION}/namespaces/{NAMESPACE}/{PLURAL}/{name}/scale"
    body = json.dumps({"spec": {"replicas": replicas}}).encode()
    request = urllib.request.Request(
        url, body, method="PATCH", headers={"Content-Type": "application/merge-patch+json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


def _groups(api: APIServer, name: str) -> list[dict[str, Any]]:
    listed = api.list(LWS_API, LWS_KIND, NAMESPACE, label_selector=f"app.kubernetes.io/instance={name}")
    return [g for g in listed if not g["metadata"].get("deletionTimestamp")]


def _groups_converged(api: APIServer, name: str, active: int, warm: int) -> bool:
    """Groups by role whose pods are all there and Ready, and the Service's pods (their leaders)."""
    shape = {"active": 0, "warm": 0}
    for g in _groups(api, name):
        pods = api.list("v1", "Pod", NAMESPACE, label_selector=f"{LWS_NAME}={g['metadata']['name']}")
        if len(pods) == 2 and all(_ready(p) for p in pods):
            shape[g["metadata"]["labels"][ROLE_LABEL]] += 1
    return shape == {"active": active, "warm": warm} and len(_pods(api, name, "active")) == active


def run_scenario(api: APIServer, proxy: RecordingProxy) -> None:
    """Every path of the operator that calls the API, in one pass. The test's own changes go straight to
    the API server; only the operator's requests pass the proxy."""
    pods_url = f"/api/v1/namespaces/{NAMESPACE}/pods"
    api.create(
        {
            "apiVersion": "v1",
            "kind": "ResourceQuota",
            "metadata": {"name": "gpus", "namespace": NAMESPACE},
            "spec": {"hard": {"requests.nvidia.com/gpu": "0"}},
        }
    )
    api.create(_service("main", replicas={"min": 1, "max": 3}, warmPool={"size": 1}))
    # reads main's endpoint; without a router its Service selects the engines
    api.create(_service("backup", fallback={"service": "main"}, router={"enabled": False}))
    api.create(_service("gpu", resources={"gpus": 1}))  # refused by the quota
    wait_for(lambda: _converged(api, "main", 1, 1), what="main: 1 active + 1 warm")
    wait_for(lambda: _converged(api, "backup", 1, 0), what="backup: 1 active")
    assert "main.default.svc" in _policy(api, "backup")
    wait_for(lambda: _condition(api, "gpu", "Stalled").get("reason") == "QuotaExceeded", what="QuotaExceeded")
    assert proxy.saw("POST", pods_url, 403)

    # Scaling promotes the warm pod, refills the pool and moves the PodDisruptionBudget.
    _patch_spec(api, "main", {"replicas": {"min": 2, "max": 3}})
    wait_for(lambda: _converged(api, "main", 2, 1), what="main: 2 active + 1 warm")
    # A policy field changes only the ConfigMap.
    _patch_spec(api, "main", {"loadShedding": {"maxQueueDepth": 3}})
    wait_for(lambda: "maxQueueDepth: 3" in _policy(api, "main"), what="the policy ConfigMap updated")
    # An engine field rolls the pods.
    old = {p["metadata"]["labels"][HASH_LABEL] for p in _pods(api, "main")}
    _patch_spec(api, "main", {"engine": {"maxNumSeqs": 64}})
    wait_for(
        lambda: (
            _converged(api, "main", 2, 1)
            and not old & {p["metadata"]["labels"][HASH_LABEL] for p in _pods(api, "main")}
        ),
        what="main rolled",
    )
    # External mode follows what an HPA writes through /scale.
    _patch_spec(api, "main", {"autoscaling": {"mode": "External"}})
    _write_scale(api, "main", 3)
    wait_for(lambda: _converged(api, "main", 3, 1), what="main: 3 active after /scale")

    # Drift: a pod deleted and the Service edited by hand.
    victim = _pods(api, "backup")[0]["metadata"]["name"]
    api.delete("v1", "Pod", NAMESPACE, victim)
    api.patch("v1", "Service", NAMESPACE, "backup", {"spec": {"selector": {ROLE_LABEL: "warm"}}})

    def repaired() -> bool:
        svc = api.get("v1", "Service", NAMESPACE, "backup")
        names = {p["metadata"]["name"] for p in _pods(api, "backup")}
        return (
            svc is not None
            and svc["spec"]["selector"][ROLE_LABEL] == "active"
            and victim not in names
            and _converged(api, "backup", 1, 0)
        )

    wait_for(repaired, what="backup's pod and Service repaired")
    # The proxy records a request once the API server has answered it, after the change it made shows to
    # this test's own reads: wait for the record, briefly.
    put = f"/api/v1/namespaces/{NAMESPACE}/services/backup"
    wait_for(lambda: proxy.saw("PUT", put), timeout=10, what=f"the operator's PUT {put} through the proxy")

    # The router: its Deployment follows spec.router, its RoleBinding and its ServiceAccount's labels are
    # put back when edited by hand, and turning it off deletes its Deployment, RoleBinding and
    # ServiceAccount.
    rbac = "rbac.authorization.k8s.io/v1"
    _patch_spec(api, "main", {"router": {"epsilon": 0.5}})

    def router_args() -> list[str]:
        deploy = api.get("apps/v1", "Deployment", NAMESPACE, "main-router")
        return list(deploy["spec"]["template"]["spec"]["containers"][0]["args"]) if deploy else []

    wait_for(lambda: "--epsilon=0.5" in router_args(), what="main's router Deployment updated")
    stranger = [{"kind": "ServiceAccount", "name": "default", "namespace": NAMESPACE}]
    api.patch(rbac, "RoleBinding", NAMESPACE, "main-router", {"subjects": stranger})
    wait_for(
        lambda: (
            api.get(rbac, "RoleBinding", NAMESPACE, "main-router")["subjects"][0]["name"] == "main-router"
        ),
        what="main's router RoleBinding put back",
    )
    # `kubectl label sa main-router ember.dev/role-`: the operator puts the label back (a PUT).
    api.patch("v1", "ServiceAccount", NAMESPACE, "main-router", {"metadata": {"labels": {ROLE_LABEL: None}}})

    def account_labelled() -> bool:
        account = api.get("v1", "ServiceAccount", NAMESPACE, "main-router")
        return account is not None and account["metadata"].get("labels", {}).get(ROLE_LABEL) == "router"

    wait_for(account_labelled, what="main's router ServiceAccount's labels put back")
    put = f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/main-router"
    wait_for(lambda: proxy.saw("PUT", put), timeout=10, what=f"the operator's PUT {put} through the proxy")
    _patch_spec(api, "main", {"router": {"enabled": False}})
    wait_for(
        lambda: (
            not any(
                api.get(v, k, NAMESPACE, "main-router")
                for v, k in (("apps/v1", "Deployment"), (rbac, "RoleBinding"), ("v1", "ServiceAccount"))
            )
        ),
        what="main's router objects deleted",
    )

    # A multi-node service: its replicas are LeaderWorkerSets, created, promoted (relabelled) and, when an
    # engine field changes, replaced.
    api.delete("v1", "ResourceQuota", NAMESPACE, "gpus")
    api.create(_service("duo", resources={"gpus": 1, "nodes": 2}, warmPool={"size": 1}))
    wait_for(lambda: _groups_converged(api, "duo", 1, 1), what="duo: 1 active + 1 warm group")
    groups_before = {g["metadata"]["name"] for g in _groups(api, "duo")}
    _patch_spec(api, "duo", {"engine": {"maxNumSeqs": 64}})
    wait_for(
        lambda: (
            _groups_converged(api, "duo", 1, 1)
            and not groups_before & {g["metadata"]["name"] for g in _groups(api, "duo")}
        ),
        what="duo's groups rolled",
    )

    for name in ("main", "backup", "gpu", "duo"):
        api.delete(API_VERSION, "InferenceService", NAMESPACE, name)
    wait_for(
        lambda: (
            not api.list(API_VERSION, "InferenceService", NAMESPACE) and not api.list("v1", "Pod", NAMESPACE)
        ),
        what="everything deleted and garbage-collected",
    )


@dataclass(frozen=True)
class Observed:
    args: tuple[str, ...]
    accesses: frozenset[Access]
    non_resource: frozenset[str]
    log: str

    def at(self, namespace: str | None) -> set[tuple[str, str, str]]:
        """The grants requested in `namespace` (None: cluster-scoped and all-namespaces requests)."""
        return {a.grant for a in self.accesses if a.namespace == namespace}

    def namespaces(self) -> set[str]:
        return {a.namespace for a in self.accesses if a.namespace is not None}

    def show(self) -> str:
        rows = sorted(
            f"{a.namespace or '(cluster)'} {a.group or 'core'} {a.resource} {a.verb}" for a in self.accesses
        )
        lines = [line for line in self.log.splitlines() if "succeeded" not in line]
        return (
            f"ember operator {' '.join(self.args)} requested:\n  "
            + "\n  ".join(rows)
            + "\noperator log (tail, without successes):\n"
            + "\n".join(lines[-40:])
        )


def _deployment_args(docs: tuple[dict[str, Any], ...]) -> tuple[str, ...]:
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return tuple(str(a) for a in container["args"])


def observe(overlay: str, tmp: Path) -> Observed:
    """Run the scenario under the operator started with the overlay's own arguments, next to what the
    overlay installs for it (kopf's peering CRDs and object in ha/)."""
    docs = render(overlay)
    args = _deployment_args(docs)
    with APIServer(pod_graceful_deletion=False, bookmark_interval=1.0) as api:
        api.install_crd(crd_manifest())
        api.install_crd(lws_crd_manifest())
        for doc in docs:
            if doc["kind"] == "CustomResourceDefinition":
                api.install_crd(doc)
        for doc in docs:
            if doc["kind"] == "ClusterKopfPeering":
                api.create(doc)
        runner = PodRunner(api).start()
        # The cluster's LeaderWorkerSet controller talks to the API server directly: not the operator's.
        lws = LeaderWorkerSetController(api.write_kubeconfig(tmp / "cluster-kubeconfig")).start()
        try:
            with RecordingProxy(api.url) as proxy:
                with running_operator(api, proxy, args, tmp) as log:
                    wait_for(
                        lambda: any(a.resource == PLURAL and a.verb == "watch" for a in proxy.accesses()),
                        what=f"the operator watching {PLURAL} (its log: {log})",
                    )
                    try:
                        run_scenario(api, proxy)
                    except AssertionError as e:
                        raise AssertionError(f"{e}\noperator log:\n{log.read_text()[-4000:]}") from None
                return Observed(
                    args, frozenset(proxy.accesses()), frozenset(proxy.non_resource_paths()), log.read_text()
                )
        finally:
            lws.stop()
            runner.stop()


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Observed]:
    """`observed(overlay)`: the operator's requests under that overlay's arguments, each mode run once."""
    runs: dict[str, Observed] = {}

    def get(overlay: str) -> Observed:
        if overlay not in runs:
            runs[overlay] = observe(overlay, tmp_path_factory.mktemp(overlay))
        return runs[overlay]

    return get


# -- what the manifests grant --------------------------------------------------------------------------


def _bound(
    docs: tuple[dict[str, Any], ...],
) -> tuple[set[tuple[str, str, str]], dict[str, set[tuple[str, str, str]]]]:
    """What the operator's ServiceAccount is granted: cluster-wide (ClusterRoleBindings), and by namespace
    (RoleBindings, to a Role or a ClusterRole)."""
    subject = {"kind": "ServiceAccount", "name": "ember-operator", "namespace": "ember-system"}
    roles = {
        (d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d
        for d in docs
        if d["kind"] in ("Role", "ClusterRole")
    }
    cluster: set[tuple[str, str, str]] = set()
    by_namespace: dict[str, set[tuple[str, str, str]]] = {}
    for binding in docs:
        if binding["kind"] not in ("ClusterRoleBinding", "RoleBinding") or subject not in binding["subjects"]:
            continue
        ref = binding["roleRef"]
        namespace = binding["metadata"].get("namespace") if binding["kind"] == "RoleBinding" else None
        role = roles[(ref["kind"], namespace if ref["kind"] == "Role" else None, ref["name"])]
        if namespace is None:
            cluster |= grants(role)
        else:
            by_namespace.setdefault(namespace, set()).update(grants(role))
    return cluster, by_namespace


def _ungranted(
    seen: Observed, cluster: set[tuple[str, str, str]], by_namespace: dict[str, set[tuple[str, str, str]]]
) -> list[Access]:
    return sorted(
        (
            a
            for a in seen.accesses
            if a.grant not in cluster
            and (a.namespace is None or a.grant not in by_namespace.get(a.namespace, set()))
        ),
        key=str,
    )


# -- the tests -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "query", "expected"),
    [
        ("GET", "/api/v1/pods", {}, ("", "pods", "list", None)),
        ("GET", "/api/v1/pods", {"watch": "true", "labelSelector": "a=b"}, ("", "pods", "watch", None)),
        ("GET", "/api/v1/namespaces/ns/pods", {"watch": "1"}, ("", "pods", "watch", "ns")),
        ("GET", "/api/v1/watch/namespaces/ns/pods/p", {}, ("", "pods", "watch", "ns")),
        ("GET", "/api/v1/namespaces/ns/pods/p", {}, ("", "pods", "get", "ns")),
        ("POST", "/api/v1/namespaces/ns/events", {}, ("", "events", "create", "ns")),
        ("PUT", "/api/v1/namespaces/ns/services/s", {}, ("", "services", "update", "ns")),
        ("PATCH", "/api/v1/namespaces/ns/pods/p", {}, ("", "pods", "patch", "ns")),
        ("DELETE", "/api/v1/namespaces/ns/pods/p", {}, ("", "pods", "delete", "ns")),
        ("DELETE", "/api/v1/namespaces/ns/pods", {}, ("", "pods", "deletecollection", "ns")),
        (
            "PATCH",
            f"/apis/{GROUP}/{VERSION}/namespaces/ns/{PLURAL}/x/status",
            {},
            (GROUP, f"{PLURAL}/status", "patch", "ns"),
        ),
        ("GET", f"/apis/{GROUP}/{VERSION}/{PLURAL}", {"watch": "true"}, (GROUP, PLURAL, "watch", None)),
        (
            "PUT",
            "/apis/policy/v1/namespaces/ns/poddisruptionbudgets/x",
            {},
            ("policy", "poddisruptionbudgets", "update", "ns"),
        ),
        # Namespaces: the collection, one namespace, and its own subresources.
        ("GET", "/api/v1/namespaces", {"watch": "true"}, ("", "namespaces", "watch", None)),
        ("GET", "/api/v1/namespaces/ns", {}, ("", "namespaces", "get", "ns")),
        ("PUT", "/api/v1/namespaces/ns/finalize", {}, ("", "namespaces/finalize", "update", "ns")),
        # Discovery and other non-resource paths.
        ("GET", "/api", {}, None),
        ("GET", "/api/v1", {}, None),
        ("GET", f"/apis/{GROUP}/{VERSION}", {}, None),
        ("GET", "/version", {}, None),
    ],
)
def test_requests_map_to_rbac_attributes_as_the_api_server_maps_them(
    method: str, path: str, query: dict[str, str], expected: tuple[str, str, str, str | None] | None
) -> None:
    assert access(method, path, query) == (Access(*expected) if expected else None)


# What `system:discovery` and `system:public-info-viewer` let every authenticated client read.
_DISCOVERY = re.compile(r"/api(/[^/]+)?|/apis(/[^/]+){0,2}|/version/?|/openapi(/.*)?|/(healthz|livez|readyz)")


@pytest.mark.parametrize("overlay", ["base", "ha", "namespaced"])
def test_outside_the_resource_api_the_operator_reads_only_discovery(
    observed: Callable[[str], Observed], overlay: str
) -> None:
    seen = observed(overlay)
    assert {p for p in seen.non_resource if not _DISCOVERY.fullmatch(p)} == set(), seen.show()


@pytest.mark.parametrize("overlay", ["base", "ha"])
def test_a_cluster_wide_install_grants_exactly_what_the_operator_requests(
    observed: Callable[[str], Observed], overlay: str
) -> None:
    seen = observed(overlay)
    assert "--all-namespaces" in seen.args
    cluster, by_namespace = _bound(render(overlay))
    assert by_namespace == {}
    ungranted = _ungranted(seen, cluster, by_namespace)
    assert not ungranted, f"requested but not granted: {ungranted}\n{seen.show()}"
    unused = cluster - {a.grant for a in seen.accesses}
    assert unused == NOT_OBSERVABLE, f"granted but never requested: {sorted(unused)}\n{seen.show()}"


def test_the_namespaced_install_grants_exactly_what_the_operator_requests(
    observed: Callable[[str], Observed],
) -> None:
    seen = observed("namespaced")
    cluster, by_namespace = _bound(render("namespaced"))
    watched = {a.split("=", 1)[1] for a in seen.args if a.startswith("--namespace=")}
    assert watched == {NAMESPACE}  # where the pod runner starts pods
    assert seen.namespaces() == watched
    assert set(by_namespace) == watched
    ungranted = _ungranted(seen, cluster, by_namespace)
    assert not ungranted, f"requested but not granted: {ungranted}\n{seen.show()}"
    # Cluster-wide only what cannot be had in a namespace (kopf's observers), and nothing unused.
    assert cluster == seen.at(None), seen.show()
    for namespace in watched:
        expected = (seen.at(namespace) - cluster) | NOT_OBSERVABLE
        assert by_namespace[namespace] == expected, seen.show()
