"""The local control plane's LeaderWorkerSet controller (what `leaderworkerset.py` describes, applied).

`LeaderWorkerSetController` talks to the API server only through the official `kubernetes` client, as the
upstream controller does through controller-runtime: it lists and watches LeaderWorkerSets and the pods
labelled with a set's name, and after every change to a set or one of its pods it takes one step for
that set: the headless Service, pods created or leaders deleted (`group_actions`), then the status (a
merge patch of the status subresource, only when it changed). A call that fails is retried a second
later; a create that meets an existing name (an old pod still going) waits for that pod's deletion.
"""

from __future__ import annotations

import functools
import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from ember_localcluster.informer import Informer
from ember_localcluster.leaderworkerset import (
    GROUP,
    NAME,
    PLURAL,
    VERSION,
    desired_status,
    group_actions,
    headless_service,
)
from ember_localcluster.workqueue import KeyedController

__all__ = ["LeaderWorkerSetController"]

log = logging.getLogger("ember.lws")

Key = tuple[str, str]


class LeaderWorkerSetController(KeyedController[Key]):
    def __init__(self, kubeconfig: str | Path) -> None:
        super().__init__(kubeconfig, "lws", log)
        self._sets: dict[Key, dict[str, Any]] = {}
        self._pods: dict[Key, dict[str, Any]] = {}
        self._services: set[str] = set()  # uids of sets whose Service exists
        self._custom: Any = None

    def _opened(self) -> None:
        self._custom = client.CustomObjectsApi(self._runtime.core.api_client)

    def _informers(self) -> list[Informer]:
        runtime = self._runtime
        return [
            runtime.informer(
                functools.partial(self._custom.list_cluster_custom_object, GROUP, VERSION, PLURAL),
                self._on_set,
                name="lws-sets",
            ),
            runtime.informer(
                functools.partial(runtime.core.list_pod_for_all_namespaces, label_selector=NAME),
                self._on_pod,
                name="lws-pods",
            ),
        ]

    def _describe(self, key: Key) -> str:
        return f"LeaderWorkerSet {key[0]}/{key[1]}"

    # -- on the controller's loop ----------------------------------------------------------------------

    def _on_set(self, kind: str, obj: dict[str, Any]) -> None:
        key = (obj["metadata"].get("namespace") or "default", obj["metadata"]["name"])
        if kind == "DELETED":
            self._sets.pop(key, None)
            self._services.discard(obj["metadata"].get("uid", ""))
        else:
            self._sets[key] = obj
            self._mark(key)

    def _on_pod(self, kind: str, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        key = (meta.get("namespace") or "default", meta["name"])
        if kind == "DELETED":
            self._pods.pop(key, None)
        else:
            self._pods[key] = obj
        owner = (meta.get("labels") or {}).get(NAME)
        if owner:
            self._mark((key[0], owner))

    async def _step(self, key: Key) -> None:
        lws = self._sets.get(key)
        if lws is None or lws["metadata"].get("deletionTimestamp"):
            return
        namespace, name = key
        core = self._runtime.core
        if lws["metadata"]["uid"] not in self._services:
            try:
                await self._call(core.create_namespaced_service, namespace, headless_service(lws))
            except ApiException as e:
                if e.status != 409:
                    raise
            self._services.add(lws["metadata"]["uid"])
        pods = [
            p
            for (ns, _), p in self._pods.items()
            if ns == namespace and (p["metadata"].get("labels") or {}).get(NAME) == name
        ]
        create, delete = group_actions(lws, pods)
        for pod in create:
            try:
                await self._call(core.create_namespaced_pod, namespace, pod)
            except ApiException as e:
                if e.status != 409:  # the name's previous pod is still going: its deletion wakes us
                    raise
        for leader in delete:
            try:
                await self._call(
                    core.delete_namespaced_pod, leader, namespace, propagation_policy="Foreground"
                )
            except ApiException as e:
                if e.status != 404:
                    raise
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        status = desired_status(lws, pods, now)
        if {k: (lws.get("status") or {}).get(k) for k in status} != status:
            await self._call(
                self._custom.patch_namespaced_custom_object_status,
                GROUP,
                VERSION,
                namespace,
                PLURAL,
                name,
                {"status": status},
            )
