"""The background runtime the process kubelet, the service proxy and the scheduler each run on: an asyncio
loop on a daemon thread, a thread pool for the blocking calls of the official `kubernetes` client, that client
(opened from a kubeconfig), and the `Informer`s that feed the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from kubernetes import client, config

from ember_localcluster.informer import Informer

__all__ = ["BackgroundRuntime"]

T = TypeVar("T")


class BackgroundRuntime:
    """One loop thread (`ember-<name>`) with its API executor (`<name>-api`, `api_workers` threads).

    `start()` opens the client from a kubeconfig and starts the loop; `informer()` and `sync()` follow
    the API server onto the loop; `stop()` stops the informers, runs a shutdown coroutine on the loop,
    then stops and closes the loop, the executor and the client. A stopped runtime can be started again.
    """

    def __init__(self, name: str, *, api_workers: int) -> None:
        self.name = name
        self.api_workers = api_workers
        self.loop: asyncio.AbstractEventLoop | None = None
        self.executor: ThreadPoolExecutor | None = None
        self.core: Any = None  # the official client's CoreV1Api, once started
        self.policy: Any = None  # and its PolicyV1Api
        self._thread: threading.Thread | None = None
        self._api_client: Any = None
        self._informers: list[Informer] = []

    @property
    def running(self) -> bool:
        return self.loop is not None and self._thread is not None

    def start(self, kubeconfig: str | Path) -> asyncio.AbstractEventLoop:
        """Open the client and start the loop's thread; returns the loop."""
        self._api_client = config.new_client_from_config(config_file=str(kubeconfig))
        self.core = client.CoreV1Api(self._api_client)
        self.policy = client.PolicyV1Api(self._api_client)
        self.executor = ThreadPoolExecutor(
            max_workers=self.api_workers, thread_name_prefix=f"{self.name}-api"
        )
        loop = asyncio.new_event_loop()
        self.loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name=f"ember-{self.name}", daemon=True)
        self._thread.start()
        return loop

    def run(self, coroutine: Coroutine[Any, Any, T], *, timeout: float) -> T:
        """Run `coroutine` on the loop and wait for its result."""
        assert self.loop is not None, "the runtime is not running"
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=timeout)

    def informer(
        self,
        list_call: Callable[..., Any],
        on_event: Callable[[str, dict[str, Any]], object],
        *,
        name: str,
    ) -> Informer:
        """An informer (not started yet) whose events `on_event(kind, obj)` receives on the loop."""
        loop = self.loop
        assert loop is not None, "the runtime is not running"
        informer = Informer(
            list_call, lambda kind, obj: loop.call_soon_threadsafe(on_event, kind, obj), name=name
        )
        self._informers.append(informer)
        return informer

    def sync(self, *informers: Informer, timeout: float = 10) -> None:
        """Start `informers` together, then wait (up to `timeout` each) until each has listed."""
        for informer in informers:
            informer.start()
        for informer in informers:
            informer.synced.wait(timeout=timeout)

    def stop(self, shutdown: Callable[[], Coroutine[Any, Any, object]]) -> None:
        """Everything at once: `stop_informers()`, `stop_loop(shutdown)`, `close()`."""
        if not self.running:
            return
        self.stop_informers()
        self.stop_loop(shutdown)
        self.close()

    def stop_informers(self) -> None:
        for informer in self._informers:
            informer.stop()

    def stop_loop(self, shutdown: Callable[[], Coroutine[Any, Any, object]], *, timeout: float = 15) -> None:
        """Run `shutdown()` on the loop (its errors ignored, up to `timeout`), then stop the loop's thread
        and close the loop (left open if the thread does not end within 10 s)."""
        loop, thread = self.loop, self._thread
        if loop is None or thread is None:
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout=timeout)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        if not thread.is_alive():
            loop.close()

    def close(self) -> None:
        """Shut the executor down (without waiting) and close the client; the runtime is then stopped."""
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
        if self._api_client is not None:
            self._api_client.close()
        self.loop = self._thread = self.executor = self._api_client = self.core = self.policy = None
        self._informers = []
