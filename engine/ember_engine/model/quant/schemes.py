"""The weight schemes as pure tensor arithmetic: quantize, pack, unpack, dequantize.

Canonical forms held by the engine's layers (whatever the checkpoint's own layout):
- `fp8`: E4M3 weight `[out, in]`, float32 scale per output channel `[out]`; activations are quantized
  per token at run time (W8A8-FP8), or with a checkpoint's calibrated scale per projection (static).
- `w8a16`: int8 weight `[out, in]`, float32 scale per output channel `[out, 1]` (or per group of input
  columns, as llm-compressor's W8A16 preset writes, `[out, in / group_size]`); activations stay as they are.
- `w4a16`: int4 values packed two to a byte `[out, in / 2]` (low nibble first, stored as value + 8),
  float32 scale per group of `group_size` input columns `[out, in / group_size]`.
- `w8a8`: `w8a16`'s int8 weight with a scale per output channel `[out, 1]`; activations are quantized to
  int8 per token at run time (W8A8-INT8) and multiplied in integers.
All are symmetric: zero is exactly representable and no zero point is stored.
"""

from __future__ import annotations

import torch

from ember_engine.core.config import QUANT_SCHEMES as SCHEMES

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
DEFAULT_GROUP_SIZE = 128
# Online scheme names that name their layers' scheme otherwise: `bitsandbytes` quantizes to NF4.
LAYER_SCHEME = {"bitsandbytes": "bnb-nf4"}
_TINY = 1e-12


def _over(t: torch.Tensor, constant: float) -> torch.Tensor:
    """t / constant with IEEE division on every device. On CUDA, torch divides by a Python number as a
    multiplication by its reciprocal, which can land one unit in the last place away from the quotient:
    a scale so shifted moved an int8 activation across a rounding boundary against the CPU's (and the
    Triton quantizer's) exact result."""
    return t / torch.full((), constant, dtype=t.dtype, device=t.device)


class UnsupportedQuantizationError(ValueError):
    pass


def check_scheme(scheme: str) -> str:
    if scheme not in SCHEMES:
        raise UnsupportedQuantizationError(
            f"quantization: unsupported scheme {scheme!r}; supported: {', '.join(SCHEMES)}"
        )
    return scheme


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel E4M3: (weight [out, in], scale [out])."""
    scale = _over(w.float().abs().amax(dim=1).clamp(min=_TINY), FP8_MAX)
    q = (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 with one scale per [rows, columns] tile (the last tiles partial), as Hugging Face's `fp8`
    checkpoints store it: (weight [out, in], scale [ceil(out / rows), ceil(in / columns)]), weight * scale
    (broadcast over each tile) being the weight it stands for (the checkpoint's `weight_scale_inv`)."""
    out, inp = w.shape
    bo, bi = block
    po, pi = -out % bo, -inp % bi
    tiles = torch.nn.functional.pad(w.float(), (0, pi, 0, po)).reshape(
        (out + po) // bo, bo, (inp + pi) // bi, bi
    )
    scale = _over(tiles.abs().amax(dim=(1, 3)).clamp(min=_TINY), FP8_MAX)
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(out + po, inp + pi)[:out, :inp].contiguous(), scale


def block_scales_per_row(scale: torch.Tensor, rows: int, block_rows: int) -> torch.Tensor:
    """Tile scales [ceil(rows / block_rows), groups] -> each row's [rows, groups] (the layers' form,
    which keeps a merged projection's parts apart whatever their row offsets)."""
    return scale.float().repeat_interleave(block_rows, dim=0)[:rows].contiguous()


def quantize_activation_fp8_groups(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token and group of `group_size` columns, dynamic E4M3: (values [n, in], float32 scale
    [n, in / group_size]) (what block-scaled FP8 checkpoints are run with)."""
    n, k = x.shape
    groups = x.float().reshape(n, k // group_size, group_size)
    scale = _over(groups.abs().amax(dim=-1).clamp(min=_TINY), FP8_MAX)
    q = (groups / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(n, k), scale


def quantize_int8(w: torch.Tensor, group_size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 in [-127, 127], one scale per output channel (`group_size` 0) or per group of
    input columns: (weight [out, in], scale [out, in / group_size])."""
    out, inp = w.shape
    g = group_size or inp
    groups = w.float().reshape(out, inp // g, g)
    scale = _over(groups.abs().amax(dim=2).clamp(min=_TINY), 127.0)
    q = torch.round(groups / scale[:, :, None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(out, inp), scale


def quantize_int4(w: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-wise symmetric int4 in [-8, 7] (scale = absmax / 7.5, the compressed-tensors rule):
    (values as int8 [out, in], scale [out, in / group_size])."""
    out, inp = w.shape
    if inp % group_size:
        raise UnsupportedQuantizationError(
            f"w4a16: input size {inp} is not a multiple of the group size {group_size}"
        )
    groups = w.float().reshape(out, inp // group_size, group_size)
    scale = _over(groups.abs().amax(dim=2).clamp(min=_TINY), 7.5)
    q = torch.round(groups / scale[:, :, None]).clamp(-8, 7).to(torch.int8)
    return q.reshape(out, inp), scale


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int4 values [out, in] (in [-8, 7]) -> bytes [out, in / 2], column 2j in the low nibble."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4`: int8 values [out, 2 * packed columns]."""
    low = (packed & 0xF).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack((low, high), dim=-1).reshape(packed.shape[0], -1)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    q = unpack_int4(packed)
    group_size = q.shape[1] // scale.shape[1]
    return (q.float() * scale.float().repeat_interleave(group_size, dim=1)).to(dtype)


def quantize_activation_fp8(x: torch.Tensor, ub: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (row) dynamic E4M3: (values [n, in], float32 scale [n, 1]). With `ub` (fbgemm_fp8's
    `activation_scale_ub`) a row's largest magnitude is taken as at most `ub`, and its values beyond
    saturate at +-448."""
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    if ub:
        amax = amax.clamp(max=ub)
    scale = _over(amax.clamp(min=_TINY), FP8_MAX)
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantize_activation_fp8_static(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 with a calibrated scale for every token (a checkpoint's static per-tensor `input_scale`):
    (values [n, in], float32 scale [n, 1], every row the same), values beyond the calibrated range
    saturating at +-448."""
    s = scale.float().reshape(1, 1)
    q = (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, s.expand(x.shape[0], 1)


def quantize_activation_int8_static(
    x: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 with a calibrated scale for every token (compressed-tensors' static per-tensor activations):
    round(x / scale) (half to even) saturated to [-128, 127]; (values [n, in], float32 scale [n, 1])."""
    s = scale.float().reshape(1, 1)
    return torch.round(x.float() / s).clamp_(-128, 127).to(torch.int8), s.expand(x.shape[0], 1)


def quantize_activation_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (row) dynamic int8, compressed-tensors' symmetric rule (the format's reference): scale
    max|x| / 127.5, values round(x / scale) (half to even) in [-128, 127]: (values [n, in], float32 scale
    [n, 1])."""
    xf = x.float()
    scale = _over(xf.abs().amax(dim=-1, keepdim=True).clamp(min=_TINY), 127.5)
    return torch.round(xf / scale).clamp_(-128, 127).to(torch.int8), scale


# NF4's 16 values (bitsandbytes' `quant_map` for `nf4`, float32), in code order.
NF4_VALUES = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)


def quantize_nf4(w: torch.Tensor, block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """NF4 as bitsandbytes quantizes it: per block of `block` input columns the absolute maximum; each
    value times its reciprocal (float32, clamped to [-1, 1]) takes the code whose value is nearest (a
    value exactly between two codes takes the lower). (codes [out, in / 2] uint8, column 2j in the low
    nibble; absmax float32 [out, in / block])."""
    out, inp = w.shape
    blocks = w.float().reshape(out, inp // block, block)
    absmax = blocks.abs().amax(dim=-1)
    scaled = (blocks * (1.0 / absmax.clamp(min=1e-38))[..., None]).clamp(-1.0, 1.0)
    table = torch.tensor(NF4_VALUES, device=w.device)
    codes = torch.bucketize(scaled, (table[1:] + table[:-1]) / 2).to(torch.uint8).reshape(out, inp)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous(), absmax


# E2M1 (FP4) values of the nibbles 0-7; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Bytes [out, in / 2], two E2M1 values each (column 2j in the low nibble) -> float32 [out, in]."""
    table = torch.tensor(E2M1_VALUES, device=packed.device)
    nibbles = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1).long()
    values = table[nibbles & 7]
    return torch.where(nibbles >= 8, -values, values)


def fake_quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """NVFP4 activations, quantized and dequantized as compressed-tensors defines them (float32 [n, in]):
    per token and group of 16 columns a local scale max|x| / 6 times the calibrated global scale, rounded
    to E4M3 (0 becomes 0.125); each value divided by that over the global scale, saturated at +-6 and
    rounded to the nearest E2M1 value (ties to the even one), then multiplied back."""
    n, k = x.shape
    groups = x.float().reshape(n, k // 16, 16)
    g = global_scale.float().reshape(())
    local = g * (groups.abs().amax(dim=-1, keepdim=True) / 6.0)
    local = local.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    scale = torch.where(local == 0, torch.tensor(0.125, device=x.device), local) / g
    q = round_to_e2m1((groups / scale).clamp(-6.0, 6.0))
    return (q * scale).reshape(n, k)


MX_GROUP = 32
MX_BINADE = {4: 2, 8: 8}  # the largest binade of E2M1 (6 = 1.5 * 2^2) and of E4M3 (448 = 1.75 * 2^8)


def quantize_activation_mx(
    x: torch.Tensor, bits: int, fit: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """MX activations per token and group of 32 columns: (values [n, in], E4M3 for 8 bits, E2M1 values in
    float32 for 4; float32 power-of-two scale [n, in / 32]). A group's scale, as compressed-tensors takes
    it (its MXFP4 and MXFP8 presets): its largest magnitude rounded to a power of two (up where the
    mantissa is 1.75 or more, else down) over 2^2 or 2^8, an exponent within E8M0's [-127, 127]; with
    `fit`, as ModelOpt's MXFP8 takes it: the smallest power of two at least max|x| / 448 (that quotient
    rounded to float32 first), 1 for a zero group. Each value over the scale saturates at the format's
    largest (6 or 448) and rounds to the nearest value, ties to the even one."""
    n, k = x.shape
    groups = x.float().reshape(n, k // MX_GROUP, MX_GROUP)
    amax = groups.abs().amax(dim=-1)
    if fit:
        mantissa, exponent = torch.frexp(_over(amax, FP8_MAX))  # [0.5, 1): a power of two where it is 0.5
        power = torch.where(amax > 0, exponent - (mantissa == 0.5).to(exponent.dtype), 0)
    else:
        mantissa, exponent = torch.frexp(amax)
        power = exponent - 1 + (mantissa >= 0.875).to(exponent.dtype) - MX_BINADE[bits]
    scale = torch.exp2(power.clamp(-127, 127).float())
    v = groups / scale[..., None]
    q = v.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn) if bits == 8 else round_to_e2m1(v.clamp(-6.0, 6.0))
    return q.reshape(n, k), scale


def e8m0_scales(exponent: torch.Tensor, name: str) -> torch.Tensor:
    """MX scales as a checkpoint holds them, E8M0 bytes e (2^(e - 127); 255 is NaN), as float32."""
    if exponent.dtype != torch.uint8 or bool((exponent == 255).any()):
        found = (
            f"255 in {int((exponent == 255).sum())} of them"
            if exponent.dtype == torch.uint8
            else exponent.dtype
        )
        raise UnsupportedQuantizationError(
            f"{name}: MX scales must be E8M0 bytes other than 255 (NaN), found {found}"
        )
    return torch.exp2(exponent.float() - 127.0)


# The activations a weight scheme may quantize at run time (`QuantSpec.input_quant`): MX's per group of
# 32, compressed-tensors' rule (mxfp4, mxfp8) or ModelOpt's (mxfp8-fit); or per token (fp8, int8)
MX_INPUTS = {"mxfp4": (4, False), "mxfp8": (8, False), "mxfp8-fit": (8, True)}


def fake_quantize_input(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Activations [n, in] quantized and dequantized, float32: `kind` one of MX_INPUTS
    (`quantize_activation_mx`), or fp8 or int8 per token (`quantize_activation_fp8`, `_int8`)."""
    if kind in MX_INPUTS:
        q, scale = quantize_activation_mx(x, *MX_INPUTS[kind])
        return (q.float().reshape(*scale.shape, MX_GROUP) * scale[..., None]).reshape(x.shape)
    q, scale = quantize_activation_fp8(x) if kind == "fp8" else quantize_activation_int8(x)
    return q.float() * scale


def round_to_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Each value (in [-6, 6]) to the nearest E2M1 value, a tie to the one with an even mantissa: the
    grid steps by 0.5 below 2, by 1 below 4 and by 2 up to 6, and rounding half to even on the grid
    (torch.round) breaks the ties as E2M1's mantissa does."""
    a = v.abs()
    step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    q = torch.round(a / step) * step
    return torch.where(v < 0, -q, q)


def unpack_int32(packed: torch.Tensor, num_bits: int, columns: int) -> torch.Tensor:
    """compressed-tensors `pack-quantized`: `32 / num_bits` unsigned values per int32 along the last
    dimension, value k of a word in bits [k*num_bits, (k+1)*num_bits), each stored as value + 2^(bits-1).
    Returns signed int8 values [rows, columns]."""
    per_word = 32 // num_bits
    mask = (1 << num_bits) - 1
    words = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per_word, dtype=torch.int64) * num_bits
    values = (words[:, :, None] >> shifts) & mask
    values = values.reshape(packed.shape[0], -1)[:, :columns]
    return (values - (1 << (num_bits - 1))).to(torch.int8)


def pack_int32(values: torch.Tensor, num_bits: int) -> torch.Tensor:
    """The inverse of `unpack_int32`: signed values [rows, columns] -> int32 words [rows, ceil(columns *
    num_bits / 32)] (the last word zero-padded)."""
    per_word = 32 // num_bits
    rows, columns = values.shape
    u = values.to(torch.int64) + (1 << (num_bits - 1))
    pad = -columns % per_word
    if pad:
        u = torch.cat((u, torch.zeros(rows, pad, dtype=torch.int64)), dim=1)
    shifts = torch.arange(per_word, dtype=torch.int64) * num_bits
    return as_int32((u.reshape(rows, -1, per_word) << shifts).sum(dim=-1))


def as_int32(words: torch.Tensor) -> torch.Tensor:
    """Integers (int64), taken modulo 2^32, as the int32 words checkpoints store (the same 32 bits)."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
