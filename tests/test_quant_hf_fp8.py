"""Hugging Face `fp8` checkpoints (`quant_method: fp8`: E4M3 `weight` and `weight_scale_inv` per 128x128
block) load into the fp8 layers: rows whose blocks share one scale exactly, others within one E4M3 step."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ember_engine import LLM
from ember_engine.model.quant.linear import Fp8Linear
from ember_engine.model.quant.schemes import FP8_MAX

BLOCK = 128


def _block_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 128x128 tile (the last ones partial, as k/v projections smaller than a block are)."""
    out, inp = w.shape
    po, pi = -out % BLOCK, -inp % BLOCK
    padded = torch.nn.functional.pad(w, (0, pi, 0, po))
    tiles = padded.reshape((out + po) // BLOCK, BLOCK, (inp + pi) // BLOCK, BLOCK)
    scale = tiles.abs().amax(dim=(1, 3)) / FP8_MAX
    q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(out + po, inp + pi)
    return q[:out, :inp].contiguous(), scale


def test_block_scaled_fp8_checkpoint_loads(tiny_model: Path, tmp_path: Path) -> None:
    dst = tmp_path / "fp8"
    shutil.copytree(tiny_model, dst)
    tensors, dense = {}, {}
    with safe_open(str(tiny_model / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118
            t = f.get_tensor(name)
            if name.endswith("_proj.weight"):
                q, scale = _block_fp8(t)
                tensors[name], tensors[name.replace("weight", "weight_scale_inv")] = q, scale
                full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
                dense[name] = q.float() * full[: q.shape[0], : q.shape[1]]
            else:
                tensors[name] = t
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
    }
    (dst / "config.json").write_text(json.dumps(config))
    llm = LLM(str(dst), num_kv_blocks=16)
    layer = llm.engine.runner.model.model.layers[0]
    assert isinstance(layer.mlp.down_proj, Fp8Linear)
    # down_proj: 2 blocks per row; gate/up: one (so exact).
    got_down = layer.mlp.down_proj.dequantized()
    want_down = dense["model.layers.0.mlp.down_proj.weight"]
    assert torch.allclose(got_down, want_down, rtol=2**-3, atol=1e-6)
    got_gate = layer.mlp.gate_up_proj.dequantized()[: want_down.shape[1]]
    assert torch.equal(got_gate, dense["model.layers.0.mlp.gate_proj.weight"])
    out = llm.generate([list(range(10, 30))], use_tqdm=False)[0]
    assert len(out.token_ids) > 0
