"""The engine's Triton kernels compiled ahead of time, on this machine, for the GPUs users run: compute
capability 7.5 (T4, float16 only), 8.0 (A100), 8.9 (L4, L40S) and 9.0 (H100, H200), by Triton's own compiler and the ptxas it
ships (`tests/kernel_compile.py`): the quantized GEMM and the activation quantizer in every variant their
configuration gives on that GPU, and the attention and KV-cache kernels in every variant engines launched
while starting here (bfloat16, float16 and float32 models; bfloat16, E4M3 and E5M2 caches; speculative
queries). The interpreter the other kernel tests run in compiles nothing, so a kernel it runs can still be
refused by a GPU's compiler (as Triton's E4M3 type is on 8.0); here every variant must reach machine
code, and its PTX shows the arithmetic chosen."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ember_engine import LLM
from ember_engine.model import kernel_launch, triton_attention
from ember_engine.model.kernel_launch import KernelLedger
from ember_engine.model.quant.triton_gemm_config import blocks

HERE = Path(__file__).parent
FP8_DOT_KINDS = ("fp8", "fp8-block", "w4a8-fp8")
TORCH_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "int32": "i32", "int64": "i64"}
TORCH_TYPES |= {"uint8": "u8", "int8": "i8"}
# (model dtype, KV cache dtype, speculative options) of the engines whose launches are compiled
NGRAM = {"speculative_method": "ngram", "speculative_adaptive": False}
ENGINES = [
    ("bfloat16", "auto", {}),
    ("bfloat16", "fp8", NGRAM),
    ("float16", "fp8_e5m2", {}),
    ("float32", "auto", NGRAM),
]


def ledger_variants(ledger: Any) -> list[dict[str, Any]]:
    """A launch ledger's variants (`kernel_launch.KernelLedger`) as JSON: per launch, the kernel's name,
    each recorded argument's kind (a tensor's dtype, an integer's being 1; `:16`: a tensor 16-byte
    aligned, an integer a multiple of 16) and the constexprs."""
    out = []
    for name, keys in ledger.variants.items():
        for key in keys:
            args, constexprs = {}, {}
            for arg, spec in key:
                if isinstance(spec, tuple) and spec and spec[0] == "tensor":
                    aligned = ":16" if spec[2] else ""
                    args[arg] = "*" + TORCH_TYPES[str(spec[1]).removeprefix("torch.")] + aligned
                elif isinstance(spec, tuple) and spec and spec[0] == "int":
                    args[arg] = "one" if spec[1] else ("i32:16" if spec[2] else "i32")
                elif isinstance(spec, tuple) and spec and spec[0] == "float":
                    args[arg] = "fp32"
                else:
                    constexprs[arg] = spec
            out.append({"kernel": name, "args": args, "constexprs": constexprs})
    return out


def _wide_head_attention() -> None:
    """`paged_attention` launched as a layer of Llama 3 8B's shape launches it (128-wide heads, four query
    heads to a KV head), in bfloat16 over a bfloat16 and an E4M3 cache: decode, decode in two key
    segments (and their merge), and a prefill chunk."""
    gen = torch.Generator().manual_seed(0)
    for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        k_cache, v_cache = (torch.randn(10, 16, 1, 128, generator=gen).to(cache_dtype) for _ in range(2))
        for q_len, splits in ((1, None), (1, 2), (5, None)):
            q = torch.randn(q_len, 4, 128, generator=gen).to(torch.bfloat16)
            triton_attention.paged_attention(
                q,
                k_cache,
                v_cache,
                torch.arange(10, dtype=torch.int32)[None, :],
                torch.tensor([160], dtype=torch.int32),
                torch.tensor([0, q_len], dtype=torch.int32),
                q_len,
                160,
                128**-0.5,
                num_splits=splits,
            )


@pytest.fixture(scope="module")
def variants(tiny_model: Path) -> list[dict[str, Any]]:
    """The attention and KV-store variants these engines launched while starting, and the wide-head ones."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EMBER_ATTENTION", "triton")
        mp.setattr(kernel_launch, "LEDGER", KernelLedger())  # these launches only
        for dtype, kv, spec in ENGINES:  # each launches every attention variant it can reach as it starts
            LLM(str(tiny_model), max_model_len=512, max_num_seqs=4, dtype=dtype, kv_cache_dtype=kv, **spec)
        _wide_head_attention()
        return ledger_variants(kernel_launch.LEDGER)


@pytest.fixture(scope="module")
def compiled(
    variants: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Any]]:
    path = tmp_path_factory.mktemp("kernels") / "variants.json"
    path.write_text(json.dumps(variants))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, str(HERE / "kernel_compile.py"), "--resources", str(path)]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    results: dict[str, dict[str, Any]] = json.loads(run.stdout)
    return results


def test_every_variant_reaches_machine_code(compiled: dict[str, dict[str, Any]]) -> None:
    failed = {key: r["error"] for key, r in compiled.items() if not r["ok"]}
    assert not failed, failed
    kinds = {key.split("/")[1] for key in compiled if key.startswith("gemm/")}
    assert len(kinds) == 9 and len(compiled) > 100
    launched = {key.split("/")[1] for key in compiled if key.startswith("launched/")}
    assert launched == {"_attention_kernel", "_merge_splits_kernel", "_store_kv_kernel"}


def test_each_variant_is_compiled_as_the_launcher_specializes_it(
    compiled: dict[str, dict[str, Any]], variants: list[dict[str, Any]]
) -> None:
    """Triton's launcher compiles a kernel for what it knows of a launch: an integer of 1 as a constant,
    a tensor 16-byte aligned and an integer a multiple of 16 as such, which decides whether the compiler
    may use vector loads and asynchronous copies. The variants compiled here are those: a layer's GEMM
    with aligned operands and sizes of 4096, one row as the constant 1; the attention and cache kernels
    with what the ledger saw."""
    decode = compiled["gemm/w4a16/sm90/bfloat16/1"]["signature"]
    assert decode["M"] == "constexpr"  # one row: the constant 1
    assert decode["w_ptr"] == "*u8:16" and decode["x_ptr"] == "*bf16:16"
    assert decode["K"] == decode["N"] == decode["stride_wn"] == "i32:16"
    assert compiled["gemm/w4a16/sm90/bfloat16/128"]["signature"]["M"] == "i32:16"
    kinds = [kind for v in variants for kind in v["args"].values()]
    assert "*bf16:16" in kinds and "i32:16" in kinds


def test_the_weight_tiles_are_loaded_in_vectors(compiled: dict[str, dict[str, Any]]) -> None:
    """No GEMM variant whose weights are bytes (int8, E4M3) or two to a byte (int4, the 4-bit codes)
    loads them a byte at a time. The 4-bit kinds did, on every capability: the weight of column k was
    nibble k % 2 of byte k // 2, each byte loaded once for each nibble by a load of its own (4 to 128
    single-byte loads in a variant's PTX); each byte is now loaded once, contiguous with its row's next, and its two
    nibbles multiplied with the even and odd activation columns. nvfp4 still loads its E4M3 group scales
    as bytes (one a group of 16), and w4a8-fp8 its codes' E4M3 table entries."""
    gemms = {key: r for key, r in compiled.items() if key.startswith("gemm/")}
    by_byte = {key: r["byte_loads"] for key, r in gemms.items() if r["byte_loads"]}
    assert {key.split("/")[1] for key in by_byte} == {"nvfp4", "w4a8-fp8"}, by_byte


def test_fp8_dots_where_the_gpu_has_them_and_no_e4m3_on_ampere(compiled: dict[str, dict[str, Any]]) -> None:
    """fp8, block-scaled fp8 and w4a8-fp8 multiply E4M3 on the tensor cores: on 8.9 in every tile; on
    9.0, whose E4M3 products are warpgroup instructions only (64 rows and up), in tiles of 64 rows or
    more, smaller ones converting E4M3 to float16 (exact) for float16 dots. On 8.0, where Triton has no
    E4M3 type, and on 7.5, not one E4M3 instruction in any kernel: the bytes are decoded with integers."""
    checked = 0
    for key, r in compiled.items():
        what, kind, arch, *rest = key.split("/")
        if what == "gemm" and kind in FP8_DOT_KINDS:
            wide = blocks(int(rest[-1]), 4096)[0] >= 64
            assert r["fp8_dots"] == (arch == "sm89" or (arch == "sm90" and wide)), key
            assert r["e4m3"] == (arch not in ("sm75", "sm80")), key
            checked += 1
        if arch in ("sm75", "sm80"):
            assert not r["e4m3"], key
    assert checked == 3 * 4 * 7  # three kinds, four capabilities, seven row classes


def test_block_scaled_fp8_compiles_in_every_block_width_it_takes(compiled: dict[str, dict[str, Any]]) -> None:
    """A checkpoint's FP8 blocks may be any multiple of 16 columns wide (`ember quantize --block-size`,
    Hugging Face's `weight_block_size`), and a K step lies within one block. E4M3 tensor-core dots take
    K steps of 32 or more, so blocks of 16 (or 48, ...) are multiplied as 8.0's are, E4M3 decoded to
    float32 (exact in TF32): with E4M3 dots in K steps of 16, Triton refused them on 8.9 and 9.0
    ("K >= 32")."""
    widths = {key: r for key, r in compiled.items() if key.startswith("blocks/")}
    assert len(widths) == 3 * 4 * 7  # three widths, four capabilities, seven row classes
    failed = {key: r["error"] for key, r in widths.items() if not r["ok"]}
    assert not failed, failed
    for key, r in widths.items():
        _, width, arch, _, rows = key.split("/")
        wide = blocks(int(rows), 4096)[0] >= 64
        assert r["fp8_dots"] == (width != "16" and (arch == "sm89" or (arch == "sm90" and wide))), key
    spilled = {key: r["spill_stores"] for key, r in widths.items() if r["spill_stores"] or r["spill_loads"]}
    assert not spilled, spilled


def test_the_quantizer_divides_exactly(compiled: dict[str, dict[str, Any]]) -> None:
    """Every division IEEE's (`div.rn.f32`), none of the approximate ones Triton's `/` gives on a GPU."""
    quantizers = {key: r for key, r in compiled.items() if key.startswith("quantize/")}
    assert len(quantizers) == 16
    for key, r in quantizers.items():
        assert r["div_rn"] and not r["div_approx"], key


def test_the_gemm_tiles_keep_their_sums_in_registers(compiled: dict[str, dict[str, Any]]) -> None:
    """No quantized GEMM variant, in any tile class on any capability, spills to local memory (ptxas's
    report): the tiles and K steps `triton_gemm_config` picks were chosen so. Before, on 4 warps, the
    64-row tiles spilled 120 to 670 bytes a thread on 9.0, the 128 x 128 tile on 8 warps on every
    capability; then, with K steps of 64, every tile of 32 rows and more on 7.5 (up to 4,312 bytes), the
    64 x 128 tile on 8.0 and 8.9 for three or four kinds and block-scaled fp8 in every tile of 32 rows
    and more on 8.0; and float32 activations (IEEE dots) in tiles of 32 rows and more, on 8.0, 8.9 and
    9.0, with the K steps and tiles the half types take (64 of 140 variants, up to 11 KB a thread).
    Compiled as the launcher specializes them (aligned operands, sizes multiples of 16), the 32-row tile
    with K steps of 32 spilled 8 bytes for int8 weights in bfloat16 on 8.9."""
    gemms = {key: r for key, r in compiled.items() if key.startswith("gemm/")}
    # 7.5: 8 kinds (no w8a8) in 7 row classes; 8.0, 8.9, 9.0: 9 kinds; and on each, the 5 kinds whose
    # activations are not quantized in float32 too
    assert len(gemms) == 8 * 7 + 3 * 9 * 7 + 4 * 5 * 7
    spilled = {key: r["spill_stores"] for key, r in gemms.items() if r["spill_stores"] or r["spill_loads"]}
    assert not spilled, spilled


def test_the_attention_and_cache_kernels_keep_their_values_in_registers(
    compiled: dict[str, dict[str, Any]], variants: list[dict[str, Any]]
) -> None:
    """No launched variant spills on any capability (ptxas's report, as Triton runs ptxas to build it):
    `paged_attention` runs 128-wide heads on 8 warps (on 4 every variant spilled, 28 to 1,900 bytes a
    thread on 8.0 and 9.0), and FP8 caches and float32 queries on 32 keys a step (16 for a float32
    prefill), decode on 8 warps (on 64 keys and 4 warps they spilled up to 516 bytes on 7.5 and 424 on
    8.0); but a decode of 128-wide heads over an FP8 cache on 4 (on 8 it spilled 8 bytes on 9.0)."""
    wide = [
        i
        for i, v in enumerate(variants)
        if v["kernel"] == "_attention_kernel" and v["constexprs"]["HEAD_DIM"] == 128
    ]
    assert {variants[i]["constexprs"]["KV_FP8"] for i in wide} == {0, 1}
    assert {variants[i]["constexprs"]["SPLIT"] for i in wide} == {False, True}
    for i in wide:
        c = variants[i]["constexprs"]
        decode = c["BLOCK_Q"] * c["GROUP_P2"] == 16  # a decode's q tile: 16 rows of query heads
        assert c["num_warps"] == (4 if decode and c["KV_FP8"] else 8), c
    launched = {key: r for key, r in compiled.items() if key.startswith("launched/")}
    assert len(launched) > 3 * len(variants)  # 7.5 compiles the variants without bfloat16
    spilled = {
        key: (variants[int(key.split("/")[-1])]["constexprs"], r["spill_stores"])
        for key, r in launched.items()
        if r["spill_stores"] or r["spill_loads"]
    }
    assert not spilled, spilled


# The shared memory one block may take on each capability's GPUs (CUDA's opt-in maximum a block, which
# Triton reads as `max_shared_mem` and holds each launch to, refusing one that needs more with
# OutOfResources): T4 64 KB, A100 163 KB, L4 and L40S 99 KB, H100 and H200 227 KB.
SHARED_LIMIT = {"sm75": 65536, "sm80": 166912, "sm89": 101376, "sm90": 232448}


def test_every_variant_fits_its_gpu_s_shared_memory(compiled: dict[str, dict[str, Any]]) -> None:
    """Each variant's pipeline buffers (`num_stages` K steps of both operands) fit one block's shared
    memory on its GPU; a variant that did not would compile here and be refused at its first launch."""
    over = {
        key: r["shared"]
        for key, r in compiled.items()
        if r["ok"] and r["shared"] > SHARED_LIMIT[key.split("/")[2]]
    }
    assert not over, over
    assert all(r["shared"] > 0 for key, r in compiled.items() if key.startswith("gemm/"))
