"""GGUF's block layouts that ember runs as stored, decoded into its canonical forms (`quant/schemes.py`):
int values [out, in] as int8, float32 scales [out, in / group], and for the types with a minimum per
group float32 zero points. Each row of a tensor is a run of blocks, each a fixed number of bytes; d, m
and dmin are float16:
- Q8_0 (32 values): d, 32 int8 q; the weight d q.
- Q4_0 (32): d, 16 bytes whose low nibbles hold values 0..15 and high nibbles 16..31; the weight d (q - 8).
- Q5_0 (32): d, a 32-bit word of fifth bits (bit i for value i), Q4_0's nibbles; the weight d (q - 16).
- Q4_1, Q5_1 (32): d, m, then as Q4_0 or Q5_0; the weight d q + m.
- Q6_K (256 in 16 groups of 16): 128 bytes of low 4 bits, 64 bytes of high 2 bits, 16 int8 group scales
  s, d; the weight d s (q - 32). Value v has its low bits in byte (v // 128) * 64 + v % 64, the high
  nibble when v % 128 >= 64, and its high bits in byte 128 + (v // 128) * 32 + v % 32, at bit
  2 * ((v % 128) // 32).
- Q4_K (256 in 8 groups of 32): d, dmin, 12 bytes of eight 6-bit scales s and minimums m (`_k_scales`),
  128 bytes of 4-bit q: byte 32 c + i holds value i of group 2 c in its low nibble and of group 2 c + 1
  in its high one. The weight d s q - dmin m. Q5_K (176 bytes): the same, with 32 bytes of fifth bits
  (bit j of byte i for value i of group j) before the nibbles.
- Q3_K (256 in 16 groups of 16): 32 bytes of high bits (bit v // 32 of byte v % 32), 64 bytes of low 2
  bits (`_crumbs`), 12 bytes of sixteen 6-bit scales s (`_q3_k_scales`), d; the weight d (s - 32) q, q the
  low bits less 4 where the high bit is 0: -4..3.
- Q2_K (256 in 16 groups of 16): 16 bytes each a 4-bit scale s (low nibble) and minimum m (high), 64 bytes
  of 2-bit q (`_crumbs`), d, dmin; the weight d s q - dmin m.
- IQ4_NL (32): d, Q4_0's nibbles, each an index into 16 values (`IQ4_VALUES`, -127..113); the weight
  d IQ4_VALUES[q]. IQ4_XS (256 in 8 groups of 32): d, a 16-bit word of the high 2 bits of eight 6-bit
  group scales s (bits 2 g), 4 bytes of their low nibbles (group 2 i low, 2 i + 1 high), then each group's
  16 bytes of nibbles as IQ4_NL's; the weight d (s - 32) IQ4_VALUES[q].
The weight a q + b of a type with a minimum is held as scale a times (q - mid - z), z = -(mid + b / a),
mid being 8 or 16 (`_affine`): w4a16's or w8a16's zero points, any real number. The other i-quants'
layouts (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S: values of lattice grids) are `iq_blocks.py`'s.
"""

from __future__ import annotations

import numpy as np
import torch

from ember_engine.model.gguf import iq_blocks

GROUP = {k: 32 for k in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "IQ4_NL", "IQ4_XS")}
GROUP |= {k: 16 for k in ("Q6_K", "Q2_K", "Q3_K")}  # values a scale
_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q6_K": 210, "Q4_K": 144, "Q5_K": 176}
_BYTES |= {"Q2_K": 84, "Q3_K": 110, "IQ4_NL": 18, "IQ4_XS": 136}
GROUP |= iq_blocks.GROUP
_BYTES |= iq_blocks.BYTES
# IQ4_NL's and IQ4_XS's 16 values, in code order (llama.cpp's kvalues_iq4nl)
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)

Decoded = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def decode(data: np.ndarray, kind: str) -> Decoded:
    """A tensor's bytes [out, blocks * block bytes] -> (int8 values [out, in], float32 scales [out, in /
    group], float32 zero points [out, in / group] for the types with a minimum, else None)."""
    out = data.shape[0]
    b = np.ascontiguousarray(data).reshape(out, -1, _BYTES[kind])
    zero = None
    if kind == "Q8_0":
        values, scale = b[:, :, 2:].view(np.int8), _half(b[:, :, :2])
    elif kind == "Q4_0":
        values, scale = _nibbles(b[:, :, 2:], 16).astype(np.int8) - 8, _half(b[:, :, :2])
    elif kind == "Q5_0":
        values, scale = (
            _fifth_bits(b[:, :, 2:6], _nibbles(b[:, :, 6:], 16)).astype(np.int8) - 16,
            _half(b[:, :, :2]),
        )
    elif kind == "Q4_1":
        q = _nibbles(b[:, :, 4:], 16)[:, :, None]  # one group a block
        values, scale, zero = _affine(q, _half(b[:, :, :2]), _half(b[:, :, 2:4]), 8)
    elif kind == "Q5_1":
        q = _fifth_bits(b[:, :, 4:8], _nibbles(b[:, :, 8:], 16))[:, :, None]
        values, scale, zero = _affine(q, _half(b[:, :, :2]), _half(b[:, :, 2:4]), 16)
    elif kind == "Q6_K":
        values, scale = _q6_k(b)
    elif kind == "Q2_K":
        q = _crumbs(b[:, :, 16:80]).reshape(*b.shape[:2], 16, 16)
        d, dmin, sm = _half(b[:, :, 80:82]), _half(b[:, :, 82:84]), b[:, :, 0:16]
        values, scale, zero = _affine(q, d * (sm & 15), -dmin * (sm >> 4), 8)
    elif kind == "Q3_K":
        high = (b[:, :, 0:32].reshape(*b.shape[:2], 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
        values = _crumbs(b[:, :, 32:96]).astype(np.int8) - 4 * (1 - high.reshape(*b.shape[:2], 256)).astype(
            np.int8
        )
        scale = _q3_k_scales(b[:, :, 96:108]) * _half(b[:, :, 108:110])
    elif kind == "IQ4_NL":
        values, scale = IQ4_VALUES[_nibbles(b[:, :, 2:], 16)], _half(b[:, :, :2])
    elif kind == "IQ4_XS":
        low = (b[:, :, 4:8].reshape(*b.shape[:2], 4, 1) >> np.array([0, 4], np.uint8)) & 15
        high = (np.ascontiguousarray(b[:, :, 2:4]).view("<u2") >> np.arange(0, 16, 2, dtype=np.uint16)) & 3
        sub = (low.reshape(*b.shape[:2], 8) | (high.astype(np.uint8) << 4)).astype(np.float32) - 32
        values, scale = IQ4_VALUES[_nibbles(b[:, :, 8:], 16)], sub * _half(b[:, :, :2])
    elif kind in iq_blocks.GROUP:
        values, scale = iq_blocks.decode(b, kind)
    elif kind in ("Q4_K", "Q5_K"):
        scale_k, minimum = _k_scales(b)
        q = _nibbles(b[:, :, 16:144] if kind == "Q4_K" else b[:, :, 48:176], 32).reshape(*b.shape[:2], 8, 32)
        if kind == "Q5_K":  # bit j of byte i: the fifth bit of value i of group j
            high = (
                b[:, :, 16:48].reshape(*b.shape[:2], 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
            ) & 1
            q = q | (high << 4)
        values, scale, zero = _affine(q, scale_k, -minimum, 8 if kind == "Q4_K" else 16)
    else:
        raise ValueError(f"GGUF type {kind} is not run as stored")
    return (
        torch.from_numpy(np.ascontiguousarray(values.reshape(out, -1))),
        torch.from_numpy(np.ascontiguousarray(scale.reshape(out, -1).astype(np.float32))),
        None if zero is None else torch.from_numpy(zero.reshape(out, -1).astype(np.float32)),
    )


def _half(b: np.ndarray) -> np.ndarray:
    """float16 numbers from their two little-endian bytes (the last axis), as float32."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(b: np.ndarray, run: int) -> np.ndarray:
    """Bytes [..., k * run] holding values in runs: each run of `run` bytes gives `run` values from its low
    nibbles, then `run` from its high ones."""
    shaped = b.reshape(*b.shape[:-1], -1, 1, run) >> np.array([0, 4], np.uint8).reshape(2, 1)
    return (shaped & 0x0F).reshape(*b.shape[:-1], -1)


def _fifth_bits(word: np.ndarray, low: np.ndarray) -> np.ndarray:
    """Q5_0 and Q5_1: a block's 32 low nibbles with the fifth bit of value i from bit i of the block's
    little-endian 32-bit word."""
    bits = np.ascontiguousarray(word).view("<u4") >> np.arange(32, dtype=np.uint32)
    return low | ((bits & 1).astype(np.uint8) << 4)


def _affine(q: np.ndarray, scale: np.ndarray, offset: np.ndarray, mid: int) -> tuple[np.ndarray, ...]:
    """Weights scale * q + offset (q unsigned, per group the last axis of q) as values q - mid, scale and
    zero point: scale * (v - z), z = -(mid + offset / scale). A group whose scale is 0 is the constant
    offset: values 0 under scale -offset and zero point 1."""
    empty = scale == 0
    values = np.where(empty[..., None], mid, q).astype(np.int16) - mid
    zero = np.where(empty, 1.0, -(mid + offset / np.where(empty, 1.0, scale)))
    return values.astype(np.int8), np.where(empty, -offset, scale), zero


def _crumbs(b: np.ndarray) -> np.ndarray:
    """Two-bit values from 64 bytes [..., 64]: value v at bits 2 ((v % 128) // 32) of byte
    (v // 128) * 32 + v % 32 (Q6_K's high bits, Q2_K's and Q3_K's low ones)."""
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    return ((b.reshape(*b.shape[:-1], 2, 1, 32) >> shifts) & 0x03).reshape(*b.shape[:-1], 256)


def _q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """Q3_K's 16 group scales, each six bits less 32: the low four bits of scales 0-7 in the low nibbles of
    bytes 0-7 and of 8-15 in their high ones; the high two bits of scale i at bits 2 (i // 4) of byte
    8 + i % 4."""
    low = (packed[..., 0:8, None] >> np.array([0, 4], np.uint8)) & 15
    low = low.swapaxes(-1, -2).reshape(*packed.shape[:-1], 16)
    high = (packed[..., None, 8:12] >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3
    return (low | (high.reshape(*packed.shape[:-1], 16) << 4)).astype(np.float32) - 32


def _q6_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    low = _nibbles(b[:, :, :128], 64)  # value order: half, nibble, byte
    values = (low | (_crumbs(b[:, :, 128:192]) << 4)).astype(np.int8) - 32
    return values, b[:, :, 192:208].view(np.int8).astype(np.float32) * _half(b[:, :, 208:210])


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's eight group scales d s and minimums dmin m: six bits each, packed in 12 bytes
    after the block's float16 d and dmin (bytes 0-3 the low six bits of s 0-3 and in their top bits the
    high two of s 4-7; bytes 4-7 the same for m; bytes 8-11 the low four bits of s 4-7 and of m 4-7)."""
    d, dmin, packed = _half(b[:, :, 0:2]), _half(b[:, :, 2:4]), b[:, :, 4:16]
    first, second, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    s = np.concatenate([first & 63, (rest & 15) | ((first >> 6) << 4)], axis=-1).astype(np.float32)
    m = np.concatenate([second & 63, (rest >> 4) | ((second >> 6) << 4)], axis=-1).astype(np.float32)
    return d * s, dmin * m


def regroup(
    values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int, to: int
) -> Decoded:
    """A decoded tensor in groups of `to` columns (`to` dividing `group`): each scale and zero point
    repeated, and zero points of 0 where the type has none."""
    if zero is None:
        zero = torch.zeros_like(scale)
    times = group // to
    return values, scale.repeat_interleave(times, dim=1), zero.repeat_interleave(times, dim=1)
