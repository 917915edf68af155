"""A compressed-tensors checkpoint whose config quantizes the LM head too (llm-compressor with nothing
ignored: the class name "Linear" takes `lm_head`): ember runs the head in the checkpoint's scheme, and its
logits are those of transformers + compressed-tensors on the same checkpoint. A tied head (the embedding
matrix) held quantized is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from test_engine_greedy import hf_greedy
from test_quant_load import _prompts
from transformers import AutoModelForCausalLM

from ember_engine import LLM, SamplingParams
from ember_engine.model.model_runner import Chunk
from ember_engine.model.quant.fp8_linear import Fp8Linear
from ember_engine.model.quant.int_linear import Int4Linear, Int8Linear

BUILD = "quant_targets_build.py"
# preset: (the head's layer, tolerance on the logits as a fraction of their range, prompts whose 12 greedy
# tokens all match transformers')
CASES = {
    "W8A16_HEAD": (Int8Linear, 1e-4, 1.0),
    "W4A16_HEAD": (Int4Linear, 1e-4, 1.0),
    # FP8 activations may round a value to the neighbouring E4M3 step where the orders of operations differ,
    # and how far that moves the logits depends on the CPU's float kernels (measured 2.6e-2 of the range on a
    # CPU with AVX-512 and AMX, under 2e-2 on others)
    "FP8_DYNAMIC_HEAD": (Fp8Linear, 3e-2, 0.75),
}


@pytest.mark.parametrize("preset", list(CASES))
def test_a_quantized_head_runs_in_its_scheme_and_matches_transformers(preset: str, quantized_model) -> None:  # type: ignore[no-untyped-def]
    layer, tolerance, agreement = CASES[preset]
    path = quantized_model("tiny", preset, BUILD)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert "lm_head.weight_scale" in set(f.keys())
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert hf.lm_head.quantization_scheme is not None  # the oracle runs its head quantized too
    llm = LLM(str(path), num_kv_blocks=64)
    runner = llm.engine.runner
    assert type(runner.model.lm_head) is layer
    for prompt in _prompts(4, 40):
        with torch.inference_mode():
            theirs = hf(torch.tensor([prompt])).logits[0].float()
        ours = runner.forward([Chunk(list(range(-(-len(prompt) // 16))), 0, prompt, num_logits=len(prompt))])
        assert ours is not None and ours.dtype == torch.float32
        span = (theirs.max() - theirs.min()).item()
        assert (ours - theirs).abs().max().item() <= tolerance * span, preset
    prompts = _prompts(8, 20)
    expected = hf_greedy(hf, prompts, 12)
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert sum(g.token_ids == e for g, e in zip(got, expected, strict=True)) / len(prompts) >= agreement


def test_a_tied_head_held_quantized_is_refused_by_name(quantized_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import shutil

    path = tmp_path / "m"
    shutil.copytree(quantized_model("tiny", "W8A16_HEAD", BUILD), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": True}))
    with pytest.raises(
        ValueError,
        match=r"lm_head: the checkpoint's quantization config holds it in w8a16, but tie_word_embeddings ties "
        r"it to embed_tokens, which ember keeps in the model dtype",
    ):
        LLM(str(path), num_kv_blocks=16)
