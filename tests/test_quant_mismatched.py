"""A checkpoint whose tensors do not fit its config, or hold scales that are no numbers, is refused with an
error that names the tensor: never loaded into wrong answers, never a bare torch error."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ember_engine import LLM
from ember_engine.model.quant.schemes import UnsupportedQuantizationError

DOWN = "model.layers.1.mlp.down_proj"
ANY = r"model\.layers\.\d\.[a-z_]+\.[a-z_]+"  # a config edit reaches every projection: the first loaded


def _set(**values: Any) -> Callable[[dict[str, Any]], None]:
    return lambda group: group["weights"].update(values)


def _nan_scale(state: dict[str, torch.Tensor]) -> None:
    state[f"{DOWN}.weight_scale"][3] = float("nan")


def _inf_scale(state: dict[str, torch.Tensor]) -> None:
    state[f"{DOWN}.weight_scale"][0, 1] = float("inf")


def _zero_points_cut(state: dict[str, torch.Tensor]) -> None:
    state[f"{DOWN}.weight_zero_point"] = state[f"{DOWN}.weight_zero_point"][:3].contiguous()


def _no_scale(state: dict[str, torch.Tensor]) -> None:
    del state[f"{DOWN}.weight_scale"]


def _nan(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(state: dict[str, torch.Tensor]) -> None:
        state[name].view(-1)[1] = float("nan")

    return edit


CASES = [
    # config says 4 bits, the words hold 8-bit values: was loaded, the extra words dropped (wrong answers)
    ("W8A16", {"group": _set(num_bits=4)}, rf"{ANY}\.weight_packed: .*4-bit values .* need \[\d+, \d+\]"),
    # zero points for 3 of the rows' words: was loaded, the rows past them given garbage
    ("W4A16_ASYM", {"tensors": _zero_points_cut}, rf"{DOWN}\.weight_zero_point: "),
    # scales in groups of 128, config says 64: was a bare torch error (a layer shape torch could not fit)
    ("W4A16", {"group": _set(group_size=64)}, rf"{ANY}\.weight_scale: .* groups of 64 needs"),
    # scales in groups of 128 (the preset's), config says per channel: was a bare torch error
    ("W8A16", {"group": _set(strategy="channel", group_size=None)}, rf"{ANY}: .*weight_scale \[\d+, 2\]"),
    ("FP8_DYNAMIC", {"tensors": _nan_scale}, rf"{DOWN}\.weight_scale: .*not finite"),
    ("W4A16", {"tensors": _inf_scale}, rf"{DOWN}\.weight_scale: .*not finite"),
    ("FP8_DYNAMIC", {"tensors": _no_scale}, rf"missing tensor\(s\): {DOWN}\.weight_scale"),
    # GPTQ's, AWQ's and bitsandbytes' own scales (their checkpoints: gptq_build.py, bnb_build.py)
    ("INT4", {"tensors": _nan(f"{DOWN}.scales")}, rf"{DOWN}\.scales: not finite"),
    ("AWQ", {"tensors": _nan(f"{DOWN}.scales")}, rf"{DOWN}\.scales: not finite"),
    ("NF4", {"tensors": _nan(f"{DOWN}.weight.nested_absmax")}, rf"{DOWN}\.weight\.nested_absmax: not finite"),
    # AWQ's scales in groups of 64, config says 32; GPTQ zero points off the midpoint, config says sym:
    # both were refused naming no projection ("awq: a [128, 256] weight ...", "gptq: zero points ...")
    ("AWQ", {"quantization": lambda qc: qc.update(group_size=32)}, rf"{ANY}\.scales: .* groups of 32 needs"),
    ("INT4_ASYM", {"quantization": lambda qc: qc.update(sym=True)}, rf"{ANY}\.qzeros: zero points other"),
]


def _cut(
    name: str, rows: int | None = None, columns: int | None = None
) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(state: dict[str, torch.Tensor]) -> None:
        state[name] = state[name][:rows, :columns].contiguous()

    return edit


def _as_float(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(state: dict[str, torch.Tensor]) -> None:
        state[name] = state[name].float()

    return edit


CASES += [
    # zero points for a quarter of the output columns: loaded, the columns past them given garbage (the
    # logits 3 off); AWQ's zero points for one group of four: blamed on the scales
    (
        "INT4_ASYM",
        {"tensors": _cut(f"{DOWN}.qzeros", columns=4)},
        rf"{DOWN}\.qzeros: \[4, 4\] .* needs \[4, 16\]",
    ),
    (
        "AWQ_ASYM",
        {"tensors": _cut(f"{DOWN}.qzeros", rows=1)},
        rf"{DOWN}\.qzeros: \[1, 16\] .* needs \[4, 16\]",
    ),
    # packed words stored as float32: loaded, the logits 12 off
    ("INT4", {"tensors": _as_float(f"{DOWN}.qweight")}, rf"{DOWN}\.qweight: torch\.float32 words, where"),
]
BUILDERS = {
    "INT4": "gptq_build.py",
    "AWQ": "gptq_build.py",
    "INT4_ASYM": "gptq_build.py",
    "AWQ_ASYM": "gptq_build.py",
    "NF4": "bnb_build.py",
}


@pytest.mark.parametrize(
    ("preset", "edit", "message"),
    CASES,
    ids=[
        "bits",
        "zero-points",
        "group-size",
        "strategy",
        "nan-scale",
        "inf-scale",
        "missing-scale",
        "gptq-scales",
        "awq-scales",
        "bnb-absmax",
        "awq-groups",
        "gptq-symmetric",
        "gptq-zero-point-columns",
        "awq-zero-point-groups",
        "gptq-float-words",
    ],
)
def test_a_checkpoint_its_config_does_not_describe_is_refused_naming_the_tensor(
    preset: str, edit: dict[str, Any], message: str, quantized_model, edited_checkpoint, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    path = edited_checkpoint(
        quantized_model("tiny", preset, BUILDERS.get(preset, "quant_build.py")), tmp_path / "m", **edit
    )
    with pytest.raises((UnsupportedQuantizationError, ValueError), match=message):
        LLM(str(path), num_kv_blocks=16)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        # the config says 4 KV heads, the file holds 2: k_proj's rows filled half of k's slot and v's rows
        # spilled into the rest, and the model loaded and wrote other tokens
        (
            {"num_key_value_heads": 4},
            r"model\.layers\.0\.self_attn\.k_proj: 64 output rows, but the config gives that part 128",
        ),
    ],
)
def test_a_quantized_projection_with_other_rows_than_its_config_is_refused(
    edit: dict[str, Any], message: str, tiny_model: Path, tmp_path: Path
) -> None:
    """As the full-precision loader refuses a mis-shaped tensor by name."""
    import json

    from ember_engine.cli import main

    dst = tmp_path / "q"
    assert main(["quantize", str(tiny_model), str(dst), "--scheme", "w8a16"]) == 0
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(ValueError, match=message):
        LLM(str(dst), num_kv_blocks=16)
