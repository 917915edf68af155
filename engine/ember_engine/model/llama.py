"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over the paged KV cache.

Module names mirror Hugging Face's, except that q/k/v and gate/up projections are merged into one matmul
each; the loader slices checkpoint tensors into them. Under tensor parallelism (`parallel.py`) each rank
builds the same modules at its shard's sizes, and each attention and MLP block ends in one all-reduce.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ember_engine.model import kv_quant
from ember_engine.model.attention import context_attention, store_kv
from ember_engine.model.context import get_context
from ember_engine.model.model_config import ModelConfig
from ember_engine.model.parallel import SINGLE, ParallelLMHead, Shard, TPGroup, VocabParallelEmbedding


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and cast back before the weight, the order the reference uses.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if config.rope_freq_factors is not None:  # each angle divided by its factor, as llama.cpp applies them
        return inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    scaling = config.rope_scaling
    if scaling is None or scaling.get("rope_type", scaling.get("type")) != "llama3":
        return inv_freq
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = positions[:, None] * rope_inv_freq(config)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    k_cache: torch.Tensor
    v_cache: torch.Tensor

    def __init__(self, config: ModelConfig, shard: Shard, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = (
            shard.num_heads,
            shard.num_kv_heads,
            config.head_dim,
        )
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.scale = self.head_dim**-0.5
        self.k_cache = self.v_cache = torch.empty(0)
        # An FP8 cache's per-layer scales (stored = x / scale), or per KV head (this rank's heads): the
        # checkpoint's ("k"/"v" in checkpoint_scales), else computed at load (kv_quant), 1.0 until then and
        # with any other cache.
        self.k_scale: kv_quant.Scale = 1.0
        self.v_scale: kv_quant.Scale = 1.0
        self.checkpoint_scales: set[str] = set()
        # While the scales the checkpoint lacks are computed: the largest |K| and |V| seen so far.
        self.calibration: torch.Tensor | None = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        if self.calibration is not None:
            self._calibrate(k, v)
        ctx = get_context()
        store_kv(k, v, self.k_cache, self.v_cache, ctx.slot_mapping, self.k_scale, self.v_scale)
        out = context_attention(
            q.contiguous(), self.k_cache, self.v_cache, ctx, self.scale, self.k_scale, self.v_scale
        )
        return self.tp.all_reduce(self.o_proj(out.reshape(n, self.q_size)))

    def _calibrate(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Scales from the largest |K| and |V| of the calibration so far (every rank's heads), set before
        this forward stores them: the layers after this one then see what serving will give them."""
        assert self.calibration is not None
        here = self.tp.max_over_ranks(torch.stack([k.abs().max(), v.abs().max()]).float())
        torch.maximum(self.calibration, here, out=self.calibration)
        largest = self.calibration.tolist()
        if "k" not in self.checkpoint_scales:
            self.k_scale = kv_quant.computed_scale(largest[0], "keys")
        if "v" not in self.checkpoint_scales:
            self.v_scale = kv_quant.computed_scale(largest[1], "values")


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * shard.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shard.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.tp.all_reduce(self.down_proj(F.silu(gate) * up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard, tp: TPGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, shard, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, shard, tp)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
        h = h + self.self_attn(positions, self.input_layernorm(h), rotary)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(shard, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, shard, tp) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(positions, h, self.rotary)
        return self.norm(h)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.shard = Shard.of(config, tp.rank, tp.size)
        self.model = LlamaModel(config, self.shard, tp)
        self.lm_head = ParallelLMHead(self.shard, config.hidden_size, tp)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [N, hidden] for N flattened token rows laid out by the forward context."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits over the vocabulary; None on ranks other than 0 (only rank 0 samples)."""
        logits = self.lm_head(hidden)
        return None if logits is None else logits.float()

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers if isinstance(layer, DecoderLayer)]
