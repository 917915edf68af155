"""GPTQ checkpoints stored in more than one format: GPTQModel's `dynamic` overrides of bits and group size
for the modules a pattern matches, and a quantized LM head (`lm_head: true`). Each projection runs in its
own format; every weight is what GPTQModel's own loader dequantizes, and the logits are those of
transformers holding those weights (`gptq_mixed_oracle.py`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from script_runs import run_script
from test_quant_gptq import BEFORE, MERGED, _edited, _prompts

from ember_engine import LLM, SamplingParams
from ember_engine.model.model_runner import Chunk
from ember_engine.model.quant.int_linear import Int4Linear, Int8Linear

BUILD = "gptq_mixed_build.py"


@pytest.fixture(scope="module")
def mixed(quantized_model, tmp_path_factory) -> tuple[Path, dict]:  # type: ignore[no-untyped-def]
    path = quantized_model("tiny", "INT4_MIXED", BUILD)
    work = tmp_path_factory.mktemp("gptq-mixed")
    (work / "prompts.json").write_text(json.dumps(_prompts()))
    oracle = Path(__file__).with_name("gptq_mixed_oracle.py")
    run_script(oracle, path, work / "oracle.pt", work / "prompts.json")
    return path, torch.load(work / "oracle.pt")


def test_each_module_runs_in_its_own_format_and_holds_gptqmodels_weights(mixed) -> None:  # type: ignore[no-untyped-def]
    path, oracle = mixed
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    assert config["lm_head"] and config["dynamic"][r"+:.*mlp\.down_proj"] == {"bits": 8, "group_size": 32}
    model = LLM(str(path), num_kv_blocks=64, dtype="float32").engine.runner.model
    assert len(oracle["weights"]) == 7 * len(model.model.layers) + 1  # every projection and the head
    for layer in model.model.layers:
        for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj):
            assert type(proj) is Int4Linear and proj.group_size == 64
        assert type(layer.mlp.down_proj) is Int8Linear and layer.mlp.down_proj.group_size == 32
    assert type(model.lm_head) is Int8Linear and model.lm_head.group_size == 32
    for name, theirs in oracle["weights"].items():
        module, _, proj = name.rpartition(".")
        layer = model.get_submodule(f"{module}.{MERGED.get(proj, proj)}" if module else proj)
        start = sum(oracle["weights"][f"{module}.{p}"].shape[0] for p in BEFORE.get(proj, ()))
        ours = layer.dequantized(torch.float32)[start : start + theirs.shape[0]]
        assert torch.equal(ours, theirs), name


def test_logits_and_greedy_tokens_match(mixed) -> None:  # type: ignore[no-untyped-def]
    path, oracle = mixed
    llm = LLM(str(path), num_kv_blocks=64, dtype="float32", quantization="gptq")
    runner = llm.engine.runner
    for prompt, theirs in zip(_prompts(), oracle["logits"], strict=True):
        ours = runner.forward([Chunk(list(range(-(-len(prompt) // 16))), 0, prompt, num_logits=len(prompt))])
        span = (theirs.max() - theirs.min()).item()
        assert (ours - theirs).abs().max().item() <= 1e-4 * span
    got = llm.generate(
        _prompts(), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    assert [list(g.token_ids) for g in got] == oracle["greedy"]


@pytest.mark.parametrize(
    ("config", "error"),
    [
        (  # q_proj alone 8-bit: ember runs q, k and v as one layer
            {"dynamic": {r"+:.*q_proj": {"bits": 8}}},
            r"model.layers.0.self_attn: q_proj is w8a16 but k_proj, v_proj are w4a16 \(config groups\)",
        ),
        (
            {"dynamic": {r"+:.*down_proj": {"bits": 3}}},
            r"gptq: dynamic '\+:\.\*down_proj': 3-bit weights are not "
            r"supported; supported: 4, 8",
        ),
        (
            {"tie_word_embeddings": True},
            r"lm_head: the checkpoint's quantization config holds it in w8a16, but "
            r"tie_word_embeddings ties it to embed_tokens",
        ),
    ],
)
def test_a_format_ember_cannot_run_is_refused_by_name(quantized_model, tmp_path: Path, config, error) -> None:  # type: ignore[no-untyped-def]
    src = quantized_model("tiny", "INT4_MIXED", BUILD)
    if "tie_word_embeddings" in config:
        path = _edited(src, tmp_path / "m")
        raw = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(raw | config))
    else:
        path = _edited(src, tmp_path / "m", config)
    with pytest.raises(ValueError, match=error):
        LLM(str(path), num_kv_blocks=16)
