"""LoRA adapters served beside the base model: each request runs on the base model or on one adapter, and
one batch mixes them.

Each adapter, loaded when the engine starts or later between steps (`core/adapter_updates.py`), gets a
slot (1, 2, ...; 0 is the base model; a slot is never given twice). A projection any adapter adapts
carries a forward hook that adds, to each token row of an adapter, that adapter's `B (A x)`: the base projection runs once for the whole batch (quantized or not). A step with
one adapter computes its low-rank product over that adapter's rows only; a step mixing several computes
every adapter's at once, two matmuls whatever their number: `x` times all the adapters' `A` stacked, each
row's columns other than its own adapter's zeroed, times their `B` side by side. The merged projections
(q/k/v, gate/up) hold each adapter's factors stacked too: `A` as the rows of every part, `B`
block-diagonal. Under tensor parallelism each rank keeps its shard: the output rows of `B` of a
column-parallel projection, the input columns of `A` of a row-parallel one, whose partial products the
block's all-reduce sums with the base's.

The forward context (`context.py`) carries the step's rows per adapter (`StepAdapters`, built by the runner
from its chunks); a step of base-model requests only has none, and the hooks then add nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from torch import nn

from ember_engine.core.config import adapter_name_problem
from ember_engine.model.context import get_context
from ember_engine.model.llama import LlamaForCausalLM
from ember_engine.model.lora_files import AdapterFiles, Factors, read_adapter
from ember_engine.model.model_config import ModelConfig
from ember_engine.model.parallel import Shard

# checkpoint projection -> (the engine's module, its part of the merged output, or None)
_MODULE = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", None),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", None),
}


@dataclass(slots=True)
class StepAdapters:
    """The adapters of a step's rows. With one adapter, `rows` are its token rows (None: every row); with
    several, `row_slots` [T] holds each row's slot (0: the base model)."""

    slot: int  # the one adapter's slot; 0 with several
    rows: torch.Tensor | None
    row_slots: torch.Tensor | None
    # per column layout of the stacked factors: each row's 0/1 mask over the columns, made once a step
    masks: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)

    def mask(self, column_slots: torch.Tensor, layout: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        found = self.masks.get(layout)
        if found is None:
            assert self.row_slots is not None
            found = self.masks[layout] = (self.row_slots[:, None] == column_slots[None, :]).to(dtype)
        return found


@dataclass(slots=True)
class _Stacked:
    a: torch.Tensor  # [sum R, in]: every adapter's A, by slot
    b: torch.Tensor  # [out, sum R]: their B side by side
    column_slots: torch.Tensor  # [sum R]: the slot of each column
    layout: tuple[int, ...]  # (slot, rank) pairs, flattened: the key of its mask


@dataclass(slots=True)
class _Adapted:
    """What one projection adds: every adapter's factors stacked (`stacked`, for steps that mix adapters),
    and per slot views of them, (A [R, in], B [out, R]). Stacked again at each change, so each adapter's
    factors are held once."""

    weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    stacked: _Stacked | None = None

    def __call__(self, _module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
        step: StepAdapters | None = get_context().lora
        if step is None:
            return out
        x = args[0]
        if step.row_slots is None:  # one adapter
            pair = self.weights.get(step.slot)
            if pair is None:
                return out
            a, b = pair
            if step.rows is None:
                return out + (x @ a.t()) @ b.t()
            return out.index_add(0, step.rows, (x.index_select(0, step.rows) @ a.t()) @ b.t())
        s = self.stacked
        if s is None:
            return out
        return out + ((x @ s.a.t()) * step.mask(s.column_slots, s.layout, x.dtype)) @ s.b.t()

    def restack(self) -> None:
        """Stack the adapters' factors after a change, and make the per-slot factors views of the stack."""
        if not self.weights:
            self.stacked = None
            return
        slots = sorted(self.weights)
        a = torch.cat([self.weights[k][0] for k in slots])
        b = torch.cat([self.weights[k][1] for k in slots], dim=1).contiguous()
        ranks = [self.weights[k][0].shape[0] for k in slots]
        column_slots = torch.repeat_interleave(
            torch.tensor(slots, device=a.device), torch.tensor(ranks, device=a.device)
        )
        layout = tuple(v for pair in zip(slots, ranks, strict=True) for v in pair)
        self.stacked = _Stacked(a, b, column_slots, layout)
        start = 0
        for k, r in zip(slots, ranks, strict=True):
            self.weights[k] = (a[start : start + r], b[:, start : start + r])
            start += r


def _shard(f: Factors, shard: Shard, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's A and B of one projection (Shard.checkpoint_range: rows of B, or columns of A)."""
    a, b = f.a, f.b
    cut = shard.checkpoint_range(f"{f.projection}.weight", head_dim) if shard.size > 1 else None
    if cut is not None:
        dim, start, length = cut
        if dim == 0:
            b = b[start : start + length]
        else:
            a = a[:, start : start + length]
    return a, b


class LoraSet:
    """The engine's adapters by name, their slots, and the hooks that apply them. Adapters can be added
    and removed between steps; a slot is never given twice, so a request's slot never names another
    adapter than the one it was admitted on."""

    def __init__(self, model: LlamaForCausalLM, adapters: Sequence[AdapterFiles], dtype: torch.dtype) -> None:
        self.model, self.dtype = model, dtype
        self.device = next(model.parameters()).device
        self.slots: dict[str, int] = {}
        self.names: dict[int, str] = {}  # slot -> name
        self._hooks: dict[str, _Adapted] = {}  # "layer.module" -> its hook, registered once
        self._next_slot = 1
        self._loads: dict[str, int] = {}  # name -> times loaded in this engine's life
        for adapter in adapters:
            self.add(adapter)

    def add(self, adapter: AdapterFiles) -> None:
        if (problem := adapter_name_problem(adapter.name)) is not None:
            raise ValueError(f"lora: {problem}")
        if adapter.name in self.slots:
            raise ValueError(f"lora: adapter {adapter.name!r} is already loaded")
        slot, self._next_slot = self._next_slot, self._next_slot + 1
        model = self.model
        per_module: dict[str, list[tuple[int | None, torch.Tensor, torch.Tensor]]] = {}
        for f in adapter.factors:
            module, part = _MODULE[f.projection]
            a, b = _shard(f, model.shard, model.config.head_dim)
            per_module.setdefault(f"{f.layer}.{module}", []).append((part, a, b))
        stacked = {}
        for key, pieces in per_module.items():
            a, b = _stack(pieces, _part_sizes(model, key.split(".", 1)[1]))
            stacked[key] = (
                a.to(self.device, self.dtype).contiguous(),
                b.to(self.device, self.dtype).contiguous(),
            )
        for key, pair in stacked.items():  # all moved: nothing is attached half
            hook = self._hooks.get(key)
            if hook is None:
                layer, module = key.split(".", 1)
                hook = self._hooks[key] = _Adapted()
                model.model.layers[int(layer)].get_submodule(module).register_forward_hook(hook)
            hook.weights[slot] = pair
            hook.restack()
        self.slots[adapter.name], self.names[slot] = slot, adapter.name
        self._loads[adapter.name] = self._loads.get(adapter.name, 0) + 1

    def remove(self, name: str) -> None:
        slot = self.slot(name)
        for hook in self._hooks.values():
            if hook.weights.pop(slot, None) is not None:
                hook.restack()
        del self.slots[name], self.names[slot]

    def cache_key(self, name: str) -> str:
        """The key of the adapter's blocks in the prefix cache: its name; from its second load on (other
        weights, perhaps, under the same name), its name and that load's number."""
        loads = self._loads[name]
        return name if loads == 1 else f"{name}\x00{loads}"  # no name holds a control character

    def slot(self, name: str) -> int:
        if name not in self.slots:
            known = ", ".join(self.slots) or "none"
            raise ValueError(f"lora: unknown adapter {name!r}; loaded: {known}")
        return self.slots[name]


class ChunkLike(Protocol):
    adapter: int
    token_ids: Sequence[int]


def rows_of(
    adapters: LoraSet | None, chunks: Sequence[ChunkLike], device: torch.device
) -> StepAdapters | None:
    """The step's rows per adapter, from each chunk's slot and token count; None when every chunk runs on
    the base model."""
    slots = [c.adapter for c in chunks]
    if adapters is None or not any(slots):
        return None
    per_row = np.repeat(np.asarray(slots, dtype=np.int64), [len(c.token_ids) for c in chunks])
    used = set(slots) - {0}
    if len(used) > 1:
        return StepAdapters(0, None, torch.from_numpy(per_row).to(device))
    (slot,) = used
    if 0 not in slots:
        return StepAdapters(slot, None, None)
    return StepAdapters(slot, torch.from_numpy(np.flatnonzero(per_row == slot)).to(device), None)


def load(
    model: LlamaForCausalLM,
    modules: dict[str, str] | None,
    config: ModelConfig,
    dtype: torch.dtype,
    max_rank: int | None = None,
) -> LoraSet | None:
    """The adapters of `lora_modules` (name -> PEFT directory), read, checked (no rank over `max_rank`)
    and attached; None for none."""
    if not modules:
        return None
    adapters = [read_adapter(name, path, config) for name, path in modules.items()]
    for adapter in adapters:
        check_rank(adapter, max_rank)
    return LoraSet(model, adapters, dtype)


def check_rank(adapter: AdapterFiles, max_rank: int | None) -> None:
    """ValueError for an adapter with a projection of a rank over `max_rank` (max_lora_rank)."""
    rank = max((f.a.shape[0] for f in adapter.factors), default=0)
    if max_rank is not None and rank > max_rank:
        raise ValueError(f"lora: adapter {adapter.name!r} has rank {rank}, over max_lora_rank {max_rank}")


def slot_of(adapters: LoraSet | None, name: str | None) -> int:
    """The slot of the adapter a request names (0: none, the base model); ValueError for one not loaded."""
    if name is None:
        return 0
    if adapters is None:
        raise ValueError(f"lora: no LoRA adapters are loaded; {name!r} is unknown")
    return adapters.slot(name)


def key_of(adapters: LoraSet | None, name: str | None) -> str | None:
    """The prefix-cache key of a request's adapter (None for the base model)."""
    return None if adapters is None or name is None else adapters.cache_key(name)


def _part_sizes(model: LlamaForCausalLM, module: str) -> list[int]:
    shard, d = model.shard, model.config.head_dim
    if module.endswith("qkv_proj"):
        return [shard.num_heads * d, shard.num_kv_heads * d, shard.num_kv_heads * d]
    if module.endswith("gate_up_proj"):
        return [shard.intermediate_size] * 2
    return []


def _stack(
    pieces: list[tuple[int | None, torch.Tensor, torch.Tensor]], sizes: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One projection's A and B: a plain projection's own, or a merged one's parts stacked (A by rows, B
    block-diagonal over the parts' output rows; a part the adapter leaves alone adds nothing)."""
    if not sizes:
        ((_, a, b),) = pieces
        return a, b
    a = torch.cat([p[1] for p in pieces])
    b = torch.zeros(sum(sizes), a.shape[0], dtype=a.dtype)
    rank_at = 0
    for part, pa, pb in pieces:
        assert part is not None
        row = sum(sizes[:part])
        b[row : row + pb.shape[0], rank_at : rank_at + pa.shape[0]] = pb
        rank_at += pa.shape[0]
    return a, b
