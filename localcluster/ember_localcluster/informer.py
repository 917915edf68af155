"""Following the API server through the official `kubernetes` client: the list-then-watch `Informer` of the
process kubelet, the service proxy and the scheduler, and the request settings they use.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import urllib3

log = logging.getLogger("ember.kubelet")

MERGE_PATCH = "application/merge-patch+json"
API_TIMEOUT = 10.0


def _key(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj["metadata"]
    return (meta.get("namespace") or "", meta["name"])


class _Expired(Exception):
    """The watch's resourceVersion is too old: list again."""


class Informer:
    """Mirrors one kind of object from the API server and reports every change to `on_event`.

    It lists, then watches from the list's resourceVersion with bookmarks; a stream that ends is resumed
    from the last resourceVersion seen, and a 410 Expired or any error leads to a fresh list (after a
    back-off for errors). After a re-list it reports the difference from what it held before, so
    `on_event(type, obj)` sees ADDED, MODIFIED and DELETED as if it had watched all along. `list_call`
    is a `list_*` method of the official client; `on_event` runs on the informer's own thread.
    """

    def __init__(
        self,
        list_call: Callable[..., Any],
        on_event: Callable[[str, dict[str, Any]], object],
        *,
        name: str,
        watch_timeout: int = 60,
    ) -> None:
        self._list_call = list_call
        self._on_event = on_event
        self._name = name
        self._watch_timeout = watch_timeout
        self._objects: dict[tuple[str, str], dict[str, Any]] = {}
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._response: Any = None
        self._thread: threading.Thread | None = None
        self.synced = threading.Event()  # set once the first list has been reported

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"informer-{self._name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        with self._lock:
            response = self._response
        if response is not None:
            # Unblocks a read in progress on the informer's thread.
            with contextlib.suppress(Exception):
                response.shutdown()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        delay = 0.2
        while not self._stopped.is_set():
            try:
                rv = self._relist()
                self.synced.set()
                delay = 0.2
                while not self._stopped.is_set():
                    rv = self._watch(rv)
            except _Expired:
                continue
            except Exception as error:
                if self._stopped.is_set():
                    return
                log.warning("%s: %s; listing again in %.1f s", self._name, error, delay)
                self._stopped.wait(delay)
                delay = min(delay * 2, 5.0)

    def _deliver(self, kind: str, obj: dict[str, Any]) -> None:
        if kind == "DELETED":
            self._objects.pop(_key(obj), None)
        else:
            self._objects[_key(obj)] = obj
        try:
            self._on_event(kind, obj)
        except Exception:
            log.exception("%s: handling %s %s failed", self._name, kind, _key(obj))

    def _relist(self) -> str:
        response = self._list_call(_preload_content=False, _request_timeout=API_TIMEOUT)
        body = json.loads(response.data)
        current = {_key(obj): obj for obj in body.get("items") or []}
        for key, old in list(self._objects.items()):
            new = current.get(key)
            if new is None or new["metadata"].get("uid") != old["metadata"].get("uid"):
                self._deliver("DELETED", old)
        for key, obj in current.items():
            known = self._objects.get(key)
            if known is None:
                self._deliver("ADDED", obj)
            elif known["metadata"].get("resourceVersion") != obj["metadata"].get("resourceVersion"):
                self._deliver("MODIFIED", obj)
        return str(body["metadata"]["resourceVersion"])

    def _watch(self, rv: str) -> str:
        response = self._list_call(
            watch=True,
            resource_version=rv,
            allow_watch_bookmarks=True,
            timeout_seconds=self._watch_timeout,
            _preload_content=False,
            _request_timeout=(API_TIMEOUT, self._watch_timeout + 15.0),
        )
        with self._lock:
            self._response = response
        if self._stopped.is_set():
            response.release_conn()
            return rv
        try:
            for line in _lines(response):
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise _Expired()
                    raise RuntimeError(f"watch error: {obj.get('message', obj)}")
                rv = str((obj.get("metadata") or {}).get("resourceVersion") or rv)
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self._deliver(kind, obj)
        except urllib3.exceptions.ReadTimeoutError:
            pass  # a quiet stream: resume from where it was
        finally:
            with self._lock:
                self._response = None
            response.release_conn()
        return rv


def _lines(response: Any) -> Iterator[bytes]:
    buffer = b""
    for chunk in response.stream(amt=None, decode_content=False):
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        yield from (line for line in lines if line.strip())
