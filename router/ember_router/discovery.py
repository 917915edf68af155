"""Finding the engines in Kubernetes: the Ready pods a label selector names, followed with a watch.

`PodDiscovery` lists the pods of one namespace that match the selector (for an InferenceService:
`app.kubernetes.io/instance=NAME,ember.dev/role=active`, so a warm pod joins the moment it is promoted)
and then watches them, resuming from the last resourceVersion and listing again after a 410 Gone. A pod
that is Ready, has an IP and is not being deleted is an engine at `http://IP:PORT`; any other is removed.
It runs in a thread of its own (the official client blocks) and hands changes to the pool's event loop.
Its RBAC: `list` and `watch` on pods in that namespace.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("ember.router")


def engine_url(pod: dict[str, Any], port: int) -> str | None:
    """The pod's engine address, when it can serve: Ready, with an IP, not terminating."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    ip = status.get("podIP")
    if not ready or not ip or meta.get("deletionTimestamp"):
        return None
    return f"http://{ip}:{port}"


class DiscoveryConfigError(Exception):
    """The Kubernetes configuration discovery would use cannot be used."""


class PodDiscovery:
    def __init__(
        self,
        namespace: str,
        selector: str,
        port: int,
        on_change: Callable[[dict[str, str]], None],
        kubeconfig: str | None = None,
    ) -> None:
        self.namespace, self.selector, self.port = namespace, selector, port
        self.on_change = on_change  # called with {pod name: url} after every change
        self.kubeconfig = kubeconfig
        self.api = self._client()  # at start, so that a configuration it cannot use is refused then
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.engines: dict[str, str] = {}

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        def publish() -> None:
            loop.call_soon_threadsafe(self.on_change, dict(self.engines))

        self._thread = threading.Thread(target=self._run, args=(publish,), daemon=True, name="discovery")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _client(self) -> Any:
        import kubernetes

        try:
            if self.kubeconfig:
                return kubernetes.client.CoreV1Api(kubernetes.config.new_client_from_config(self.kubeconfig))
            try:
                kubernetes.config.load_incluster_config()
            except kubernetes.config.ConfigException:
                kubernetes.config.load_kube_config()
            return kubernetes.client.CoreV1Api()
        except (kubernetes.config.ConfigException, OSError, ValueError, TypeError) as e:
            where = (
                f"--kubeconfig {self.kubeconfig}: cannot read it"
                if self.kubeconfig
                else "--kube-selector: no Kubernetes configuration (not in a pod, no KUBECONFIG, no ~/.kube/config)"
            )
            raise DiscoveryConfigError(f"{where}: {e}") from None

    def _apply(self, pod: dict[str, Any], deleted: bool = False) -> bool:
        name = pod["metadata"]["name"]
        url = None if deleted else engine_url(pod, self.port)
        if url is None:
            return self.engines.pop(name, None) is not None
        changed = self.engines.get(name) != url
        self.engines[name] = url
        return changed

    def _run(self, publish: Callable[[], None]) -> None:
        import kubernetes

        api = self.api
        while not self._stop.is_set():
            try:
                listed = api.list_namespaced_pod(
                    self.namespace, label_selector=self.selector, _preload_content=False
                )
                body = json.loads(listed.data)
                self.engines = {}
                for pod in body.get("items") or []:
                    self._apply(pod)
                publish()
                version = body["metadata"].get("resourceVersion")
                watch = kubernetes.watch.Watch()
                for event in watch.stream(
                    api.list_namespaced_pod,
                    self.namespace,
                    label_selector=self.selector,
                    resource_version=version,
                    timeout_seconds=30,
                ):
                    if self._stop.is_set():
                        watch.stop()
                        return
                    raw = event["raw_object"]
                    if self._apply(raw, deleted=event["type"] == "DELETED"):
                        publish()
            except kubernetes.client.ApiException as e:
                if e.status != 410:
                    log.warning("listing engine pods failed: %s %s", e.status, e.reason)
                    self._stop.wait(1.0)
            except Exception:  # a dropped connection: list again
                log.exception("watching engine pods failed; listing again")
                self._stop.wait(1.0)
