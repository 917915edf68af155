"""`w4a8-fp8` (ModelOpt's W4A8_AWQ held as 4-bit codes and each row's and group's 16 E4M3 values): every
table byte decodes to torch's value, and the product, on the CPU's fused and blocked loops and in the
Triton kernel (interpreted on a CPU, compiled on a GPU), is the float64 product of the E4M3 activations
and weights it stands for. The whole-model check against ModelOpt's own simulation is in
`test_quant_modelopt.py`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ember_engine.model.quant import cpu_decode, cpu_w4a8, schemes
from ember_engine.model.quant.w4a8_linear import W4Fp8Linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the CPU's lookups: 16 codes an instruction (AVX-512's vpermps), or one at a time
LOOKUPS = [
    pytest.param(False, id="one-at-a-time"),
    pytest.param(
        True,
        id="16-at-a-time",
        marks=pytest.mark.skipif(not cpu_w4a8.LOOKUP16, reason="this CPU has no AVX-512"),
    ),
]


def _layer(out: int, k: int, group: int, seed: int) -> W4Fp8Linear:
    """A merged layer of two parts, each with ModelOpt's arithmetic: int4 values v with a scale s_g per row
    and group, E4M3(v * s_g / s2) under the part's own s2, and a static input scale."""
    g = torch.Generator().manual_seed(seed)
    layer = W4Fp8Linear(k, out, bias=False, dtype=torch.float32, group_size=group)
    half = out // 2
    for start, rows in ((0, half), (half, out - half)):
        values = torch.randint(-8, 8, (rows, k), generator=g, dtype=torch.int8)
        group_scale = torch.rand(rows, k // group, generator=g) * 0.02 + 1e-3
        outer = group_scale.max() * 7 / 448
        codes = torch.arange(-8, 8, dtype=torch.float32)
        table = (codes * group_scale[:, :, None] / outer).clamp(-448, 448).to(torch.float8_e4m3fn)
        layer.set_rows(start, values, table)
        layer.set_outer_rows(start, rows, outer)
        layer.set_input_scale(torch.tensor(0.02 + 0.01 * start / out), f"part{start}")
    return layer


def _expected(layer: W4Fp8Linear, x: torch.Tensor) -> torch.Tensor:
    assert layer.input_scale is not None
    xq, xs = schemes.quantize_activation_fp8_static(x, layer.input_scale)
    w = layer.e4m3_weight().double() * layer.weight_scale.double()[:, None]
    return (xq.double() * xs.double()) @ w.t()


def test_the_table_stands_for_modelopt_s_e4m3_weight() -> None:
    layer = _layer(8, 256, 128, 0)
    values = schemes.unpack_int4(layer.weight_packed)
    assert layer.input_scale is not None and float(layer.input_scale) == pytest.approx(
        0.025
    )  # the larger part's
    # Each weight is its group's table entry for its code (value + 8).
    for row, col in ((0, 0), (3, 200), (7, 255)):
        byte = layer.weight_table[row, col // 128, int(values[row, col]) + 8]
        assert layer.e4m3_weight()[row, col].view(torch.uint8) == byte.view(torch.uint8)
    held = [layer.weight_packed, layer.weight_table, layer.weight_scale]
    assert sum(t.numel() * t.element_size() for t in held) == 8 * 256 * 5 // 8 + 4 * 8


# 1: one row; 3, 8: the fused loop; 9, 40: blocked (here in blocks of 4 rows of 256 columns, the last
# short). Groups of 128 and 32 columns: 64 and 16 bytes, looked up 16 at a time where the CPU can; groups
# of 16 (8 bytes) one at a time on every CPU.
@pytest.mark.parametrize("lookup16", LOOKUPS)
@pytest.mark.parametrize("group", [128, 32, 16])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 40])
def test_the_cpu_product_is_the_e4m3_product(
    m: int, group: int, lookup16: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_decode, "SCRATCH_BYTES", 4096)
    monkeypatch.setattr(cpu_w4a8, "LOOKUP16", lookup16)
    layer = _layer(102, 256, group, m)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)) * 0.5
    monkeypatch.setenv("EMBER_QUANT_GEMM", "torch")
    got = layer(x)
    want = _expected(layer, x)
    assert got.shape == (m, 102) and got.dtype == torch.float32
    assert (got.double() - want).abs().max().item() <= 1e-6 * want.abs().max().item()


@pytest.mark.parametrize("lookup16", LOOKUPS)
@pytest.mark.parametrize("m", [1, 2, 9])  # one row, the fused loop, the blocked decode
def test_every_table_byte_decodes_to_torch_s_value(
    m: int, lookup16: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_w4a8, "LOOKUP16", lookup16)
    # One output row per group of 16 byte values (0x7F and 0xFF are NaN: left out); each code c of row r
    # stands for byte 16 r + c, and an input of ones picks each column's value out one at a time.
    layer = W4Fp8Linear(32, 16, bias=False, dtype=torch.float32, group_size=32)
    every = torch.arange(256, dtype=torch.uint8).reshape(16, 1, 16).clone()
    every[7, 0, 15] = every[15, 0, 15] = 0
    codes = torch.arange(-8, 8, dtype=torch.int8).repeat(16, 2)  # columns 0..15 and 16..31: codes 0..15
    layer.set_rows(0, codes, every.view(torch.float8_e4m3fn))
    layer.set_input_scale(torch.tensor(1.0), "ones")
    want = every.view(torch.float8_e4m3fn).float()[:, 0, :]  # [row, code]
    for col in (0, 5, 15, 16, 31):
        x = torch.zeros(m, 32)
        x[:, col] = 1.0
        got = layer(x)
        assert torch.equal(got, want[:, col % 16].expand(m, 16))


@pytest.mark.parametrize("shape", [(1, 256, 64), (5, 256, 96), (33, 384, 200)], ids=str)
def test_the_triton_kernel_gives_the_e4m3_product(
    shape: tuple[int, int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    m, k, n = shape
    layer = _layer(n, k, 128, n).to(DEVICE)
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 0.5).to(DEVICE)
    want = _expected(layer, x)
    monkeypatch.setenv("EMBER_QUANT_GEMM", "triton")
    got = layer(x)
    assert got.shape == (m, n)
    # float32 sums in another order, and the two scales multiplied before they scale the sums; on a GPU
    # the E4M3 dots' tensor cores (Hopper's) add with fewer bits, as for `fp8` (test_quant_kernels.py)
    tolerance = 1e-3 if DEVICE == "cuda" else 1e-5
    assert (got.double() - want).abs().max().item() <= tolerance * want.abs().max().item()


def test_the_loops_compile_for_a_cpu_without_avx512(tmp_path: Path) -> None:
    """Compiled for an AVX2 CPU (Haswell: F16C for the E4M3 decoding, no AVX-512), the loops leave the
    16-at-a-time lookups out and still give the E4M3 product."""
    script = """
import torch
from ember_engine.model.quant import cpu_w4a8

assert not cpu_w4a8.LOOKUP16
cpu_w4a8.warm_up()
for fn in (cpu_w4a8._decode_row, cpu_w4a8._times_rows, cpu_w4a8._decode):
    assert all("permvar" not in ir for ir in fn.inspect_llvm().values()), fn
codes = torch.tensor([[0x10, 0xF2]], dtype=torch.uint8)  # codes 0, 1, 2, 15
table = torch.tensor([1.0, 2.0, 3.0] + [0.0] * 12 + [-0.5]).to(torch.float8_e4m3fn).reshape(1, 1, 16)
x = torch.tensor([[1.0, 8.0, 64.0, 256.0]]).to(torch.float8_e4m3fn)  # E4M3 values
got = cpu_w4a8.matmul(x, torch.ones(1, 1), codes, table, torch.full((1,), 2.0))
assert got.tolist() == [[2.0 * (1.0 * 1 + 2.0 * 8 + 3.0 * 64 - 0.5 * 256)]], got
print("ok")
"""
    features = "+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+f16c,+fma,+lzcnt,+movbe,+popcnt,+sse4.2,+ssse3"
    env = {
        **os.environ,
        "NUMBA_CPU_NAME": "haswell",
        "NUMBA_CPU_FEATURES": features,  # else numba's JIT takes the host's
        "NUMBA_CACHE_DIR": str(tmp_path),
    }
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
