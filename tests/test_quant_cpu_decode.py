"""The CPU's weight decoders (`cpu_decode`, `cpu_int4`). fp8: every E4M3 byte decodes to torch's value, bit for bit, and
the product (fused for decode batches, blocked above them) is the float64 product of the dequantized
operands to float32 precision, whatever the row blocks, scales and batch. int4 and w8a16: every byte
decodes to its value, and the product (fused, blocked, or for int8 with a scale per channel the digit
split) is the dequantized one to float32 precision, zero points and groups included."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ember_engine import LLM, SamplingParams
from ember_engine.model.quant import cpu_decode, cpu_int4, schemes
from ember_engine.model.quant.fp8_linear import Fp8BlockLinear, Fp8Linear
from ember_engine.model.quant.int_linear import Int4Linear, Int8Linear


def test_every_byte_decodes_to_torch_s_value_bit_for_bit() -> None:
    q = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)[None]
    got = cpu_decode.fp8_dequantize(q, torch.ones(1))[0]
    want = q[0].float()
    nan = want.isnan()
    assert int(nan.sum()) == 2 and bool(got[nan].isnan().all())  # 0x7F and 0xFF
    # Bits, not values: -0.0 (0x80) stays negative, and every subnormal is exact.
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))


@pytest.mark.parametrize("m", [1, 3])
def test_the_fused_loops_decode_every_byte_to_torch_s_value(m: int) -> None:
    # A weight of 256 rows of one column, row b holding byte b: the product with x = 1 is each byte's value.
    w = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)[:, None]
    x = torch.ones(m, 1, dtype=torch.float8_e4m3fn)
    got = cpu_decode.fp8_matmul(x, torch.ones(m, 1), w, torch.ones(256))
    want = w[:, 0].float().expand(m, 256)
    assert torch.equal(got.isnan(), want.isnan()) and int(want.isnan().sum()) == 2 * m
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_scales_apply_per_row_and_per_group() -> None:
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(3, 8, generator=g) * 100).to(torch.float8_e4m3fn)
    rows = torch.rand(3, generator=g) + 0.5
    groups = torch.rand(3, 4, generator=g) + 0.5
    assert torch.equal(cpu_decode.fp8_dequantize(q, rows), q.float() * rows[:, None])
    assert torch.equal(cpu_decode.fp8_dequantize(q, groups), q.float() * groups.repeat_interleave(2, dim=1))


def _fp8_case(m: int, n: int, k: int, group: int, seed: int):
    """fp8 operands (per channel when group is 0, else block-scaled) and their float64 product."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(m, k, generator=g)
    if group:
        wq, tiles = schemes.quantize_fp8_blocks(w, (group, group))
        ws = schemes.block_scales_per_row(tiles, n, group)  # the layers' form: each row its tiles' scales
        xq, xs = schemes.quantize_activation_fp8_groups(x, group)
        ws_cols, xs_cols = ws.repeat_interleave(group, dim=1), xs.repeat_interleave(group, dim=1)
    else:
        wq, ws = schemes.quantize_fp8(w)
        xq, xs = schemes.quantize_activation_fp8(x)
        ws_cols, xs_cols = ws[:, None], xs
    want = (xq.double() * xs_cols.double()) @ (wq.double() * ws_cols.double()).t()
    return xq, xs, wq, ws, want


def _close(got: torch.Tensor, want: torch.Tensor, m: int, n: int) -> None:
    assert got.shape == (m, n) and got.dtype == torch.float32 and got.is_contiguous()
    assert (got.double() - want).abs().max().item() <= 1e-6 * want.abs().max().item()


# 1: the one-row loop; 3, 6, 8: the four-row loop over one and two chunks (padded, or not); 9: blocked.
@pytest.mark.parametrize("m", [1, 3, 6, 8, 9])
@pytest.mark.parametrize("group", [0, 32])
def test_the_product_is_the_dequantized_product(m: int, group: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # 4 KiB of scratch holds 8 rows of 128 columns: 100 rows take 13 blocks, the last one short.
    monkeypatch.setattr(cpu_decode, "SCRATCH_BYTES", 4096)
    assert cpu_decode.FP8_FUSED_ROWS == 8
    n, k = 100, 128
    xq, xs, wq, ws, want = _fp8_case(m, n, k, group, m + group)
    _close(cpu_decode.fp8_matmul(xq, xs, wq, ws), want, m, n)


def test_an_empty_batch_gives_an_empty_product() -> None:
    wq, ws = schemes.quantize_fp8(torch.randn(8, 16))
    xq, xs = schemes.quantize_activation_fp8(torch.randn(0, 16))
    assert cpu_decode.fp8_matmul(xq, xs, wq, ws).shape == (0, 8)
    xq, xs = schemes.quantize_activation_fp8_groups(torch.randn(0, 16), 8)
    assert cpu_decode.fp8_matmul(xq, xs, wq, torch.ones(8, 2)).shape == (0, 8)
    q, scale = schemes.quantize_int4(torch.randn(1024, 512), 128)
    assert cpu_int4.int4_matmul(torch.randn(0, 512), schemes.pack_int4(q), scale).shape == (0, 1024)
    q, scale = schemes.quantize_int8(torch.randn(1024, 512), 128)
    assert cpu_decode.int8_matmul(torch.randn(0, 512), q, scale).shape == (0, 1024)


def test_the_layers_take_the_decoder_on_a_cpu() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, generator=g)
    layer = Fp8Linear(64, 48, bias=False, dtype=torch.float32)
    w = torch.randn(48, 64, generator=g) * 0.1
    q, s = schemes.quantize_fp8(w)
    layer.weight.copy_(q)
    layer.weight_scale.copy_(s)
    xq, xs = schemes.quantize_activation_fp8(x)
    want = (xq.double() * xs.double()) @ layer.dequantized(torch.float64).t()
    assert (layer(x).double() - want).abs().max().item() <= 1e-6 * want.abs().max().item()

    block = Fp8BlockLinear(64, 48, bias=False, dtype=torch.bfloat16, group_size=16)
    q, tiles = schemes.quantize_fp8_blocks(w, (16, 16))
    block.weight.copy_(q)
    block.weight_scale.copy_(schemes.block_scales_per_row(tiles, 48, 16))
    x16 = x.to(torch.bfloat16)
    xq, xs = schemes.quantize_activation_fp8_groups(x16, 16)
    want = (xq.double() * xs.repeat_interleave(16, dim=1).double()) @ block.dequantized(torch.float64).t()
    got = block(x16)
    assert got.dtype == torch.bfloat16  # the float32 product rounded once to the model's dtype
    assert (got.double() - want).abs().max().item() <= 2**-8 * want.abs().max().item()


@pytest.mark.parametrize("zero", [None, "int8", "float32"])
def test_the_blocked_int4_decode_gives_every_byte_s_two_values(zero: str | None) -> None:
    # One weight row of every byte value (512 columns, two groups): times the identity (512 rows, so the
    # blocked decode), each column's product is its value, less its group's zero point, times the scale.
    every = torch.arange(256, dtype=torch.uint8)[None]
    values = schemes.unpack_int4(every).double()[0]
    assert torch.equal(schemes.pack_int4(schemes.unpack_int4(every)), every)
    scale = torch.tensor([[0.5, 0.25]])
    zeros = None if zero is None else torch.tensor([[3, -5]], dtype=getattr(torch, zero))
    got = cpu_int4.int4_matmul(torch.eye(512), every, scale, zeros)[:, 0].double()
    z = torch.zeros(2) if zeros is None else zeros[0].double()
    want = (values - z.repeat_interleave(256)) * scale[0].double().repeat_interleave(256)
    assert torch.equal(got, want)


# 3 and 8 rows: the fused loop; 9: the blocked decode.
@pytest.mark.parametrize("m", [3, 8, 9])
@pytest.mark.parametrize("shape", [(48, 64), (512, 512)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zeros", [None, "int8", "float32"])
def test_the_int4_product_is_the_dequantized_product(
    m: int, shape: tuple[int, int], dtype: torch.dtype, zeros: str | None
) -> None:
    assert cpu_int4.INT4_FUSED_ROWS == 8
    n, k = shape
    g = torch.Generator().manual_seed(n)
    q, scale = schemes.quantize_int4(torch.randn(n, k, generator=g) * 0.05, 32)
    layer = Int4Linear(
        k,
        n,
        bias=False,
        dtype=dtype,
        group_size=32,
        zero_points=zeros is not None,
        float_zeros=zeros == "float32",
    )
    layer.set_rows(0, q, scale)
    if zeros is not None:  # a checkpoint's zero points (less 8): whole in int8, any real number in float32
        z = torch.randint(-3, 4, (n, k // 32), generator=g).float()
        layer.set_zero_rows(0, z if zeros == "int8" else z + torch.rand(n, k // 32, generator=g))
    x = torch.randn(m, k, generator=g).to(dtype)
    want = x.double() @ layer.dequantized(torch.float64).t()
    got = layer(x)
    assert got.dtype == dtype
    # float32 precision whatever the model dtype; then one rounding to it.
    tol = 1e-6 if dtype == torch.float32 else 2**-8
    assert (got.double() - want).abs().max().item() <= tol * want.abs().max().item()


def test_the_fused_int4_loop_reads_the_nibbles_in_packing_order() -> None:
    # One weight row of every byte value (512 columns), one group: the product with a one-hot row picks
    # out each column's value, so a swapped nibble or a wrong offset shows.
    every = torch.arange(256, dtype=torch.uint8)[None]
    values = schemes.unpack_int4(every).float()[0]
    for col in (0, 1, 2, 255, 510, 511):
        x = torch.zeros(1, 512)
        x[0, col] = 1.0
        assert cpu_int4.int4_matmul(x, every, torch.full((1, 1), 0.5)).item() == 0.5 * values[col].item()


@pytest.mark.parametrize("group", [0, 16, 32])
# 1: the fused loop; 3, 4 (per group: the four-row fused loop; per channel this small weight is widened
# whole); 5, 9, 40 (per group: blocked, here in blocks of 8 rows, the last one short)
@pytest.mark.parametrize("m", [1, 3, 4, 5, 9, 40])
def test_the_int8_product_is_the_dequantized_product(
    m: int, group: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_decode, "SCRATCH_BYTES", 4096)
    assert cpu_decode.INT8_FUSED_ROWS == 4
    n, k = 97, 128
    g = torch.Generator().manual_seed(m + group)
    w = torch.randn(n, k, generator=g) * 0.05
    q, scale = schemes.quantize_int8(w, group)
    layer = Int8Linear(k, n, bias=False, dtype=torch.float32, group_size=group)
    layer.weight.copy_(q)
    layer.weight_scale.copy_(scale)
    x = torch.randn(m, k, generator=g)
    want = x.double() @ layer.dequantized(torch.float64).t()
    got = layer(x)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert (got.double() - want).abs().max().item() <= 1e-6 * want.abs().max().item()
    # Every byte's value: a one-hot row picks out one column of the weight, scaled.
    every = torch.arange(-128, 128, dtype=torch.int8)[None]
    for col in (0, 1, 127, 128, 255):
        one = torch.zeros(1, 256)
        one[0, col] = 1.0
        assert cpu_decode.int8_matmul(one, every, torch.full((1, 1), 0.5)).item() == 0.5 * (col - 128)


@pytest.mark.parametrize("scheme", ["fp8", "w4a16", "w8a16"])
def test_the_engine_compiles_its_loops_while_starting_and_serving_adds_no_signature(
    tiny_model: Path, scheme: str
) -> None:
    if scheme == "fp8":
        loops = [cpu_decode._decode, cpu_decode._fp8_times_row, cpu_decode._fp8_times_rows]
    elif scheme == "w4a16":
        loops = [cpu_int4._nibbles_decode, cpu_int4._nibbles_times_row, cpu_int4._nibbles_times_rows]
    else:
        loops = [cpu_decode._int8_times_row, cpu_decode._int8_times_rows, cpu_decode._int8_decode]
    llm = LLM(str(tiny_model), quantization=scheme, num_kv_blocks=64)
    # Every loop compiled (or read from the cache) before any request. (Another test in this process may
    # have compiled a loop for other types too: float32 zero points, GGUF's Q4_K.)
    started = [len(loop.signatures) for loop in loops]
    assert min(started) >= 1
    prompts = [list(range(10, 10 + n)) for n in (5, 17, 3)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    # Prefill, one-row and several-row decode took the warm-up's types.
    assert [len(loop.signatures) for loop in loops] == started


def test_the_loops_compile_and_decode_exactly_without_f16c(tmp_path: Path) -> None:
    """Compiled for a CPU without F16C (numba's `generic` x86-64, as portable images set NUMBA_CPU_NAME),
    where LLVM has no instruction for float16 to float32 and no library function to call for it: the
    loops convert with integer operations instead, every float16 bit pattern to the value torch gives it,
    and every E4M3 byte, and the layers' loops compile."""
    script = """
import torch
from ember_engine.model.quant import cpu_decode, cpu_fp4, cpu_half, cpu_w4a8

assert not cpu_half.NATIVE_HALF
halves = torch.arange(1 << 16, dtype=torch.int32)
got = cpu_half.halves_to_float(halves)
want = halves.to(torch.int16).view(torch.float16).float()
nan = want.isnan()
assert bool(got[nan].isnan().all()) and torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))
q = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)[None]
got, want = cpu_decode.fp8_dequantize(q, torch.ones(1))[0], q[0].float()
nan = want.isnan()
assert bool(got[nan].isnan().all()) and torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))
cpu_decode.warm_up("fp8")
cpu_fp4.warm_up()
cpu_w4a8.warm_up()
print("ok")
"""
    env = {**os.environ, "NUMBA_CPU_NAME": "generic", "NUMBA_CACHE_DIR": str(tmp_path)}
    env.pop("NUMBA_CPU_FEATURES", None)
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])
