"""Load a Hugging Face safetensors checkpoint (single file or sharded) into the engine's model.

Each tensor is read through a safetensors slice, so a tensor-parallel rank reads only the bytes of its
own shard (`Shard.read`), never the whole tensor. KV-cache scales (`kv_quant.scale_target`) go to their
attention layer's `k_scale`/`v_scale`, used when the cache is FP8 (scales per KV head: each rank takes its
heads').
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ember_engine.model import gguf, kv_quant
from ember_engine.model.llama import Attention, LlamaForCausalLM
from ember_engine.model.quant.apply import QuantCollector

# checkpoint projection -> (merged parameter, which shard of it)
_MERGED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_SPLIT = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


class CheckpointError(ValueError):
    pass


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {model_dir}")
    return files


def iter_slices(model_dir: Path) -> Iterator[tuple[str, Any]]:
    """(name, safetensors slice) of every checkpoint tensor: nothing is read until the slice is indexed.
    A GGUF file's directory (`gguf.directory.materialize`) gives its tensors, read from the file."""
    if gguf.file_of(model_dir) is not None:
        yield from gguf.iter_tensors(model_dir)
        return
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_slice(name)


# The element types a full-precision parameter is loaded from.
_FULL_PRECISION = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _shard_sizes(model: LlamaForCausalLM, merged: str) -> list[int]:
    s, d = model.shard, model.config.head_dim
    if merged == "qkv_proj":
        return [s.num_heads * d, s.num_kv_heads * d, s.num_kv_heads * d]
    return [s.intermediate_size, s.intermediate_size]


def _set_kv_scale(model: LlamaForCausalLM, name: str, target: tuple[str, str], tensor_slice: Any) -> None:
    module_name, which = target
    try:
        attn = model.get_submodule(module_name)
    except AttributeError:
        attn = None
    if not isinstance(attn, Attention):
        raise CheckpointError(f"unexpected tensor {name!r} in checkpoint (no such attention layer)")
    value = kv_quant.read_scale(name, tensor_slice[...], model.config.num_kv_heads)
    if isinstance(value, torch.Tensor):  # this rank's heads (one float where they share one scale)
        first, count = model.shard.first_kv_head, model.shard.num_kv_heads
        mine = value[first : first + count]
        value = (
            float(mine[0])
            if bool((mine == mine[0]).all())
            else mine.to(model.model.embed_tokens.weight.device)
        )
    if "k" in which:
        attn.k_scale = value
        attn.checkpoint_scales.add("k")
    if "v" in which:
        attn.v_scale = value
        attn.checkpoint_scales.add("v")


def _unexpected(
    name: str, target: str, params: dict[str, torch.nn.Parameter], quant: QuantCollector | None
) -> str:
    """Why tensor `name` has no place: no such parameter, or (a quantized tensor of a projection the
    model holds in full precision) its config leaves a projection out that the file holds quantized."""
    module = target.rpartition(".")[0]
    if quant is None or f"{module}.weight" not in params:
        return f"unexpected tensor {name!r} in checkpoint (no such parameter)"
    held = name.rpartition(".")[0]
    return (
        f"unexpected tensor {name!r} in checkpoint: {held} is quantized in the file, but the checkpoint's "
        f"{quant.spec.format} config leaves it in full precision (its lists of modules quantized or left out "
        "do not match the file)"
    )


def load_weights(model: LlamaForCausalLM, model_dir: str | Path, quant: QuantCollector | None = None) -> None:
    """Copy every checkpoint tensor into place; error naming any missing, unknown or mis-shaped one.
    `quant` takes the tensors of the quantized projections (a quantized checkpoint)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for name, tensor_slice in iter_slices(Path(model_dir)):
        if "rotary_emb" in name:
            continue  # derived buffers some checkpoints carry
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if (kv := kv_quant.scale_target(name)) is not None:
            _set_kv_scale(model, name, kv, tensor_slice)
            continue
        if quant is not None:
            name = quant.checkpoint_name(name)
        parts = name.split(".")
        target, shard = name, None
        if len(parts) >= 2 and parts[-2] in _MERGED:
            merged, shard = _MERGED[parts[-2]]
            target = ".".join([*parts[:-2], merged, parts[-1]])
        if quant is not None:
            sizes = _shard_sizes(model, target.split(".")[-2]) if shard is not None else [0]
            rows = sizes[shard] if shard is not None else None
            if quant.take(name, target, shard, sum(sizes[: shard or 0]), tensor_slice, rows):
                continue
        param = params.get(target)
        if param is None:
            raise CheckpointError(_unexpected(name, target, params, quant))
        tensor = model.shard.read(name, tensor_slice, model.config.head_dim)
        dest = param.data
        if target.split(".")[-2] in ("embed_tokens", "lm_head"):
            dest = dest.narrow(0, 0, model.shard.vocab_rows)  # the last rank's range is padded
        if shard is not None:
            sizes = _shard_sizes(model, target.split(".")[-2])
            dest = dest.narrow(0, sum(sizes[:shard]), sizes[shard])
        if tuple(dest.shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
            )
        if tensor.dtype not in _FULL_PRECISION:  # copy_ would widen the bytes and drop their scales
            raise CheckpointError(
                f"tensor {name!r} is {tensor.dtype}, a quantized type, but the checkpoint's config "
                "(quantization_config) does not quantize its layer"
            )
        dest.copy_(tensor)
        loaded.add(name)
    expected = set()
    for pname in params:
        parts = pname.split(".")
        if len(parts) >= 2 and parts[-2] in _SPLIT:
            expected |= {".".join([*parts[:-2], shard_name, parts[-1]]) for shard_name in _SPLIT[parts[-2]]}
        elif not (pname == "lm_head.weight" and model.config.tie_word_embeddings):
            expected.add(pname)
    placed = quant.split.placed if quant is not None else set()  # a split's quantized head, dequantized
    missing = sorted(expected - loaded - placed) + (quant.missing() if quant is not None else [])
    if missing:
        raise CheckpointError(f"checkpoint {model_dir} is missing tensor(s): {', '.join(missing[:8])}")
    if quant is not None:
        quant.finish(model)
