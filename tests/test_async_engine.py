"""The online API: streaming updates, abort on close or cancel, blocks freed within a step."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from ember_engine import SamplingParams
from ember_engine.async_engine import AsyncEngine
from ember_engine.core.config import EngineConfig


@pytest.fixture(scope="module")
def engine(tiny_model: Path):  # type: ignore[no-untyped-def]
    eng = AsyncEngine(EngineConfig(model=str(tiny_model)))
    yield eng
    eng.shutdown()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


async def _wait_idle(engine: AsyncEngine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.kv_cache_usage == 0.0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine not idle: {engine.stats()}")


def test_stream_deltas_add_up_to_the_final_text(engine: AsyncEngine) -> None:
    async def main() -> None:
        deltas, token_count, last = [], 0, None
        async for out in engine.generate("def main():", greedy(20)):
            deltas.append(out.outputs[0].delta_text)
            token_count += len(out.outputs[0].delta_token_ids)
            last = out
        assert last is not None and last.finished and last.finish_reason == "length"
        assert "".join(deltas) == last.text and token_count == 20
        assert len(deltas) > 1  # it streamed

    asyncio.run(main())


def test_concurrent_requests(engine: AsyncEngine) -> None:
    async def one(prompt: str) -> str:
        text = ""
        async for out in engine.generate(prompt, greedy(12)):
            text = out.text
        return text

    async def main() -> None:
        prompts = [f"value_{i} = " for i in range(6)]
        together = await asyncio.gather(*(one(p) for p in prompts))
        alone = [await one(p) for p in prompts]
        assert together == alone

    asyncio.run(main())


def test_closing_the_iterator_aborts_and_frees_blocks(engine: AsyncEngine) -> None:
    async def main() -> None:
        stream = engine.generate(list(range(10, 400)), greedy(1000))
        async for out in stream:
            assert not out.finished
            break
        assert engine.stats().kv_cache_usage > 0
        await stream.aclose()  # type: ignore[attr-defined]
        await _wait_idle(engine)

    asyncio.run(main())


def test_cancelling_the_consumer_aborts(engine: AsyncEngine) -> None:
    async def consume() -> None:
        async for _ in engine.generate(list(range(10, 300)), greedy(1000)):
            pass

    async def main() -> None:
        task = asyncio.create_task(consume())
        while engine.stats().num_running == 0:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _wait_idle(engine)

    asyncio.run(main())


def test_refused_request_raises_value_error(engine: AsyncEngine) -> None:
    async def main() -> None:
        with pytest.raises(ValueError, match="max_model_len"):
            async for _ in engine.generate(list(range(1, 3000)), greedy(4)):
                pass
        # The engine keeps serving.
        outs = [o async for o in engine.generate("ok", greedy(3))]
        assert outs[-1].finished and len(outs[-1].token_ids) == 3

    asyncio.run(main())
