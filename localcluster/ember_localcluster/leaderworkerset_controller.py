"""The local control plane's LeaderWorkerSet controller (what `leaderworkerset.py` describes, applied).

`LeaderWorkerSetController` talks to the API server only through the official `kubernetes` client, as the
upstream controller does through controller-runtime: it lists and watches LeaderWorkerSets and the pods
labelled with a set's name, and after every change to a set or one of its pods it takes one step for
that set: the headless Service, pods created or leaders deleted (`group_actions`), then the status (a
merge patch of the status subresource, only when it changed). A call that fails is retried a second
later; a create that meets an existing name (an old pod still going) waits for that pod's deletion.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from ember_localcluster.informer import API_TIMEOUT
from ember_localcluster.leaderworkerset import (
    GROUP,
    NAME,
    PLURAL,
    VERSION,
    desired_status,
    group_actions,
    headless_service,
)
from ember_localcluster.runtime import BackgroundRuntime

__all__ = ["LeaderWorkerSetController"]

log = logging.getLogger("ember.lws")

RETRY_SECONDS = 1.0
Key = tuple[str, str]


class LeaderWorkerSetController:
    def __init__(self, kubeconfig: str | Path) -> None:
        self.kubeconfig = Path(kubeconfig)
        self._sets: dict[Key, dict[str, Any]] = {}
        self._pods: dict[Key, dict[str, Any]] = {}
        self._dirty: set[Key] = set()
        self._services: set[str] = set()  # uids of sets whose Service exists
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._custom: Any = None
        self._runtime = BackgroundRuntime("lws", api_workers=2)

    def __enter__(self) -> LeaderWorkerSetController:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> LeaderWorkerSetController:
        runtime = self._runtime
        runtime.start(self.kubeconfig)
        self._custom = client.CustomObjectsApi(runtime.core.api_client)
        runtime.run(self._begin(), timeout=10)
        sets = runtime.informer(
            functools.partial(self._custom.list_cluster_custom_object, GROUP, VERSION, PLURAL),
            self._on_set,
            name="lws-sets",
        )
        pods = runtime.informer(
            functools.partial(runtime.core.list_pod_for_all_namespaces, label_selector=NAME),
            self._on_pod,
            name="lws-pods",
        )
        runtime.sync(sets, pods)
        return self

    def stop(self) -> None:
        self._runtime.stop(self._shutdown)

    # -- on the controller's loop ----------------------------------------------------------------------

    async def _begin(self) -> None:
        self._wakeup = asyncio.Event()
        self._task = asyncio.create_task(self._work())

    async def _shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def _mark(self, key: Key) -> None:
        self._dirty.add(key)
        if self._wakeup is not None:
            self._wakeup.set()

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

    async def _work(self) -> None:
        assert self._wakeup is not None
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._dirty:
                key = self._dirty.pop()
                try:
                    await self._step(key)
                except Exception as error:  # the API server went away or refused: try again soon
                    log.warning("LeaderWorkerSet %s/%s: %s; retrying", *key, error)
                    asyncio.get_running_loop().call_later(RETRY_SECONDS, self._mark, key)

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        call = functools.partial(fn, *args, _request_timeout=API_TIMEOUT, **kwargs)
        return await loop.run_in_executor(self._runtime.executor, call)

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
