"""`APIServer`: the in-process Kubernetes API server, run on a background thread with its own loop.

A thread of its own because its clients block or own loops too: the official `kubernetes` client makes
synchronous calls from the test's thread, kopf's `KopfRunner` runs an event loop in another thread, and
kubectl is a subprocess. All state lives on the server's loop; the helpers below (`create`, `get`, ...)
run there through `run_coroutine_threadsafe`, so tests never race the HTTP handlers.

Plain HTTP (no TLS) on 127.0.0.1 and a free port by default; `kubeconfig()` gives a config that kopf,
the official client and kubectl all accept (a dummy bearer token, which the server ignores: there is no
authentication or authorisation).
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import yaml
from aiohttp import web

from . import deletion
from .errors import APIError
from .http import build_app
from .resources import ResourceType
from .selectors import parse_field_selector, parse_label_selector
from .store import Store
from .watch import CLOSE, EXPIRE

T = TypeVar("T")

CONTEXT = "ember-local"


class APIServer:
    """An in-memory Kubernetes API server for kopf, the `kubernetes` client and kubectl.

    Use it as a context manager (or `start()`/`stop()`), point clients at `url` or at the file from
    `write_kubeconfig(path)`, and set up or inspect state with the blocking helpers `create`,
    `install_crd`, `get`, `list`, `patch`, `delete` and `call` from any thread but the server's.
    `compact`, `expire_watches` and `disconnect_watches` provoke what clients must survive.
    `store` is the state itself; touch it only through `call`. `attach_kubelet` tells the server where a
    process kubelet keeps its pods' logs, which `pods/log` (`kubectl logs`) serves.

    `pod_kill_margin` is how long past a terminating Pod's grace period the server waits for a kubelet to
    confirm the kill before removing the Pod itself; None never removes it (kube-apiserver's way: a pod
    whose kubelet is gone stays Terminating until it is force-deleted, as `DevCluster` runs it).
    `pod_graceful_deletion=False` deletes Pods at once, for setups with no kubelet to confirm the
    kill; `bookmark_interval` is how often idle watches that asked for bookmarks get one;
    `history_limit` is how many changes a watch can be resumed across before it gets 410 Expired.
    A stopped server can be started again: it keeps its objects and, once bound, its port.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        pod_graceful_deletion: bool = True,
        pod_kill_margin: float | None = 10.0,
        bookmark_interval: float = 10.0,
        history_limit: int = 10_000,
    ) -> None:
        self.host = host
        self.port = port
        self.store = Store(
            pod_graceful_deletion=pod_graceful_deletion,
            history_limit=history_limit,
            pod_kill_margin=pod_kill_margin,
        )
        self._bookmark_interval = bookmark_interval
        self._pods_dirs: dict[str, Path] = {}
        self._requests: Counter[tuple[str, str, str]] = Counter()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    # -- lifecycle ---------------------------------------------------------------------------------

    def __enter__(self) -> APIServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> APIServer:
        if self._thread is not None:
            raise RuntimeError("the API server is already running")
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        loop = asyncio.new_event_loop()
        self._loop = loop
        started = threading.Event()
        failures: list[BaseException] = []
        self._thread = threading.Thread(
            target=self._run, args=(loop, sock, started, failures), name="ember-apiserver", daemon=True
        )
        self._thread.start()
        started.wait(timeout=30)
        if failures:
            self._loop = self._thread = None
            raise failures[0]
        return self

    def _run(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        started: threading.Event,
        failures: list[BaseException],
    ) -> None:
        asyncio.set_event_loop(loop)
        app = build_app(
            self.store,
            bookmark_interval=self._bookmark_interval,
            pods_dirs=self._pods_dirs,
            requests=self._requests,
        )
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)

        async def serve() -> None:
            assert self._runner is not None
            await self._runner.setup()
            await web.SockSite(self._runner, sock).start()

        try:
            loop.run_until_complete(serve())
        except BaseException as error:
            failures.append(error)
            loop.close()
            return
        finally:
            started.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return

        async def shutdown() -> None:
            self.store.hub.signal_all(CLOSE)
            if self._runner is not None:
                await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        self._loop = self._thread = self._runner = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def kubeconfig(self) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": CONTEXT, "cluster": {"server": self.url}}],
            "users": [{"name": CONTEXT, "user": {"token": "ember-local"}}],
            "contexts": [
                {"name": CONTEXT, "context": {"cluster": CONTEXT, "user": CONTEXT, "namespace": "default"}}
            ],
            "current-context": CONTEXT,
            "preferences": {},
        }

    def write_kubeconfig(self, path: str | Path) -> Path:
        """Written whole under another name, then renamed into place: a client that reads the file as
        soon as it exists never finds it half written."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        staged.write_text(yaml.safe_dump(self.kubeconfig(), sort_keys=False))
        os.replace(staged, path)
        return path

    def attach_kubelet(self, nodes: Iterable[str], pods_dir: str | Path) -> None:
        """Serve `pods/log` for pods bound to `nodes` from `pods_dir` (a `ProcessKubelet.pods_dir`), as
        kube-apiserver asks each node's kubelet; pods on other nodes answer as not started."""
        self._pods_dirs.update({node: Path(pods_dir) for node in nodes})

    # -- thread-safe helpers -----------------------------------------------------------------------

    def request_counts(self) -> dict[tuple[str, str, str], int]:
        """Requests served so far over HTTP by (verb, resource, subresource), as kube-apiserver counts
        them in `apiserver_request_total`: verbs LIST, WATCH, GET, POST, PUT, PATCH, DELETE and
        DELETECOLLECTION; subresource "" for the object itself. The blocking helpers are not counted."""
        return self.call(lambda: dict(self._requests))

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `fn(*args, **kwargs)` on the server's loop and return a deep copy of its result."""
        loop = self._loop
        if loop is None:
            raise RuntimeError("the API server is not running")
        if threading.current_thread() is self._thread:
            raise RuntimeError("APIServer helpers block; call them from another thread")

        async def run() -> T:
            return _copied(fn(*args, **kwargs))

        return asyncio.run_coroutine_threadsafe(run(), loop).result(timeout=30)

    def _rtype(self, api_version: str, kind: str) -> ResourceType:
        rtype = self.store.registry.by_kind(api_version, kind)
        if rtype is None:
            raise APIError(404, "NotFound", f'no kind "{kind}" is registered for version "{api_version}"')
        return rtype

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Create `obj` (namespaced kinds default to the `default` namespace); APIError on failure."""

        def create() -> dict[str, Any]:
            rtype = self._rtype(obj.get("apiVersion", ""), obj.get("kind", ""))
            namespace = (
                ((obj.get("metadata") or {}).get("namespace") or "default") if rtype.namespaced else None
            )
            return self.store.create(rtype, namespace, obj)

        return self.call(create)

    def install_crd(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Create a CustomResourceDefinition; its types are served as soon as this returns."""
        return self.create(
            {**manifest, "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition"}
        )

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        """The object, or None when there is none (APIError for a kind that is not served)."""

        def get() -> dict[str, Any] | None:
            rtype = self._rtype(api_version, kind)
            try:
                return self.store.get(rtype, namespace, name)
            except APIError as error:
                if error.code == 404:
                    return None
                raise

        return self.call(get)

    def list(
        self,
        api_version: str,
        kind: str,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> list[dict[str, Any]]:
        labels, fields = parse_label_selector(label_selector), parse_field_selector(field_selector)
        return self.call(lambda: self.store.list(self._rtype(api_version, kind), namespace, labels, fields))

    def patch(
        self,
        api_version: str,
        kind: str,
        namespace: str | None,
        name: str,
        patch: dict[str, Any],
        *,
        subresource: str | None = None,
    ) -> dict[str, Any]:
        """Apply a JSON merge patch (to `/status` with `subresource="status"`)."""
        raw = json.dumps(patch).encode()

        def apply() -> dict[str, Any]:
            rtype = self._rtype(api_version, kind)
            if subresource == "status" and not rtype.has_status:
                raise APIError(404, "NotFound", f"{rtype.plural} have no status subresource")
            return self.store.patch(
                rtype, namespace, name, "application/merge-patch+json", raw, subresource=subresource
            )[0]

        return self.call(apply)

    def delete(
        self,
        api_version: str,
        kind: str,
        namespace: str | None,
        name: str,
        *,
        grace_period_seconds: int | None = None,
        propagation_policy: str | None = None,
    ) -> dict[str, Any]:
        """DELETE the object; it may linger (finalizers, a Pod's grace period). APIError when absent."""
        options = deletion.DeleteOptions(grace_period_seconds, propagation_policy)

        def delete() -> dict[str, Any]:
            return deletion.delete(self.store, self._rtype(api_version, kind), namespace, name, options)

        return self.call(delete)

    # -- test hooks --------------------------------------------------------------------------------

    def compact(self) -> None:
        """Forget the change history: watches resuming from an older resourceVersion get 410 Expired."""
        self.call(self.store.compact)

    def expire_watches(self) -> None:
        """Send every open watch an ERROR 410 event and close it, as when etcd compacts under a watch."""
        self.call(self.store.hub.signal_all, EXPIRE)

    def disconnect_watches(self) -> None:
        """End every open watch stream cleanly, as a server-side timeout does."""
        self.call(self.store.hub.signal_all, CLOSE)


_SCALARS = (str, int, float, bool, type(None))


def _copied(value: Any) -> Any:
    """A deep copy of what a helper returns: the store's objects are JSON (dicts, lists, scalars), copied
    here at a third of `copy.deepcopy`'s cost (it keeps a memo of every node; the helpers are polled, e.g.
    the operator tests' pod runner lists the pods every 50 ms); anything else through `copy.deepcopy`."""
    if isinstance(value, dict):
        return {key: _copied(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_copied(item) for item in value]
    if isinstance(value, _SCALARS):
        return value
    return copy.deepcopy(value)
