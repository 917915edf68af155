"""Runs one scheduled step: lays the batch out, runs the model over the paged cache, samples."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ember_engine.config import EngineConfig
from ember_engine.context import ForwardContext, set_context
from ember_engine.llama import LlamaForCausalLM
from ember_engine.loader import load_weights
from ember_engine.model_config import ModelConfig, resolve_dtype
from ember_engine.request import Request
from ember_engine.scheduler import SchedulerOutput

_CPU_DEFAULT_KV_BYTES = 2 << 30


@dataclass(slots=True)
class StepResult:
    sampled: list[Request]  # requests whose chunk reached their last known token, in batch order
    logits: torch.Tensor | None  # [len(sampled), vocab] float32; None when nothing is sampled


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int) -> None:
        self.config = config
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto" else config.device
        )
        self.dtype = resolve_dtype(config.dtype, model_config)
        self.block_size = config.block_size
        torch.manual_seed(config.seed)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = LlamaForCausalLM(model_config)
        finally:
            torch.set_default_dtype(previous)
        load_weights(self.model, Path(config.model))
        self.model.eval()
        self.num_blocks = self._num_kv_blocks()
        self._allocate_kv_cache()

    # -- KV cache -------------------------------------------------------------------------------------

    def block_bytes(self) -> int:
        c = self.model_config
        per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * self.dtype.itemsize
        return per_token * self.block_size

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.config.kv_cache_memory is not None:
            return max(1, self.config.kv_cache_memory // self.block_bytes())
        if self.device.type == "cuda":
            return self._profile_kv_blocks()
        # CPU: room for every sequence at full length, capped.
        wanted = -(-self.max_model_len // self.block_size) * min(self.config.max_num_seqs, 64)
        return max(1, min(wanted, _CPU_DEFAULT_KV_BYTES // self.block_bytes()))

    def _profile_kv_blocks(self) -> int:
        """Run the largest prefill the scheduler can produce, then give the cache what memory is left."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        self.num_blocks = -(-n // self.block_size)
        self._allocate_kv_cache()
        self.execute_dummy(n)
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        peak = torch.cuda.max_memory_allocated()
        for layer in self.model.attention_layers():
            layer.k_cache = layer.v_cache = torch.empty(0)
        self.kv_cache = torch.empty(0)
        torch.cuda.empty_cache()
        used_elsewhere = total - free - torch.cuda.memory_reserved()
        budget = total * self.config.gpu_memory_utilization - peak - max(used_elsewhere, 0)
        blocks = int(budget // self.block_bytes())
        if blocks < 1:
            raise RuntimeError(
                f"no GPU memory left for the KV cache (peak {peak / 2**30:.1f} GiB of {total / 2**30:.1f} GiB); "
                "lower max_num_batched_tokens or raise gpu_memory_utilization"
            )
        return blocks

    def _allocate_kv_cache(self) -> None:
        c = self.model_config
        shape = (2, c.num_layers, self.num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.model.attention_layers()):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    # -- a step ---------------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> StepResult:
        """Run the batch's forward; logits only for the requests that reach their last known token."""
        bs = self.block_size
        ids, pos, slots, q_loc, seq_lens, logit_rows = [], [], [], [0], [], []
        sampled: list[Request] = []
        max_blocks = max(len(r.block_ids) for r in batch.requests)
        tables = np.zeros((len(batch), max_blocks), dtype=np.int32)
        for i, (req, n) in enumerate(zip(batch.requests, batch.num_tokens, strict=True)):
            start = req.num_computed_tokens
            positions = np.arange(start, start + n)
            block_ids = np.asarray(req.block_ids, dtype=np.int64)
            tables[i, : len(block_ids)] = block_ids
            ids.append(np.asarray(req.all_token_ids[start : start + n], dtype=np.int64))
            pos.append(positions)
            slots.append(block_ids[positions // bs] * bs + positions % bs)
            q_loc.append(q_loc[-1] + n)
            seq_lens.append(start + n)
            if start + n == req.num_tokens:
                logit_rows.append(q_loc[-1] - 1)
                sampled.append(req)
        dev = self.device
        input_ids = torch.from_numpy(np.concatenate(ids)).to(dev, non_blocking=True)
        positions_t = torch.from_numpy(np.concatenate(pos)).to(dev, non_blocking=True)
        set_context(
            ForwardContext(
                slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev, non_blocking=True),
                query_start_loc=torch.tensor(q_loc, dtype=torch.int32, device=dev),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
                block_tables=torch.from_numpy(tables).to(dev, non_blocking=True),
                max_query_len=max(batch.num_tokens),
                max_seq_len=max(seq_lens),
            )
        )
        try:
            hidden = self.model(input_ids, positions_t)
        finally:
            set_context(None)
        if not sampled:
            return StepResult([], None)
        return StepResult(sampled, self.model.compute_logits(hidden[torch.tensor(logit_rows, device=dev)]))

    @torch.inference_mode()
    def execute_dummy(self, num_tokens: int) -> None:
        """One forward over `num_tokens` prompt tokens of one sequence, writing into block 0.. (profiling,
        warm-up)."""
        bs = self.block_size
        positions = torch.arange(num_tokens, device=self.device)
        blocks = torch.arange(-(-num_tokens // bs), dtype=torch.int32, device=self.device) % self.num_blocks
        set_context(
            ForwardContext(
                slot_mapping=(blocks.long()[positions // bs] * bs + positions % bs),
                query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
                seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
                block_tables=blocks.unsqueeze(0),
                max_query_len=num_tokens,
                max_seq_len=num_tokens,
            )
        )
        try:
            hidden = self.model(torch.zeros(num_tokens, dtype=torch.long, device=self.device), positions)
            self.model.compute_logits(hidden[-1:])
        finally:
            set_context(None)
