"""Prefix-cache events: stable block hashes, the engine's event log, and `GET /v1/kv_events`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import plainhttp
from server_util import running_server

from ember_engine import SamplingParams
from ember_engine.core.config import EngineConfig
from ember_engine.core.kv_events import REMOVED, STORED, KVEvents, chain_hash, prefix_hashes
from ember_engine.core.llm_engine import LLMEngine


def test_block_hashes_are_the_same_in_every_process() -> None:
    tokens = list(range(100, 164))
    code = (
        "from ember_engine.core.kv_events import prefix_hashes;"
        f"print(prefix_hashes({tokens}, 16), prefix_hashes({tokens}, 16, 'salt'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"{prefix_hashes(tokens, 16)} {prefix_hashes(tokens, 16, 'salt')}"
    assert prefix_hashes(tokens, 16) != prefix_hashes(tokens, 16, "salt")
    assert chain_hash(None, [1, 2]) != chain_hash(0, [1, 2])  # no parent is not parent 0


def test_the_log_answers_deltas_and_a_snapshot_when_behind() -> None:
    events = KVEvents(capacity=3)
    for h in (1, 2, 3, 4):
        events.record(STORED, h)
    held = [2, 3, 4]
    batch = events.since(2, lambda: held)
    assert batch.seq == 4 and batch.events == [(STORED, 3), (STORED, 4)] and batch.snapshot is None
    assert events.since(4, lambda: held).events == []
    behind = events.since(0, lambda: held)
    assert behind.snapshot == held and behind.events == [] and behind.seq == 4
    assert events.since(1, lambda: held).snapshot is None  # event 2 is still in the log
    assert events.since(0, lambda: held).snapshot == held


def test_the_engine_announces_the_blocks_it_caches(tiny_model: Path) -> None:
    engine = LLMEngine(EngineConfig(str(tiny_model), block_size=16, num_kv_blocks=64))
    prompt = [5 + i % 50 for i in range(40)]
    engine.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    bm = engine.block_manager
    batch = bm.events.since(0, lambda: tuple(bm.cached))
    assert batch.snapshot is not None and set(prefix_hashes(prompt, 16)) <= set(batch.snapshot)
    log = [(kind, h) for _, kind, h in bm.events._log]
    assert log[:2] == [(STORED, h) for h in prefix_hashes(prompt, 16)]
    bm.reset_prefix_cache()
    assert {(REMOVED, h) for h in prefix_hashes(prompt, 16)} <= set(bm.events.since(batch.seq, tuple).events)


def test_the_server_publishes_the_events(tiny_model: Path) -> None:
    with running_server(tiny_model, "--block-size", "16") as s:
        first = plainhttp.get(f"{s.url}/v1/kv_events", params={"since": 0}).json()
        assert first["block_size"] == 16 and first["enabled"] is True and "snapshot" in first
        prompt = [7 + i % 40 for i in range(48)]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
        assert plainhttp.post(f"{s.url}/v1/completions", json=body, timeout=60).status_code == 200
        delta = plainhttp.get(f"{s.url}/v1/kv_events", params={"since": first["seq"]}).json()
        stored = [h for kind, h in delta["events"] if kind == STORED]
        assert prefix_hashes(prompt, 16)[:2] == stored[:2]
