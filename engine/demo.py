"""`ember demo`: build a test checkpoint, stream a chat reply token by token, then run a batch.

The checkpoint has random weights, so the words are noise; what the demo shows is the engine at work:
streaming, continuous batching, prefix caching, and the numbers behind them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path


def default_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "ember" / "demo-tiny"


def main(args: argparse.Namespace) -> int:
    from ember_engine import SamplingParams
    from ember_engine.async_engine import AsyncEngine
    from ember_engine.chat import render_chat
    from ember_engine.testmodel import make_test_model

    model_dir = Path(args.dir) if args.dir else default_dir()
    if not (model_dir / "model.safetensors").exists():
        print(f"building a tiny test checkpoint in {model_dir} ...")
        make_test_model(model_dir, size="tiny", force=True)
    engine = AsyncEngine(model=str(model_dir))
    system = "You are a terse assistant who answers in Python. " * 4  # a shared prefix: 3+ cache blocks
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Write a function."}]
    prompt = render_chat(engine.tokenizer, messages)

    async def stream() -> None:
        print(f"\nprompt:\n{prompt}\nstreaming reply:")
        start = time.perf_counter()
        first: float | None = None
        async for out in engine.generate(
            prompt, SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=48)
        ):
            first = first or time.perf_counter()
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()
        assert first is not None
        print(f"\n[{len(out.token_ids)} tokens, first after {1000 * (first - start):.0f} ms]")

    async def batch() -> None:
        questions = [f"Question {i}: what is {i} squared?" for i in range(16)]
        params = SamplingParams(temperature=0.7, max_tokens=64, ignore_eos=True)

        async def one(q: str) -> int:
            p = render_chat(
                engine.tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": q}]
            )
            n = 0
            async for out in engine.generate(p, params):
                n = len(out.token_ids)
            return n

        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(q) for q in questions)))
        elapsed = time.perf_counter() - start
        s = engine.stats()
        print(
            f"\nbatch: 16 chat requests, {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:.0f} output tok/s"
        )
        print(
            f"prefix cache: {s.prefix_cache_hits} of {s.prefix_cache_queries} prompt tokens served from cache"
        )

    try:
        asyncio.run(stream())
        asyncio.run(batch())
    finally:
        engine.shutdown()
    return 0
