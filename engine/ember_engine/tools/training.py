"""How the speculative-decoding pair is trained: the training model, the corpus and its batches, the
loops that train the target (next-token loss) and distil the draft from it, and the held-out evaluation.

Training uses a small self-contained Llama whose parameter names are Hugging Face's, so its state dict is
saved as `model.safetensors` unchanged and loads in ember and in `transformers` alike. The sizes and
settings of the packaged pair, and writing it out, are in `spec_pair`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ember_engine.model.llama import RMSNorm, rotate_half
from ember_engine.tools import testmodel


@dataclass(frozen=True, slots=True)
class TrainSettings:
    steps: int
    tokens_per_step: int
    seq_len: int
    # The last `long_steps` steps see longer windows (same tokens per step), so positions far past
    # `seq_len` are trained too; short windows before that buy many more updates for the same time.
    long_seq_len: int
    long_steps: int
    lr: float
    warmup: int
    seed: int

    def shape(self, step: int) -> tuple[int, int]:
        """(batch size, window length) at `step`."""
        seq_len = self.long_seq_len if step >= self.steps - self.long_steps else self.seq_len
        return self.tokens_per_step // seq_len, seq_len


# The draft's loss: KL to the target's next-token distribution plus this much of the plain LM loss.
DRAFT_LM_WEIGHT = 0.1
HELD_OUT_FILES = 4  # the corpus's last files are never trained on
WEIGHT_DECAY = 0.01
EVAL_SEQ_LEN = 512

Log = Callable[[str], None] | None  # called with progress lines


# --- the training model -------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        h, d = config["hidden_size"], config["head_dim"]
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config["num_attention_heads"],
            config["num_key_value_heads"],
            d,
        )
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # Grouped-query attention: each KV head serves a run of consecutive query heads.
        group = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        h, inter = config["hidden_size"], config["intermediate_size"]
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config["hidden_size"], config["rms_norm_eps"])
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config["hidden_size"], config["rms_norm_eps"])
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config["num_hidden_layers"]))
        self.norm = RMSNorm(config["hidden_size"], config["rms_norm_eps"])


class TrainingLlama(nn.Module):
    """A plain causal Llama (no KV cache) with Hugging Face's parameter names. With tied embeddings the
    output projection is the embedding matrix and the state dict has no `lm_head.weight`, as in a tied
    Hugging Face checkpoint."""

    inv_freq: torch.Tensor

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaBody(config)
        self.tied = bool(config["tie_word_embeddings"])
        if not self.tied:
            self.lm_head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)
        d = config["head_dim"]
        inv_freq = 1.0 / (config["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def init_weights(self, generator: torch.Generator) -> None:
        std = self.config["initializer_range"]
        # Residual-branch outputs scaled down with depth, so a deep stack starts close to the identity.
        out_std = std / math.sqrt(2 * self.config["num_hidden_layers"])
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                nn.init.ones_(p)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, std=out_std, generator=generator)
            else:
                nn.init.normal_(p, std=std, generator=generator)

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        positions = torch.arange(t, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        x = self.model.embed_tokens(input_ids)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.norm(x)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits, shape (batch, tokens, vocab)."""
        h = self.hidden_states(input_ids)
        weight = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        return F.linear(h, weight)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


# --- data ---------------------------------------------------------------------------------------------


def corpus_tokens(tokenizer_file: Path, eos_id: int) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """(training tokens, held-out tokens, held-out file names): each file's tokens followed by EOS, in the
    corpus's sorted order; the last HELD_OUT_FILES files are held out."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    files = testmodel.corpus_files()
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    encoded = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]

    def stream(parts: list[list[int]]) -> torch.Tensor:
        ids: list[int] = []
        for part in parts:
            ids.extend(part)
            ids.append(eos_id)
        return torch.tensor(ids, dtype=torch.int64)

    split = len(files) - HELD_OUT_FILES
    return stream(encoded[:split]), stream(encoded[split:]), [p.name for p in files[split:]]


def _batch(data: torch.Tensor, batch_size: int, seq_len: int, g: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=g)
    return torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])


def _lr(step: int, s: TrainSettings) -> float:
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _optimizer(model: nn.Module, s: TrainSettings) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=s.lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)


def _windows(data: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping windows of seq_len + 1 tokens covering the data (the tail dropped)."""
    n = (len(data) - 1) // seq_len
    return torch.stack([data[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])


@torch.inference_mode()
def evaluate(
    target: TrainingLlama, draft: TrainingLlama | None, data: torch.Tensor, seq_len: int = EVAL_SEQ_LEN
) -> dict[str, float]:
    """Mean next-token loss of each model on `data`, and the fraction of positions where their argmax
    predictions agree."""
    losses = {"target": 0.0, "draft": 0.0}
    agree, count = 0, 0
    for w in _windows(data, seq_len):
        x, y = w[None, :-1], w[None, 1:]
        t_logits = target(x)
        losses["target"] += F.cross_entropy(t_logits[0], y[0], reduction="sum").item()
        if draft is not None:
            d_logits = draft(x)
            losses["draft"] += F.cross_entropy(d_logits[0], y[0], reduction="sum").item()
            agree += int((d_logits.argmax(-1) == t_logits.argmax(-1)).sum())
        count += y.numel()
    out = {"target_loss": losses["target"] / count}
    if draft is not None:
        out["draft_loss"] = losses["draft"] / count
        out["agreement"] = agree / count
    return out


# --- training -----------------------------------------------------------------------------------------


def train_target(model: TrainingLlama, data: torch.Tensor, s: TrainSettings, log: Log = None) -> float:
    """Plain next-token training; returns the mean loss of the last 20 steps."""
    g = torch.Generator().manual_seed(s.seed + 1000)
    opt = _optimizer(model, s)
    model.train()
    recent: list[float] = []
    for step in range(s.steps):
        for group in opt.param_groups:
            group["lr"] = _lr(step, s)
        batch = _batch(data, *s.shape(step), g)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        recent = [*recent[-19:], loss.item()]
        if log is not None and (step % 50 == 0 or step == s.steps - 1):
            log(f"target step {step}/{s.steps} loss {sum(recent) / len(recent):.3f}")
    model.eval()
    return sum(recent) / len(recent)


def train_draft(
    draft: TrainingLlama, target: TrainingLlama, data: torch.Tensor, s: TrainSettings, log: Log = None
) -> float:
    """Distillation: KL(target || draft) on each position's next-token distribution, plus
    DRAFT_LM_WEIGHT times the plain next-token loss; returns the latter's mean over the last 20 steps."""
    g = torch.Generator().manual_seed(s.seed + 1000)
    opt = _optimizer(draft, s)
    draft.train()
    target.eval()
    recent: list[float] = []
    for step in range(s.steps):
        for group in opt.param_groups:
            group["lr"] = _lr(step, s)
        batch = _batch(data, *s.shape(step), g)
        x, y = batch[:, :-1], batch[:, 1:].reshape(-1)
        with torch.no_grad():
            t_logp = F.log_softmax(target(x).reshape(-1, testmodel.VOCAB_SIZE), dim=-1)
        d_logits = draft(x).reshape(-1, testmodel.VOCAB_SIZE)
        d_logp = F.log_softmax(d_logits, dim=-1)
        kl = F.kl_div(d_logp, t_logp, log_target=True, reduction="batchmean")
        lm = F.nll_loss(d_logp, y)
        loss = kl + DRAFT_LM_WEIGHT * lm
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        recent = [*recent[-19:], lm.item()]
        if log is not None and (step % 50 == 0 or step == s.steps - 1):
            log(f"draft step {step}/{s.steps} kl {kl.item():.3f} lm {sum(recent) / len(recent):.3f}")
    draft.eval()
    return sum(recent) / len(recent)
