"""`ember quantize SRC DST --scheme fp8|w8a16|w4a16|w8a8 [--group-size G] [--block-size N]`: write a quantized
copy of a checkpoint in the compressed-tensors format (what llm-compressor writes, and what transformers,
vLLM and ember load).

Round-to-nearest, no calibration data: every decoder projection is quantized (symmetric; FP8 and int8 per
output channel, int4 per group of `--group-size` input columns); embeddings, norms and the LM head are
copied as they are. FP8 is written `float-quantized` with dynamic per-token activations (FP8_DYNAMIC), or
with `--block-size N` one scale per N x N tile of the weight and activations per token and group of N
columns (FP8_BLOCK); int8 and int4 `pack-quantized` (W8A16, W4A16); int8 with dynamic per-token int8
activations `int-quantized` (W8A8).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from ember_engine.model.quant.schemes import DEFAULT_GROUP_SIZE

# Written anew (config) or dropped (the shards' index: the copy is one file) rather than copied.
_REWRITTEN = ("config.json", "model.safetensors.index.json")
# a quantized checkpoint's tensors beside or in place of a projection's weight (GPTQ's and AWQ's, the
# compressed-tensors and FP8 forms, bitsandbytes')
_QUANTIZED_TENSORS = (
    ".qweight",
    ".qzeros",
    ".weight_packed",
    ".weight_scale",
    ".weight_scale_inv",
    ".weight.absmax",
    ".SCB",
)
_PROJECTION = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.weight$")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ember_engine.core.config import QUANT_SCHEMES

    p.add_argument("src", help="a full-precision Hugging Face checkpoint directory")
    p.add_argument("dst", help="where to write the quantized checkpoint (must not exist)")
    written = [scheme for scheme in QUANT_SCHEMES if scheme != "bitsandbytes"]
    p.add_argument(
        "--scheme",
        required=True,
        choices=written,
        help="bitsandbytes (NF4) is not written: `ember serve --quantization bitsandbytes` quantizes at load",
    )
    p.add_argument(
        "--group-size",
        type=int,
        default=None,
        help=f"w4a16: input columns per scale (default {DEFAULT_GROUP_SIZE})",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="fp8: one scale per N x N weight tile (FP8_BLOCK; N a multiple of 16) instead of per channel",
    )


def check_options(scheme: str, group_size: int | None, block_size: int | None) -> int:
    """Refuses, by name, an option `scheme` does not take or a size it cannot write; returns the group size
    (w4a16's, `DEFAULT_GROUP_SIZE` unless given; unused by the other schemes)."""
    if group_size is not None and scheme != "w4a16":
        raise ValueError(f"--group-size applies to the w4a16 scheme only, not {scheme}")
    if group_size is not None and (group_size <= 0 or group_size % 2):
        raise ValueError(f"--group-size must be a positive even number, got {group_size}")
    if block_size is not None and scheme != "fp8":
        raise ValueError(f"--block-size applies to the fp8 scheme only, not {scheme}")
    if block_size is not None and (block_size <= 0 or block_size % 16):
        raise ValueError(f"--block-size must be a positive multiple of 16, got {block_size}")
    return DEFAULT_GROUP_SIZE if group_size is None else group_size


def quantization_config(scheme: str, group_size: int, block_size: int = 0) -> dict[str, Any]:
    """The compressed-tensors `quantization_config` for a scheme, as llm-compressor's presets spell it."""
    weights: dict[str, Any] = {
        "actorder": None,
        "block_structure": None,
        "dynamic": False,
        "group_size": None,
        "num_bits": 8,
        "observer": "minmax",
        "observer_kwargs": {},
        "strategy": "channel",
        "symmetric": True,
        "type": "int",
    }
    acts = None
    fmt = "pack-quantized"
    if scheme == "fp8":
        weights["type"], fmt = "float", "float-quantized"
        acts = {**weights, "dynamic": True, "observer": None, "strategy": "token"}
        if block_size:
            weights.update(strategy="block", block_structure=[block_size, block_size])
            acts.update(strategy="group", group_size=block_size)
    elif scheme == "w4a16":
        weights.update(num_bits=4, strategy="group", group_size=group_size)
    elif scheme == "w8a8":
        fmt = "int-quantized"
        acts = {**weights, "dynamic": True, "observer": None, "strategy": "token"}
    group = {"input_activations": acts, "output_activations": None, "targets": ["Linear"], "weights": weights}
    return {
        "config_groups": {"group_0": group},
        "format": fmt,
        "global_compression_ratio": None,
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


def quantize_tensor(
    name: str, w: torch.Tensor, scheme: str, group_size: int, block_size: int = 0
) -> dict[str, torch.Tensor]:
    """One projection weight -> its compressed-tensors tensors (scales in the weight's dtype)."""
    from ember_engine.model.quant import schemes

    base = name.removesuffix(".weight")
    if scheme == "fp8" and block_size:
        if w.shape[1] % block_size:  # each row's tiles are its activations' groups, which must fill it
            raise ValueError(
                f"fp8: {name}: input size {w.shape[1]} is not a multiple of the block size {block_size}"
            )
        q, scale = schemes.quantize_fp8_blocks(w, (block_size, block_size))
        return {f"{base}.weight": q, f"{base}.weight_scale": scale.to(w.dtype)}
    if scheme == "fp8":
        q, scale = schemes.quantize_fp8(w)
        return {f"{base}.weight": q, f"{base}.weight_scale": scale[:, None].to(w.dtype)}
    if scheme == "w8a8":
        q, scale = schemes.quantize_int8(w)
        return {f"{base}.weight": q, f"{base}.weight_scale": scale.to(w.dtype)}
    if scheme == "w8a16":
        q, scale = schemes.quantize_int8(w)
        bits = 8
    else:
        q, scale = schemes.quantize_int4(w, group_size)
        bits = 4
    return {
        f"{base}.weight_packed": schemes.pack_int32(q, bits),
        f"{base}.weight_scale": scale.to(w.dtype),
        f"{base}.weight_shape": torch.tensor(list(w.shape), dtype=torch.int64),
    }


def quantize_checkpoint(
    src: str | Path,
    dst: str | Path,
    scheme: str,
    group_size: int | None = None,
    block_size: int | None = None,
) -> Path:
    """Writes the quantized copy of `src` to `dst`, which must not exist. Every tensor is quantized before
    `dst` is made, so a refusal (a ValueError naming the cause) leaves nothing behind."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from ember_engine.model.loader import checkpoint_files
    from ember_engine.model.quant.checkpoint import read_quantization_config, weights_quantized
    from ember_engine.model.quant.schemes import check_scheme

    check_scheme(scheme)
    if scheme == "bitsandbytes":
        raise ValueError(
            "ember quantize writes compressed-tensors checkpoints (fp8, w8a16, w4a16, w8a8), not bitsandbytes; "
            "serve the full-precision checkpoint with --quantization bitsandbytes to quantize it to NF4 at load"
        )
    group = check_options(scheme, group_size, block_size)
    src, dst = Path(src), Path(dst)
    if dst.exists() or dst.is_symlink():  # a link to nothing is there all the same
        raise ValueError(f"{dst} already exists")
    if not (src / "config.json").is_file():
        raise ValueError(f"{src} has no config.json: not a Hugging Face checkpoint directory")
    config = json.loads((src / "config.json").read_text())
    held = read_quantization_config(src)  # under either key, or an older export's own file
    if held is not None and weights_quantized(held):
        raise ValueError(f"{src} is already quantized ({held.get('quant_method')})")
    if held is not None:  # sparsity or KV-cache scales alone, which the written config would drop
        parts = [k for k in ("sparsity_config", "kv_cache_scheme", "transform_config") if held.get(k)]
        raise ValueError(
            f"{src} holds a {held.get('quant_method')} config ({', '.join(parts) or 'no config groups'}) that "
            "a quantized copy would lose; serve it with --quantization to quantize it at load instead"
        )
    out: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(src):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                t = f.get_tensor(name)
                quantized = _PROJECTION.match(name) and (not t.is_floating_point() or t.element_size() == 1)
                if quantized or name.endswith(_QUANTIZED_TENSORS):  # a config this reader does not know of
                    raise ValueError(
                        f"{src} holds quantized weights ({name}: {t.dtype}) that its config.json does not "
                        "describe; give ember quantize a full-precision checkpoint"
                    )
                out.update(
                    quantize_tensor(name, t, scheme, group, block_size or 0)
                    if _PROJECTION.match(name)
                    else {name: t}
                )
    config["quantization_config"] = quantization_config(scheme, group, block_size or 0)
    # Written beside dst and renamed into place, so an interrupted write leaves no dst behind.
    # (A directory of its own, made as any other is: mkdtemp's would keep its owner-only mode.)
    dst.parent.mkdir(parents=True, exist_ok=True)
    part = dst.with_name(f".{dst.name}.partial-{os.getpid()}")
    shutil.rmtree(part, ignore_errors=True)  # left by an interrupted run of the same process id
    part.mkdir()
    try:
        save_file(out, str(part / "model.safetensors"), metadata={"format": "pt"})
        (part / "model.safetensors").chmod(0o644)  # safetensors writes it owner-only: readable as the rest
        (part / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for other in src.iterdir():
            if other.is_file() and other.suffix != ".safetensors" and other.name not in _REWRITTEN:
                shutil.copy(other, part / other.name)
        part.rename(dst)
    except BaseException:
        shutil.rmtree(part, ignore_errors=True)
        raise
    return dst


def main(args: argparse.Namespace) -> int:
    try:
        dst = quantize_checkpoint(args.src, args.dst, args.scheme, args.group_size, args.block_size)
    except (ValueError, OSError) as e:  # UnsupportedQuantizationError included; DST where none can be written
        print(f"ember quantize: error: {e}", file=sys.stderr)
        return 2
    what = f"{args.scheme} ({args.block_size}x{args.block_size} blocks)" if args.block_size else args.scheme
    print(f"wrote {what} checkpoint to {dst}")
    return 0
