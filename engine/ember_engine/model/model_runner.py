"""Runs one scheduled step: lays the batch out, runs the model over the paged cache, samples."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from ember_engine.core import prompt_logprobs
from ember_engine.core.config import EngineConfig
from ember_engine.core.request import Request
from ember_engine.core.scheduler import SchedulerOutput
from ember_engine.model import kv_quant, lora
from ember_engine.model.context import ForwardContext, set_context
from ember_engine.model.input_buffers import InputBuffers
from ember_engine.model.llama import LlamaForCausalLM
from ember_engine.model.loader import load_weights
from ember_engine.model.memory import MemoryReport, blocks_in, kv_block_bytes, kv_cache_blocks, read_memory
from ember_engine.model.model_config import ModelConfig, resolve_dtype
from ember_engine.model.parallel import SINGLE, TPGroup
from ember_engine.model.quant import apply as quant_apply
from ember_engine.model.quant.checkpoint import read_quantization_config
from ember_engine.model.quant.checkpoint import resolve as resolve_quantization
from ember_engine.sample.sampler import sampler_peak_probe

log = logging.getLogger(__name__)

_CPU_DEFAULT_KV_BYTES = 2 << 30


@dataclass(slots=True)
class Chunk:
    """A run of one sequence's tokens for a forward pass."""

    block_ids: list[int]  # the sequence's block table
    start: int  # position of the first token
    token_ids: Sequence[int]
    num_logits: int = 0  # logits wanted for the last this-many tokens
    adapter: int = 0  # the LoRA adapter's slot (0: the base model)


class StepPeers(Protocol):
    """The other tensor-parallel ranks, as rank 0's runner sees them (`distributed.workers.WorkerPool`)."""

    def send(self, chunks: Sequence[Chunk]) -> None:
        """Hand them the step's chunks, which they run beside this rank."""


@dataclass(slots=True)
class StepResult:
    sampled: list[Request]  # requests whose chunk reached their last known token, in batch order
    # [rows, vocab] float32: per sampled request 1 + len(spec_token_ids) rows; None when nothing is sampled
    logits: torch.Tensor | None


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        max_model_len: int,
        model_dir: str | None = None,
        num_blocks: int | None = None,
        extra_block_bytes: int = 0,
        reserved_bytes: int = 0,
        tp: TPGroup = SINGLE,
        device: torch.device | None = None,
        peers: StepPeers | None = None,
    ) -> None:
        """`model_dir` defaults to config.model. A draft model's runner is given the target's
        `num_blocks`, so both caches share one block table; the target's runner is told what each block
        costs the draft (`extra_block_bytes`) and what its weights take (`reserved_bytes`) when it sizes
        the cache. Under tensor parallelism each rank builds its runner over its shard (`tp`, on its
        `device`); rank 0's `peers` get every step's chunks before it runs them."""
        self.config = config
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.tp, self.peers = tp, peers
        self.device = device or torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto" else config.device
        )
        self.dtype = resolve_dtype(config.dtype, model_config)
        self.kv_dtype = kv_quant.cache_dtype(config.kv_cache_dtype, self.dtype)
        if self.kv_dtype in kv_quant.FP8_FORMATS:
            kv_quant.check_checkpoint_scheme(read_quantization_config(model_dir or config.model))
        self.block_size = config.block_size
        self.extra_block_bytes = extra_block_bytes
        self.reserved_bytes = reserved_bytes
        if self.device.type == "cuda":
            if self.device.index is None:  # "cuda": the current device, named, so set_device takes it
                self.device = torch.device("cuda", torch.cuda.current_device())
            # Kernels, allocations and memory reports without an explicit device go to this one.
            torch.cuda.set_device(self.device)
        torch.manual_seed(config.seed)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = LlamaForCausalLM(model_config, tp)
        finally:
            torch.set_default_dtype(previous)
        # Online quantization is the target's (a draft model runs as its checkpoint is).
        weights_dir = Path(model_dir or config.model)
        self.quant = resolve_quantization(weights_dir, config.quantization if model_dir is None else None)
        if self.quant is not None and self.quant.prequantized:
            quant_apply.prepare(self.model, self.quant)
            load_weights(self.model, weights_dir, quant_apply.QuantCollector(self.model, self.quant))
        else:
            load_weights(self.model, weights_dir)
            if self.quant is not None:
                quant_apply.quantize_model(self.model, self.quant, tp)
        # LoRA adapters are the target's, as online quantization is; applied over the (quantized) base.
        modules = None if model_dir else config.lora_modules
        self.lora = lora.load(self.model, modules, model_config, self.dtype, config.max_lora_rank)
        self.model.eval()
        # One block table serves every rank: the cache is as large as the most constrained rank allows.
        self.num_blocks = tp.min_over_ranks(
            self._num_kv_blocks() if num_blocks is None else num_blocks, self.device
        )
        self._allocate_kv_cache()
        self.inputs = InputBuffers(
            config.max_num_batched_tokens,
            config.max_num_seqs,
            -(-max_model_len // self.block_size),
            self.block_size,
            self.device,
        )
        if self.kv_dtype in kv_quant.FP8_FORMATS:
            self._compute_kv_scales()
        # Every attention kernel variant compiles now, before the server reports ready.
        self.warm_up()

    # -- KV cache -------------------------------------------------------------------------------------

    def block_bytes(self) -> int:
        """What one block costs: this model's K and V for block_size tokens, plus a draft model's."""
        heads = self.model.shard.num_kv_heads
        return (
            kv_block_bytes(self.model_config, self.kv_dtype, self.block_size, heads) + self.extra_block_bytes
        )

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.config.kv_cache_memory is not None:
            return blocks_in(self.config.kv_cache_memory, self.block_bytes())
        if self.device.type == "cuda":
            return self._profile_kv_blocks()
        # CPU: room for every sequence at full length, capped.
        wanted = -(-self.max_model_len // self.block_size) * min(self.config.max_num_seqs, 64)
        return max(1, min(wanted, _CPU_DEFAULT_KV_BYTES // self.block_bytes()))

    def _profile_kv_blocks(self) -> int:
        """Run the largest step the scheduler can produce (a full prefill, then the sampler over its most
        rows: every sequence, K + 1 rows each with speculation), then give the cache what memory is left.
        Everything is read from this runner's own device."""
        dev = self.device
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        self.num_blocks = -(-n // self.block_size)
        self._allocate_kv_cache()
        self.execute_dummy(n)
        rows = self.config.max_num_seqs * (
            1 + (self.config.speculative_tokens if self.config.speculation else 0)
        )
        sampler_peak_probe(min(rows, self.config.max_num_batched_tokens), self.model_config.vocab_size, dev)
        report = read_memory(dev)
        for layer in self.model.attention_layers():
            layer.k_cache = layer.v_cache = torch.empty(0)
        self.kv_cache = torch.empty(0)
        torch.cuda.empty_cache()
        report = MemoryReport(report.total, report.free, torch.cuda.memory_reserved(dev), report.peak)
        blocks = kv_cache_blocks(
            report, self.config.gpu_memory_utilization, self.reserved_bytes, self.block_bytes()
        )
        if blocks < 1:
            raise RuntimeError(
                f"no GPU memory left for the KV cache (peak {report.peak / 2**30:.1f} GiB of "
                f"{report.total / 2**30:.1f} GiB); lower max_num_batched_tokens or raise gpu_memory_utilization"
            )
        return blocks

    def _allocate_kv_cache(self) -> None:
        self.kv_cache = self._kv_cache_of(self.num_blocks)

    def _kv_cache_of(self, num_blocks: int) -> torch.Tensor:
        """A KV cache of `num_blocks` blocks, each attention layer given its views of it."""
        c = self.model_config
        heads = self.model.shard.num_kv_heads
        shape = (2, c.num_layers, num_blocks, self.block_size, heads, c.head_dim)
        cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        for i, layer in enumerate(self.model.attention_layers()):
            layer.k_cache, layer.v_cache = cache[0, i], cache[1, i]
        return cache

    @torch.inference_mode()
    def _compute_kv_scales(self) -> None:
        """Give every FP8-cache scale the checkpoint did not: kv_quant's calibration sequences, one forward
        each, in which each layer takes its scales from the largest |K| and |V| seen so far, before it
        stores them (over every rank's heads under tensor parallelism, so each rank stores the bytes one
        rank would). The sequences run whole, in a cache of their own: the result depends on the model
        alone, not on the cache's size, the step's token budget or the longest sequence served."""
        layers = self.model.attention_layers()
        if all(layer.checkpoint_scales >= {"k", "v"} for layer in layers):
            return
        n = min(kv_quant.CALIBRATION_LENGTH, self.model_config.max_position_embeddings)
        blocks = list(range(-(-n // self.block_size)))
        for layer in layers:
            layer.calibration = torch.zeros(2, device=self.device)
        scratch = self._kv_cache_of(len(blocks))
        try:
            for tokens in kv_quant.calibration_sequences(self.model_config.vocab_size):
                self.run([Chunk(blocks, 0, tokens[:n], 0)])
        finally:
            for i, layer in enumerate(layers):
                layer.calibration = None
                layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
            del scratch
        if self.tp.rank == 0:
            log.info(
                "FP8 KV cache: scales computed where the checkpoint has none; K %s, V %s",
                ", ".join(kv_quant.describe(a.k_scale) for a in layers),
                ", ".join(kv_quant.describe(a.v_scale) for a in layers),
            )

    # -- a step ---------------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> StepResult:
        """Run the batch's forward. Requests whose chunk reaches their last known token are sampled: they
        get logits for that token and for each of their speculative tokens (which follow it). A prefill
        chunk of a request collecting prompt logprobs gets them at every position, recorded here."""
        chunks, sampled, parts, first_rows, row = [], [], [], [], 0
        for req, n in zip(batch.requests, batch.num_tokens, strict=True):
            start, known = req.num_computed_tokens, req.num_tokens
            tokens = req.all_token_ids[start : min(start + n, known)]
            if start + n > known:
                tokens = tokens + req.spec_token_ids[: start + n - known]
            sample_now = start + n == known + len(req.spec_token_ids)
            num_logits = 1 + len(req.spec_token_ids) if sample_now else 0
            if req.prompt_logprobs is not None and (part := prompt_logprobs.prompt_rows(req, start, n, row)):
                parts.append(part)
                num_logits = n  # every position: the sampled rows, if any, are still the last ones
            if sample_now:
                sampled.append(req)
                first_rows.append(row + num_logits - 1 - len(req.spec_token_ids))
            row += num_logits
            chunks.append(Chunk(req.block_ids, start, tokens, num_logits, req.adapter))
        logits = self.forward(chunks)
        if parts and logits is not None:  # the prompts' rows recorded, the sampled ones kept
            logits = prompt_logprobs.record(logits, parts, sampled, first_rows)
        return StepResult(sampled, logits)

    def forward(self, chunks: Sequence[Chunk]) -> torch.Tensor | None:
        """One forward over the chunks, writing their K/V into the cache at their positions; returns the
        logits [sum of num_logits, vocab] (float32) in chunk order, or None when no chunk wants any.
        Under tensor parallelism this is rank 0's side: the chunks go to the other ranks first (the
        step's one broadcast), then every rank runs them."""
        if self.peers is not None:
            self.peers.send(chunks)
        return self.run(chunks)

    @torch.inference_mode()
    def run(self, chunks: Sequence[Chunk]) -> torch.Tensor | None:
        """`forward` on this rank alone (other ranks than 0 get None: only rank 0 gathers logits)."""
        step = self.inputs.prepare(chunks)
        set_context(step.context(lora.rows_of(self.lora, chunks, self.device)))
        try:
            hidden = self.model(step.input_ids, step.positions)
        finally:
            set_context(None)
        if not step.num_logits:
            return None
        rows = hidden if step.logit_rows is None else hidden.index_select(0, step.logit_rows)
        return self.model.compute_logits(rows)

    @torch.inference_mode()
    def warm_up(self) -> int:
        """Launch every attention kernel variant serving can reach (prefill, decode, each split-KV count
        the model length allows), so none compiles mid-serving; returns how many were new. The CPU's
        loops for the model's quantization compile here too (a no-op beyond that on the torch attention
        path)."""
        from ember_engine.model import attention, triton_attention
        from ember_engine.model.kernel_launch import LEDGER

        if self.quant is not None and self.device.type == "cpu":
            from ember_engine.model.quant.linear import warm_up_cpu

            warm_up_cpu(self.quant)
        if not attention._use_triton(torch.empty(0, device=self.device)):
            return 0
        before = LEDGER.compiles
        self.run([Chunk([0], 0, [0, 0], 2)])  # a prefill (also speculation's multi-token queries)
        self.run([Chunk([0], 1, [0], 1)])  # a decode
        layer = next(iter(self.model.attention_layers()))
        heads, dim = self.model.shard.num_heads, self.model_config.head_dim
        q = torch.zeros(1, heads, dim, dtype=self.dtype, device=self.device)
        longest = min(triton_attention.MAX_SPLITS, self.max_model_len // triton_attention.MIN_KEYS_PER_SPLIT)
        for splits in range(2, longest + 1):
            seq_len = splits * 64  # one 64-key segment each
            step = self.inputs.prepare([Chunk([0] * -(-seq_len // self.block_size), seq_len - 1, [0], 1)])
            triton_attention.paged_attention(
                q,
                layer.k_cache,
                layer.v_cache,
                step.block_tables,
                step.seq_lens,
                step.query_start_loc,
                1,
                seq_len,
                1.0,
                num_splits=splits,
                k_scale=layer.k_scale,
                v_scale=layer.v_scale,
            )
        return LEDGER.compiles - before

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
