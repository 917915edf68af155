"""FP8 KV-cache scales per KV head: what llm-compressor writes for `kv_cache_scheme` with strategy
"attn_head" (a K and a V scale of shape [num_kv_heads, 1, 1] per layer). Checked against transformers +
compressed-tensors, which quantizes each layer's keys and values with those scales in its forward (per
tensor too), and at the kernel level: the Triton store writes the reference's bytes, attention over the
cache equals attention over its per-head dequantized values; 2 and 4 tensor-parallel ranks give one
rank's tokens. Triton runs in its CPU interpreter here and compiled where a GPU is present."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from test_attention import MIXED, make_batch
from test_engine_greedy import hf_greedy
from transformers import AutoModelForCausalLM

from ember_engine import LLM, SamplingParams
from ember_engine.model import kv_quant, triton_attention
from ember_engine.model.attention import paged_attention_reference, store_kv, store_kv_reference
from ember_engine.model.model_runner import Chunk

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


@pytest.fixture
def use_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_ATTENTION", "triton")


def _prompts(n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(10, 4000, (length + 3 * i,), generator=g).tolist() for i in range(n)]


@pytest.mark.parametrize("preset", ["KV", "KV_HEAD"])
def test_logits_and_greedy_tokens_match_transformers_with_compressed_tensors(
    quantized_model: Callable[..., Path], tiny_model: Path, preset: str
) -> None:
    path = quantized_model("tiny", preset, "kv_scales_build.py")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    llm = LLM(str(path), kv_cache_dtype="fp8", num_kv_blocks=64)
    runner = llm.engine.runner
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for i, layer in enumerate(runner.model.attention_layers()):
            for which in ("k", "v"):
                stored = f.get_tensor(f"model.layers.{i}.self_attn.{which}_scale").float().flatten()
                ours = getattr(layer, f"{which}_scale")
                if preset == "KV":
                    assert ours == stored.item()
                else:  # every head its own scale, as written
                    assert isinstance(ours, torch.Tensor) and torch.equal(ours.cpu(), stored)
                    assert len(stored.unique()) == len(stored) == 2
    rows = []
    for prompt in _prompts(4, 40):
        with torch.inference_mode():
            theirs = hf(torch.tensor([prompt])).logits[0]
            unquantized = plain(torch.tensor([prompt])).logits[0]
        blocks = list(range(-(-len(prompt) // 16)))
        ours = runner.forward([Chunk(blocks, 0, prompt, num_logits=len(prompt))])
        assert ours is not None
        span = (theirs.max() - theirs.min()).item()
        # The oracle does quantize the cache: its logits move by far more than ours differ from them.
        effect = (theirs - unquantized).abs().max().item()
        assert effect > 0.005 * span
        # A float32 rounding difference upstream (ember computes q, k and v in one matmul) can move a key
        # or value to the neighbouring E4M3 step, and every later position of that prompt with it: less
        # than a tenth of what quantizing the cache moves. Measured on one build of the scales: 3 prompts
        # within 8.6e-7 of the range, and one whose position 14 rounds the other way, 5.4e-4 from there on
        # (the cache's own effect 1.2e-2); on another build every prompt within 6.2e-6 per head, 4.2e-5 per
        # layer. Dividing by the scale instead of multiplying by its float32 reciprocal changes none of these.
        assert (ours - theirs).abs().max().item() <= 0.1 * effect
        rows += ((ours - theirs).abs().max(dim=1).values / span).tolist()
    # the positions no flipped step reaches (the median of every prompt's): as transformers computes them
    assert sorted(rows)[len(rows) // 2] <= 1e-5
    prompts = _prompts(8, 20)
    expected = hf_greedy(hf, prompts, 12)
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [list(g.token_ids) for g in got] == expected


def test_a_layers_head_reciprocals_are_computed_once() -> None:
    scale = torch.tensor([0.3, 0.007, 5.0])
    first = kv_quant.reciprocal(scale)
    assert isinstance(first, torch.Tensor) and kv_quant.reciprocal(scale) is first
    assert torch.equal(first, (1.0 / scale.double()).float())
    other = scale.clone()  # equal values, another layer's tensor: its own entry
    assert kv_quant.reciprocal(other) is not first and torch.equal(kv_quant.reciprocal(other), first)


def _head_scales(n: int, low: float, high: float) -> torch.Tensor:
    return torch.linspace(low, high, n, device=DEVICE)


@pytest.mark.parametrize("dtype", [FP8, torch.float8_e5m2])
def test_triton_store_writes_the_reference_bytes_with_per_head_scales(
    use_triton: None, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(3)
    key = (torch.randn(40, 4, 8, generator=g) * torch.tensor([1.0, 30.0, 0.01, 500.0]).view(4, 1)).to(DEVICE)
    value = key.flip(0) * 0.5
    slots = torch.randperm(48, generator=torch.Generator().manual_seed(1))[:40].to(DEVICE)
    slots[::7] = -1
    k_scale, v_scale = _head_scales(4, 0.003, 1.5), _head_scales(4, 0.9, 0.01)
    caches = [torch.zeros(6, 8, 4, 8, device=DEVICE).to(dtype) for _ in range(4)]
    store_kv_reference(key, value, caches[0], caches[1], slots, k_scale=k_scale, v_scale=v_scale)
    store_kv(key, value, caches[2], caches[3], slots, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(caches[2].view(torch.uint8), caches[0].view(torch.uint8))
    assert torch.equal(caches[3].view(torch.uint8), caches[1].view(torch.uint8))
    # Each head is stored as its values over its own scale.
    rows = slots >= 0
    written = caches[0].view(-1, 4, 8)[slots[rows]].float()
    expected = kv_quant.quantize(key[rows], k_scale, dtype).float()
    assert torch.equal(written, expected)
    assert torch.equal(expected[:, 1], kv_quant.quantize(key[rows, 1], k_scale[1].item(), dtype).float())


def _dequantized(b, k_scale: torch.Tensor, v_scale: torch.Tensor) -> tuple:  # type: ignore[no-untyped-def]
    args = list(b.attention_args())
    args[1] = kv_quant.dequantize(b.k_cache, k_scale)
    args[2] = kv_quant.dequantize(b.v_cache, v_scale)
    return tuple(args)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_attention_with_per_head_scales_is_attention_over_the_dequantized_cache(
    use_triton: None, num_splits: int, dtype: torch.dtype
) -> None:
    specs = MIXED if num_splits == 1 else [(299, 1), (90, 1), (0, 1), (150, 6)]
    b = make_batch(specs, block_size=16, num_heads=4, num_kv_heads=2, head_dim=40, dtype=dtype, device=DEVICE)
    k_scale, v_scale = _head_scales(2, 0.02, 0.3), _head_scales(2, 0.5, 0.05)
    b.k_cache = kv_quant.quantize(b.k_cache * torch.tensor([1.0, 10.0], device=DEVICE).view(2, 1), k_scale)
    b.v_cache = kv_quant.quantize(b.v_cache, v_scale)
    store_kv(b.key, b.value, b.k_cache, b.v_cache, b.slot_mapping, k_scale=k_scale, v_scale=v_scale)
    expected = paged_attention_reference(*_dequantized(b, k_scale, v_scale))[: b.num_tokens]
    reference = paged_attention_reference(*b.attention_args(), k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(reference[: b.num_tokens], expected, atol=1e-5, rtol=1e-5)
    out = triton_attention.paged_attention(
        *b.attention_args(), num_splits=num_splits, k_scale=k_scale, v_scale=v_scale
    )
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out[: b.num_tokens], expected.to(dtype), atol=tol, rtol=tol)
    # Not the same as one scale for both heads: the heads' scales are used, each for its own.
    one = triton_attention.paged_attention(*b.attention_args(), k_scale=0.02, v_scale=0.5)
    assert not torch.allclose(one[: b.num_tokens], out[: b.num_tokens], atol=tol, rtol=tol)


@pytest.mark.parametrize("ranks", [2, 4])
def test_tensor_parallel_ranks_take_their_heads_scales(
    quantized_model: Callable[..., Path], ranks: int
) -> None:
    """2 ranks hold one KV head each; 4 ranks hold each head twice (the tiny model has 2 KV heads)."""
    from ember_engine.model.llama import LlamaForCausalLM
    from ember_engine.model.loader import load_weights
    from ember_engine.model.model_config import ModelConfig
    from ember_engine.model.parallel import TPGroup

    path = quantized_model("tiny", "KV_HEAD", "kv_scales_build.py")
    config = ModelConfig.from_dir(path)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        k = f.get_tensor("model.layers.1.self_attn.k_scale").flatten()
        v = f.get_tensor("model.layers.1.self_attn.v_scale").flatten()
    for rank in range(ranks):
        with torch.device("cpu"):
            model = LlamaForCausalLM(config, TPGroup(rank=rank, size=ranks))
        load_weights(model, path)
        attn = model.model.layers[1].self_attn
        head = rank * 2 // ranks  # the one KV head this rank holds
        assert attn.k_scale == k[head].item() and attn.v_scale == v[head].item()  # as floats: one head each
    prompts = _prompts(6, 30)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run(**options: object) -> list[list[int]]:
        llm = LLM(str(path), dtype="float32", kv_cache_dtype="fp8", **options)
        try:
            return [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.engine.shutdown()

    assert run(tensor_parallel_size=ranks) == run()


def test_scales_of_another_shape_are_refused_by_name(tiny_model: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    for f in tiny_model.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(tiny_model / "model.safetensors"))
    for name, value, error in [
        (
            "model.layers.0.self_attn.k_scale",
            torch.ones(3, 1, 1),
            r"has shape \(3, 1, 1\); supported: one scale",
        ),
        (
            "model.layers.0.self_attn.k_scale",
            torch.ones(2, 1, 16),
            r"has shape \(2, 1, 16\); supported: one scale",
        ),
        (
            "model.layers.1.self_attn.v_scale",
            torch.tensor([0.5, 0.0]),
            r"is 0\.0; it must be a positive finite",
        ),
    ]:
        save_file({**tensors, name: value}, str(tmp_path / "model.safetensors"))
        with pytest.raises(ValueError, match=rf"{name}.*{error}"):
            LLM(str(tmp_path), kv_cache_dtype="fp8")
