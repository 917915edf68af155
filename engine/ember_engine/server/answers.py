"""From the engine's output streams to an HTTP answer (the Responses API's shapes are in `responses_api`):
following and merging the streams of a request's prompts, then either one JSON body (`_complete`, which
aborts when the client leaves or the deadline passes) or a server-sent event stream (`_stream`,
`_TicketedStream`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ember_engine.async_engine import EngineFailed
from ember_engine.core.outputs import RequestOutput
from ember_engine.sample.constraint import DEAD_END
from ember_engine.server.errors import _timeout_error, engine_failed, internal_error
from ember_engine.server.openai_format import Formatter, Usage, sse
from ember_engine.server.protocol import APIError
from ember_engine.server.state import ServerState, _Ticket

log = logging.getLogger("ember.server")


class _TicketedStream(StreamingResponse):
    """A streamed response that releases its ticket however it ends: if the client is gone before the
    response starts, Starlette never runs the body, so the body's own cleanup would never run."""

    def __init__(self, body: AsyncIterator[str], ticket: _Ticket) -> None:
        super().__init__(body, media_type="text/event-stream")
        self._body, self._ticket = body, ticket

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._body.aclose()  # type: ignore[attr-defined]
            self._ticket.release()


async def _tracked(gen: AsyncIterator[RequestOutput], ticket: _Ticket) -> AsyncIterator[RequestOutput]:
    first = True
    # `gen` hands its request to the engine as soon as it is first iterated, below, with no await between.
    ticket.submitting()
    async with contextlib.aclosing(gen):  # type: ignore[type-var]
        async for out in gen:
            if first:
                first = False
                ticket.started(out)
            yield out


async def _merge(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' updates as they come; closing this closes (aborts) them all."""
    if len(gens) == 1:
        async with contextlib.aclosing(gens[0]):  # type: ignore[type-var]
            async for out in gens[0]:
                yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async with contextlib.aclosing(gen):  # type: ignore[type-var]
                async for out in gen:
                    await queue.put((i, out))
        except Exception as exc:
            await queue.put((i, exc))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _complete(
    state: ServerState,
    request: Request,
    fmt: Formatter,
    merged: AsyncIterator[tuple[int, RequestOutput]],
    n: int,
    deadline: float | None,
) -> Response:
    finals: dict[int, RequestOutput] = {}

    async def collect() -> None:
        async with contextlib.aclosing(merged):  # type: ignore[type-var]
            async for i, out in merged:
                if out.finished:
                    finals[i] = out

    work = asyncio.create_task(collect())
    gone = asyncio.create_task(_disconnected(request))
    try:
        done, _ = await asyncio.wait({work, gone}, timeout=deadline, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()  # the client left or the deadline passed: abort its requests
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work not in done:
        if gone in done:
            return Response(status_code=499)  # nobody is listening
        state.metrics.record_deadline_abort()
        raise _timeout_error(deadline or 0)
    try:
        work.result()
    except ValueError as exc:
        raise APIError(400, str(exc), param=str(exc).split(":", 1)[0]) from exc
    for out in finals.values():
        if out.error is not None:
            raise _unfinished(out, fmt.constraint)
    usage = Usage()
    outputs = []
    for i, out in finals.items():
        if out.prompt_logprobs is not None:
            fmt.prompts[i] = (out.prompt_token_ids, out.prompt_logprobs)
        usage.prompt_tokens += len(out.prompt_token_ids)
        usage.cached_tokens += out.num_cached_tokens
        for o in out.outputs:
            usage.completion_tokens += len(o.token_ids)
            outputs.append((i * n + o.index, o))
    return JSONResponse(fmt.response(outputs, usage))


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _stream(
    state: ServerState,
    fmt: Formatter,
    merged: AsyncIterator[tuple[int, RequestOutput]],
    n: int,
    include_usage: bool,
    deadline: float | None,
    ticket: _Ticket,
    continuous_usage: bool = False,
) -> AsyncIterator[str]:
    loop = asyncio.get_running_loop()
    ends_at = None if deadline is None else loop.time() + deadline
    sent_logprobs: Counter[int] = Counter()
    started: set[int] = set()
    ended: set[int] = set()
    usage = Usage()
    so_far: dict[int, tuple[int, int, int]] = {}  # per prompt: (prompt, completion, cached tokens) so far
    try:
        while True:
            timeout = None if ends_at is None else max(0.0, ends_at - loop.time())
            try:
                # The deadline covers waiting for the engine, never a yield to the client.
                async with asyncio.timeout(timeout):
                    i, out = await anext(merged)
            except StopAsyncIteration:
                break
            except TimeoutError:
                state.metrics.record_deadline_abort()
                yield sse(_timeout_error(deadline or 0).body())
                yield sse("[DONE]")
                return
            except APIError as exc:  # the server stopped it (a drain whose time is up)
                yield sse(exc.body())
                yield sse("[DONE]")
                return
            except ValueError as exc:
                yield sse(APIError(400, str(exc)).body())
                yield sse("[DONE]")
                return
            except EngineFailed as exc:  # the engine could not go on (a rank died): it restarts
                log.error("a stream ended early: %s", exc)
                yield sse(engine_failed(exc).body())
                yield sse("[DONE]")
                return
            except Exception as exc:  # the server's fault
                log.error("a stream ended early: %s: %s", type(exc).__name__, exc)
                yield sse(internal_error(exc).body())
                yield sse("[DONE]")
                return
            if out.error is not None:
                yield sse(_unfinished(out, fmt.constraint).body())
                yield sse("[DONE]")
                return
            if out.prompt_logprobs is not None and i not in fmt.prompts:  # complete by the first token
                fmt.prompts[i] = (out.prompt_token_ids, out.prompt_logprobs)
            for o in out.outputs:
                index = i * n + o.index
                # A finished choice stays in every later update of its prompt: its end was sent once.
                if index in ended or not (o.delta_text or o.finish_reason or index not in started):
                    continue
                if o.finish_reason:
                    ended.add(index)
                new_lps = None
                if o.logprobs is not None:
                    new_lps = o.logprobs[sent_logprobs[index] :]
                    sent_logprobs[index] = len(o.logprobs)
                try:
                    chunk = fmt.chunk(index, o, new_lps, first=index not in started)
                    if continuous_usage:
                        tokens = sum(len(c.token_ids) for c in out.outputs)
                        so_far[i] = (len(out.prompt_token_ids), tokens, out.num_cached_tokens)
                        now = Usage(*(sum(counts) for counts in zip(*so_far.values(), strict=True)))
                        chunk["usage"] = now.to_dict()
                    event = sse(chunk)
                except ValueError as exc:  # an output JSON cannot carry (a NaN): the server's fault
                    log.exception("a stream's output could not be sent")
                    yield sse(internal_error(exc).body())
                    yield sse("[DONE]")
                    return
                yield event
                started.add(index)
            if out.finished:
                usage.prompt_tokens += len(out.prompt_token_ids)
                usage.cached_tokens += out.num_cached_tokens
                usage.completion_tokens += sum(len(o.token_ids) for o in out.outputs)
        if include_usage:
            yield sse(fmt.usage_chunk(usage))
        yield sse("[DONE]")
    finally:
        with contextlib.suppress(RuntimeError):  # already closed by a cancellation
            await merged.aclose()  # type: ignore[attr-defined]
        ticket.release()


def _unfinished(out: RequestOutput, param: str | None) -> APIError:
    """A request the engine ended unfinished, its text short of the constraint: where the constraint admits
    no continuation of the text (it matches nothing that begins so), the client's fault, naming its field;
    where the grammar engine met one of its limits, the server's."""
    assert out.error is not None
    if out.error == DEAD_END:
        text = next((o.text for o in out.outputs if o.finish_reason == "abort"), "")
        return APIError(
            400, f"{param}: {DEAD_END} ({text!r}): it matches no text that begins so", param=param
        )
    return APIError(500, out.error, type="internal_server_error", code="grammar_failed")
