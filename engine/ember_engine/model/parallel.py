"""Tensor parallelism (Megatron's layout): which slice of each weight a rank holds, and the layers that
split the vocabulary.

Column-parallel projections (the merged q/k/v and gate/up) give each rank its own output features — its
attention heads, its slice of the MLP — with no communication. Row-parallel projections (o_proj,
down_proj) multiply each rank's slice of the inputs and an all-reduce sums the partial outputs: one per
attention block and one per MLP block, done by the blocks themselves (`llama.py`), so both stay plain
`nn.Linear`s. The vocabulary is cut into equal contiguous ranges (the last one padded): the embedding looks
up the ids in its range and an all-reduce assembles the rows; the LM head computes its range of logits and
rank 0, the only rank that samples, gathers them.

KV heads: with at least as many KV heads as ranks, each rank holds `num_kv_heads / size` of them; with
fewer, each KV head is replicated on `size / num_kv_heads` consecutive ranks, whose query heads are exactly
the ones that attend to it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ember_engine.model.model_config import ModelConfig

# The row-parallel projections: split by input columns, each rank's partial sums all-reduced.
INPUT_SPLIT = ("o_proj", "down_proj")


class TensorParallelError(ValueError):
    pass


class TPGroup:
    """This process's place among the ranks, and the collectives the layers use. Size 1 communicates
    nothing: the layers then compute exactly what the unsplit model does."""

    def __init__(self, rank: int = 0, size: int = 1, group: Any = None) -> None:
        self.rank, self.size, self.group = rank, size, group
        # With `timed` set (benchmarks), `seconds` totals the time spent in collectives, waiting for the
        # other ranks to arrive included; the device is synchronized around each, so keep it off otherwise.
        self.timed = False
        self.seconds = 0.0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            start = self._clock(t)
            dist.all_reduce(t, group=self.group)
            self._tally(t, start)
        return t

    def gather_to_first(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's equally shaped `t`, in rank order, on rank 0; None on the others."""
        if self.size == 1:
            return [t]
        parts = [torch.empty_like(t) for _ in range(self.size)] if self.rank == 0 else None
        start = self._clock(t)
        dist.gather(t.contiguous(), parts, dst=0, group=self.group)
        self._tally(t, start)
        return parts

    def _clock(self, t: torch.Tensor) -> float:
        if not self.timed:
            return 0.0
        if t.is_cuda:
            torch.cuda.synchronize(t.device)
        return time.perf_counter()

    def _tally(self, t: torch.Tensor, start: float) -> None:
        if self.timed:
            if t.is_cuda:
                torch.cuda.synchronize(t.device)
            self.seconds += time.perf_counter() - start

    def min_over_ranks(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's value (e.g. the KV blocks that fit on each rank's device)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def max_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        """Elementwise, the largest of every rank's `t` (in place)."""
        if self.size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t


SINGLE = TPGroup()


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Refuse a split the model's shape does not allow, naming the numbers."""
    if size < 1:
        raise TensorParallelError(f"tensor_parallel_size: must be >= 1, got {size}")
    if config.num_heads % size:
        raise TensorParallelError(
            f"tensor_parallel_size {size} does not divide the model's {config.num_heads} attention heads"
        )
    kv = config.num_kv_heads
    if kv % size and size % kv:
        raise TensorParallelError(
            f"tensor_parallel_size {size} and the model's {kv} KV heads: one must divide the other "
            "(KV heads are split across ranks, or each is replicated on size / KV heads ranks)"
        )
    if config.intermediate_size % size:
        raise TensorParallelError(
            f"tensor_parallel_size {size} does not divide the model's intermediate size "
            f"{config.intermediate_size}"
        )


@dataclass(frozen=True, slots=True)
class Shard:
    """One rank's share of a model."""

    rank: int
    size: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank (replicated when the model has fewer than ranks)
    first_kv_head: int
    intermediate_size: int
    vocab_start: int
    vocab_per_rank: int  # rows of the embedding and LM head here, padding included
    vocab_size: int

    @classmethod
    def of(cls, config: ModelConfig, rank: int = 0, size: int = 1) -> Shard:
        check_tensor_parallel(config, size)
        kv = config.num_kv_heads
        local_kv = max(1, kv // size)
        per_rank = -(-config.vocab_size // size)
        return cls(
            rank=rank,
            size=size,
            num_heads=config.num_heads // size,
            num_kv_heads=local_kv,
            first_kv_head=rank * local_kv if kv >= size else rank // (size // kv),
            intermediate_size=config.intermediate_size // size,
            vocab_start=rank * per_rank,
            vocab_per_rank=per_rank,
            vocab_size=config.vocab_size,
        )

    @property
    def vocab_rows(self) -> int:
        """Real (unpadded) vocabulary rows on this rank."""
        return max(0, min(self.vocab_per_rank, self.vocab_size - self.vocab_start))

    def checkpoint_range(self, name: str, head_dim: int) -> tuple[int, int, int] | None:
        """(dim, start, length) of checkpoint tensor `name` that this rank holds; None for a tensor every
        rank holds whole (norms, q/k norms)."""
        parts = name.split(".")
        module = parts[-2] if len(parts) >= 2 else ""
        is_bias = parts[-1] == "bias"
        if module == "q_proj":
            return 0, self.rank * self.num_heads * head_dim, self.num_heads * head_dim
        if module in ("k_proj", "v_proj"):
            return 0, self.first_kv_head * head_dim, self.num_kv_heads * head_dim
        if module in ("gate_proj", "up_proj"):
            return 0, self.rank * self.intermediate_size, self.intermediate_size
        if module in INPUT_SPLIT and not is_bias:
            width = self.num_heads * head_dim if module == "o_proj" else self.intermediate_size
            return 1, self.rank * width, width
        if module in ("embed_tokens", "lm_head"):
            return 0, self.vocab_start, self.vocab_rows
        return None

    def read(self, name: str, tensor_slice: Any, head_dim: int) -> torch.Tensor:
        """This rank's part of a checkpoint tensor, read through a safetensors slice (only those bytes)."""
        if self.size == 1:
            return tensor_slice[:]
        cut = self.checkpoint_range(name, head_dim)
        if cut is None:
            return tensor_slice[:]
        dim, start, length = cut
        if dim == 0:
            return tensor_slice[start : start + length]
        return tensor_slice[:, start : start + length]


class VocabParallelEmbedding(nn.Module):
    def __init__(self, shard: Shard, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.shard, self.tp = shard, tp
        self.weight = nn.Parameter(torch.zeros(shard.vocab_per_rank, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.shard.vocab_start
        outside = (local < 0) | (local >= self.shard.vocab_rows)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        rows.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(rows)


class ParallelLMHead(nn.Module):
    def __init__(self, shard: Shard, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.shard, self.tp = shard, tp
        self.weight = nn.Parameter(torch.zeros(shard.vocab_per_rank, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits over the whole vocabulary on rank 0 (None on the others)."""
        local = F.linear(hidden, self.weight)
        if self.tp.size == 1:
            return local
        parts = self.tp.gather_to_first(local)
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[:, : self.shard.vocab_size]
