"""Adding and removing LoRA adapters while the engine serves: between steps, in the engine's thread
(`AsyncEngine.call`), so no step sees an adapter half attached. An adapter is removed only once no request
runs or waits on it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ember_engine.model.lora import LoraSet, check_rank
from ember_engine.model.lora_files import AdapterFiles

if TYPE_CHECKING:
    from ember_engine.core.llm_engine import LLMEngine


class AdapterInUse(ValueError):
    """The adapter still has requests in flight."""


def add_adapter(engine: LLMEngine, adapter: AdapterFiles) -> None:
    if engine.workers is not None:
        raise ValueError(
            "lora: adapters are not loaded while serving under tensor parallelism (give them at start)"
        )
    check_rank(adapter, engine.config.max_lora_rank)
    runner = engine.runner
    if runner.lora is None:
        runner.lora = LoraSet(runner.model, [], runner.dtype)
    runner.lora.add(adapter)


def remove_adapter(engine: LLMEngine, name: str) -> None:
    adapters = engine.runner.lora
    if adapters is None or name not in adapters.slots:
        raise KeyError(name)
    slot = adapters.slots[name]
    in_flight = sum(
        1 for group in engine.groups.values() if any(s.request.adapter == slot for s in group.samples)
    )
    if in_flight:
        raise AdapterInUse(
            f"lora_name: adapter {name!r} has {in_flight} request(s) in flight; remove it once they end"
        )
    adapters.remove(name)
