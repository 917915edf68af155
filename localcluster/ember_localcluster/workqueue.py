"""The loop the local control plane's controllers share, a small form of client-go's work queue.

A `KeyedController` follows the API server with informers on its own `BackgroundRuntime`; informer
events mark keys dirty (`_mark`), and one task on the runtime's loop takes the dirty keys one at a time
and runs the subclass's `_step(key)` for each. A step that raises is retried `RETRY_SECONDS` later, so an
API server that went away or refused a call is tried again rather than given up on.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from pathlib import Path
from typing import Any, Generic, Self, TypeVar

from ember_localcluster.informer import API_TIMEOUT, Informer
from ember_localcluster.runtime import BackgroundRuntime

__all__ = ["RETRY_SECONDS", "KeyedController"]

RETRY_SECONDS = 1.0
K = TypeVar("K", bound=tuple[str, ...])


class KeyedController(Generic[K]):
    """Subclasses open their API clients in `_opened`, list their informers in `_informers`, and
    reconcile one key in `_step`; `_describe` names a key in log lines."""

    def __init__(self, kubeconfig: str | Path, name: str, log: logging.Logger) -> None:
        self.kubeconfig = Path(kubeconfig)
        self._log = log
        self._dirty: set[K] = set()
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._runtime = BackgroundRuntime(name, api_workers=2)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> Self:
        self._runtime.start(self.kubeconfig)
        self._opened()
        self._runtime.run(self._begin(), timeout=10)
        self._runtime.sync(*self._informers())
        return self

    def stop(self) -> None:
        self._runtime.stop(self._shutdown)

    # -- for subclasses ----------------------------------------------------------------------------------

    def _opened(self) -> None:
        """Called once the runtime's client is open, before any informer starts."""

    def _informers(self) -> list[Informer]:
        raise NotImplementedError

    async def _step(self, key: K) -> None:
        raise NotImplementedError

    def _describe(self, key: K) -> str:
        return "/".join(key)

    # -- on the controller's loop ------------------------------------------------------------------------

    async def _begin(self) -> None:
        self._wakeup = asyncio.Event()
        self._task = asyncio.create_task(self._work())

    async def _shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def _mark(self, key: K) -> None:
        self._dirty.add(key)
        if self._wakeup is not None:
            self._wakeup.set()

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
                    self._log.warning("%s: %s; retrying", self._describe(key), error)
                    asyncio.get_running_loop().call_later(RETRY_SECONDS, self._mark, key)

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """A blocking call of the official client, on the runtime's API executor."""
        loop = asyncio.get_running_loop()
        call = functools.partial(fn, *args, _request_timeout=API_TIMEOUT, **kwargs)
        return await loop.run_in_executor(self._runtime.executor, call)
