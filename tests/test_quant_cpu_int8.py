"""The CPU w8a16 product: activations split into int8 digits, exact int32 sums, float32 precision."""

from __future__ import annotations

import pytest
import torch

from ember_engine.model.quant import cpu_int8, schemes


def _float64_product(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    g = q.shape[1] // scale.shape[1]
    return x.double() @ (q.double() * scale.double().repeat_interleave(g, dim=1)).t()


def test_digits_hold_a_row_to_float32_precision() -> None:
    g = torch.Generator().manual_seed(1)
    # values over many binades, exact zeros and a row of zeros
    x = torch.randn(4, 300, generator=g) * torch.logspace(-6, 2, 300)
    x[1, ::7] = 0
    x[3] = 0
    digits, scale = cpu_int8.split(x)
    assert digits.dtype == torch.int8 and digits.shape == (3 * 4, 300)
    assert digits.abs().max().item() <= 127
    d = digits.reshape(3, 4, 300).double()
    rebuilt = scale.double() * (d[0] + d[1] / cpu_int8.BASE + d[2] / cpu_int8.BASE**2)
    row_max = x.abs().amax(dim=1, keepdim=True).double()
    # |remainder| <= sx / (2 * 254^2) = row max / (127 * 2 * 254^2), just over 2^-24 of it
    assert ((rebuilt - x.double()).abs() <= 1.001 / (127 * 2 * cpu_int8.BASE**2) * row_max).all()
    assert torch.equal(rebuilt[3], torch.zeros(300, dtype=torch.float64))


@pytest.mark.parametrize("rows", [1, 7, 40])
def test_product_is_as_precise_as_a_float32_matmul(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 256, generator=g) * 0.05
    q, scale = schemes.quantize_int8(w, 0)
    x = torch.randn(rows, 256, generator=g)
    exact = _float64_product(x, q, scale)
    got = cpu_int8.digit_matmul(x, q, scale)
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    dense = (q.float() * scale.repeat_interleave(256 // scale.shape[1], dim=1)).t()
    float32_error = (x @ dense - exact).abs().max().item()
    # about float32's own rounding; bfloat16 activations (what the CPU path multiplied before) are ~1e3 worse
    assert (got - exact).abs().max().item() <= max(4 * float32_error, 1e-6 * exact.abs().max().item())


def test_other_dtypes_come_back_in_their_own() -> None:
    g = torch.Generator().manual_seed(3)
    q, scale = schemes.quantize_int8(torch.randn(32, 128, generator=g), 0)
    x = torch.randn(3, 128, generator=g).to(torch.float16)
    got = cpu_int8.digit_matmul(x, q, scale)
    assert got.dtype == torch.float16
    exact = _float64_product(x.float(), q, scale)
    assert (got.double() - exact).abs().max().item() <= 2**-10 * exact.abs().max().item()


@pytest.mark.parametrize("shape", [(64, 128), (640, 512)], ids=["dequantized", "digits"])
def test_small_weights_are_widened_large_ones_split(shape: tuple[int, int]) -> None:
    """Either path the layer takes (by weight size) gives the float32-precision product."""
    out, k = shape
    assert (out * k < cpu_int8.DEQUANTIZE_BELOW) == (shape == (64, 128))
    g = torch.Generator().manual_seed(out)
    q, scale = schemes.quantize_int8(torch.randn(out, k, generator=g), 0)
    x = torch.randn(2, k, generator=g)
    exact = _float64_product(x, q, scale)
    got = cpu_int8.int8_matmul(x, q, scale)
    assert (got.double() - exact).norm() <= 1e-6 * exact.norm()


def test_a_scale_per_group_is_refused_by_name() -> None:
    """Grouped scales would take one int8 matmul a group; `cpu_decode`'s loops take those weights."""
    q, scale = schemes.quantize_int8(torch.randn(8, 256), 128)
    with pytest.raises(ValueError, match="a scale per output channel, not 2 groups a row"):
        cpu_int8.int8_matmul(torch.randn(2, 256), q, scale)
