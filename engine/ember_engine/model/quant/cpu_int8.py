"""int8-weight matmul on the CPU with the activations kept at full float32 precision, through torch's
int8 x int8 -> int32 matmul (`torch._int_mm`, exact integer sums).

Each activation row x is written as three signed base-254 digits of its own scale:
    x = sx * (d0 + d1 / 254 + d2 / 254^2) + r,   sx = max|x| / 127,  d_i in [-127, 127],
with |r| <= sx / (2 * 254^2), about 2^-24 of the row's largest value, so the digits hold the row to
float32's own precision. Then x . q = sx * (d0 . q + d1 . q / 254 + d2 . q / 254^2) where every d_i . q is
an exact int32 sum (|d . q| <= 127^2 * in < 2^31 for fewer than 133 000 input columns), and the three
digit rows of every token go through one `_int_mm` call, which reads the int8 weights once: at decode
batch sizes the product costs a quarter of float32's weight bytes and keeps its precision (relative error
about 1e-7, that of a float32 matmul itself). This is for a scale per output channel; with a scale per
group of input columns the sums would need one `_int_mm` a group, and `cpu_decode`'s compiled loops take
those weights instead. Weights small enough that widening them costs less than the split are multiplied
dequantized, in float32.
"""

from __future__ import annotations

import torch

BASE = 254.0  # digit d_i in [-127, 127]: a remainder in [-0.5, 0.5] times 254 rounds into that range
DIGITS = 3
MAX_INPUT = (2**31 - 1) // (127 * 127)  # input columns whose exact int32 sum cannot overflow
# Below this many weights, widening the whole weight to float32 for one matmul costs less than the dozen
# small tensor operations of the digit split (a model with hidden size 128 decodes 1.5x faster that way);
# above it, reading a quarter of float32's bytes wins.
DEQUANTIZE_BELOW = 1 << 18


def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [n, k] -> (digits int8 [3n, k], digit i of row j at row i * n + j; scale float32 [n, 1])."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_(min=torch.finfo(torch.float32).tiny).div_(127.0)
    rest = xf / scale
    digits = torch.empty(DIGITS, *x.shape, dtype=torch.float32, device=x.device)
    for i in range(DIGITS):
        torch.round(rest, out=digits[i])
        if i + 1 < DIGITS:
            rest.sub_(digits[i]).mul_(BASE)
    return digits.to(torch.int8).reshape(DIGITS * x.shape[0], x.shape[1]), scale


def _combine(sums: torch.Tensor, rows: int) -> torch.Tensor:
    """int32 digit sums [3n, out] -> their value in units of the activation scale, float32 [n, out]."""
    weights = torch.tensor([[1.0, 1.0 / BASE, 1.0 / (BASE * BASE)]], device=sums.device)
    return (weights @ sums.reshape(DIGITS, -1).float()).reshape(rows, -1)


def int8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [n, in] (any float dtype) times the int8 `weight` [out, in] with a float32 `scale` per output
    channel ([out] or [out, 1]), transposed: [n, out] in x's dtype, at float32 precision either way."""
    if scale.dim() == 2 and scale.shape[1] != 1:
        raise ValueError(f"cpu_int8: a scale per output channel, not {scale.shape[1]} groups a row")
    if x.shape[0] == 0:  # nothing to split (the digit sums' reshapes need a row)
        return x.new_zeros(0, weight.shape[0])
    if weight.numel() >= DEQUANTIZE_BELOW:
        return digit_matmul(x, weight, scale)
    return (x.float() @ (weight.float() * scale.reshape(-1, 1)).t()).to(x.dtype)


def digit_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`int8_matmul` through the digit split and torch's int8 matmul."""
    k = x.shape[1]
    if k > MAX_INPUT:
        raise ValueError(f"w8a16: {k} input columns overflow int32 sums (at most {MAX_INPUT})")
    digits, x_scale = split(x)
    y = _combine(torch._int_mm(digits, weight.t()), x.shape[0]).mul_(scale.reshape(1, -1))
    return y.mul_(x_scale).to(x.dtype)
