"""GGUF's lattice i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S): each weight is a small
integer of one of llama.cpp's grids (as the `gguf` package holds them), signed, times its group's scale.
A type has at most 16 such integers (`table`), so a weight is held as a 4-bit code into them (`pack`:
`CodebookLinear`'s form, scheme `codebook`) under a float32 scale per group; `decode` gives the integers
themselves as int8 (for the parts of a merged projection in different types, held as `w8a16`). Blocks of
256 values; d is float16:
- IQ2_XXS (66 bytes, groups of 32): d, then per group two little-endian 32-bit words: the first four
  bytes index a 256-entry grid of 8 values (8, 25, 43), the second holds four 7-bit sign indices (bits
  7 k) into `ksigns` (8 signs of even parity) and the group scale s in its top 4 bits; the weight d (0.5 +
  s) / 4 times the value.
- IQ2_XS (74, groups of 16): d, 32 little-endian 16-bit words (9 bits of a 512-entry grid index, 7 of a
  sign index), 8 bytes of 4-bit group scales (low nibble first); the weight d (0.5 + s) / 4 times it.
- IQ2_S (82, groups of 16): d, 32 bytes of low grid index bits, 32 sign bytes (bit j for value j of 8),
  8 bytes of the index's two high bits (bits 2 j for entry 4 i + j), 8 bytes of 4-bit scales; a 1024-entry
  grid; the weight as IQ2_XS's.
- IQ3_XXS (98, groups of 32): d, 64 bytes each indexing a 256-entry grid of 4 values (4, 12, ..., 52, 62),
  then per group a 32-bit word of four sign indices and the scale in its top 4 bits; the weight d (0.5 +
  s) / 2 times the value.
- IQ3_S (110, groups of 32): d, 64 bytes of low grid index bits, 8 bytes of ninth bits (bit j of byte i
  for entry 8 i + j), 32 sign bytes, 4 bytes of 4-bit scales; a 512-entry grid of 4 odd values 1..15; the
  weight d (1 + 2 s) times it.
- IQ1_S (50, groups of 32): d, 32 bytes of low grid index bits, then per group a 16-bit word: 3 high index
  bits for each of its four entries (bits 3 k), a 3-bit scale s (bits 12-14) and the sign of a shift
  (bit 15); a 2048-entry grid of 8 values -1, 0, 1. The weight d (2 s + 1) (g +- 1/8), held as the
  integer 8 g +- 1 under d (2 s + 1) / 8.
- IQ1_M (56, groups of 16): 32 bytes of low index bits, 16 bytes each holding two entries' 3 high index
  bits and shift signs (a nibble each: bits 0-2 and 3), four 16-bit words of 3-bit scales (bits 3 k) whose
  top nibbles make d; the weight d (2 s + 1) (g +- 1/8), held as IQ1_S's.
"""

from __future__ import annotations

from functools import cache

import numpy as np

GROUP = {"IQ2_XXS": 32, "IQ2_XS": 16, "IQ2_S": 16, "IQ3_XXS": 32, "IQ3_S": 32, "IQ1_S": 32, "IQ1_M": 16}
BYTES = {"IQ2_XXS": 66, "IQ2_XS": 74, "IQ2_S": 82, "IQ3_XXS": 98, "IQ3_S": 110, "IQ1_S": 50, "IQ1_M": 56}


@cache
def _grid(kind: str) -> np.ndarray:
    """The type's grid, int16 [entries, values an entry]."""
    from gguf import quants

    table = getattr(quants, kind)
    table.init_grid()
    return table.grid.reshape(table.grid_shape).astype(np.int16)


@cache
def _ksigns() -> np.ndarray:
    """The 128 sign patterns the 7-bit sign indices name, as +-1 int16 [128, 8]."""
    from gguf import quants

    patterns = np.frombuffer(quants.IQ2_XXS.ksigns, dtype=np.uint8)
    return _bit_signs(patterns)


def _bit_signs(b: np.ndarray) -> np.ndarray:
    """Bytes [...] -> int16 [..., 8]: -1 where bit j is set, else 1."""
    bits = (b[..., None] >> np.arange(8, dtype=np.uint8)) & 1
    return 1 - 2 * bits.astype(np.int16)


def _half(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(b: np.ndarray) -> np.ndarray:
    """Bytes [..., n] -> [..., 2 n]: each byte's low nibble, then its high one."""
    return ((b[..., None] >> np.array([0, 4], np.uint8)) & 15).reshape(*b.shape[:-1], -1)


@cache
def _values(kind: str) -> tuple[int, ...]:
    """The type's signed integers, increasing (none is 0): IQ2's +-8, 25, 43; IQ3_XXS's +-4, 12, ..., 52,
    62; IQ3_S's odd +-1..15; IQ1's 8 g +- 1 for g in -1, 0, 1."""
    if kind.startswith("IQ1"):
        return tuple(sorted({8 * g + s for g in (-1, 0, 1) for s in (-1, 1)}))
    return tuple(sorted({s * int(m) for m in np.unique(_grid(kind)) for s in (-1, 1)}))


def table(kind: str) -> np.ndarray:
    """The type's integers padded with zeros to 16 entries (float32): a codebook layer's table."""
    values = _values(kind)
    return np.array(values + (0,) * (16 - len(values)), np.float32)


def pack(values: np.ndarray, kind: str) -> np.ndarray:
    """int8 values of `kind` [out, in] -> their 4-bit codes into `table(kind)`, two a byte (column 2 j in the
    low nibble): uint8 [out, in / 2]."""
    index = np.zeros(256, np.uint8)
    index[np.array(_values(kind)) + 128] = np.arange(len(_values(kind)), dtype=np.uint8)
    codes = index[values.astype(np.int16) + 128]
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def decode(b: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """Blocks [out, blocks, BYTES[kind]] -> (int8 values [out, blocks, 256], float32 scales [out, blocks,
    256 / GROUP[kind]])."""
    rows, n = b.shape[:2]
    if kind in ("IQ2_XXS", "IQ3_XXS"):
        d = _half(b[:, :, :2])
        if kind == "IQ2_XXS":  # per group: 4 index bytes, then the word of signs and scale
            words = np.ascontiguousarray(b[:, :, 2:]).reshape(rows, n, 8, 8)
            index = words[:, :, :, :4]
            aux = np.ascontiguousarray(words[:, :, :, 4:]).view("<u4")[..., 0]
        else:
            index = b[:, :, 2:66].reshape(rows, n, 8, 8)
            aux = np.ascontiguousarray(b[:, :, 66:98]).view("<u4")
        values = _grid(kind)[index].reshape(rows, n, 8, 4, 8)
        signs = _ksigns()[(aux[..., None] >> np.array([0, 7, 14, 21], np.uint32)) & 127]
        half = np.float32(0.25 if kind == "IQ2_XXS" else 0.5)
        scale = d * (np.float32(0.5) + (aux >> 28).astype(np.float32)) * half
        values = values * signs.reshape(rows, n, 8, 4, 8)
    elif kind == "IQ2_XS":
        d = _half(b[:, :, :2])
        words = np.ascontiguousarray(b[:, :, 2:66]).view("<u2")
        values = _grid(kind)[words & 511] * _ksigns()[words >> 9]
        scale = d * (np.float32(0.5) + _nibbles(b[:, :, 66:74]).astype(np.float32)) * np.float32(0.25)
    elif kind == "IQ2_S":
        d = _half(b[:, :, :2])
        high = (b[:, :, 66:74, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3
        index = b[:, :, 2:34].astype(np.uint16) | (high.reshape(rows, n, 32).astype(np.uint16) << 8)
        values = _grid(kind)[index] * _bit_signs(b[:, :, 34:66])
        scale = d * (np.float32(0.5) + _nibbles(b[:, :, 74:82]).astype(np.float32)) * np.float32(0.25)
    elif kind == "IQ3_S":
        d = _half(b[:, :, :2])
        ninth = (b[:, :, 66:74, None] >> np.arange(8, dtype=np.uint8)) & 1
        index = b[:, :, 2:66].astype(np.uint16) | (ninth.reshape(rows, n, 64).astype(np.uint16) << 8)
        values = _grid(kind)[index].reshape(rows, n, 32, 8) * _bit_signs(b[:, :, 74:106])
        scale = d * (1 + 2 * _nibbles(b[:, :, 106:110]))
    elif kind == "IQ1_S":
        d = _half(b[:, :, :2])
        aux = np.ascontiguousarray(b[:, :, 34:50]).view("<u2")  # [rows, n, 8]
        high = (aux[..., None] >> np.array([0, 3, 6, 9], np.uint16)) & 7
        index = b[:, :, 2:34].astype(np.uint16) | (high.reshape(rows, n, 32) << 8)
        shift = np.where(aux & 0x8000, -1, 1).astype(np.int16)  # [rows, n, 8]
        values = 8 * _grid(kind)[index].reshape(rows, n, 8, 32) + shift[..., None]
        scale = d * (2 * ((aux >> 12) & 7) + 1) * np.float32(0.125)
    elif kind == "IQ1_M":
        words = np.ascontiguousarray(b[:, :, 48:56]).view("<u2")  # [rows, n, 4]
        top = (words & 0xF000) >> np.array([12, 8, 4, 0], np.uint16)
        d = (top[..., 0] | top[..., 1] | top[..., 2] | top[..., 3]).view(np.float16).astype(np.float32)
        sub = ((words[..., None] >> np.array([0, 3, 6, 9], np.uint16)) & 7).reshape(rows, n, 16)
        nib = _nibbles(b[:, :, 32:48])  # [rows, n, 32]: entry 2 i low, 2 i + 1 high
        index = b[:, :, 0:32].astype(np.uint16) | ((nib & 7).astype(np.uint16) << 8)
        shift = np.where(nib & 8, -1, 1).astype(np.int16)
        values = 8 * _grid(kind)[index] + shift[..., None]
        scale = d[..., None] * (2 * sub + 1) * np.float32(0.125)
    else:
        raise ValueError(f"GGUF type {kind} is not a lattice i-quant")
    return values.reshape(rows, n, 256).astype(np.int8), scale.astype(np.float32)
