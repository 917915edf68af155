"""GGUF's block layouts that ember runs as stored, decoded into its canonical forms (`quant/schemes.py`):
int values [out, in] as int8, float32 scales [out, in / group], and for Q4_K float32 zero points.

Each row of a tensor is a run of blocks, each block a fixed number of bytes:
- Q8_0 (34 bytes, 32 values): a float16 scale d, then 32 int8 values q; the weight is d * q.
- Q4_0 (18 bytes, 32 values): d, then 16 bytes whose low nibbles hold values 0..15 and high nibbles
  values 16..31, each q in 0..15; the weight is d * (q - 8).
- Q6_K (210 bytes, 256 values in 16 groups of 16): 128 bytes of low 4 bits, 64 bytes of high 2 bits, 16
  int8 group scales s, then d; the weight is d * s * (q - 32), q in 0..63. Value v of the block has its
  low bits in byte (v // 128) * 64 + v % 64, the high nibble when v % 128 >= 64, and its high bits in
  byte 128 + (v // 128) * 32 + v % 32, at bit 2 * ((v % 128) // 32).
- Q4_K (144 bytes, 256 values in 8 groups of 32): d, dmin (float16), 12 bytes of eight 6-bit group scales
  s and eight 6-bit group minimums m, then 128 bytes of 4-bit q: byte 32 c + i holds value i of group
  2 c in its low nibble and of group 2 c + 1 in its high one. The weight is d s q - dmin m: ember holds
  it as scale d s times (q - 8 - z), z = dmin m / (d s) - 8 (w4a16 with a zero point per group, any real
  number). A group whose scale is 0 is one constant, -dmin m: held as values 0 under scale dmin m and
  zero point 1.
"""

from __future__ import annotations

import numpy as np
import torch

GROUP = {"Q8_0": 32, "Q4_0": 32, "Q6_K": 16, "Q4_K": 32}  # values per scale
_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q6_K": 210, "Q4_K": 144}  # bytes per block

Decoded = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def decode(data: np.ndarray, kind: str) -> Decoded:
    """A tensor's bytes [out, blocks * block bytes] -> (int8 values [out, in], float32 scales [out, in /
    group], float32 zero points less 8 [out, in / group] for Q4_K, else None)."""
    out = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(out, -1, _BYTES[kind])
    if kind == "Q8_0":
        values, scale, zero = blocks[:, :, 2:].view(np.int8), _half(blocks[:, :, :2]), None
    elif kind == "Q4_0":
        values, scale, zero = (
            _nibbles(blocks[:, :, 2:], 16).astype(np.int8) - 8,
            _half(blocks[:, :, :2]),
            None,
        )
    elif kind == "Q6_K":
        values, scale, zero = _q6_k(blocks)
    elif kind == "Q4_K":
        values, scale, zero = _q4_k(blocks)
    else:
        raise ValueError(f"GGUF type {kind} is not run as stored")
    flat = (values.reshape(out, -1), scale.reshape(out, -1).astype(np.float32))
    return (
        torch.from_numpy(np.ascontiguousarray(flat[0])),
        torch.from_numpy(np.ascontiguousarray(flat[1])),
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


def _q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    out, n = blocks.shape[:2]
    low = _nibbles(blocks[:, :, :128], 64)  # value order: half, nibble, byte
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    high = ((blocks[:, :, 128:192].reshape(out, n, 2, 1, 32) >> shifts) & 0x03).reshape(out, n, 256)
    values = (low | (high << 4)).astype(np.int8) - 32
    scale = blocks[:, :, 192:208].view(np.int8).astype(np.float32) * _half(blocks[:, :, 208:210])
    return values, scale, None


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, dmin, packed = _half(blocks[:, :, 0:2]), _half(blocks[:, :, 2:4]), blocks[:, :, 4:16]
    first, second, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    s = np.concatenate([first & 63, (rest & 15) | ((first >> 6) << 4)], axis=-1).astype(np.float32)
    m = np.concatenate([second & 63, (rest >> 4) | ((second >> 6) << 4)], axis=-1).astype(np.float32)
    q = _nibbles(blocks[:, :, 16:], 32).reshape(*blocks.shape[:2], 8, 32)
    scale, offset = d * s, dmin * m
    empty = scale == 0
    values = np.where(empty[..., None], 8, q).astype(np.int8) - 8
    zero = np.where(empty, 1.0, offset / np.where(empty, 1.0, scale) - 8)
    return values, np.where(empty, offset, scale), zero


def regroup(
    values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int, to: int
) -> Decoded:
    """A decoded tensor in groups of `to` columns (`to` dividing `group`): each scale and zero point
    repeated, and zero points of 0 where the type has none."""
    if zero is None:
        zero = torch.zeros_like(scale)
    times = group // to
    return values, scale.repeat_interleave(times, dim=1), zero.repeat_interleave(times, dim=1)
