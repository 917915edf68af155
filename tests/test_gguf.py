"""GGUF files (`model/gguf/`): ember computes what transformers computes from the same file
(`gguf_build.py` writes it as llama.cpp lays a llama model out, and transformers' own GGUF loading is the
oracle); Q8_0 and Q4_0 projections run as the file stores them; what ember cannot read is refused by
name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from gguf_build import IQ_TYPES
from script_runs import run_script
from server_util import running_server
from test_quant_modelopt import _forward

from ember_engine import LLM, SamplingParams
from ember_engine.model import gguf
from ember_engine.model.gguf import blocks as gguf_blocks
from ember_engine.model.gguf import directory as gguf_dir
from ember_engine.model.gguf import iq_blocks
from ember_engine.model.quant import schemes
from ember_engine.model.quant.codebook_linear import CodebookLinear
from ember_engine.model.quant.int_linear import Int4Linear, Int8Linear
from ember_engine.model.quant.schemes import UnsupportedQuantizationError
from ember_engine.sample.grammar import Constraint

BUILD = "gguf_build.py"


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))


def _file(quantized_model, preset: str) -> Path:  # type: ignore[no-untyped-def]
    return quantized_model("tiny", preset, BUILD) / "model.gguf"


# preset -> the scheme ember runs (None: every projection dequantized). Measured, the largest logit
# difference from transformers' as a fraction of the logits' range: F32 3.7e-7, F16 3.7e-7, Q8_0 3.5e-7,
# Q4_0 3.2e-7, Q4_K 4.0e-7, Q6_K 3.3e-7, Q4_K_M 4.1e-7, Q5_K_M 5.1e-7, MIXED 4.2e-7, Q3_K 3.1e-7, Q2_K
# 1.2e-6, IQ4_NL 3.8e-7, IQ4_XS 3.5e-7; the 8-layer files of test_k_and_q6_k_parts_of_one_layer_run_alike
# 5.3e-7 (Q4_K_M), 5.9e-7 (Q5_K_M) and 6.0e-7 (Q3_K_M). The bound: 1e-5.
PRESETS = {
    "F32": None,
    "F16": None,
    "Q8_0": "w8a16",
    "Q4_0": "w4a16",
    "Q4_K": "mixed",  # Q4_K for down; Q5_0 where rows are no whole K block
    "Q6_K": "mixed",
    "Q4_K_M": "mixed",
    "Q5_K_M": "mixed",
    "MIXED": "mixed",
    "Q3_K": "mixed",  # Q3_K for down; IQ4_NL where rows are no whole K block
    "Q2_K": "mixed",
    "IQ4_NL": "w8a16",
    "IQ4_XS": "mixed",
}


@pytest.mark.parametrize("preset", list(PRESETS))
def test_gguf_computes_what_transformers_computes(preset: str, quantized_model) -> None:  # type: ignore[no-untyped-def]
    path = _file(quantized_model, preset)
    oracle = torch.load(path.with_name("oracle.pt"))
    if preset == "F32":  # the file is the source model, in llama.cpp's layout: transformers reads it back
        for theirs, source in zip(oracle["logits"], oracle["source_logits"], strict=True):
            assert torch.equal(theirs, source)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    runner = llm.engine.runner
    scheme = PRESETS[preset]
    assert (runner.quant and runner.quant.scheme, runner.quant and runner.quant.format) == (
        scheme,
        scheme and "gguf",
    )
    for prompt, theirs in zip(oracle["prompts"], oracle["logits"], strict=True):
        worst = (_forward(runner, prompt) - theirs).abs().max().item() / (theirs.max() - theirs.min()).item()
        assert worst <= 1e-5, (preset, worst)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = [g.token_ids for g in llm.generate(oracle["prompts"][:6], params, use_tqdm=False)]
    assert got == oracle["greedy"]


def test_q8_0_and_q4_0_run_as_stored(quantized_model) -> None:  # type: ignore[no-untyped-def]
    import gguf as gguf_package

    for preset, layer_type in (("Q8_0", Int8Linear), ("Q4_0", Int4Linear)):
        path = _file(quantized_model, preset)
        reader = gguf_package.GGUFReader(str(path))
        stored = {t.name: t for t in reader.tensors}
        model = LLM(str(path), dtype="float32", num_kv_blocks=16, max_num_seqs=2).engine.runner.model
        layer = model.model.layers[1]
        down, qkv = layer.mlp.down_proj, layer.self_attn.qkv_proj
        assert isinstance(down, layer_type) and isinstance(qkv, layer_type)
        assert isinstance(model.lm_head, layer_type)  # the file's output.weight, stored apart
        # The file's values and float16 scales, block by block.
        values, scale, _ = gguf_blocks.decode(np.asarray(stored["blk.1.ffn_down.weight"].data), preset)
        held = down.weight if preset == "Q8_0" else schemes.unpack_int4(down.weight_packed)
        assert torch.equal(held, values)
        assert torch.equal(down.weight_scale, scale)
        dequantized = gguf_package.quants.dequantize(
            np.asarray(stored["blk.1.ffn_down.weight"].data), stored["blk.1.ffn_down.weight"].tensor_type
        )
        assert torch.equal(down.dequantized(torch.float32), torch.from_numpy(dequantized))
        # q's rows back in Hugging Face's order (the file interleaves each head's halves)
        q_file = torch.from_numpy(
            gguf_package.quants.dequantize(
                np.asarray(stored["blk.1.attn_q.weight"].data), stored["blk.1.attn_q.weight"].tensor_type
            )
        )
        q_ours = qkv.dequantized(torch.float32)[:128]
        assert torch.equal(q_ours, q_file.reshape(4, 16, 2, 128).transpose(1, 2).reshape(128, 128))
        assert not torch.equal(q_ours, q_file)


def test_mixed_types_dequantize_what_does_not_run_as_stored(quantized_model) -> None:  # type: ignore[no-untyped-def]
    import gguf as gguf_package

    path = _file(quantized_model, "MIXED")
    stored = {t.name: t for t in gguf_package.GGUFReader(str(path)).tensors}
    runner = LLM(str(path), dtype="float32", num_kv_blocks=16, max_num_seqs=2).engine.runner
    layers = runner.model.model.layers
    # q and k are Q4_0 but v Q8_0: ember runs them as one layer, so alike (int8 in groups of 16 with zero
    # points); o is Q5_1; gate Q4_1 but up BF16, dequantized; down Q6_K (layer 0) or Q5_0.
    qkv = layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Int8Linear) and qkv.group_size == 16 and qkv.weight_zero is not None
    v = stored["blk.0.attn_v.weight"]
    v_file = torch.from_numpy(gguf_package.quants.dequantize(np.asarray(v.data), v.tensor_type))
    assert torch.equal(qkv.dequantized(torch.float32)[128 + 64 :], v_file)
    o = layers[0].self_attn.o_proj
    assert isinstance(o, Int8Linear) and o.group_size == 32 and o.weight_zero is not None
    assert type(layers[0].mlp.gate_up_proj) is torch.nn.Linear
    assert isinstance(layers[0].mlp.down_proj, Int8Linear) and layers[0].mlp.down_proj.group_size == 16
    assert isinstance(layers[1].mlp.down_proj, Int8Linear) and layers[1].mlp.down_proj.group_size == 32
    assert type(runner.model.lm_head).__name__ == "ParallelLMHead"  # F16: in full precision
    groups = {(g.scheme, g.group_size, g.zero_points, g.targets) for g in runner.quant.groups}
    qkv_parts = tuple(f"model.layers.{i}.self_attn.{p}_proj" for i in range(4) for p in "kqv")
    assert groups == {
        ("w8a16", 16, True, qkv_parts),
        ("w8a16", 32, True, tuple(f"model.layers.{i}.self_attn.o_proj" for i in range(4))),
        ("w8a16", 32, False, tuple(f"model.layers.{i}.mlp.down_proj" for i in range(1, 4))),
        ("w8a16", 16, False, ("model.layers.0.mlp.down_proj",)),
    }


def test_k_quants_run_as_stored(quantized_model) -> None:  # type: ignore[no-untyped-def]
    import gguf as gguf_package

    path = _file(quantized_model, "Q4_K_M")
    stored = {t.name: t for t in gguf_package.GGUFReader(str(path)).tensors}

    def file_weight(name: str) -> torch.Tensor:
        t = stored[name]
        return torch.from_numpy(gguf_package.quants.dequantize(np.asarray(t.data), t.tensor_type))

    model = LLM(str(path), dtype="float32", num_kv_blocks=16, max_num_seqs=2).engine.runner.model
    layers = model.model.layers
    # llama.cpp's Q4_K_M on 4 layers gives layers 2 and 3 more bits
    kinds = [stored[f"blk.{i}.ffn_down.weight"].tensor_type.name for i in range(4)]
    assert kinds == ["Q4_K", "Q4_K", "Q6_K", "Q6_K"]
    q4k, q6k = layers[1].mlp.down_proj, layers[2].mlp.down_proj
    # Q4_K: 4-bit values with a scale and a real zero point per group of 32
    assert isinstance(q4k, Int4Linear) and q4k.group_size == 32
    assert q4k.weight_zero is not None and q4k.weight_zero.dtype == torch.float32
    assert not torch.equal(q4k.weight_zero, q4k.weight_zero.round())
    theirs = file_weight("blk.1.ffn_down.weight")
    assert (q4k.dequantized(torch.float32) - theirs).abs().max().item() <= 1e-6 * theirs.abs().max().item()
    # Q6_K: 6-bit values (int8) with a scale per group of 16
    assert isinstance(q6k, Int8Linear) and q6k.group_size == 16
    assert int(q6k.weight.min()) >= -32 and int(q6k.weight.max()) <= 31
    assert torch.equal(q6k.dequantized(torch.float32), file_weight("blk.2.ffn_down.weight"))
    # rows of no whole 256-value block took llama.cpp's fallback types: Q5_0, run as w8a16
    assert stored["blk.1.attn_q.weight"].tensor_type.name == "Q5_0"
    qkv = layers[1].self_attn.qkv_proj
    assert isinstance(qkv, Int8Linear) and qkv.group_size == 32 and qkv.weight_zero is None
    # Q5_K: 5-bit values (int8) with a scale and a real zero point per group of 32
    path = _file(quantized_model, "Q5_K_M")
    stored = {t.name: t for t in gguf_package.GGUFReader(str(path)).tensors}
    assert stored["blk.1.ffn_down.weight"].tensor_type.name == "Q5_K"
    q5k = LLM(str(path), dtype="float32", num_kv_blocks=16).engine.runner.model.model.layers[1].mlp.down_proj
    assert isinstance(q5k, Int8Linear) and q5k.group_size == 32 and q5k.weight_zero is not None
    assert int(q5k.weight.min()) >= -16 and int(q5k.weight.max()) <= 15
    theirs = file_weight("blk.1.ffn_down.weight")
    assert (q5k.dequantized(torch.float32) - theirs).abs().max().item() <= 1e-6 * theirs.abs().max().item()


@pytest.mark.parametrize(
    "preset,layer,group,zeros",
    [("Q3_K", Int4Linear, 16, False), ("Q2_K", Int4Linear, 16, True), ("IQ4_XS", Int8Linear, 32, False)],
)
def test_low_bit_k_quants_and_iq4_run_as_stored(
    preset: str, layer: type, group: int, zeros: bool, quantized_model
) -> None:  # type: ignore[no-untyped-def]
    """Q3_K (values -4..3 under a scale per 16) and Q2_K (0..3, a scale and minimum per 16) as w4a16 in
    groups of 16; IQ4_XS and IQ4_NL (indices into 16 values, -127..113) as w8a16 in groups of 32, the
    values the table's: each held weight is what the `gguf` package dequantizes from the file."""
    import gguf as gguf_package

    path = _file(quantized_model, preset)
    stored = {t.name: t for t in gguf_package.GGUFReader(str(path)).tensors}
    # the down projection's rows are whole K blocks; 128-column rows took llama.cpp's fallback, IQ4_NL
    assert stored["blk.1.ffn_down.weight"].tensor_type.name == preset
    assert stored["blk.1.attn_q.weight"].tensor_type.name == "IQ4_NL"
    layers = LLM(
        str(path), dtype="float32", num_kv_blocks=16, max_num_seqs=2
    ).engine.runner.model.model.layers
    down = layers[1].mlp.down_proj
    assert isinstance(down, layer) and down.group_size == group and (down.weight_zero is not None) == zeros
    t = stored["blk.1.ffn_down.weight"]
    theirs = torch.from_numpy(gguf_package.quants.dequantize(np.asarray(t.data), t.tensor_type))
    assert (down.dequantized(torch.float32) - theirs).abs().max().item() <= 1e-6 * theirs.abs().max().item()
    qkv = layers[1].self_attn.qkv_proj
    assert isinstance(qkv, Int8Linear) and qkv.group_size == 32 and qkv.weight_zero is None
    assert set(qkv.weight.unique().tolist()) <= set(gguf_blocks.IQ4_VALUES.tolist())


@pytest.mark.parametrize("rows", [1, 3, 9])
def test_int4_layer_with_real_zero_points(rows: int) -> None:
    """Q4_K's form: (value - zero) * scale with float zero points, through the fused loops (up to 8 rows)
    and the unpacked int8 matmul above them, against the float64 product."""
    gen = torch.Generator().manual_seed(rows)
    layer = Int4Linear(256, 48, False, torch.float32, 32, zero_points=True, float_zeros=True)
    values = torch.randint(-8, 8, (48, 256), generator=gen, dtype=torch.int8)
    layer.set_rows(0, values, torch.rand(48, 8, generator=gen) * 0.01)
    layer.set_zero_rows(0, torch.randn(48, 8, generator=gen) * 5)
    x = torch.randn(rows, 256, generator=gen)
    weight = layer.dequantized(torch.float64)
    expected = x.double() @ weight.t()
    got = layer(x)
    assert (got.double() - expected).abs().max().item() <= 1e-6 * expected.abs().max().item()


def test_the_model_dtype_is_the_files(quantized_model) -> None:  # type: ignore[no-untyped-def]
    for preset, dtype in (("F16", torch.float16), ("F32", torch.float32), ("Q8_0", torch.float32)):
        llm = LLM(str(_file(quantized_model, preset)), num_kv_blocks=16, max_num_seqs=2)
        assert llm.engine.runner.dtype == dtype, preset


def test_quantization_options(quantized_model) -> None:  # type: ignore[no-untyped-def]
    q8 = str(_file(quantized_model, "Q8_0"))
    assert LLM(q8, quantization="gguf", num_kv_blocks=16).engine.runner.quant.scheme == "w8a16"
    with pytest.raises(UnsupportedQuantizationError, match="already quantized as 'w8a16'") as refused:
        LLM(q8, quantization="fp8", num_kv_blocks=16)
    assert f"but {q8} is already" in str(refused.value)  # the file given, not the directory made of it
    f16 = str(_file(quantized_model, "F16"))  # no projection stored quantized: quantized at load
    assert LLM(f16, quantization="fp8", dtype="float32", num_kv_blocks=16).engine.runner.quant.scheme == "fp8"
    assert LLM(f16, quantization="gguf", num_kv_blocks=16).engine.runner.quant is None


def test_tokenizer_from_option_or_beside_the_file(quantized_model, tmp_path: Path, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    alone = tmp_path / "alone" / "model.gguf"
    alone.parent.mkdir()
    shutil.copy(_file(quantized_model, "Q4_0"), alone)
    bare = _write(tmp_path / "alone" / "bare.gguf", **LLAMA)  # no tokenizer.ggml.* metadata
    with pytest.raises(
        gguf.GGUFError,
        match=r"alone has no tokenizer.json and the file carries none \(tokenizer.ggml.model\); give tokenizer "
        r"\(--tokenizer\) the base model's directory",
    ):
        LLM(str(bare), num_kv_blocks=16)
    with pytest.raises(
        gguf.GGUFError, match=rf"{tmp_path} has no tokenizer.json; give tokenizer \(--tokenizer\)"
    ):
        LLM(str(alone), tokenizer=str(tmp_path), num_kv_blocks=16)  # a directory named: no fallback
    llm = LLM(str(alone), tokenizer=str(tiny_model), num_kv_blocks=16, max_num_seqs=2)
    assert llm.generate("Hello", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0].text
    other = tmp_path / "other"
    other.mkdir()
    _relabelled_tokenizer(tiny_model / "tokenizer.json", other / "tokenizer.json")
    with pytest.raises(gguf.GGUFError, match="is not the file's: token 5 is"):
        LLM(str(alone), tokenizer=str(other), num_kv_blocks=16)


def test_tokenizer_option_for_a_checkpoint_directory(tmp_path: Path, tiny_model: Path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(tiny_model / name, bare / name)
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json not found"):
        LLM(str(bare), num_kv_blocks=16)
    llm = LLM(str(bare), tokenizer=str(tiny_model), num_kv_blocks=16, max_num_seqs=2)
    assert llm.tokenizer.encode("Hello world") == LLM(str(tiny_model), num_kv_blocks=16).tokenizer.encode(
        "Hello world"
    )


def _relabelled_tokenizer(src: Path, dst: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(src))
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    first = next(t for t, i in vocab.items() if i == 5)
    vocab[first + "x"] = vocab.pop(first)
    dst.write_text(json.dumps(data))


def _write(
    path: Path, arch: str = "llama", tensors: dict[str, np.ndarray] | None = None, **fields: float
) -> Path:
    import gguf as gguf_package

    w = gguf_package.GGUFWriter(str(path), arch)
    for key, value in fields.items():
        name = f"{arch}.{key.replace('__', '.')}"
        w.add_float32(name, value) if isinstance(value, float) else w.add_uint32(name, value)
    for name, array in (tensors or {"token_embd.weight": np.zeros((8, 4), np.float32)}).items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


LLAMA = {"attention__head_count": 2, "embedding_length": 4, "feed_forward_length": 8, "block_count": 1}


@pytest.mark.parametrize(
    "case,error",
    [
        ("gemma2", r"GGUF architecture 'gemma2' is not supported; supported: llama, qwen2, qwen3"),
        ("missing", r"metadata llama.feed_forward_length is missing"),
        (
            "rope_freqs",
            r"rope_freqs.weight must hold one positive number per rotary frequency \(1\); it has 3",
        ),
        (
            "qwen2_bias",
            r"bias tensors \(blk.0.attn_output.bias, ...\) are not supported in a qwen2 GGUF file",
        ),
        ("unknown_tensor", r"unexpected tensor 'blk.0.attn_qkv.weight' in the GGUF file"),
        ("not_gguf", r"not a readable GGUF file"),
        ("scale_linear", r"llama.rope.scale_linear 4.0 \(scaled rotary positions\) is not supported"),
        ("scaling_factor", r"llama.rope.scaling.factor 2.0 \(scaled rotary positions\) is not supported"),
        ("bias", r"bias tensors \(blk.0.attn_q.bias, ...\) are not supported"),
    ],
)
def test_what_cannot_be_read_is_refused_by_name(
    case: str, error: str, tmp_path: Path, tiny_model: Path
) -> None:
    path = tmp_path / "m.gguf"
    embed = {"token_embd.weight": np.zeros((8, 4), np.float32)}
    if case == "gemma2":
        _write(path, "gemma2", **LLAMA)
    elif case == "qwen2_bias":
        biases = {f"blk.0.attn_{p}.bias": np.zeros(4, np.float32) for p in ("q", "k", "v", "output")}
        _write(path, "qwen2", tensors=embed | biases, **LLAMA)
    elif case == "missing":
        _write(path, **{k: v for k, v in LLAMA.items() if k != "feed_forward_length"})
    elif case == "rope_freqs":
        _write(path, tensors=embed | {"rope_freqs.weight": np.ones(3, np.float32)}, **LLAMA)
    elif case == "unknown_tensor":
        _write(path, tensors=embed | {"blk.0.attn_qkv.weight": np.zeros((12, 4), np.float32)}, **LLAMA)
    elif case == "scale_linear":
        _write(path, rope__scale_linear=4.0, **LLAMA)
    elif case == "scaling_factor":
        _write(path, rope__scaling__factor=2.0, **LLAMA)
    elif case == "bias":
        _write(path, tensors=embed | {"blk.0.attn_q.bias": np.zeros(4, np.float32)}, **LLAMA)
    else:
        path.write_bytes(b"GGUF" + b"\0" * 12)
    with pytest.raises(gguf.GGUFError, match=error):
        LLM(str(path), tokenizer=str(tiny_model), num_kv_blocks=16)


def test_ember_serve_answers_from_a_gguf_file(quantized_model, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    path = _file(quantized_model, "Q4_0")
    with running_server(path, "--served-model-name", "tiny-q4", "--tokenizer", str(tiny_model)) as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none")
        out = client.completions.create(model="tiny-q4", prompt="Hello", max_tokens=5, temperature=0)
        assert out.usage.completion_tokens == 5
        assert s.state.engine.engine.runner.quant.scheme == "w4a16"


def test_padding_entries_of_the_files_vocabulary_need_no_token(tmp_path: Path, tiny_model: Path) -> None:
    """llama.cpp's converter pads the vocabulary to the embedding's rows with "[PAD<id>]" entries of type
    UNUSED, which the base model's tokenizer does not have."""
    import gguf as gguf_package
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    n = tok.get_vocab_size()
    path = tmp_path / "padded.gguf"
    w = gguf_package.GGUFWriter(str(path), "llama")
    w.add_token_list([tok.id_to_token(i) for i in range(n)] + [f"[PAD{i}]" for i in range(n, n + 4)])
    w.add_token_types([1] * n + [5] * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf.reader_of(path)
    gguf_dir.check_vocabulary(reader, tiny_model / "tokenizer.json", path)  # no error
    w = gguf_package.GGUFWriter(str(path), "llama")  # the same entries, not marked as padding
    w.add_token_list([tok.id_to_token(i) for i in range(n)] + [f"[PAD{i}]" for i in range(n, n + 4)])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(gguf.GGUFError, match=f"token {n} is None there and '\\[PAD{n}\\]' in the file"):
        gguf_dir.check_vocabulary(gguf.reader_of(path), tiny_model / "tokenizer.json", path)


def test_stop_tokens_are_the_files_and_the_base_models(quantized_model, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    # the file's EOS (1) and the base model's generation_config.json's ([1, 6])
    llm = LLM(str(_file(quantized_model, "Q8_0")), tokenizer=str(tiny_model), num_kv_blocks=16)
    assert llm.engine.model_config.eos_token_ids == (1, 6)
    assert (
        llm.engine.model_config.eos_token_ids
        == LLM(str(tiny_model), num_kv_blocks=16).engine.model_config.eos_token_ids
    )


def test_the_tokenizer_option_reaches_structured_outputs(tmp_path: Path, tiny_model: Path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(tiny_model / name, bare / name)
    llm = LLM(str(bare), tokenizer=str(tiny_model), num_kv_blocks=16, max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=6, constraint=Constraint("choice", ["red", "green"]))
    out = llm.generate("Hello", params, use_tqdm=False)[0]
    assert out.text in ("red", "green")


def test_a_gguf_draft_model(quantized_model, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    """A .gguf draft is described like the target; speculation changes no greedy token."""
    draft = _file(quantized_model, "F32")
    prompts = [list(range(10, 10 + n)) for n in (5, 9)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = LLM(str(tiny_model), num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tiny_model), draft_model=str(draft), num_speculative_tokens=2, num_kv_blocks=64)
    assert Path(llm.engine.config.draft_model).name.startswith("model-")
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_tensor_parallelism_splits_a_file_of_full_precision(quantized_model, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    path = str(_file(quantized_model, "F16"))
    prompts = [list(range(10, 10 + n)) for n in (5, 30)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    one = LLM(path, dtype="float32", num_kv_blocks=64)
    expected = [o.token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    split = LLM(path, dtype="float32", num_kv_blocks=64, tensor_parallel_size=2, quantization="gguf")
    try:
        assert [o.token_ids for o in split.generate(prompts, params, use_tqdm=False)] == expected
    finally:
        split.engine.shutdown()


@pytest.mark.parametrize("preset", ["Q8_0", "Q4_K_M", "IQ"])
def test_two_ranks_run_a_quantized_file_as_one(preset: str, quantized_model) -> None:  # type: ignore[no-untyped-def]
    """Each rank holds its rows (q/k/v, gate/up) or its columns (o, down: whole groups of 32 and 16) of the
    file's values and scales (IQ: down's 4-bit codes of IQ2_XXS, IQ2_XS, IQ2_S and IQ3_XXS, two a byte),
    and the LM head (Q4_K_M's Q6_K) dequantized, split by vocabulary rows."""
    path = str(_file(quantized_model, preset))
    prompts = torch.load(_file(quantized_model, preset).with_name("oracle.pt"))["prompts"][:4]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    one = LLM(path, dtype="float32", num_kv_blocks=64)
    expected = [o.token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    split = LLM(path, dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)
    try:
        quant = split.engine.runner.quant
        assert quant is not None and quant.format == "gguf"
        assert ("codebook" in {m.scheme for m in quant.members()}) == (preset == "IQ")
        assert [o.token_ids for o in split.generate(prompts, params, use_tqdm=False)] == expected
    finally:
        split.engine.shutdown()


def test_concurrent_writes_of_the_description(tmp_path: Path) -> None:
    import threading

    dst = tmp_path / "config.json"
    errors: list[BaseException] = []

    def write(tag: bytes) -> None:
        try:
            for _ in range(200):
                gguf_dir._write(dst, tag * 1000)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(t,)) for t in (b"a", b"b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert dst.read_bytes() in (b"a" * 1000, b"b" * 1000)
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


def _wide_file(tmp_path_factory: pytest.TempPathFactory, preset: str) -> Path:
    """A random llama of 8 layers whose matrices are whole K blocks (hidden size 256), written as `preset`."""
    from safetensors.torch import save_file

    from ember_engine.tools import testmodel

    src = tmp_path_factory.mktemp(f"wide-{preset}") / "model"
    src.mkdir()
    ids = testmodel.write_tokenizer(src)
    config = testmodel.llama_config(testmodel.ModelSize(256, 512, 8, 4, 2, 2048), ids)
    (src / "config.json").write_text(json.dumps(config))
    save_file(
        testmodel.random_llama_weights(config, 5), str(src / "model.safetensors"), metadata={"format": "pt"}
    )
    dst = src.parent / "gguf"
    build = Path(__file__).with_name(BUILD)
    run_script(build, src, dst, preset)
    return dst / "model.gguf"


@pytest.fixture(scope="module", params=["Q4_K_M", "Q5_K_M", "Q3_K_M"])
def wide_k_m(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """The wide llama written as llama.cpp's Q4_K_M or Q5_K_M lays it out (layers 0, 3, 6 and 7 hold v and
    down in Q6_K beside q and k in Q4_K or Q5_K), or after its Q3_K_M (q and k Q3_K beside v in Q5_K or Q4_K
    in every layer)."""
    return _wide_file(tmp_path_factory, request.param)


def _matches_oracle(llm: LLM, oracle: dict) -> None:  # type: ignore[type-arg]
    """The logits within 1e-5 of the range of transformers' on every prompt, and its greedy tokens."""
    worst = 0.0
    for prompt, theirs in zip(oracle["prompts"], oracle["logits"], strict=True):
        ours = _forward(llm.engine.runner, prompt)
        worst = max(worst, (ours - theirs).abs().max().item() / (theirs.max() - theirs.min()).item())
    assert worst <= 1e-5, worst
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = [g.token_ids for g in llm.generate(oracle["prompts"][:6], params, use_tqdm=False)]
    assert got == oracle["greedy"]


def test_k_and_q6_k_parts_of_one_layer_run_alike(wide_k_m: Path) -> None:
    oracle = torch.load(wide_k_m.with_name("oracle.pt"))
    llm = LLM(str(wide_k_m), dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    four = "Q4_K_M" in str(wide_k_m)
    runner = llm.engine.runner
    layers = runner.model.model.layers
    for i, layer in enumerate(layers):
        qkv = layer.self_attn.qkv_proj
        if "Q3_K_M" in str(wide_k_m):  # q, k Q3_K beside v Q5_K or Q4_K; gate and up Q3_K (w4a16 by 16)
            assert isinstance(qkv, Int8Linear) and qkv.group_size == 16 and qkv.weight_zero is not None
            assert isinstance(layer.mlp.gate_up_proj, Int4Linear) and layer.mlp.gate_up_proj.group_size == 16
            continue
        if i in (0, 3, 6, 7):  # q, k Q4_K or Q5_K and v Q6_K: int8 in groups of 16, with zero points
            assert isinstance(qkv, Int8Linear) and qkv.group_size == 16 and qkv.weight_zero is not None
        else:  # all Q4_K (w4a16) or all Q5_K (w8a16), in groups of 32 with zero points
            assert isinstance(qkv, Int4Linear if four else Int8Linear) and qkv.group_size == 32
            assert qkv.weight_zero is not None
        assert isinstance(layer.mlp.gate_up_proj, Int4Linear if four else Int8Linear)
    _matches_oracle(llm, oracle)


@pytest.mark.parametrize("kind", list(iq_blocks.GROUP))
def test_i_quant_blocks_decode_to_what_the_gguf_package_dequantizes(kind: str) -> None:
    """Random blocks of each lattice i-quant (every field random but d): ember's int8 values times their
    group's scale are, bit for bit, the weights the `gguf` package dequantizes."""
    from gguf import GGMLQuantizationType
    from gguf import quants as gguf_quants

    rng = np.random.default_rng(4)
    rows, blocks = 6, 3
    b = rng.integers(0, 256, (rows, blocks, iq_blocks.BYTES[kind]), dtype=np.uint8)
    d = rng.uniform(1e-4, 1e-2, (rows, blocks)).astype(np.float16)
    if kind == "IQ1_M":  # d's nibbles top the four 16-bit scale words
        words = np.ascontiguousarray(b[:, :, 48:56]).view("<u2").copy()
        words = (words & 0x0FFF) | (
            ((d.view(np.uint16)[..., None] >> np.array([0, 4, 8, 12], np.uint16)) & 15) << 12
        )
        b[:, :, 48:56] = words.view(np.uint8)
    else:
        b[:, :, :2] = d.view(np.uint8).reshape(rows, blocks, 2)
    values, scale, zero = gguf_blocks.decode(b.reshape(rows, -1), kind)
    group = iq_blocks.GROUP[kind]
    assert zero is None and values.dtype == torch.int8 and scale.shape == (rows, blocks * 256 // group)
    ours = (values.float().reshape(rows, -1, group) * scale[:, :, None]).reshape(rows, -1)
    theirs = torch.from_numpy(gguf_quants.dequantize(b.reshape(rows, -1), GGMLQuantizationType[kind]))
    assert torch.equal(ours, theirs.reshape(rows, -1))


@pytest.fixture(scope="module")
def wide_iq(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wide llama with each layer's matrices in one lattice i-quant (`gguf_build.IQ_TYPES`)."""
    return _wide_file(tmp_path_factory, "IQ")


def test_lattice_i_quants_run_as_4_bit_codes_into_their_grid_values(wide_iq: Path) -> None:
    """IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S hold at most 16 distinct integers each; they
    run as 4-bit codes into them under the groups' scales (`codebook`), each held weight the `gguf`
    package's, and the model transformers' (they were dequantized to the model dtype at load before)."""
    import gguf as gguf_package

    stored = {t.name: t for t in gguf_package.GGUFReader(str(wide_iq)).tensors}
    oracle = torch.load(wide_iq.with_name("oracle.pt"))
    llm = LLM(str(wide_iq), dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    runner = llm.engine.runner
    # the i-quants' groups, and the Q6_K head's
    assert runner.quant.format == "gguf" and {g.scheme for g in runner.quant.groups} == {"codebook", "w8a16"}
    for i, layer in enumerate(runner.model.model.layers):
        kind = IQ_TYPES[i % len(IQ_TYPES)]
        assert stored[f"blk.{i}.ffn_down.weight"].tensor_type.name == kind
        modules = (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
        for module in modules:
            assert isinstance(module, CodebookLinear) and module.scheme == "codebook", (kind, module)
            assert module.group_size == iq_blocks.GROUP[kind]
            assert torch.equal(module.code, torch.from_numpy(iq_blocks.table(kind)))
        t = stored[f"blk.{i}.ffn_down.weight"]
        theirs = torch.from_numpy(gguf_package.quants.dequantize(np.asarray(t.data), t.tensor_type))
        assert torch.equal(layer.mlp.down_proj.dequantized(torch.float32), theirs)
    _matches_oracle(llm, oracle)
