"""The FP8 KV cache: what the cache stores, how values are quantized into it and read back, and where a
checkpoint keeps the per-layer scales.

A cache with `kv_cache_dtype="fp8"` (or `fp8_e4m3`) holds float8_e4m3fn, one with `fp8_e5m2` float8_e5m2
(2 mantissa bits to E4M3's 3, a range to ±57344 against ±448). Each attention layer has one K scale and
one V scale (floats), or, from a checkpoint that has them, one per KV head (float32 tensors), the same for
either format: a write stores `x / scale`, saturated to the format's largest finite value and rounded to
its nearest value (ties to even); a read gives `stored * scale`. The division is done as a
multiplication by the float32 reciprocal, in the torch path and in the Triton kernels alike, so both
store the same bytes.

The scales are the checkpoint's where it carries them. Otherwise they are computed at load: a forward
over each of a few short sequences of fixed token ids (the same for every load of a model, whatever the
traffic, the cache's size or the engine's seed) gives each layer's largest |K| and |V|, and the scale
stores that at FP8_MAX / KV_SCALE_HEADROOM. Served text may then run KV_SCALE_HEADROOM times larger
before it saturates, and values down to about 1/1800 of the calibration's largest (2^-6 stored, against
448 / 16 = 28) keep E4M3's full precision; smaller ones are subnormal. An E5M2 cache takes the same
scales: it then saturates only at 2048 times the calibration's largest, and is subnormal below 2^-14.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import Tensor

from ember_engine.model import cpu_kv
from ember_engine.model.quant import modelopt, quark

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
E5M2 = torch.float8_e5m2
# Each FP8 cache element type and its largest finite value (what a write saturates at).
FP8_FORMATS = {FP8: FP8_MAX, E5M2: 57344.0}
# The element type of each FP8 `kv_cache_dtype` (fp8_e4m3 is vLLM's name for fp8).
CACHE_DTYPES = {"fp8": FP8, "fp8_e4m3": FP8, "fp8_e5m2": E5M2}
KV_SCALE_HEADROOM = 16.0
CALIBRATION_SEQUENCES, CALIBRATION_LENGTH = 8, 32
_CALIBRATION_SEED = 0x6B76  # fixed: computed scales depend on the model alone

# Checkpoint tensors holding KV scales, by the suffix after `...self_attn.`: compressed-tensors (what
# llm-compressor's kv_cache_scheme writes), its older output-activation form, ModelOpt's, and the single
# shared scale of older FP8 checkpoints.
_SCALE_SUFFIXES = {
    "k_scale": "k",
    "v_scale": "v",
    "k_proj.output_scale": "k",
    "v_proj.output_scale": "v",
    "k_proj.k_scale": "k",
    "v_proj.v_scale": "v",
    "kv_scale": "kv",
}


# A layer's K or V scale: one float, or one per KV head of this rank (float32, on the model's device).
Scale = float | Tensor


def check_checkpoint_scheme(quantization_config: dict[str, Any] | None) -> None:
    """Refuse, by name, a checkpoint's KV-cache scheme (compressed-tensors `kv_cache_scheme`) whose scales
    an FP8 cache cannot use: only static, symmetric FP8 with one scale per tensor or per KV head is
    (ModelOpt's and Quark's configs: `modelopt.check_kv_scheme`, `quark.check_kv_scheme`)."""
    method = (quantization_config or {}).get("quant_method")
    if method in (modelopt.METHOD, quark.METHOD):
        assert quantization_config is not None
        (modelopt if method == modelopt.METHOD else quark).check_kv_scheme(quantization_config)
        return
    scheme = (quantization_config or {}).get("kv_cache_scheme")
    if not scheme:
        return
    if not isinstance(scheme, dict):  # AutoFP8's: the string "static", scales per tensor
        if scheme != "static" or method != "fp8":
            raise ValueError(
                f"kv_cache_scheme {scheme!r} is not supported with kv_cache_dtype fp8; supported: a "
                'compressed-tensors scheme, or "static" in a quant_method fp8 checkpoint (AutoFP8\'s)'
            )
        return
    kind, bits, strategy = scheme.get("type"), scheme.get("num_bits"), scheme.get("strategy")
    if (
        (kind, bits) != ("float", 8)
        or strategy not in ("tensor", "attn_head")
        or scheme.get("dynamic")
        or not scheme.get("symmetric")
    ):
        raise ValueError(
            f"kv_cache_scheme: {kind} {bits}-bit, strategy {strategy!r}, dynamic={scheme.get('dynamic')}, "
            f"symmetric={scheme.get('symmetric')} is not supported with kv_cache_dtype fp8; supported: float "
            "8-bit, strategy 'tensor' or 'attn_head', static, symmetric"
        )


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type: `auto` keeps the model's dtype; `fp8` and `fp8_e4m3` are E4M3,
    `fp8_e5m2` E5M2."""
    return CACHE_DTYPES.get(kv_cache_dtype, model_dtype)


def is_fp8(cache: Tensor) -> bool:
    return cache.dtype in FP8_FORMATS


def kernel_format(cache: Tensor) -> int:
    """How the Triton kernels treat a cache's elements: 0 as they are, 1 as E4M3 bytes, 2 as E5M2 bytes."""
    return {FP8: 1, E5M2: 2}.get(cache.dtype, 0)


@functools.cache
def _values(dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every byte's float32 value in an FP8 format, indexed by the byte."""
    return torch.arange(256, dtype=torch.uint8, device=device).view(dtype).float()


def decode_bytes(raw: Tensor, dtype: torch.dtype) -> Tensor:
    """An FP8 cache's bytes (uint8, any shape) as the float32 values they store, before the scale, looked
    up in a table of the format's 256 values: on a CPU by a compiled loop (`cpu_kv`; torch's own E4M3
    conversion goes an element at a time there), elsewhere by `index_select`."""
    table = _values(dtype, raw.device)
    if raw.device.type == "cpu":
        return cpu_kv.decode(raw, table)
    return table.index_select(0, raw.reshape(-1).int()).view(raw.shape)


@functools.lru_cache(maxsize=1024)
def _head_reciprocals(scale: Tensor) -> Tensor:
    # Keyed by the tensor itself (its hash is its identity, and the cache holds it, so no other tensor can
    # take its place): a layer's per-head scales are computed once, not at every step.
    return (1.0 / scale.double()).float()


def reciprocal(scale: Scale) -> Scale:
    """1 / scale rounded to float32 (each head's, for per-head scales), the factor a write multiplies by."""
    if isinstance(scale, Tensor):
        return _head_reciprocals(scale)
    return float(torch.tensor(1.0 / scale, dtype=torch.float32))


def _by_head(factor: Scale, x: Tensor) -> Scale:
    """A per-head factor shaped to multiply x [..., heads, head_dim]."""
    return factor.to(x.device).view(-1, 1) if isinstance(factor, Tensor) else factor


def quantize(x: Tensor, scale: Scale, dtype: torch.dtype = FP8) -> Tensor:
    """x [..., heads, head_dim] / scale in an FP8 format, E4M3 by default (saturating; ties to even)."""
    top = FP8_FORMATS[dtype]
    return (x.float() * _by_head(reciprocal(scale), x)).clamp(-top, top).to(dtype)


def dequantize(x: Tensor, scale: Scale) -> Tensor:
    """Stored FP8 values [..., heads, head_dim] back to float32."""
    return x.float() * _by_head(scale, x)


def head_scales(scale: Scale, num_kv_heads: int, device: torch.device) -> Tensor:
    """A scale as one float32 per KV head on `device`."""
    if isinstance(scale, Tensor):
        return scale.to(device=device, dtype=torch.float32)
    return torch.full((num_kv_heads,), scale, dtype=torch.float32, device=device)


def describe(scale: Scale) -> str:
    """A scale for the log: the float, or the heads' in brackets."""
    if isinstance(scale, Tensor):
        return "[" + " ".join(f"{v:.3g}" for v in scale.tolist()) + "]"
    return f"{scale:.3g}"


def calibration_sequences(vocab_size: int) -> list[list[int]]:
    """The token ids a scale calibration runs: CALIBRATION_SEQUENCES sequences of CALIBRATION_LENGTH draws
    over the vocabulary, from a fixed seed."""
    g = torch.Generator().manual_seed(_CALIBRATION_SEED)
    ids = torch.randint(0, vocab_size, (CALIBRATION_SEQUENCES, CALIBRATION_LENGTH), generator=g)
    return ids.tolist()


def computed_scale(largest: float, what: str) -> float:
    """The scale that stores `largest` (a calibration's largest |K| or |V|) at FP8_MAX / KV_SCALE_HEADROOM;
    1.0 for a layer whose calibration values were all zero."""
    if not math.isfinite(largest):
        raise ValueError(
            f"FP8 KV-cache scale calibration: the largest of an attention layer's {what} is {largest}; "
            "the checkpoint's weights do not give finite activations"
        )
    return largest * KV_SCALE_HEADROOM / FP8_MAX if largest > 0 else 1.0


def scale_target(name: str) -> tuple[str, str] | None:
    """For a checkpoint tensor holding a KV scale: (the attention module's name, "k", "v" or "kv");
    None for any other tensor."""
    head, sep, tail = name.partition(".self_attn.")
    if not sep or tail not in _SCALE_SUFFIXES:
        return None
    return head + ".self_attn", _SCALE_SUFFIXES[tail]


def read_scale(name: str, tensor: Tensor, num_kv_heads: int) -> Scale:
    """A checkpoint's scale: one per layer as a float; one per KV head ([num_kv_heads, 1, 1], what
    llm-compressor writes for strategy "attn_head", or [num_kv_heads]) as a float32 tensor over all the
    model's KV heads, or a float where they are all equal. Other shapes (per channel, ...) are refused by
    name."""
    per_head = tensor.dim() >= 1 and tensor.shape[0] == num_kv_heads and all(d == 1 for d in tensor.shape[1:])
    if tensor.numel() != 1 and not per_head:
        raise ValueError(
            f"KV scale {name!r} has shape {tuple(tensor.shape)}; supported: one scale per layer, or one per KV "
            f"head ([{num_kv_heads}, 1, 1] or [{num_kv_heads}])"
        )
    values = tensor.float().reshape(-1)
    for value in values.tolist():
        if not value > 0 or value == float("inf"):
            raise ValueError(f"KV scale {name!r} is {value}; it must be a positive finite number")
    if bool((values == values[0]).all()):
        return float(values[0])
    return values
