"""Online API: an async iterator per request over an engine stepping in its own thread.

The step loop never waits on the event loop: requests and aborts reach it through a thread-safe inbox,
outputs go back with `call_soon_threadsafe`. Closing or cancelling a request's iterator aborts it, so
a client that goes away frees its KV blocks within one step.

A failed step fails its requests and the engine goes on, except when a tensor-parallel rank is lost:
then every request fails (`EngineFailed`), the loop ends and the fatal hooks run (the server exits; the
pod restarts). Idle, a tensor-parallel engine sends its ranks an empty step message every
HEARTBEAT_SECONDS, so that a rank lost on another node ends it then, not at the next request.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ember_engine.core.config import EngineConfig
from ember_engine.core.llm_engine import EngineStats, LLMEngine
from ember_engine.core.outputs import RequestOutput
from ember_engine.distributed.group import TensorParallelFailure
from ember_engine.sample.sampling_params import SamplingParams

T = TypeVar("T")

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 2.0


class EngineFailed(RuntimeError):
    """The engine stopped for good (a tensor-parallel rank was lost) before it finished the request."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"the engine has stopped: {cause}")
        self.cause = cause


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    arrival_time: float | None
    lora: str | None = None


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _AbortAll:
    reason: BaseException


@dataclass(slots=True)
class _Call:
    fn: Callable[[LLMEngine], Any]
    result: concurrent.futures.Future[Any]


@dataclass(slots=True)
class _Fatal:
    error: TensorParallelFailure


_Stream = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[RequestOutput | BaseException]"]


class AsyncEngine:
    def __init__(
        self, config: EngineConfig | None = None, engine: LLMEngine | None = None, **options: Any
    ) -> None:
        if engine is None:
            engine = LLMEngine(config or EngineConfig(**options))
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._inbox: queue.SimpleQueue[_Add | _Abort | _AbortAll | _Call | _Fatal | None] = (
            queue.SimpleQueue()
        )
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._stats = engine.stats()
        self._step_hooks: list[Callable[[LLMEngine, list[RequestOutput]], None]] = []
        self._fatal_hooks: list[Callable[[BaseException], None]] = []
        self.fatal: BaseException | None = None  # why the engine stopped for good
        if engine.workers is not None:
            engine.workers.on_lost = lambda error: self._inbox.put(_Fatal(error))
        # Samples (a request's n) by priority: handed to generate() (counted in the caller's thread), and
        # taken in by the engine (counted in its thread, so a step hook sees a count consistent with the
        # engine's queue).
        self.submitted: collections.Counter[int] = collections.Counter()
        self.taken_in: collections.Counter[int] = collections.Counter()
        self._thread = threading.Thread(target=self._loop, name="ember-engine", daemon=True)
        self._thread.start()

    # -- client side (event loop) ---------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        lora: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield an update per step that changed the request; the last has `.finished`. Raises
        ValueError for a request the engine refuses. `arrival_time` (time.monotonic()) is when the request
        arrived, now by default: its wait in the engine's inbox counts as queue time."""
        arrival = time.monotonic() if arrival_time is None else arrival_time
        rid = request_id or f"req-{next(self._ids)}"
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        with self._lock:
            if self.fatal is not None:
                raise EngineFailed(self.fatal)
            if rid in self._streams:
                raise ValueError(f"request_id: {rid!r} is already in use")
            self._streams[rid] = (asyncio.get_running_loop(), stream)
        params = params or SamplingParams()
        self.submitted[priority] += params.n
        self._inbox.put(_Add(rid, prompt, params, priority, cache_salt, arrival, lora))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(rid, None)
            if not finished:  # closed early or cancelled: the client is gone
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def abort_all(self, reason: BaseException) -> None:
        """End every request handed to generate() so far; each listener gets `reason` (a stop)."""
        self._inbox.put(_AbortAll(reason))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """`fn(engine)`, run in the engine's thread between two steps; its result, or its exception."""
        result: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._inbox.put(_Call(fn, result))
        return await asyncio.wrap_future(result)

    def stats(self) -> EngineStats:
        """A snapshot taken after the latest step (safe to read from any thread)."""
        return self._stats

    def add_step_hook(self, hook: Callable[[LLMEngine, list[RequestOutput]], None]) -> None:
        """Run `hook(engine, outputs)` in the engine thread after every step (metrics)."""
        self._step_hooks.append(hook)

    def add_fatal_hook(self, hook: Callable[[BaseException], None]) -> None:
        """Run `hook(error)` (in the engine thread) when the engine stops for good."""
        self._fatal_hooks.append(hook)

    def shutdown(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=30)
        self.engine.shutdown()

    # -- engine side (its own thread) -----------------------------------------------------------------

    def _loop(self) -> None:
        engine = self.engine
        heartbeat = HEARTBEAT_SECONDS if engine.workers is not None else None
        while True:
            # Idle: block for work (a tensor-parallel engine: for a heartbeat's time). Busy: take whatever
            # arrived and step again.
            block = not engine.has_unfinished_requests()
            try:
                while True:
                    item = self._inbox.get(block=block, timeout=heartbeat if block else None)
                    block = False
                    if item is None:
                        return
                    if isinstance(item, _Fatal):
                        self._die(item.error)
                        return
                    self._handle(item)
            except queue.Empty:
                if block and engine.workers is not None:  # idle for a heartbeat's time: are the ranks there?
                    try:
                        engine.workers.heartbeat()
                    except TensorParallelFailure as exc:
                        self._die(exc)
                        return
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except TensorParallelFailure as exc:
                self._die(exc)
                return
            except Exception as exc:  # a failed step fails its requests, not the process
                log.exception("engine step failed")
                self._fail_all(exc)
                continue
            self._stats = engine.stats()
            # Hooks first: delivering can abort a request whose listener left, and its final output
            # must reach the hooks after this step's.
            for hook in self._step_hooks:
                hook(engine, outputs)
            for out in outputs:
                self._deliver(out.request_id, out)

    def _handle(self, item: _Add | _Abort | _AbortAll | _Call) -> None:
        if isinstance(item, _Call):
            try:
                item.result.set_result(item.fn(self.engine))
            except Exception as exc:
                item.result.set_exception(exc)
            return
        if isinstance(item, _Abort):
            self._abort(item.request_id)
            return
        if isinstance(item, _AbortAll):
            self._abort_all(item.reason)
            return
        self.taken_in[item.priority] += item.params.n
        try:
            self.engine.add_request(
                item.request_id,
                item.prompt,
                item.params,
                item.priority,
                item.cache_salt,
                item.arrival_time,
                item.lora,
            )
        except ValueError as exc:
            self._deliver(item.request_id, exc)

    def _abort(self, request_id: str, reason: BaseException | None = None) -> None:
        """Abort in the engine; the final output still reaches the step hooks (metrics) and, if someone
        is listening, the stream (or `reason`, an error, instead)."""
        final = self.engine.abort_request(request_id)
        if final is None:
            return
        self._stats = self.engine.stats()
        for hook in self._step_hooks:
            hook(self.engine, [final])
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            loop, q = stream
            with contextlib.suppress(RuntimeError):  # the listener's loop is closed
                loop.call_soon_threadsafe(q.put_nowait, reason or final)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is None:
            self._abort(request_id)  # nobody is listening any more
            return
        loop, q = stream
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the client's loop is closed
            self._abort(request_id)

    def _abort_all(self, reason: BaseException) -> None:
        with self._lock:
            streams = dict(self._streams)
        for rid in list(self.engine.groups):
            self._abort(rid, reason)
        for rid, (loop, q) in streams.items():  # listening, not yet in the engine (its add comes later)
            if rid not in self.engine.groups:
                with contextlib.suppress(RuntimeError):  # the listener's loop is closed
                    loop.call_soon_threadsafe(q.put_nowait, reason)

    def _fail_all(self, exc: Exception) -> None:
        for rid in list(self.engine.groups):
            self._abort(rid, RuntimeError(f"engine step failed: {exc}"))

    def _die(self, error: TensorParallelFailure) -> None:
        """The engine cannot go on: fail every request (queued ones too), then run the fatal hooks."""
        log.error("the engine stopped: %s", error)
        with self._lock:
            self.fatal = error
            streams = list(self._streams.values())
        for loop, q in streams:
            with contextlib.suppress(RuntimeError):  # the listener's loop is closed
                loop.call_soon_threadsafe(q.put_nowait, EngineFailed(error))
        for hook in self._fatal_hooks:
            hook(error)
