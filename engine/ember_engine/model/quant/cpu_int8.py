"""int8-weight matmul on the CPU with the activations kept at full float32 precision, through torch's
int8 x int8 -> int32 matmul (`torch._int_mm`, exact integer sums).

Each activation row x is written as three signed base-254 digits of its own scale:
    x = sx * (d0 + d1 / 254 + d2 / 254^2) + r,   sx = max|x| / 127,  d_i in [-127, 127],
with |r| <= sx / (2 * 254^2), about 2^-24 of the row's largest value, so the digits hold the row to
float32's own precision. Then x . q = sx * (d0 . q + d1 . q / 254 + d2 . q / 254^2) where every d_i . q is
an exact int32 sum (|d . q| <= 127^2 * in < 2^31 for fewer than 133 000 input columns), and the three
digit rows of every token go through one `_int_mm` call, which reads the int8 weights once: at decode
batch sizes the product costs a quarter of float32's weight bytes and keeps its precision (relative error
about 1e-7, that of a float32 matmul itself). With a scale per group of input columns the sums are taken
group by group and each scaled before they are added. Weights small enough that widening them costs
less than the split, and weights whose groups are narrower than `NARROW_GROUP` columns (one `_int_mm` a
group costs more than widening: GGUF's Q8_0 and Q4_0 groups of 32, Q6_K's of 16), are multiplied
dequantized, in float32, a block of rows at a time.
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
# Groups narrower than this are widened, a block of rows at a time: on a 768 x 2048 weight at 9 activation
# rows, 0.84 against 3.7 ms (groups of 16) and 0.57 against 2.4 (32); at 128 the split wins, 0.53 against 0.76.
NARROW_GROUP = 64
_BLOCK_BYTES = 2 << 20  # float32 bytes of weight rows widened at once (they stay in the core's cache)


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
    """x [n, in] (any float dtype) times the int8 `weight` [out, in] with float32 `scale` [out, groups]
    (one scale per output channel when groups is 1), transposed: [n, out] in x's dtype, at float32
    precision either way."""
    if x.shape[0] == 0:  # nothing to split (the digit sums' reshapes need a row)
        return x.new_zeros(0, weight.shape[0])
    out, k = weight.shape
    groups = scale.shape[1]
    if weight.numel() >= DEQUANTIZE_BELOW and (groups == 1 or k // groups >= NARROW_GROUP):
        return digit_matmul(x, weight, scale)
    rows = max(1, _BLOCK_BYTES // (4 * k))
    xf = x.float()
    y = torch.empty(x.shape[0], out, dtype=torch.float32, device=x.device)
    for r in range(0, out, rows):
        block = weight[r : r + rows].float().reshape(-1, groups, k // groups) * scale[r : r + rows, :, None]
        torch.matmul(xf, block.reshape(-1, k).t(), out=y[:, r : r + rows])
    return y.to(x.dtype)


def digit_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`int8_matmul` through the digit split and torch's int8 matmul."""
    n, k = x.shape
    groups = scale.shape[1]
    g = k // groups
    if g > MAX_INPUT:
        raise ValueError(f"w8a16: {g} input columns per scale overflow int32 sums (at most {MAX_INPUT})")
    digits, x_scale = split(x)
    if groups == 1:
        y = _combine(torch._int_mm(digits, weight.t()), n).mul_(scale.reshape(1, -1))
    else:
        y = torch.zeros(n, weight.shape[0], dtype=torch.float32, device=x.device)
        for j in range(groups):
            cols = slice(j * g, (j + 1) * g)
            part = _combine(torch._int_mm(digits[:, cols], weight[:, cols].t()), n)
            y.add_(part.mul_(scale[:, j]))
    return y.mul_(x_scale).to(x.dtype)
