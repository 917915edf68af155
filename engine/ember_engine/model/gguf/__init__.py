"""GGUF checkpoints (llama.cpp's single-file format; what "…-GGUF" downloads hold), read with the `gguf`
package; here the file's reader, its config, its tensors and the scheme of the projections it runs.

Here: the model's config from the file's metadata (`read_config`), its tensors under the Hugging Face
names the engine loads (`iter_tensors`), and the scheme of the projections it runs as stored (`parse`).
Beside it: `blocks.py` (the block layouts run as stored; the lattice i-quants' in `iq_blocks.py`),
`directory.py` (the file described as a model directory), `vocab.py` (the tokenizer a file carries),
`split.py` (a file split into parts).

- Q8_0, Q5_0, Q5_1, Q5_K, IQ4_NL and IQ4_XS run as `w8a16` in groups of 32, Q6_K as `w8a16` in groups
  of 16, Q4_0, Q4_1 and Q4_K as `w4a16` in groups of 32, and Q3_K and Q2_K as `w4a16` in groups of 16;
  the lattice i-quants as `codebook`, 4-bit codes into the type's at most 16 grid values: IQ2_XXS,
  IQ3_XXS, IQ3_S and IQ1_S in groups of 32, IQ2_XS, IQ2_S and IQ1_M in groups of 16 (`iq_blocks.py`);
  the types with a minimum per group (Q4_1, Q5_1, Q4_K, Q5_K, Q2_K) with a real zero point per group
  (`blocks.py`): the file's values, and its scales in float32, are what the engine multiplies with.
  The parts of a merged projection (q/k/v, gate/up) stored in different ones of these types run alike,
  as `w8a16` in groups of 16 with zero points (`COMMON`).
- Every other type (F32, F16, BF16, TQ1_0, TQ2_0, MXFP4, ...) is dequantized at load by
  the `gguf` package into the model dtype, and so are the token embeddings, and the parts of a merged
  projection when one of them is of such a type.

llama.cpp stores a llama model's q and k rows permuted for its rotary embedding (each head's two halves
interleaved); they are put back in Hugging Face's order here (qwen2's and qwen3's it stores as they are).
Architectures read: llama (which covers Mistral's conversions too; Llama 3.1's scaled rotary frequencies,
`rope_freqs.weight`, become the config's `rope_freq_factors`), qwen2 (q, k and v biases) and qwen3 (q and
k norms); the others are refused by name.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ember_engine.model.gguf import blocks as gguf_blocks
from ember_engine.model.gguf import split as gguf_split
from ember_engine.model.quant.schemes import UnsupportedQuantizationError
from ember_engine.model.quant.spec import QuantSpec

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# The architectures whose q and k rows llama.cpp's converter permutes (the others it stores as they are).
PERMUTED = ("llama",)
# The bias tensors an architecture has (Qwen2's q, k and v); any other is refused.
BIASES = {"qwen2": ("attn_q", "attn_k", "attn_v")}
# The types run as they are stored (`blocks.py`): their scheme and bits a value.
KEPT = {k: ("w8a16", 8) for k in ("Q8_0", "Q6_K", "Q5_0", "Q5_1", "Q5_K", "IQ4_NL", "IQ4_XS")}
KEPT |= {k: ("codebook", 4) for k in gguf_blocks.iq_blocks.GROUP}
KEPT |= {k: ("w4a16", 4) for k in ("Q4_0", "Q4_1", "Q4_K", "Q3_K", "Q2_K")}
ZEROED = ("Q4_1", "Q5_1", "Q4_K", "Q5_K", "Q2_K")  # a minimum per group: held as a float32 zero point
# The parts of a merged projection stored in different types of KEPT (llama.cpp's Q4_K_M gives some
# layers' v Q6_K and their q and k Q4_K) run alike: each part's values as int8, in groups of 16, with a
# float32 zero point per group (0 for the symmetric types).
COMMON, COMMON_GROUP = "common", 16
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_MERGED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
ROPE_FREQS = "rope_freqs.weight"  # not a parameter: read into the config


class GGUFError(ValueError):
    pass


def reader_of(path: Path) -> Any:
    """The file's reader: `.fields` (its metadata) and `.tensors`; a split file's parts as one."""
    import gguf

    def open_part(p: Path) -> Any:
        if not p.is_file():
            raise FileNotFoundError(f"{p} not found: a GGUF model is a .gguf file")
        try:
            return gguf.GGUFReader(str(p))
        except (ValueError, OSError) as exc:
            raise GGUFError(f"{p}: not a readable GGUF file ({exc})") from exc

    try:  # a split file's parts are read as one (`split.py`)
        return gguf_split.join(open_part(path), path, open_part)
    except gguf_split.SplitError as exc:
        raise GGUFError(str(exc)) from exc


def field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def hf_name(name: str) -> str:
    """A GGUF tensor's Hugging Face name ("blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight")."""
    base, _, suffix = name.rpartition(".")
    parts = base.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{suffix}"
    if len(parts) == 1 and parts[0] in _TOP:
        return f"{_TOP[parts[0]]}.{suffix}"
    raise GGUFError(f"unexpected tensor {name!r} in the GGUF file (no such parameter of a llama model)")


def read_config(reader: Any, path: Path) -> dict[str, Any]:
    """The Hugging Face config.json of the model the file holds."""
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    names = {t.name for t in reader.tensors}
    scaling = field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise GGUFError(f"{path}: {arch}.rope.scaling.type {scaling!r} is not supported; supported: none")
    for key in (f"{arch}.rope.scaling.factor", f"{arch}.rope.scale_linear"):  # linear scaling without a type
        factor = field(reader, key)
        if factor is not None and float(factor) not in (0.0, 1.0):
            raise GGUFError(f"{path}: {key} {factor} (scaled rotary positions) is not supported")
    allowed = BIASES.get(arch, ())
    biases = sorted(n for n in names if n.endswith(".bias") and n.split(".")[-2] not in allowed)
    if biases:
        raise GGUFError(f"{path}: bias tensors ({biases[0]}, ...) are not supported in a {arch} GGUF file")

    def need(key: str) -> Any:
        value = field(reader, f"{arch}.{key}")
        if value is None:
            raise GGUFError(f"{path}: metadata {arch}.{key} is missing")
        return value

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise GGUFError(f"{path}: tensor token_embd.weight is missing")
    full = [t for t in reader.tensors if len(t.shape) == 2 and t.tensor_type.name in ("F16", "BF16", "F32")]
    dtype = (
        {"F16": "float16", "BF16": "bfloat16"}.get(full[0].tensor_type.name, "float32") if full else "float32"
    )
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(embed.shape[1]),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(field(reader, f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(field(reader, f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": dtype,
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),  # the stop ids: directory.materialize
        "gguf_file": str(path),
    }
    factors = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if factors is not None:  # Llama 3.1's scaled rotary frequencies: each angle divided by its factor
        values = np.asarray(factors.data, dtype=np.float32).reshape(-1)
        if values.size != config["head_dim"] // 2 or not np.isfinite(values).all() or (values <= 0).any():
            raise GGUFError(
                f"{path}: {ROPE_FREQS} must hold one positive number per rotary frequency "
                f"({config['head_dim'] // 2}); it has {values.size}"
            )
        config["rope_freq_factors"] = [float(v) for v in values]
    kept = kept_projections(reader)
    if kept:
        config["quantization_config"] = {"quant_method": "gguf", "projections": kept}
    return config


def kept_projections(reader: Any) -> dict[str, list[str]]:
    """The projections run as the file stores them, by type: those of a type in `KEPT` (the LM head too,
    where it is stored apart), and under `COMMON` the parts of a merged projection (q/k/v, gate/up) stored
    in different types of KEPT; a merged projection with a part of another type runs dequantized."""
    types = {
        hf_name(t.name).removesuffix(".weight"): t.tensor_type.name
        for t in reader.tensors
        if t.name.endswith(".weight") and len(t.shape) == 2 and t.name.split(".")[-2] != "token_embd"
    }
    stored = dict(types)
    for module in stored:
        parent, _, leaf = module.rpartition(".")
        for merged in _MERGED:
            kinds = {stored.get(f"{parent}.{p}") for p in merged}
            if leaf in merged and len(kinds) > 1:
                types[module] = COMMON if kinds <= KEPT.keys() else "mixed"
    kept: dict[str, list[str]] = {}
    for module, kind in sorted(types.items()):
        if kind in KEPT or kind == COMMON:
            kept.setdefault(kind, []).append(module)
    return kept


def file_of(model_dir: str | Path) -> Path | None:
    """The GGUF file a materialized model directory describes, or None for an ordinary checkpoint."""
    config = Path(model_dir) / "config.json"
    if not config.exists():
        return None
    name = json.loads(config.read_text()).get("gguf_file")
    return None if name is None else Path(name)


def iter_tensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) of every tensor in the file: the projections `kept_projections` lists as
    int values [out, in] (int8) with "weight_scale" [out, groups] beside them (and for the types in
    `ZEROED` "weight_zero" [out, groups]; for the `codebook` types 4-bit codes [out, in / 2] and the
    type's "weight_quant_map"), everything else in float32 (the loader casts it to the model dtype)."""
    from gguf import quants

    config = json.loads((Path(model_dir) / "config.json").read_text())
    reader = reader_of(Path(config["gguf_file"]))
    projections = (config.get("quantization_config") or {}).get("projections", {})
    kept = {m for ms in projections.values() for m in ms}
    common = set(projections.get(COMMON, ()))
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    permuted = config["model_type"] in PERMUTED
    for t in reader.tensors:
        if t.name == ROPE_FREQS:
            continue
        name = hf_name(t.name)
        module = name.removesuffix(".weight")
        kind = t.tensor_type.name
        rows = {"q_proj": heads, "k_proj": kv_heads}.get(module.rpartition(".")[2]) if permuted else None
        if module in kept:
            values, scale, zero = gguf_blocks.decode(np.asarray(t.data), kind)
            if module in common:
                values, scale, zero = gguf_blocks.regroup(
                    values, scale, zero, gguf_blocks.GROUP[kind], COMMON_GROUP
                )
            elif KEPT[kind][0] == "codebook":
                values = torch.from_numpy(gguf_blocks.iq_blocks.pack(values.numpy(), kind))
                yield f"{module}.weight_quant_map", torch.from_numpy(gguf_blocks.iq_blocks.table(kind))
            yield name, _unpermute(values, rows)
            yield f"{module}.weight_scale", _unpermute(scale, rows)
            if zero is not None:
                yield f"{module}.weight_zero", _unpermute(zero, rows)
            continue
        if kind in ("F32", "F16"):
            array = np.array(t.data, dtype=np.float32)  # a copy: the file is mapped read-only
        else:  # BF16 and every quantized type
            array = quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        yield name, _unpermute(torch.from_numpy(array), rows)


def _unpermute(t: torch.Tensor, heads: int | None) -> torch.Tensor:
    """Rows of a q or k projection back in Hugging Face's order: llama.cpp stores row 2i + j of each head
    where Hugging Face has row j * (head_dim / 2) + i."""
    if heads is None:
        return t
    rest = t.shape[1:]
    return t.reshape(heads, -1, 2, *rest).transpose(1, 2).reshape(t.shape).contiguous()


def parse(qc: dict[str, Any]) -> QuantSpec:
    """The scheme of a materialized GGUF model's kept projections (`KEPT`, in the type's groups), each group
    of projections by exact name; the others are in full precision."""
    projections = qc.get("projections") or {}
    groups = []
    for kind, modules in sorted(projections.items()):
        if kind == COMMON:
            groups.append(
                QuantSpec(
                    "w8a16",
                    "gguf",
                    group_size=COMMON_GROUP,
                    zero_points=True,
                    float_zeros=True,
                    targets=tuple(modules),
                )
            )
            continue
        if kind not in KEPT:
            raise UnsupportedQuantizationError(
                f"gguf: type {kind!r} is not run as stored; supported: {', '.join(KEPT)}, {COMMON}"
            )
        scheme, bits = KEPT[kind]
        zeros = kind in ZEROED
        group = gguf_blocks.GROUP[kind]
        groups.append(
            QuantSpec(
                scheme,
                "gguf",
                group_size=group,
                num_bits=bits,
                zero_points=zeros,
                float_zeros=zeros,
                targets=tuple(modules),
            )
        )
    if not groups:
        raise UnsupportedQuantizationError("gguf: quantization_config lists no projections")
    return groups[0] if len(groups) == 1 else QuantSpec("mixed", "gguf", groups=tuple(groups))
