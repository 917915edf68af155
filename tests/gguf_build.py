"""Writes a test checkpoint as a GGUF file, as llama.cpp's converter lays a llama model out, and what
transformers computes from that file (run as a script: `python gguf_build.py SRC DST PRESET`).

DST gets `model.gguf` (the tokenizer stored in it too, `write_vocabulary`), the source's tokenizer files
beside it, and `oracle.pt`: the logits of 8 fixed
prompts and the greedy tokens after 6 of them, from transformers loading the GGUF file
(`from_pretrained(DST, gguf_file=...)`, which dequantizes every tensor with the `gguf` package and puts
the q and k rows back in order), and the source model's own logits. The `gguf` package quantizes Q8_0,
Q4_0, Q4_1, Q5_0, Q5_1 and BF16; it writes no K-quants and no IQ types, so Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
IQ4_NL and IQ4_XS are written here, rounded to nearest (llama.cpp searches for better scales), their
layouts read back by the package's own dequantizers. The lattice i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS,
IQ2_S, IQ3_XXS, IQ3_S) are written in their layouts with random grid entries (`i_quant`).

PRESET: F32, F16 (matrices F16, norms F32), Q8_0, Q4_0, Q4_K, Q6_K, Q3_K, Q2_K, IQ4_NL, IQ4_XS, or any
other type the `gguf` package quantizes (every matrix in that type), Q4_K_M and Q5_K_M (Q4_K or Q5_K, but
Q6_K for the LM head and for the v and down projections of the layers llama.cpp gives more bits,
`more_bits`), Q3_K_M (Q3_K, but Q4_K for o, Q5_K for v in layers 0 and 1 and for down in the first
sixteenth of the layers, Q4_K for the other v and down, Q6_K for the head), MIXED (q and k Q4_0, v Q8_0, o Q5_1, gate Q4_1 and up BF16,
down Q5_0 but layer 0's Q6_K, embeddings Q8_0, LM head F16), IQ (layer i's matrices in `IQ_TYPES[i % 7]`,
embeddings Q8_0, LM head Q6_K). A matrix whose rows are no whole number of 256-value K blocks takes Q5_0
for Q4_K, Q5_1 for Q5_K, Q8_0 for Q6_K and IQ4_NL for Q2_K, Q3_K, IQ4_XS and the lattice i-quants, as
llama.cpp does.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np

# what a run imports, imported ahead by `script_server.py` (which serves many runs from one import)
PRELOAD = (
    "torch",
    "gguf",
    "gguf.quants",
    "tokenizers",
    "safetensors.torch",
    "transformers",
)

PROMPT_LENGTH = 12
_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
MIXED = {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q5_1"}
MIXED |= {"ffn_gate": "Q4_1", "ffn_up": "BF16", "ffn_down": "Q5_0", "token_embd": "Q8_0", "output": "F16"}
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
ARCHITECTURES |= {"Qwen3ForCausalLM": "qwen3"}
# The lattice i-quants, one a layer in the IQ preset (layer i takes IQ_TYPES[i % 7])
IQ_TYPES = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M")
# Each i-quant's largest weight over its block's d: the grid's largest value times the largest group factor
IQ_PEAK = {"IQ2_XXS": 43 * 15.5 / 4, "IQ2_XS": 43 * 15.5 / 4, "IQ2_S": 43 * 15.5 / 4}
IQ_PEAK |= {"IQ3_XXS": 62 * 15.5 / 2, "IQ3_S": 15 * 31, "IQ1_S": 1.125 * 15, "IQ1_M": 1.125 * 15}
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"} | {
    k: "IQ4_NL" for k in ("Q2_K", "Q3_K", "IQ4_XS", *IQ_TYPES)
}


def gguf_name(name: str) -> str:
    if name.startswith("model.layers."):
        _, _, layer, rest = name.split(".", 3)
        module, _, suffix = rest.rpartition(".")
        return f"blk.{layer}.{_NAMES[module]}.{suffix}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}.get(
        name, "output.weight" if name == "lm_head.weight" else name
    )


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's order of a q or k projection's rows: each head's two rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def more_bits(layer: int, layers: int) -> bool:
    """The layers whose v and down projections llama.cpp's Q4_K_M and Q5_K_M store in Q6_K: the first and last
    eighth, and every third in between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def kind_of(preset: str, name: str, layers: int, columns: int) -> str:
    short = name.split(".")[-2]
    if preset == "F32" or short.endswith("norm") or name.endswith(".bias"):
        return "F32"
    if preset == "MIXED":
        return "Q6_K" if name == "blk.0.ffn_down.weight" else MIXED[short]
    if preset == "IQ":  # an i-quant a layer; embeddings Q8_0, the head Q6_K
        if not name.startswith("blk."):
            kind = "Q8_0" if short == "token_embd" else "Q6_K"
        else:
            kind = IQ_TYPES[int(name.split(".")[1]) % len(IQ_TYPES)]
        return FALLBACK.get(kind, kind) if columns % 256 else kind
    kind = preset
    if preset == "Q3_K_M":  # after llama.cpp's Q3_K_M: v, o, down and the head get more bits
        layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
        more = {"attn_v": 2, "ffn_down": layers // 16}.get(short, -1)
        four = "Q5_K" if layer < more else "Q4_K"
        kind = {"output": "Q6_K", "attn_v": four, "ffn_down": four, "attn_output": "Q4_K"}.get(short, "Q3_K")
    if preset in ("Q4_K_M", "Q5_K_M"):  # 6 bits where llama.cpp spends them: the head, some v and down
        layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
        more = layer >= 0 and more_bits(layer, layers) and short in ("attn_v", "ffn_down")
        kind = "Q6_K" if short == "output" or more else preset[:4]
    # llama.cpp's own fallback where a row is no whole number of 256-value K blocks
    return FALLBACK.get(kind, kind) if columns % 256 else kind


def q4_k(x: np.ndarray) -> np.ndarray:
    return _k_quant(x, 4)


def q5_k(x: np.ndarray) -> np.ndarray:
    return _k_quant(x, 5)


def _k_quant(x: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K or Q5_K blocks of x [rows, columns] (columns a multiple of 256), rounded to nearest: each group
    of 32 spans its minimum (at most 0) to its maximum in 2^bits - 1 steps, its step and minimum each a
    6-bit multiple of the block's float16 d and dmin. Q5_K's fifth bits: bit j of byte i for value i of
    group j, before the nibbles."""
    rows, top = x.shape[0], 2**bits - 1
    b = x.reshape(-1, 8, 32).astype(np.float32)
    low = np.minimum(b.min(axis=2), 0)
    step, mins = (b.max(axis=2) - low) / top, -low
    d = (step.max(axis=1) / 63).astype(np.float16)
    dmin = (mins.max(axis=1) / 63).astype(np.float16)
    sc = _multiples(step, d.astype(np.float32)[:, None], 0, 63).astype(np.uint8)
    m = _multiples(mins, dmin.astype(np.float32)[:, None], 0, 63).astype(np.uint8)
    scale = (d.astype(np.float32)[:, None] * sc)[:, :, None]
    offset = (dmin.astype(np.float32)[:, None] * m)[:, :, None]
    q = _multiples(b + offset, scale, 0, top).astype(np.uint8)
    packed = np.empty((b.shape[0], 12), np.uint8)
    packed[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    pairs = (q & 15).reshape(-1, 4, 2, 32)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    fifth = (
        [(((q >> 4) & 1) << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=1).astype(np.uint8)]
        if bits == 5
        else []
    )
    halves = [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2)]
    return np.concatenate([*halves, packed, *fifth, qs], axis=1).reshape(rows, -1)


def q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K blocks of x [rows, columns] (columns a multiple of 256), rounded to nearest: each group of 16
    scaled to -31..31 (stored plus 32), its scale an int8 multiple of the block's float16 d."""
    rows = x.shape[0]
    b = x.reshape(-1, 16, 16).astype(np.float32)
    step = np.abs(b).max(axis=2) / 31
    d = (step.max(axis=1) / 127).astype(np.float16)
    sc = _multiples(step, d.astype(np.float32)[:, None], -128, 127).astype(np.int8)
    scale = (d.astype(np.float32)[:, None] * sc)[:, :, None]
    q = (_multiples(b, scale, -32, 31) + 32).astype(np.uint8).reshape(-1, 256)
    low, high = q & 15, q >> 4
    ql = np.empty((q.shape[0], 128), np.uint8)
    for h in range(2):  # value v: low bits in byte (v // 128) * 64 + v % 64
        ql[:, h * 64 : h * 64 + 64] = low[:, h * 128 : h * 128 + 64] | (
            low[:, h * 128 + 64 : h * 128 + 128] << 4
        )
    qh = _crumbs(high)
    return np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=1).reshape(
        rows, -1
    )


def q3_k(x: np.ndarray) -> np.ndarray:
    """Q3_K blocks of x [rows, columns] (columns a multiple of 256), rounded to nearest: each group of 16
    scaled so that its value of largest magnitude is -4 steps (values -4..3), its step a 6-bit multiple
    (less 32) of the block's float16 d. Stored: high bits (1 for values >= 0), low 2 bits of the value
    plus 4 where the high bit is 0, the scales packed (`gguf/blocks.py`'s `_q3_k_scales`), d."""
    rows = x.shape[0]
    b = x.reshape(-1, 16, 16).astype(np.float32)
    step = _signed_largest(b) / -4
    d = (np.abs(step).max(axis=1) / 31).astype(np.float16)
    sc = _multiples(step, d.astype(np.float32)[:, None], -32, 31)
    q = (
        _multiples(b, (d.astype(np.float32)[:, None] * sc)[:, :, None], -4, 3)
        .astype(np.int8)
        .reshape(-1, 256)
    )
    high = (q >= 0).astype(np.uint8)
    hmask = np.zeros((q.shape[0], 32), np.uint8)
    for j in range(8):  # value v: bit v // 32 of byte v % 32
        hmask |= high[:, j * 32 : j * 32 + 32] << j
    s = (sc + 32).astype(np.uint8)
    packed = np.zeros((s.shape[0], 12), np.uint8)
    packed[:, 0:8] = (s[:, 0:8] & 15) | ((s[:, 8:16] & 15) << 4)
    for i in range(16):
        packed[:, 8 + i % 4] |= (s[:, i] >> 4) << (2 * (i // 4))
    low = _crumbs((q + 4 * (1 - high)).astype(np.uint8))
    return np.concatenate([hmask, low, packed, d.view(np.uint8).reshape(-1, 2)], axis=1).reshape(rows, -1)


def q2_k(x: np.ndarray) -> np.ndarray:
    """Q2_K blocks, rounded to nearest: each group of 16 spans its minimum (at most 0) to its maximum in 3
    steps, its step and minimum each a 4-bit multiple of the block's float16 d and dmin."""
    rows = x.shape[0]
    b = x.reshape(-1, 16, 16).astype(np.float32)
    low = np.minimum(b.min(axis=2), 0)
    step, mins = (b.max(axis=2) - low) / 3, -low
    d, dmin = (step.max(axis=1) / 15).astype(np.float16), (mins.max(axis=1) / 15).astype(np.float16)
    sc = _multiples(step, d.astype(np.float32)[:, None], 0, 15).astype(np.uint8)
    m = _multiples(mins, dmin.astype(np.float32)[:, None], 0, 15).astype(np.uint8)
    offset = (dmin.astype(np.float32)[:, None] * m)[:, :, None]
    q = _multiples(b + offset, (d.astype(np.float32)[:, None] * sc)[:, :, None], 0, 3).astype(np.uint8)
    halves = [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2)]
    return np.concatenate([sc | (m << 4), _crumbs(q.reshape(-1, 256)), *halves], axis=1).reshape(rows, -1)


def iq4_nl(x: np.ndarray) -> np.ndarray:
    """IQ4_NL blocks (32 values): d puts the block's value of largest magnitude at -127, each value the
    nearest of the 16 (the `gguf` package's `IQ4_NL.kvalues`)."""
    rows = x.shape[0]
    b = x.reshape(-1, 1, 32).astype(np.float32)
    d = (_signed_largest(b) / -127).astype(np.float16)
    q = _nearest_iq4(b, d.astype(np.float32)[:, :, None]).reshape(-1, 32)
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), q[:, :16] | (q[:, 16:] << 4)], axis=1).reshape(
        rows, -1
    )


def iq4_xs(x: np.ndarray) -> np.ndarray:
    """IQ4_XS blocks (256 values, 8 groups of 32): each group's scale as IQ4_NL's d, a 6-bit multiple (less
    32) of the block's float16 d; the high 2 bits of the eight in a 16-bit word, the low 4 two a byte."""
    rows = x.shape[0]
    b = x.reshape(-1, 8, 32).astype(np.float32)
    step = _signed_largest(b) / -127
    d = (np.abs(step).max(axis=1) / 31).astype(np.float16)
    ls = _multiples(step, d.astype(np.float32)[:, None], -32, 31)
    q = _nearest_iq4(b, (d.astype(np.float32)[:, None] * ls)[:, :, None])
    s = (ls + 32).astype(np.uint16)
    high = ((s >> 4) << np.arange(0, 16, 2, dtype=np.uint16)).sum(axis=1).astype(np.uint16)
    low = (s[:, 0::2] & 15) | ((s[:, 1::2] & 15) << 4)
    qs = (q[:, :, :16] | (q[:, :, 16:] << 4)).reshape(-1, 128)
    parts = [d.view(np.uint8).reshape(-1, 2), high.view(np.uint8).reshape(-1, 2), low.astype(np.uint8), qs]
    return np.concatenate(parts, axis=1).reshape(rows, -1)


def i_quant(kind: str):  # type: ignore[no-untyped-def]
    """An encoder of `kind` blocks (a lattice i-quant) that keeps of x only each block's largest magnitude:
    its grid entries, signs, group scales and shifts are random bytes (fixed by x), under a float16 d that
    makes the block's largest possible weight x's largest. The file is in the type's layout, its values
    the type's, for the `gguf` package and ember to decode alike; it is no quantization of x (llama.cpp's
    search for the nearest grid points is not reproduced here)."""

    def encode(x: np.ndarray) -> np.ndarray:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        rows = x.shape[0]
        blocks = x.reshape(-1, 256).astype(np.float32)
        size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]][1]
        rng = np.random.default_rng(int(np.abs(blocks).sum() * 1e3) % 2**32)
        b = rng.integers(0, 256, (blocks.shape[0], size), dtype=np.uint8)
        d = (np.abs(blocks).max(axis=1) / IQ_PEAK[kind]).astype(np.float16)
        if kind == "IQ1_M":  # d's four nibbles are the top nibbles of the four 16-bit scale words
            words = np.ascontiguousarray(b[:, 48:56]).view("<u2").copy()
            bits = d.view(np.uint16)[:, None] >> np.array([0, 4, 8, 12], np.uint16)
            words = (words & 0x0FFF) | ((bits & 15) << 12)
            b[:, 48:56] = words.astype("<u2").view(np.uint8)
        else:
            b[:, :2] = d.view(np.uint8).reshape(-1, 2)
        return b.reshape(rows, -1)

    return encode


def _signed_largest(b: np.ndarray) -> np.ndarray:
    """Each group's (the last axis) value of largest magnitude, with its sign."""
    return np.take_along_axis(b, np.abs(b).argmax(axis=-1)[..., None], axis=-1)[..., 0]


def _nearest_iq4(b: np.ndarray, scale: np.ndarray) -> np.ndarray:
    from gguf.quants import IQ4_NL

    safe = np.where(scale != 0, scale, 1)
    return (
        np.abs(b[..., None] / safe[..., None] - np.array(IQ4_NL.kvalues, np.float32))
        .argmin(axis=-1)
        .astype(np.uint8)
    )


def _crumbs(q: np.ndarray) -> np.ndarray:
    """Two-bit values [n, 256] packed into 64 bytes: value v at bits 2 ((v % 128) // 32) of byte
    (v // 128) * 32 + v % 32."""
    out = np.zeros((q.shape[0], 64), np.uint8)
    for h in range(2):
        for k in range(4):
            out[:, h * 32 : h * 32 + 32] |= (q[:, h * 128 + k * 32 : h * 128 + k * 32 + 32] & 3) << (2 * k)
    return out


def _multiples(x: np.ndarray, unit: np.ndarray, low: int, high: int) -> np.ndarray:
    """x / unit rounded and clamped to [low, high]; 0 where unit is 0."""
    safe = np.where(unit != 0, unit, 1)
    return np.where(unit != 0, np.rint(x / safe), 0).clip(low, high)


ENCODERS = {
    "Q4_K": q4_k,
    "Q5_K": q5_k,
    "Q6_K": q6_k,
    "Q3_K": q3_k,
    "Q2_K": q2_k,
    "IQ4_NL": iq4_nl,
    "IQ4_XS": iq4_xs,
} | {kind: i_quant(kind) for kind in IQ_TYPES}


def write_vocabulary(w, src: Path, config: dict) -> None:  # type: ignore[no-untyped-def]
    """The tokenizer as llama.cpp's converter stores a byte-level BPE one whose pre-tokenizer is GPT-2's:
    the tokens, their types (3 for special added tokens), the merges, the BOS flag and the chat template."""
    from tokenizers import Tokenizer

    spec = json.loads((src / "tokenizer.json").read_text())
    settings = json.loads((src / "tokenizer_config.json").read_text())
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    added = {a["id"]: a["special"] for a in spec["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([tok.id_to_token(i) for i in range(tok.get_vocab_size())])
    w.add_token_types([(3 if added[i] else 4) if i in added else 1 for i in range(tok.get_vocab_size())])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    if config.get("bos_token_id") is not None:
        w.add_bos_token_id(config["bos_token_id"])
    if config.get("eos_token_id") is not None:
        w.add_eos_token_id(config["eos_token_id"])
    w.add_add_bos_token(bool(settings.get("add_bos_token", False)))
    if settings.get("chat_template"):
        w.add_chat_template(settings["chat_template"])


def write(src: Path, path: Path, preset: str) -> None:
    import gguf
    import torch
    from safetensors.torch import load_file

    config = json.loads((src / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    arch = ARCHITECTURES[config["architectures"][0]]
    rope = config.get("rope_parameters") or {}
    theta = config.get("rope_theta") or rope.get("rope_theta", 10000.0)
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_vocab_size(config["vocab_size"])
    write_vocabulary(w, src, config)
    for name, tensor in sorted(load_file(str(src / "model.safetensors")).items()):
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        array = tensor.to(torch.float32).numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):  # llama.cpp permutes llama's alone
            array = permute(array, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            array = permute(array, kv_heads)
        target = gguf_name(name)
        kind = kind_of(preset, target, config["num_hidden_layers"], array.shape[-1])
        qtype = gguf.GGMLQuantizationType[kind]
        if kind in ENCODERS:
            w.add_tensor(target, ENCODERS[kind](array), raw_dtype=qtype)
        elif kind in ("F32", "F16"):
            w.add_tensor(target, array.astype(np.float16 if kind == "F16" else np.float32))
        else:
            w.add_tensor(target, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    scaling = config.get("rope_scaling") or rope
    if scaling.get("rope_type", scaling.get("type")) == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_factors(theta, head_dim, scaling))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama3_factors(theta: float, dim: int, scaling: dict) -> np.ndarray:
    """What llama.cpp's converter stores as rope_freqs.weight for Llama 3.1's rotary scaling: per frequency
    the number its angle is divided by (1 for short wavelengths, `factor` for long ones, blended between)."""
    import math

    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def build(src: Path, dst: Path, preset: str) -> None:
    import torch
    from modelopt_build import answers, fixed_prompts
    from transformers import AutoModelForCausalLM

    dst.mkdir(parents=True)
    write(src, dst / "model.gguf", preset)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    prompts = fixed_prompts(PROMPT_LENGTH)
    theirs = AutoModelForCausalLM.from_pretrained(dst, gguf_file="model.gguf", dtype=torch.float32).eval()
    source = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    logits, greedy = answers(theirs, prompts)
    source_logits = answers(source, prompts)[0]
    torch.save(
        {"prompts": prompts, "logits": logits, "greedy": greedy, "source_logits": source_logits},
        dst / "oracle.pt",
    )


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
