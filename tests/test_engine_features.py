"""Sampling, stopping, logprobs, n > 1 and refusals, through the offline API on the tiny checkpoint."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from ember_engine import LLM, SamplingParams
from ember_engine.model.loader import CheckpointError
from ember_engine.model.model_config import UnsupportedModelError

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Queue:\n    def __init__(self):", "x = 1"]


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> LLM:
    return LLM(str(tiny_model))


def greedy(max_tokens: int = 24, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)  # type: ignore[arg-type]


def test_seeded_sampling_is_reproducible_across_batches(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=20, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], seeded, use_tqdm=False)[0].token_ids
    others = [SamplingParams(temperature=1.2, max_tokens=n, ignore_eos=True) for n in (5, 30, 11)]
    mixed = llm.generate(
        [PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[3]],
        [others[0], others[1], seeded, others[2]],
        use_tqdm=False,
    )
    assert mixed[2].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=8, max_tokens=20, ignore_eos=True)
    assert llm.generate(PROMPTS[0], other_seed, use_tqdm=False)[0].token_ids != alone


def test_n_samples_are_distinct_and_share_the_prompt(tiny_model: Path) -> None:
    llm = LLM(str(tiny_model))
    prompt = list(range(100, 180))  # five full blocks
    out = llm.generate(
        prompt, SamplingParams(n=4, temperature=1.0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )[0]
    samples = [tuple(o.token_ids) for o in out.outputs]
    assert len(samples) == 4 and len(set(samples)) == 4
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    # Siblings found the first sample's full prompt blocks in the cache.
    assert llm.engine.stats().prefix_cache_hits == 3 * 64


def test_stop_string_split_across_tokens(llm: LLM) -> None:
    base = llm.generate(PROMPTS[0], greedy(), use_tqdm=False)[0]
    tok = llm.tokenizer
    pieces = [tok.decode(base.token_ids[: i + 1]) for i in range(len(base.token_ids))]
    # A stop string that starts inside one token and ends inside a later one.
    i = next(
        k
        for k in range(3, 20)
        if len(pieces[k]) - len(pieces[k - 1]) >= 2 and len(pieces[k + 1]) - len(pieces[k]) >= 2
    )
    start, end = len(pieces[i]) - 1, len(pieces[i]) + 1
    stop = base.text[start:end]
    assert base.text.find(stop) == start, "the chosen stop string must first occur there"
    out = llm.generate(PROMPTS[0], greedy(stop=[stop, "never-appears"]), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.text == base.text[:start]
    kept = llm.generate(PROMPTS[0], greedy(stop=stop, include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.text == base.text[:end]


def test_streamed_text_never_passes_the_stop(llm: LLM) -> None:
    base = llm.generate(PROMPTS[1], greedy(), use_tqdm=False)[0]
    stop = base.text[10:14]
    engine = llm.engine
    engine.add_request("s1", PROMPTS[1], greedy(stop=[stop]))
    streamed = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed += out.outputs[0].delta_text
            assert stop not in streamed
    assert streamed == base.text[: base.text.find(stop)]


def test_stop_token_ids_max_tokens_and_min_tokens(llm: LLM) -> None:
    base = llm.generate(PROMPTS[2], greedy(), use_tqdm=False)[0]
    stop_id = base.token_ids[4]
    first = base.token_ids.index(stop_id)
    out = llm.generate(PROMPTS[2], greedy(stop_token_ids=[stop_id]), use_tqdm=False)[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop_id
    assert llm.generate(PROMPTS[2], greedy(max_tokens=3), use_tqdm=False)[0].token_ids == base.token_ids[:3]
    # min_tokens keeps the stop id from being sampled before 6 tokens, and from ending the request.
    first_id = base.token_ids[0]
    held = llm.generate(PROMPTS[2], greedy(stop_token_ids=[first_id], min_tokens=6), use_tqdm=False)[0]
    assert len(held.token_ids) >= 6 and first_id not in held.token_ids[:6]


def test_eos_stops_unless_ignored(llm: LLM) -> None:
    eos = llm.engine.model_config.eos_token_ids
    base = llm.generate(PROMPTS[3], greedy(), use_tqdm=False)[0]
    # Make the third greedy token an EOS by declaring it one, then see both behaviours.
    object.__setattr__(llm.engine.model_config, "eos_token_ids", (*eos, base.token_ids[2]))
    try:
        stopped = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
        ignored = llm.generate(PROMPTS[3], greedy(), use_tqdm=False)[0]
    finally:
        object.__setattr__(llm.engine.model_config, "eos_token_ids", eos)
    assert stopped.token_ids == base.token_ids[:3] and stopped.finish_reason == "stop"
    assert ignored.token_ids == base.token_ids


def test_logprobs_match_transformers(llm: LLM, tiny_model: Path) -> None:
    out = llm.generate(PROMPTS[0], greedy(max_tokens=6, logprobs=3), use_tqdm=False)[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ids = torch.tensor([llm.tokenizer.encode(PROMPTS[0]) + out.token_ids])
    with torch.inference_mode():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    start = ids.shape[1] - len(out.token_ids) - 1
    assert out.logprobs is not None and len(out.logprobs) == 6
    for k, lp in enumerate(out.logprobs):
        row = logp[start + k]
        assert lp.token_id == out.token_ids[k]
        assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=1e-4)
        top = torch.topk(row, 3)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_over_long_and_empty_prompts_are_refused_alone(tiny_model: Path) -> None:
    llm = LLM(str(tiny_model), max_model_len=128)
    outs = llm.generate(
        [PROMPTS[0], list(range(10, 140)), "", PROMPTS[1]], greedy(max_tokens=8), use_tqdm=False
    )
    assert outs[1].error is not None and "max_model_len" in outs[1].error and outs[1].outputs == []
    assert outs[2].error is not None and "empty" in outs[2].error
    assert len(outs[0].token_ids) == 8 and len(outs[3].token_ids) == 8
    with pytest.raises(ValueError, match="max_tokens"):
        llm.engine.add_request("r", list(range(100)), greedy(max_tokens=64))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_unsupported_architecture_is_named(tiny_model: Path, tmp_path: Path) -> None:
    model = _copy(tiny_model, tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="GPTNeoXForCausalLM") as exc:
        LLM(str(model))
    assert "LlamaForCausalLM" in str(exc.value) and "Qwen2ForCausalLM" in str(exc.value)


@pytest.mark.parametrize("damage", ["missing", "misshaped", "fp8", "int8"])
def test_bad_tensor_is_named(tiny_model: Path, tmp_path: Path, damage: str) -> None:
    # A quantized type where the config quantizes nothing (an FP8 or int8 weight without its scales, say a
    # config that lost its quantization_config) is refused, not widened to the model dtype as it is.
    model = _copy(tiny_model, tmp_path / "m")
    tensors = load_file(model / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj.weight"
    if damage == "missing":
        del tensors[name]
    elif damage == "misshaped":
        tensors[name] = tensors[name][:, :-1].contiguous()
    else:
        tensors[name] = tensors[name].to(torch.float8_e4m3fn if damage == "fp8" else torch.int8)
    save_file(tensors, model / "model.safetensors")
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        LLM(str(model))


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        # NaN passed the one-sided checks: temperature NaN sampled, repetition_penalty NaN wrote garbage
        ("temperature", float("nan"), "temperature: must be a finite number >= 0, got nan"),
        ("temperature", float("inf"), "temperature: must be a finite number >= 0, got inf"),
        ("repetition_penalty", float("nan"), "repetition_penalty: must be a finite number > 0, got nan"),
        ("repetition_penalty", float("inf"), "repetition_penalty: must be a finite number > 0, got inf"),
    ],
)
def test_sampling_numbers_that_are_no_finite_numbers_are_refused(
    field: str, value: float, error: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(error)):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("device", ["tpu", "npu", "cuda:x"])
def test_an_unknown_device_is_refused_by_name(tiny_model: Path, device: str) -> None:
    """It failed deep in torch ("Expected one of cpu, cuda, ..."), naming no option."""
    with pytest.raises(ValueError, match=re.escape(f"device: unknown {device!r}; choose auto, cpu or cuda")):
        LLM(str(tiny_model), device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without a CUDA device")
def test_cuda_without_a_cuda_device_is_refused_by_name(tiny_model: Path) -> None:
    """It failed with torch's "AssertionError: Torch not compiled with CUDA enabled"."""
    with pytest.raises(ValueError, match=r"device: cuda requested, but torch sees no CUDA device"):
        LLM(str(tiny_model), device="cuda")


def test_a_max_model_len_the_kv_cache_cannot_hold_is_refused_naming_both(tiny_model: Path) -> None:
    """An explicit max_model_len was lowered to what the cache holds with only a log line: a request of
    the length asked for was then refused as too long, naming a limit nobody set."""
    with pytest.raises(
        ValueError, match=r"max_model_len: 256 tokens do not fit in the KV cache \(2 blocks of 16"
    ):
        LLM(str(tiny_model), max_model_len=256, num_kv_blocks=2, block_size=16)


def test_an_unset_max_model_len_becomes_what_the_kv_cache_holds(tiny_model: Path) -> None:
    llm = LLM(str(tiny_model), num_kv_blocks=2, block_size=16)
    assert llm.engine.max_model_len == 32


def test_a_kv_cache_memory_below_one_block_is_refused(tiny_model: Path) -> None:
    """It got one block anyway: more memory than it was given."""
    with pytest.raises(
        ValueError, match=r"kv_cache_memory: 100 bytes is less than one KV block \(\d+ bytes\)"
    ):
        LLM(str(tiny_model), kv_cache_memory=100)


def test_a_stop_token_keeps_its_text_with_include_stop_str_in_output(llm: LLM) -> None:
    """A request stopped by one of its `stop_token_ids` lost that token's text with the flag set too (vLLM
    keeps it then: the flag is about the stop's text, string or token)."""
    base = llm.generate(PROMPTS[2], greedy(), use_tqdm=False)[0]
    tok = llm.tokenizer
    k = next(i for i in range(2, 20) if tok.decode([base.token_ids[i]]).strip())
    stop_id = base.token_ids[k]
    first = base.token_ids.index(stop_id)
    cut = llm.generate(PROMPTS[2], greedy(stop_token_ids=[stop_id]), use_tqdm=False)[0]
    kept = llm.generate(
        PROMPTS[2], greedy(stop_token_ids=[stop_id], include_stop_str_in_output=True), use_tqdm=False
    )[0]
    assert cut.token_ids == kept.token_ids == base.token_ids[: first + 1]
    assert cut.text == tok.decode(base.token_ids[:first])
    assert kept.text == tok.decode(base.token_ids[: first + 1])


def test_a_stop_string_within_the_first_min_tokens_does_not_end_the_request(llm: LLM) -> None:
    """As vLLM: stop strings are looked for only in the text after the first `min_tokens` tokens'. A stop
    string the `min_tokens`-th token completed ended the request there."""
    base = llm.generate(PROMPTS[0], greedy(), use_tqdm=False)[0]
    tok = llm.tokenizer
    three = tok.decode(base.token_ids[:3])
    stop = three[-2:]
    assert stop and stop not in tok.decode(base.token_ids[:2])  # the third token completes it
    out = llm.generate(PROMPTS[0], greedy(stop=[stop], min_tokens=3), use_tqdm=False)[0]
    assert len(out.token_ids) > 3, out.text
    assert out.text.startswith(three)
    later = base.text.find(stop, len(three))
    if later >= 0:  # it ends at the stop's next showing, after the first three tokens' text
        assert out.text == base.text[:later]
