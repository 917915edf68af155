"""Tensor parallelism on CPU (gloo): greedy output of a model split over 2 and 4 processes is token-for-token
the output of the unsplit model (TP=1, itself equal to transformers'), whatever the batching, chunking,
prefix sharing, preemption or speculation; and the split itself (head and vocabulary shards, shard-wise
loading, the per-step message)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from script_runs import run_script

from ember_engine import LLM, SamplingParams
from ember_engine.distributed.step_channel import HEADER, decode, encode
from ember_engine.model.loader import load_weights
from ember_engine.model.model_config import ModelConfig
from ember_engine.model.model_runner import Chunk
from ember_engine.model.parallel import Shard, TensorParallelError, TPGroup, check_tensor_parallel
from ember_engine.model.quant.schemes import UnsupportedQuantizationError
from ember_engine.tools.spec_pair import packaged_pair

MAX_NEW = 8
LENGTHS = [1, 2, 7, 16, 17, 33, 100, 129, 257, 500]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(99)
    prompts = [torch.randint(10, 4000, (n,), generator=g).tolist() for n in LENGTHS]
    shared = prompts[-1][:200]  # several full blocks shared with the 500-token prompt and each other
    prompts += [shared + torch.randint(10, 4000, (n,), generator=g).tolist() for n in (3, 40)]
    return prompts


PROMPTS = _prompts()


@contextmanager
def engine(model: Path, **options: Any) -> Iterator[LLM]:
    llm = LLM(str(model), dtype="float32", **options)
    try:
        yield llm
    finally:
        llm.engine.shutdown()


def generate(model: Path, prompts: list[Any], params: SamplingParams, **options: Any) -> tuple[list, Any]:
    with engine(model, **options) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.stats()
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    return [list(o.token_ids) for o in outs], stats


CASES = {
    "all-at-once-block-8": dict(block_size=8),
    # Two at a time: the shared-prefix prompts come after the one they share blocks with.
    "batch-2-prefix-hits": dict(max_num_seqs=2),
    # Prompts in chunks of at most 64 tokens, and 36 blocks for all of them: longer outputs outgrow the
    # cache and requests are preempted.
    "chunked-preempted": dict(max_num_batched_tokens=64, num_kv_blocks=36),
    # Each rank's FP8 cache holds its heads' K/V, quantized with the layer's scales.
    "fp8-kv-cache-prefix-hits": dict(max_num_seqs=2, kv_cache_dtype="fp8"),
}


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_match_one(tiny_model: Path, case: str) -> None:
    options = CASES[case]
    params = GREEDY
    if case == "chunked-preempted":
        params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    expected, plain = generate(tiny_model, PROMPTS, params, **options)
    out, split = generate(tiny_model, PROMPTS, params, tensor_parallel_size=2, **options)
    assert out == expected
    # The same schedule ran: same preemptions, same prefix-cache hits.
    assert split.num_preemptions == plain.num_preemptions
    assert split.prefix_cache_hits == plain.prefix_cache_hits
    if case == "chunked-preempted":
        assert split.num_preemptions > 0
    if case in ("batch-2-prefix-hits", "fp8-kv-cache-prefix-hits"):
        assert split.prefix_cache_hits > 0


# Online quantization on each rank of its own shard: the weight-only schemes hold the unsplit model's very
# values and scales (a row split by columns takes its scale from the whole row's largest value; groups of
# 128, and NF4's blocks of 64, fall within a rank's columns), so their greedy output is TP=1's; fp8 and
# w8a8 also quantize each token's activations, over the rank's columns where a projection is split by them
# (o, down): a finer scale than TP=1's over the whole row.
@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random llama 256 wide (MLP 512, 2 layers): a rank's 128 columns of o are a whole group of 128."""
    from ember_engine.tools import testmodel

    out = tmp_path_factory.mktemp("wide") / "model"
    return testmodel.make_test_model(out, testmodel.ModelSize(256, 512, 2, 4, 2, 2048), seed=3)


@pytest.mark.parametrize("scheme", ["w8a16", "w4a16", "bitsandbytes", "fp8", "w8a8"])
def test_two_ranks_quantize_their_shards_as_one_does(wide_model: Path, scheme: str) -> None:
    prompts = PROMPTS[:6]
    options = dict(quantization=scheme, max_num_seqs=4)
    expected, _ = generate(wide_model, prompts, GREEDY, **options)
    out, _ = generate(wide_model, prompts, GREEDY, tensor_parallel_size=2, **options)
    if scheme in ("w8a16", "w4a16", "bitsandbytes"):
        assert out == expected
        return
    # The split's own activation scales: its tokens are no further from full precision's than TP=1's
    # (measured, the fraction of the 48 positions holding full precision's token: fp8 0.583 split, 0.562
    # TP=1; w8a8 0.771, 0.667; and split against TP=1: 0.771, 0.896).
    plain, _ = generate(wide_model, prompts, GREEDY, max_num_seqs=4)
    assert _agreement(out, plain) >= _agreement(expected, plain) - 0.1, scheme
    assert _agreement(out, expected) >= 0.5, scheme


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The fraction of positions holding the same token."""
    return sum(x == y for p, q in zip(a, b, strict=True) for x, y in zip(p, q, strict=True)) / sum(
        map(len, a)
    )


@pytest.mark.parametrize("scheme", ["w4a16", "w8a16"])
def test_two_ranks_run_a_quantized_checkpoint_as_one(wide_model: Path, tmp_path: Path, scheme: str) -> None:
    """A compressed-tensors checkpoint (`ember quantize`, which transformers loads): each rank takes its
    rows or its columns of the stored values, scales and groups."""
    from ember_engine.cli import main as ember

    out = tmp_path / scheme
    assert ember(["quantize", str(wide_model), str(out), "--scheme", scheme]) in (0, None)
    prompts = PROMPTS[:6]
    expected, _ = generate(out, prompts, GREEDY, max_num_seqs=4)
    got, _ = generate(out, prompts, GREEDY, max_num_seqs=4, tensor_parallel_size=2)
    assert got == expected


@pytest.mark.parametrize("preset", ["W4A16_AWQ", "INT8_SQ", "W4A8_AWQ"])
def test_two_ranks_run_modelopts_smoothed_exports_as_one(
    wide_model: Path, tmp_path: Path, preset: str
) -> None:
    """ModelOpt's AWQ and SmoothQuant exports (`tests/modelopt_build.py`): their o and down projections
    keep the smoothing factors, one per input column, and a rank multiplies its own columns by theirs
    (SmoothQuant: with int8 inputs under the projection's static scale; W4A8_AWQ: FP8 weights and inputs).
    (Before, a rank was given the whole vector: "down_proj: pre_quant_scale must hold 256 finite factors,
    one per input column, found 512".)"""
    out = tmp_path / "smoothed"
    build = Path(__file__).with_name("modelopt_build.py")
    run_script(build, wide_model, out, preset)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.mlp.down_proj.pre_quant_scale").shape == (512,)
    prompts = PROMPTS[:6]
    expected, _ = generate(out, prompts, GREEDY, max_num_seqs=4)
    got, _ = generate(out, prompts, GREEDY, max_num_seqs=4, tensor_parallel_size=2)
    assert got == expected


def _w4a8_head(state: dict[str, torch.Tensor]) -> None:
    """The LM head quantized as W4A8_AWQ writes a projection: int4 values two a byte along the output
    (row 2r in the low nibble), a scale per row and group of 128, one weight_scale_2 and input_scale."""
    w = state["lm_head.weight"].float()
    out, k = w.shape
    groups = w.reshape(out, k // 128, 128).abs().amax(dim=-1) / 7
    values = torch.round(w / groups.repeat_interleave(128, dim=1)).clamp(-8, 7).to(torch.int8)
    nibbles = (values & 15).to(torch.uint8).reshape(out // 2, 2, k)
    state["lm_head.weight"] = nibbles[:, 0] | (nibbles[:, 1] << 4)
    state["lm_head.weight_scale"] = groups
    state["lm_head.weight_scale_2"] = groups.max() * 8 / 448  # a value of 8 group scales is E4M3's largest
    state["lm_head.input_scale"] = torch.tensor(0.05)


def test_a_w4a8_head_splits_with_its_outer_scale(wide_model: Path, tmp_path: Path) -> None:
    """A W4A8_AWQ head held quantized: each rank holds its vocabulary rows of the whole head dequantized,
    weight_scale_2 included. (Before, the split head left weight_scale_2 out, and every logit came out
    divided by it: log-probabilities of 0.0 where one rank gave -1.3 to -2.1.)"""
    import json

    from safetensors.torch import load_file, save_file

    out = tmp_path / "head"
    build = Path(__file__).with_name("modelopt_build.py")
    run_script(build, wide_model, out, "W4A8_AWQ")
    state = load_file(str(out / "model.safetensors"))
    _w4a8_head(state)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["ignore"].remove("lm_head")
    (out / "config.json").write_text(json.dumps(config))
    heads = []
    for size in (1, 2):
        with engine(out, max_num_seqs=4, tensor_parallel_size=size) as llm:
            model = llm.engine.runner.model
            head = model.lm_head.dequantized() if size == 1 else model.lm_head.weight.detach()
            heads.append((head.float(), model.shard.vocab_start if size > 1 else 0))
            tokens = llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)
    (whole, _), (part, start) = heads
    assert start == 0 and part.shape[0] == whole.shape[0] // 2
    # rank 0's rows: the whole head's, dequantized alike (weight_scale_2 included), bit for bit
    assert torch.equal(part, whole[: part.shape[0]])
    assert all(len(o.token_ids) == MAX_NEW for o in tokens)


def test_llm_compressor_fp8_checkpoint_splits(tiny_model: Path, quantized_model) -> None:  # type: ignore[no-untyped-def]
    """FP8_DYNAMIC: the stored FP8 weights and per-row scales cut exactly; each rank scales its own
    columns' activations where a projection is split by them, as with fp8 quantized at load."""
    path = quantized_model("tiny", "FP8_DYNAMIC")
    prompts = PROMPTS[:6]
    expected, _ = generate(path, prompts, GREEDY, max_num_seqs=4)
    got, _ = generate(path, prompts, GREEDY, max_num_seqs=4, tensor_parallel_size=2)
    plain, _ = generate(tiny_model, prompts, GREEDY, max_num_seqs=4)
    assert _agreement(got, plain) >= _agreement(expected, plain) - 0.1
    assert _agreement(got, expected) >= 0.5


def test_gptq_checkpoint_splits_and_activation_order_is_refused(quantized_model) -> None:  # type: ignore[no-untyped-def]
    """GPTQModel's 4-bit checkpoint in groups of 64 (a rank's 64 columns of o are one group) runs as on one
    rank; with desc_act its columns come in another order, which a rank's share cannot follow."""
    path = quantized_model("tiny", "INT4", "gptq_build.py")
    prompts = PROMPTS[:6]
    expected, _ = generate(path, prompts, GREEDY, max_num_seqs=4)
    got, _ = generate(path, prompts, GREEDY, max_num_seqs=4, tensor_parallel_size=2)
    assert got == expected
    with pytest.raises(
        UnsupportedQuantizationError, match=r"GPTQ's activation order reorders the input columns"
    ):
        LLM(str(quantized_model("tiny", "INT4_ACT", "gptq_build.py")), tensor_parallel_size=2)


@pytest.mark.parametrize(
    ("preset", "script"),
    [
        ("NVFP4", "quant_build.py"),
        ("NVFP4", "modelopt_build.py"),
        ("W4A8_NVFP4", "modelopt_build.py"),
        ("NF4", "bnb_build.py"),
    ],
)
def test_two_ranks_run_4_bit_codes_packed_along_the_input_as_one(
    quantized_model, preset: str, script: str
) -> None:  # type: ignore[no-untyped-def]
    """Two 4-bit codes a byte along the input (NVFP4's E2M1 values, llm-compressor's and ModelOpt's, FP4
    activations too; bitsandbytes' NF4 codes): a rank takes its columns' bytes and groups (16 and 64 columns
    a group), and NVFP4's activations, quantized per group of 16 under one global scale, are quantized alike
    on either side of the split, as are ModelOpt's W4A8_NVFP4_FP8's FP8 ones under one static scale.
    Refused before ("its weight is held packed")."""
    path = quantized_model("tiny", preset, script)
    prompts = PROMPTS[:6]
    expected, _ = generate(path, prompts, GREEDY, max_num_seqs=4)
    got, _ = generate(path, prompts, GREEDY, max_num_seqs=4, tensor_parallel_size=2)
    assert got == expected


def test_groups_a_rank_would_cut_are_refused(tiny_model: Path, quantized_model) -> None:  # type: ignore[no-untyped-def]
    # llm-compressor's W4A16: groups of 128 columns, where a rank holds 64 of o's 128
    with pytest.raises(
        UnsupportedQuantizationError,
        match=r"w4a16: groups of 128 input columns do not fall within a rank's 64 columns of o_proj with "
        r"tensor_parallel_size 2",
    ):
        LLM(str(quantized_model("tiny", "W4A16")), tensor_parallel_size=2)
    # tiny's o projection has 128 input columns: 64 a rank, half a group of 128
    with pytest.raises(
        UnsupportedQuantizationError,
        match=r"w4a16: groups of 128 input columns do not fall within a rank's 64 columns of o_proj with "
        r"tensor_parallel_size 2",
    ):
        LLM(str(tiny_model), quantization="w4a16", tensor_parallel_size=2)


def test_four_ranks_replicate_the_kv_heads_and_match_one(tiny_model: Path) -> None:
    # The tiny model has 2 KV heads: with 4 ranks each KV head lives on two ranks.
    assert ModelConfig.from_dir(tiny_model).num_kv_heads == 2
    prompts = PROMPTS[::2] + PROMPTS[-2:]
    options = dict(max_num_batched_tokens=128)
    expected, _ = generate(tiny_model, prompts, GREEDY, **options)
    out, _ = generate(tiny_model, prompts, GREEDY, tensor_parallel_size=4, **options)
    assert out == expected


def test_speculation_with_the_draft_on_rank_0(tmp_path: Path) -> None:
    target, draft = packaged_pair()
    prompts = [
        "def fibonacci(n):",
        "import os\nimport sys\nimport os\n",
        "class Queue:\n    def push(self, x):",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected, _ = generate(target, prompts, params)
    out, stats = generate(
        target, prompts, params, tensor_parallel_size=2, draft_model=str(draft), speculative_adaptive=False
    )
    assert out == expected
    assert stats.spec is not None and stats.spec.num_accepted_tokens > 0


# -- the split -----------------------------------------------------------------------------------------


def test_head_counts_that_do_not_split_are_refused_naming_the_numbers(tiny_model: Path) -> None:
    config = ModelConfig.from_dir(tiny_model)  # 4 heads, 2 KV heads, intermediate 256
    with pytest.raises(TensorParallelError, match="tensor_parallel_size 3 does not divide the model's 4"):
        check_tensor_parallel(config, 3)
    with pytest.raises(TensorParallelError, match="tensor_parallel_size 3 does not divide the model's 4"):
        LLM(str(tiny_model), tensor_parallel_size=3)  # refused before any worker starts
    check_tensor_parallel(config, 4)


def test_shards_cover_every_head_and_vocabulary_row_once(tiny_model: Path) -> None:
    config = ModelConfig.from_dir(tiny_model)
    for size in (1, 2, 4):
        shards = [Shard.of(config, r, size) for r in range(size)]
        assert sum(s.num_heads for s in shards) == config.num_heads
        assert sum(s.vocab_rows for s in shards) == config.vocab_size
        assert sum(s.intermediate_size for s in shards) == config.intermediate_size
        for s in shards:
            # The query heads of a rank attend exactly to its KV heads.
            group = config.num_heads // config.num_kv_heads
            first_q = s.rank * s.num_heads
            assert {h // group for h in range(first_q, first_q + s.num_heads)} == set(
                range(s.first_kv_head, s.first_kv_head + s.num_kv_heads)
            )
    assert [Shard.of(config, r, 4).first_kv_head for r in range(4)] == [0, 0, 1, 1]


def test_an_uneven_vocabulary_is_padded_on_the_last_rank(tiny_model: Path) -> None:
    config = ModelConfig.from_dir(tiny_model)
    odd = type(config)(**{**{f: getattr(config, f) for f in config.__slots__}, "vocab_size": 4093})
    shards = [Shard.of(odd, r, 4) for r in range(4)]
    assert [s.vocab_per_rank for s in shards] == [1024] * 4
    assert [s.vocab_rows for s in shards] == [1024, 1024, 1024, 1021]


class _RecordingSlice:
    """A real safetensors slice that records how it was indexed."""

    def __init__(self, inner: Any, log: list[tuple[str, Any]], name: str) -> None:
        self.inner, self.log, self.name = inner, log, name

    def __getitem__(self, index: Any) -> torch.Tensor:
        self.log.append((self.name, index))
        return self.inner[index]


def test_each_rank_reads_only_its_shard_and_gets_the_right_rows(tiny_model: Path, monkeypatch) -> None:
    from ember_engine.model import loader
    from ember_engine.model.llama import LlamaForCausalLM

    config = ModelConfig.from_dir(tiny_model)
    reads: list[tuple[str, Any]] = []
    real = loader.iter_slices

    def recording(model_dir: Path) -> Iterator[tuple[str, Any]]:
        for name, sl in real(model_dir):
            yield name, _RecordingSlice(sl, reads, name)

    monkeypatch.setattr(loader, "iter_slices", recording)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config, TPGroup(rank=1, size=2))
    load_weights(model, tiny_model)
    whole = [name for name, index in reads if index == slice(None)]
    # Only tensors every rank holds whole are read whole.
    assert all(name.endswith("norm.weight") for name in whole), whole
    with safe_open(str(tiny_model / "model.safetensors"), framework="pt") as f:
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        o = f.get_tensor("model.layers.0.self_attn.o_proj.weight")
        embed = f.get_tensor("model.embed_tokens.weight")
    d = config.head_dim
    attn = model.model.layers[0].self_attn
    assert torch.equal(attn.qkv_proj.weight[: 2 * d], q[2 * d : 4 * d])  # rank 1's two query heads
    assert torch.equal(attn.o_proj.weight, o[:, 2 * d : 4 * d])
    assert torch.equal(model.model.embed_tokens.weight, embed[2048:])


def test_a_step_message_round_trips_whatever_its_size() -> None:
    small = [Chunk([3, 4], 17, [5], 1), Chunk([0], 0, list(range(10)), 0)]
    big = [Chunk(list(range(64)), 1000, list(range(100)), 1) for _ in range(40)]
    for chunks in (small, big):
        message = encode(chunks)
        back = decode(message)
        assert back is not None
        assert [(c.block_ids, c.start, list(c.token_ids), c.num_logits) for c in back] == [
            (c.block_ids, c.start, list(c.token_ids), c.num_logits) for c in chunks
        ]
    assert len(encode(small)) < HEADER < len(encode(big))  # one broadcast for the first, two for the second
    assert decode(np.asarray([2, 0], dtype=np.int32)) is None


def test_bench_throughput_reports_communication_per_step(tiny_model: Path, tmp_path: Path) -> None:
    import argparse
    import json

    from ember_engine.bench import throughput

    parser = argparse.ArgumentParser()
    throughput.add_arguments(parser)
    out = tmp_path / "tp.json"
    args = parser.parse_args(
        [
            *("--model", str(tiny_model), "--num-requests", "4", "--input-len", "16:64"),
            *("--output-len", "4:8", "--tensor-parallel-size", "2", "--baselines", ""),
            *("--quiet", "--json", str(out)),
        ]
    )
    assert throughput.main(args) == 0
    result = json.loads(out.read_text())
    engine, unsplit = result["engine"], result["baselines"]["ember-tp1"]
    assert engine["tensor_parallel_size"] == 2 and unsplit["tensor_parallel_size"] == 1
    assert engine["output_tokens"] == unsplit["output_tokens"] == result["workload"]["output_tokens"]
    c = engine["communication"]
    assert c["collective_seconds"] > 0 and c["broadcast_seconds"] > 0
    assert 0 < c["per_step_ms"] < c["step_ms"]
    assert 0 < c["fraction_of_step_time"] < 1
    assert "communication" not in unsplit
