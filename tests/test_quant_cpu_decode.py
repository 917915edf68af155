"""The CPU's weight decoders (`cpu_decode`). fp8: every E4M3 byte decodes to torch's value, bit for bit, and
the blocked product is the float64 product of the dequantized operands to float32 precision, whatever the
row blocks, scales and batch. int4: unpacking inverts packing, and the product through the
int8 matmul is the dequantized one to float32 precision."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ember_engine import LLM, SamplingParams
from ember_engine.model.quant import cpu_decode, schemes
from ember_engine.model.quant.linear import Fp8BlockLinear, Fp8Linear, Int4Linear


def test_every_byte_decodes_to_torch_s_value_bit_for_bit() -> None:
    q = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)[None]
    got = cpu_decode.fp8_dequantize(q, torch.ones(1))[0]
    want = q[0].float()
    nan = want.isnan()
    assert int(nan.sum()) == 2 and bool(got[nan].isnan().all())  # 0x7F and 0xFF
    # Bits, not values: -0.0 (0x80) stays negative, and every subnormal is exact.
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))


def test_scales_apply_per_row_and_per_group() -> None:
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(3, 8, generator=g) * 100).to(torch.float8_e4m3fn)
    rows = torch.rand(3, generator=g) + 0.5
    groups = torch.rand(3, 4, generator=g) + 0.5
    assert torch.equal(cpu_decode.fp8_dequantize(q, rows), q.float() * rows[:, None])
    assert torch.equal(cpu_decode.fp8_dequantize(q, groups), q.float() * groups.repeat_interleave(2, dim=1))


@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("group", [0, 32])
def test_the_blocked_product_is_the_dequantized_product(
    m: int, group: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 4 KiB of scratch holds 8 rows of 128 columns: 100 rows take 13 blocks, the last one short.
    monkeypatch.setattr(cpu_decode, "SCRATCH_BYTES", 4096)
    g = torch.Generator().manual_seed(m + group)
    n, k = 100, 128
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
    got = cpu_decode.fp8_matmul(xq, xs, wq, ws)
    want = (xq.double() * xs_cols.double()) @ (wq.double() * ws_cols.double()).t()
    assert got.shape == (m, n) and got.dtype == torch.float32 and got.is_contiguous()
    assert (got.double() - want).abs().max().item() <= 1e-6 * want.abs().max().item()


def test_an_empty_batch_gives_an_empty_product() -> None:
    wq, ws = schemes.quantize_fp8(torch.randn(8, 16))
    xq, xs = schemes.quantize_activation_fp8(torch.randn(0, 16))
    assert cpu_decode.fp8_matmul(xq, xs, wq, ws).shape == (0, 8)
    xq, xs = schemes.quantize_activation_fp8_groups(torch.randn(0, 16), 8)
    assert cpu_decode.fp8_matmul(xq, xs, wq, torch.ones(8, 2)).shape == (0, 8)
    q, scale = schemes.quantize_int4(torch.randn(1024, 512), 128)  # the int8 digit split's size
    assert cpu_decode.int4_matmul(torch.randn(0, 512), schemes.pack_int4(q), scale).shape == (0, 1024)


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


def test_int4_unpacking_inverts_packing_for_every_byte() -> None:
    every = torch.arange(256, dtype=torch.uint8)[None]
    values = cpu_decode.int4_unpack(every)
    assert values.dtype == torch.int8 and values.shape == (1, 512)
    assert torch.equal(schemes.pack_int4(values), every)
    assert torch.equal(values, schemes.unpack_int4(every))


@pytest.mark.parametrize("shape", [(48, 64), (512, 512)])  # widened to float32; the int8 digit split
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int4_product_is_the_dequantized_product(shape: tuple[int, int], dtype: torch.dtype) -> None:
    n, k = shape
    g = torch.Generator().manual_seed(n)
    q, scale = schemes.quantize_int4(torch.randn(n, k, generator=g) * 0.05, 32)
    layer = Int4Linear(k, n, bias=False, dtype=dtype, group_size=32)
    layer.set_rows(0, q, scale)
    x = torch.randn(3, k, generator=g).to(dtype)
    want = x.double() @ layer.dequantized(torch.float64).t()
    got = layer(x)
    assert got.dtype == dtype
    # float32 precision whatever the model dtype; then one rounding to it.
    tol = 1e-6 if dtype == torch.float32 else 2**-8
    assert (got.double() - want).abs().max().item() <= tol * want.abs().max().item()


@pytest.mark.parametrize(("scheme", "loop"), [("fp8", "fp8"), ("w4a16", "int4")])
def test_the_engine_compiles_its_decoder_while_starting_and_serving_adds_no_signature(
    tiny_model: Path, scheme: str, loop: str
) -> None:
    kernel = cpu_decode._decode if loop == "fp8" else cpu_decode._unpack
    llm = LLM(str(tiny_model), quantization=scheme, num_kv_blocks=64)
    assert len(kernel.signatures) == 1  # compiled (or read from the cache) before any request
    prompts = [list(range(10, 10 + n)) for n in (5, 17, 3)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(kernel.signatures) == 1  # prefill, decode and every batch size took the warm-up's types
