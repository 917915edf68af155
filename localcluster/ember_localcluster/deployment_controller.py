"""The local control plane's deployment and replicaset controllers (what `deployment.py` decides, applied).

`DeploymentController` talks to the API server only through the official `kubernetes` client, as
kube-controller-manager does through client-go: it lists and watches Deployments, ReplicaSets and pods,
and after each change takes one step for the object concerned. A ReplicaSet's step creates or deletes its
pods and writes its status, and creates or deletes again only once its informer has seen the pods it
created and deleted (`expectations.py`, as upstream); a Deployment's step creates the ReplicaSet of its current template (a name
taken by a ReplicaSet of another template raises `status.collisionCount`, as upstream does), sets the
ReplicaSets' replicas for the rollout, and writes its status. A pod's change wakes its ReplicaSet, a
ReplicaSet's its Deployment. A step that fails is retried a second later (`workqueue.py`).
"""

from __future__ import annotations

import functools
import json
import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from ember_localcluster import deployment as d
from ember_localcluster.expectations import Expectations
from ember_localcluster.informer import Informer
from ember_localcluster.workqueue import KeyedController

__all__ = ["DeploymentController"]

log = logging.getLogger("ember.deployments")

Key = tuple[str, str, str]  # (kind, namespace, name)


def _key(kind: str, obj: dict[str, Any]) -> Key:
    return (kind, obj["metadata"].get("namespace") or "default", obj["metadata"]["name"])


def _owner(obj: dict[str, Any], kind: str) -> str | None:
    for ref in obj["metadata"].get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") == kind:
            return str(ref["name"])
    return None


class DeploymentController(KeyedController[Key]):
    def __init__(self, kubeconfig: str | Path) -> None:
        super().__init__(kubeconfig, "deployments", log)
        self._objects: dict[Key, dict[str, Any]] = {}
        self._apps: Any = None
        self._expectations = Expectations()

    def _opened(self) -> None:
        self._apps = client.AppsV1Api(self._runtime.core.api_client)

    def _informers(self) -> list[Informer]:
        runtime = self._runtime
        return [
            runtime.informer(
                self._apps.list_deployment_for_all_namespaces,
                functools.partial(self._on_event, "Deployment"),
                name="deployments",
            ),
            runtime.informer(
                self._apps.list_replica_set_for_all_namespaces,
                functools.partial(self._on_event, "ReplicaSet"),
                name="replicasets",
            ),
            runtime.informer(
                runtime.core.list_pod_for_all_namespaces,
                functools.partial(self._on_event, "Pod"),
                name="deployment-pods",
            ),
        ]

    def _describe(self, key: Key) -> str:
        return f"{key[0]} {key[1]}/{key[2]}"

    # -- on the controller's loop ----------------------------------------------------------------------

    def _on_event(self, kind: str, event: str, obj: dict[str, Any]) -> None:
        key = _key(kind, obj)
        if event == "DELETED":
            self._objects.pop(key, None)
        else:
            self._objects[key] = obj
        if kind == "ReplicaSet" and event == "DELETED":
            self._expectations.forget(key)
        if kind == "Pod" and (rs := _owner(obj, "ReplicaSet")):
            rs_key = ("ReplicaSet", key[1], rs)
            if event == "DELETED" or obj["metadata"].get("deletionTimestamp"):
                self._expectations.deleted(rs_key, key[2])
            elif event == "ADDED":
                self._expectations.created(rs_key)
        if kind in ("Deployment", "ReplicaSet") and event != "DELETED":
            self._mark(key)
        parent = {"Pod": "ReplicaSet", "ReplicaSet": "Deployment"}.get(kind)
        owner = _owner(obj, parent) if parent else None
        if parent and owner:
            self._mark((parent, key[1], owner))

    async def _step(self, key: Key) -> None:
        if key[0] == "Deployment":
            await self._sync_deployment(key)
        else:
            await self._sync_replicaset(key)

    def _children(self, kind: str, owner: dict[str, Any]) -> list[dict[str, Any]]:
        namespace = owner["metadata"].get("namespace") or "default"
        return [
            o
            for (k, ns, _), o in self._objects.items()
            if k == kind and ns == namespace and d.owned_by(o, owner)
        ]

    async def _sync_replicaset(self, key: Key) -> None:
        rs = self._objects.get(key)
        if rs is None or rs["metadata"].get("deletionTimestamp"):
            return
        _, namespace, name = key
        core = self._runtime.core
        pods = self._children("Pod", rs)
        # Until the pods it last created and deleted are in the cache, the cache is stale: no action.
        create, delete = d.replicaset_actions(rs, pods) if self._expectations.satisfied(key) else (0, [])
        if create:
            self._expectations.expect(key, adds=create)
        for done in range(create):
            try:
                await self._call(core.create_namespaced_pod, namespace, d.replicaset_pod(rs))
            except Exception:
                for _ in range(create - done):  # none of the rest will be seen
                    self._expectations.created(key)
                raise
        if delete:
            self._expectations.expect(key, deletes=delete)
        for pod in delete:
            try:
                await self._call(core.delete_namespaced_pod, pod, namespace)
            except Exception as e:
                self._expectations.deleted(key, pod)
                if not (isinstance(e, ApiException) and e.status == 404):
                    raise
        status = d.replicaset_status(rs, pods, datetime.now(UTC))
        if create or delete:  # the pods' own events bring the next count
            return
        if {k: (rs.get("status") or {}).get(k) for k in status} != status:
            await self._call(
                self._apps.patch_namespaced_replica_set_status, name, namespace, {"status": status}
            )

    async def _sync_deployment(self, key: Key) -> None:
        deploy = self._objects.get(key)
        if deploy is None or deploy["metadata"].get("deletionTimestamp"):
            return
        _, namespace, name = key
        sets = self._children("ReplicaSet", deploy)
        new = next((rs for rs in sets if d.matches_template(rs, deploy)), None)
        old = [rs for rs in sets if rs is not new]
        if new is None:
            revision = 1 + max(
                (int((rs["metadata"].get("annotations") or {}).get(d.REVISION, 0)) for rs in old), default=0
            )
            wanted = d.new_replicaset(deploy, revision)
            try:
                created = await self._call(
                    self._apps.create_namespaced_replica_set, namespace, wanted, _preload_content=False
                )
            except ApiException as e:
                if e.status != 409:
                    raise
                # The name is taken by another template's ReplicaSet: a hash collision, as upstream counts it.
                count = int((deploy.get("status") or {}).get("collisionCount", 0)) + 1
                await self._call(
                    self._apps.patch_namespaced_deployment_status,
                    name,
                    namespace,
                    {"status": {"collisionCount": count}},
                )
                return
            new = json.loads(created.data)
            self._objects[_key("ReplicaSet", new)] = new
        for rs_name, replicas in d.rollout(deploy, new, old).items():
            patch: dict[str, Any] = {"spec": {"replicas": replicas}}
            if rs_name == new["metadata"]["name"]:
                surge, _ = d.surge_and_unavailable(deploy)
                want = int(deploy["spec"].get("replicas", 1))
                patch["metadata"] = {"annotations": {d.DESIRED: str(want), d.MAX: str(want + surge)}}
            await self._call(self._apps.patch_namespaced_replica_set, rs_name, namespace, patch)
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        status = d.deployment_status(deploy, new, old, now)
        current = deploy.get("status") or {}
        if {k: current.get(k) for k in status if k != "conditions"} != {
            k: v for k, v in status.items() if k != "conditions"
        } or [(c["type"], c["status"], c["reason"]) for c in current.get("conditions") or []] != [
            (c["type"], c["status"], c["reason"]) for c in status["conditions"]
        ]:
            await self._call(
                self._apps.patch_namespaced_deployment_status, name, namespace, {"status": status}
            )
