"""The local control plane's disruption controller: it keeps each PodDisruptionBudget's status, which the
`pods/eviction` subresource (`apiserver/eviction.py`) reads and spends.

As kube-controller-manager's `DisruptionController` (pkg/controller/disruption/disruption.go), through the
official client: it lists and watches PDBs, pods, ReplicaSets and Deployments, and syncs a PDB when it
changes and when a pod it selects changes. A sync (`trySync`):

* selects the PDB's pods in its namespace (a nil selector selects none, `{}` all);
* computes `expectedPods` and `desiredHealthy` (`getExpectedPodCount`): an integer `minAvailable` is
  the desired count and the selected pods are the expected ones, with no controller asked; a percent
  `minAvailable` (rounded up) or any `maxUnavailable` (rounded up, desired = expected - it, at least 0)
  needs the expected count from the pods' controllers (`getExpectedScale`): each pod's controller
  reference is resolved by the finders, a ReplicaSet (skipped when a Deployment controls it), a
  Deployment through its ReplicaSet, and any other kind through its `/scale` subresource
  (`getScaleController`: the scale's `spec.replicas`, when its uid is the reference's). The expected
  count is the sum of `spec.replicas` over the distinct controllers, so pods beyond a controller's scale
  (an InferenceService's warm pods, which its scale does not count) do not raise it. A pod with no
  controller reference is left out (upstream then records an `UnmanagedPods` event); a kind without
  `/scale` fails the sync ("PLURAL.GROUP does not implement the scale subresource"), as does a pod
  whose controller no finder resolves ("found no controllers for pod \"NAME\"");
* keeps in `disruptedPods` only the evicted pods still present, not being deleted and evicted less
  than `DELETION_TIMEOUT` (2 minutes) ago, and syncs again when the oldest of them expires;
* counts `currentHealthy`: the Ready pods that are neither being deleted nor in `disruptedPods`;
* writes (a PUT of `/status`, only when something changed) `disruptionsAllowed` = currentHealthy -
  desiredHealthy (0 when negative or when no pod is expected), `observedGeneration`, and the
  `DisruptionAllowed` condition (True/SufficientPods when a disruption is allowed, else
  False/InsufficientPods).

A sync that fails for another reason than a write conflict fails safe (`failSafe`): `disruptionsAllowed`
0 and the condition False with reason `SyncFailed` and the error as its message; `observedGeneration` is
left as it was, so a budget never synced keeps refusing evictions as not yet processed. Not modelled:
events, StatefulSets and ReplicationControllers (the local API server serves neither), and clearing
stale `DisruptionTarget` pod conditions.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from ember_localcluster.apiserver.eviction import is_ready, selector_matches, set_status_condition
from ember_localcluster.informer import Informer
from ember_localcluster.workqueue import KeyedController

__all__ = ["DELETION_TIMEOUT", "DisruptionController"]

log = logging.getLogger("ember.disruption")

DELETION_TIMEOUT = timedelta(minutes=2)
Key = tuple[str, str]  # (namespace, PDB name)
ObjKey = tuple[str, str, str]  # (kind, namespace, name)
STAMP = "%Y-%m-%dT%H:%M:%SZ"


class SyncFailed(Exception):
    """A reason a PDB's status cannot be computed; its text becomes the SyncFailed condition's message."""


def _controller_of(obj: dict[str, Any]) -> dict[str, Any] | None:
    """`metav1.GetControllerOf`."""
    for ref in obj["metadata"].get("ownerReferences") or []:
        if ref.get("controller"):
            return dict(ref)
    return None


def _group_kind_is(ref: dict[str, Any], kind: str, groups: tuple[str, ...]) -> bool:
    """`verifyGroupKind`."""
    group = str(ref.get("apiVersion") or "").rpartition("/")[0]
    return ref.get("kind") == kind and group in groups


def _scaled(value: Any, total: int) -> int:
    """`intstr.GetScaledValueFromIntOrPercent(value, total, roundUp=true)`."""
    if isinstance(value, str):
        if not value.endswith("%"):
            raise SyncFailed(f"invalid value for IntOrString: invalid value {value!r}")
        return math.ceil(int(value[:-1]) * total / 100)
    return int(value)


def _request(
    api_client: Any, method: str, path: str, body: Any = None, _request_timeout: float | None = None
) -> Any:
    """A request through the official client's connection and settings, with the body sent as given (the
    typed methods turn a dict into their model first, which rewrites timestamps); its decoded answer, an
    ApiException unless 2xx."""
    method, url, headers, data, post = api_client.param_serialize(
        method,
        path,
        header_params={"Content-Type": "application/json"} if body is not None else None,
        body=body,
        auth_settings=["BearerToken"],
    )
    response = api_client.call_api(method, url, headers, data, post, _request_timeout=_request_timeout)
    response.read()
    if not 200 <= response.status < 300:
        raise ApiException(status=response.status, reason=response.reason, body=response.data)
    return json.loads(response.data)


def _parse(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


class DisruptionController(KeyedController[Key]):
    def __init__(self, kubeconfig: str | Path) -> None:
        super().__init__(kubeconfig, "disruption", log)
        self._objects: dict[ObjKey, dict[str, Any]] = {}
        self._policy: Any = None
        self._apps: Any = None

    def _opened(self) -> None:
        api_client = self._runtime.core.api_client
        self._policy = client.PolicyV1Api(api_client)
        self._apps = client.AppsV1Api(api_client)

    def _informers(self) -> list[Informer]:
        runtime = self._runtime
        return [
            runtime.informer(
                self._policy.list_pod_disruption_budget_for_all_namespaces,
                functools.partial(self._on_event, "PodDisruptionBudget"),
                name="disruption-pdbs",
            ),
            runtime.informer(
                runtime.core.list_pod_for_all_namespaces,
                functools.partial(self._on_event, "Pod"),
                name="disruption-pods",
            ),
            runtime.informer(
                self._apps.list_replica_set_for_all_namespaces,
                functools.partial(self._on_event, "ReplicaSet"),
                name="disruption-replicasets",
            ),
            runtime.informer(
                self._apps.list_deployment_for_all_namespaces,
                functools.partial(self._on_event, "Deployment"),
                name="disruption-deployments",
            ),
        ]

    def _describe(self, key: Key) -> str:
        return f"PodDisruptionBudget {key[0]}/{key[1]}"

    # -- on the controller's loop ----------------------------------------------------------------------

    def _on_event(self, kind: str, event: str, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        key = (kind, meta.get("namespace") or "default", meta["name"])
        if event == "DELETED":
            self._objects.pop(key, None)
        else:
            self._objects[key] = obj
        if kind == "PodDisruptionBudget":
            self._mark(key[1:])
        elif kind == "Pod":
            # getPdbForPod: the budgets selecting the pod (upstream picks one of several; all are woken here).
            labels = meta.get("labels") or {}
            for pdb in self._of_kind("PodDisruptionBudget", key[1]):
                if selector_matches((pdb.get("spec") or {}).get("selector"), labels):
                    self._mark((key[1], pdb["metadata"]["name"]))

    def _of_kind(self, kind: str, namespace: str) -> list[dict[str, Any]]:
        return [o for (k, ns, _), o in self._objects.items() if k == kind and ns == namespace]

    async def _step(self, key: Key) -> None:
        pdb = self._objects.get(("PodDisruptionBudget", *key))
        if pdb is None:
            return
        try:
            await self._try_sync(pdb)
        except ApiException as error:
            if error.status == 409:
                raise  # retried without failing safe
            await self._fail_safe(pdb, f"{error.status} {error.reason}")
        except SyncFailed as error:
            await self._fail_safe(pdb, str(error))

    async def _try_sync(self, pdb: dict[str, Any]) -> None:
        namespace = pdb["metadata"]["namespace"]
        selector = (pdb.get("spec") or {}).get("selector")
        pods = [
            p
            for p in self._of_kind("Pod", namespace)
            if selector_matches(selector, p["metadata"].get("labels") or {})
        ]
        expected, desired = await self._expected_pod_count(pdb, pods)
        now = datetime.now(UTC).replace(microsecond=0)
        disrupted, recheck = self._disrupted_pod_map(pods, pdb, now)
        healthy = sum(
            1
            for p in pods
            if not p["metadata"].get("deletionTimestamp")
            and not (
                p["metadata"]["name"] in disrupted
                and _parse(disrupted[p["metadata"]["name"]]) + DELETION_TIMEOUT > now
            )
            and is_ready(p)
        )
        await self._update_status(pdb, healthy, desired, expected, disrupted, now)
        if recheck is not None:
            key = (namespace, pdb["metadata"]["name"])
            delay = (recheck - now).total_seconds()
            asyncio.get_running_loop().call_later(max(0.0, delay), self._mark, key)

    async def _expected_pod_count(self, pdb: dict[str, Any], pods: list[dict[str, Any]]) -> tuple[int, int]:
        """`getExpectedPodCount`: (expectedPods, desiredHealthy)."""
        spec = pdb.get("spec") or {}
        if spec.get("maxUnavailable") is not None:
            expected = await self._expected_scale(pods)
            return expected, max(0, expected - _scaled(spec["maxUnavailable"], expected))
        min_available = spec.get("minAvailable")
        if isinstance(min_available, int):
            return len(pods), min_available
        if isinstance(min_available, str):
            expected = await self._expected_scale(pods)
            return expected, _scaled(min_available, expected)
        return 0, 0

    async def _expected_scale(self, pods: list[dict[str, Any]]) -> int:
        """`getExpectedScale`: the sum of the scales of the pods' distinct controllers."""
        scales: dict[str, int] = {}
        for pod in pods:
            ref = _controller_of(pod)
            if ref is None:  # unmanaged: left out
                continue
            if ref.get("uid") in scales:
                continue
            namespace = pod["metadata"].get("namespace") or "default"
            for finder in (self._replicaset, self._deployment, self._scale_controller):
                found = await finder(ref, namespace)
                if found is not None:
                    scales[found[0]] = found[1]
                    break
            else:
                raise SyncFailed(f'found no controllers for pod "{pod["metadata"]["name"]}"')
        return sum(scales.values())

    def _cached(self, kind: str, namespace: str, ref: dict[str, Any]) -> dict[str, Any] | None:
        obj = self._objects.get((kind, namespace, str(ref.get("name"))))
        if obj is None or obj["metadata"].get("uid") != ref.get("uid"):
            return None
        return obj

    async def _replicaset(self, ref: dict[str, Any], namespace: str) -> tuple[str, int] | None:
        """`getPodReplicaSet`: a ReplicaSet not controlled by a Deployment."""
        if not _group_kind_is(ref, "ReplicaSet", ("apps", "extensions")):
            return None
        rs = self._cached("ReplicaSet", namespace, ref)
        if rs is None:
            return None
        owner = _controller_of(rs)
        if owner is not None and owner.get("kind") == "Deployment":
            return None
        return rs["metadata"]["uid"], int((rs.get("spec") or {}).get("replicas", 1))

    async def _deployment(self, ref: dict[str, Any], namespace: str) -> tuple[str, int] | None:
        """`getPodDeployment`: the Deployment controlling the pod's ReplicaSet."""
        if not _group_kind_is(ref, "ReplicaSet", ("apps", "extensions")):
            return None
        rs = self._cached("ReplicaSet", namespace, ref)
        if rs is None:
            return None
        owner = _controller_of(rs)
        if owner is None or not _group_kind_is(owner, "Deployment", ("apps", "extensions")):
            return None
        deployment = self._cached("Deployment", namespace, owner)
        if deployment is None:
            return None
        return deployment["metadata"]["uid"], int((deployment.get("spec") or {}).get("replicas", 1))

    async def _get(self, path: str) -> Any:
        return await self._call(functools.partial(_request, self._runtime.core.api_client, "GET", path))

    async def _scale_controller(self, ref: dict[str, Any], namespace: str) -> tuple[str, int] | None:
        """`getScaleController`: any kind, through its `/scale` subresource."""
        api_version = str(ref.get("apiVersion") or "")
        group = api_version.rpartition("/")[0]
        root = f"/apis/{api_version}" if group else f"/api/{api_version}"
        try:
            resources = (await self._get(root)).get("resources") or []
        except ApiException as error:
            if error.status != 404:
                raise
            resources = []
        # The RESTMapper's answer for the kind: its resource (not a subresource) in that group and version.
        plural = next(
            (r["name"] for r in resources if r.get("kind") == ref.get("kind") and "/" not in r["name"]), None
        )
        if plural is None:
            raise SyncFailed(f'no matches for kind "{ref.get("kind")}" in version "{api_version}"')
        resource = f"{plural}.{group}" if group else plural
        try:
            scale = await self._get(f"{root}/namespaces/{namespace}/{plural}/{ref.get('name')}/scale")
        except ApiException as error:
            if error.status != 404:
                raise
            # Not found: the object is gone, or its kind has no /scale (`implementsScale`).
            if not any(
                r["name"] == f"{plural}/scale"
                and r.get("kind") == "Scale"
                and r.get("group") == "autoscaling"
                for r in resources
            ):
                raise SyncFailed(f"{resource} does not implement the scale subresource") from None
            return None
        if scale["metadata"].get("uid") != ref.get("uid"):
            return None
        return scale["metadata"]["uid"], int((scale.get("spec") or {}).get("replicas") or 0)

    def _disrupted_pod_map(
        self, pods: list[dict[str, Any]], pdb: dict[str, Any], now: datetime
    ) -> tuple[dict[str, str], datetime | None]:
        """`buildDisruptedPodMap`: the evictions still pending, and when the first of them expires."""
        recorded = (pdb.get("status") or {}).get("disruptedPods") or {}
        result: dict[str, str] = {}
        recheck: datetime | None = None
        for pod in pods:
            name = pod["metadata"]["name"]
            if pod["metadata"].get("deletionTimestamp") or name not in recorded:
                continue
            expires = _parse(recorded[name]) + DELETION_TIMEOUT
            if expires < now:
                log.info(
                    "pod %s/%s was expected by PDB %s to be deleted but it wasn't",
                    pod["metadata"].get("namespace"),
                    name,
                    pdb["metadata"]["name"],
                )
                continue
            if recheck is None or expires < recheck:
                recheck = expires
            result[name] = recorded[name]
        return result, recheck

    async def _update_status(
        self,
        pdb: dict[str, Any],
        healthy: int,
        desired: int,
        expected: int,
        disrupted: dict[str, str],
        now: datetime,
    ) -> None:
        """`updatePdbStatus`: write only when a count, the disrupted pods, the generation or the
        condition is out of date."""
        allowed = healthy - desired
        if expected <= 0 or allowed <= 0:
            allowed = 0
        old = pdb.get("status") or {}
        generation = int(pdb["metadata"].get("generation") or 0)
        counts = {
            "currentHealthy": healthy,
            "desiredHealthy": desired,
            "expectedPods": expected,
            "disruptionsAllowed": allowed,
        }
        if (
            all(int(old.get(k) or 0) == v for k, v in counts.items())
            and (old.get("disruptedPods") or {}) == disrupted
            and int(old.get("observedGeneration") or 0) == generation
            and self._conditions_up_to_date(pdb)
        ):
            return
        status: dict[str, Any] = {**counts, "observedGeneration": generation}
        if disrupted:
            status["disruptedPods"] = disrupted
        status["conditions"] = list(old.get("conditions") or [])
        ok = allowed > 0
        condition = {
            "type": "DisruptionAllowed",
            "status": "True" if ok else "False",
            "reason": "SufficientPods" if ok else "InsufficientPods",
            "message": "",
            "observedGeneration": generation,
        }
        set_status_condition(status, condition, now.strftime(STAMP))
        await self._write_status(pdb, status)

    @staticmethod
    def _conditions_up_to_date(pdb: dict[str, Any]) -> bool:
        """`pdbhelper.ConditionsAreUpToDate`."""
        status = pdb.get("status") or {}
        condition = next(
            (c for c in status.get("conditions") or [] if c.get("type") == "DisruptionAllowed"), None
        )
        if condition is None or int(status.get("observedGeneration") or 0) != int(
            pdb["metadata"].get("generation") or 0
        ):
            return False
        if int(status.get("disruptionsAllowed") or 0) > 0:
            return bool(condition.get("status") == "True" and condition.get("reason") == "SufficientPods")
        return bool(condition.get("status") == "False" and condition.get("reason") == "InsufficientPods")

    async def _fail_safe(self, pdb: dict[str, Any], message: str) -> None:
        """`failSafe`: nothing may be disrupted while the status cannot be computed."""
        log.warning(
            "PodDisruptionBudget %s/%s: %s", pdb["metadata"]["namespace"], pdb["metadata"]["name"], message
        )
        status = dict(pdb.get("status") or {})
        status["disruptionsAllowed"] = 0
        condition = {
            "type": "DisruptionAllowed",
            "status": "False",
            "reason": "SyncFailed",
            "message": message,
            "observedGeneration": int(status.get("observedGeneration") or 0),
        }
        set_status_condition(status, condition, datetime.now(UTC).strftime(STAMP))
        if status != (pdb.get("status") or {}):
            await self._write_status(pdb, status)

    async def _write_status(self, pdb: dict[str, Any], status: dict[str, Any]) -> None:
        meta = pdb["metadata"]
        body = {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {
                "name": meta["name"],
                "namespace": meta["namespace"],
                "resourceVersion": meta["resourceVersion"],
            },
            "spec": pdb.get("spec") or {},
            "status": status,
        }
        path = f"/apis/policy/v1/namespaces/{meta['namespace']}/poddisruptionbudgets/{meta['name']}/status"
        api_client = self._runtime.core.api_client
        updated = await self._call(functools.partial(_request, api_client, "PUT", path, body))
        self._objects[("PodDisruptionBudget", meta["namespace"], meta["name"])] = updated
