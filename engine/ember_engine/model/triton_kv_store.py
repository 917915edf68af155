"""Triton side of the KV cache's storage: the kernel writing new K/V rows into their slots, and the E4M3
and E5M2 encoding and decoding an FP8 cache goes through (`kv_quant` states the formats).

An FP8 cache is passed to the kernels as its bytes (a uint8 view) and encoded and decoded with integer
arithmetic rather than through Triton's float8 types: the result is the same on every GPU (compute
capability 8.0 has no FP8 conversion instructions) and in the CPU interpreter, and rounds to
nearest-even like torch's own conversion, so the Triton and torch paths store identical bytes. The
kernels take the format as `KV_FP8` (`kv_quant.kernel_format`: 0 none, 1 E4M3, 2 E5M2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ember_engine.model import kv_quant
from ember_engine.model.kernel_launch import launch


@triton.jit
def encode_e4m3(x):
    """float32 -> E4M3 byte (uint8): saturating at ±448, ties to even; nan -> 0x7f (sign kept)."""
    raw = x.to(tl.int32, bitcast=True)
    sign = (raw >> 24) & 0x80
    is_nan = (raw & 0x7FFFFFFF) > 0x7F800000  # from the bits: no float comparison for a compiler to fold
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    mag_bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    mag = mag_bits.to(tl.float32, bitcast=True)
    # Normal range (>= 2**-6): keep 3 mantissa bits, rounding to nearest-even on the 20 dropped ones; a
    # carry rolls into the exponent, which is rebiased from 127 to 7.
    rounded = mag_bits + 0x7FFFF + ((mag_bits >> 20) & 1)
    normal = (rounded >> 20) - (120 << 3)
    # Subnormal range: multiples of 2**-9; adding and removing 2**23 rounds to an integer, ties to even.
    # 8 (a carry out of the subnormals) is exactly the code of 2**-6.
    sub = ((mag * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(mag < 0.015625, sub, normal)
    code = tl.where(is_nan, 0x7F, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def decode_e4m3(byte):
    """E4M3 byte (uint8) -> float32, exactly; built as float32 bits throughout, since a float negation
    compiles to 0 - x on a GPU, which turns -0.0 into +0.0."""
    b = byte.to(tl.int32)
    sign = (b & 0x80) << 24
    mag = b & 0x7F
    normal = (mag << 20) + (120 << 23)
    sub = (mag.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)  # multiples of 2**-9
    bits = tl.where(mag < 8, sub, normal)
    bits = tl.where(mag == 0x7F, 0x7FC00000, bits)  # the quiet NaN
    return (bits | sign).to(tl.float32, bitcast=True)


@triton.jit
def encode_e5m2(x):
    """float32 -> E5M2 byte (uint8): saturating at ±57344, ties to even; nan -> 0x7f (sign kept)."""
    raw = x.to(tl.int32, bitcast=True)
    sign = (raw >> 24) & 0x80
    is_nan = (raw & 0x7FFFFFFF) > 0x7F800000
    x = tl.minimum(tl.maximum(x, -57344.0), 57344.0)
    mag_bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    mag = mag_bits.to(tl.float32, bitcast=True)
    # Normal range (>= 2**-14): keep 2 mantissa bits, rounding to nearest-even on the 21 dropped ones; the
    # exponent is rebiased from 127 to 15.
    rounded = mag_bits + 0xFFFFF + ((mag_bits >> 21) & 1)
    normal = (rounded >> 21) - (112 << 2)
    # Subnormal range: multiples of 2**-16, rounded as for E4M3; 4 is exactly the code of 2**-14.
    # (Only a subnormal's own magnitude goes through it: larger ones would not fit the int32.)
    small = tl.minimum(mag, 6.103515625e-05)
    sub = ((small * 65536.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(mag < 6.103515625e-05, sub, normal)
    code = tl.where(is_nan, 0x7F, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def decode_e5m2(byte):
    """E5M2 byte (uint8) -> float32, exactly (0x7c is inf, 0x7d to 0x7f NaN, as float16's top byte);
    built as float32 bits, like `decode_e4m3`."""
    b = byte.to(tl.int32)
    sign = (b & 0x80) << 24
    mag = b & 0x7F
    normal = (mag << 21) + (112 << 23)
    sub = (mag.to(tl.float32) * 1.52587890625e-05).to(tl.int32, bitcast=True)  # multiples of 2**-16
    bits = tl.where(mag < 4, sub, normal)
    bits = tl.where(mag >= 0x7C, tl.where(mag == 0x7C, 0x7F800000, 0x7FC00000), bits)
    return (bits | sign).to(tl.float32, bitcast=True)


@triton.jit
def decode_fp8(byte, KV_FP8: tl.constexpr):
    """A cache byte of format KV_FP8 (1: E4M3, 2: E5M2) -> float32."""
    # A statement, not a conditional expression: the compiler keeps only the branch a constexpr takes.
    if KV_FP8 == 2:  # noqa: SIM108
        value = decode_e5m2(byte)
    else:
        value = decode_e4m3(byte)
    return value


@triton.jit
def encode_fp8(x, KV_FP8: tl.constexpr):
    """float32 -> a cache byte of format KV_FP8 (1: E4M3, 2: E5M2)."""
    if KV_FP8 == 2:  # noqa: SIM108 (as in decode_fp8)
        code = encode_e5m2(x)
    else:
        code = encode_e4m3(x)
    return code


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_inv_scale,
    v_inv_scale,
    k_inv_ptr,
    v_inv_ptr,
    stride_kn,
    stride_kh,
    stride_kd,
    stride_vn,
    stride_vh,
    stride_vd,
    stride_cb,
    stride_co,
    stride_ch,
    stride_cd,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_P2: tl.constexpr,
    HEAD_P2: tl.constexpr,
    KV_FP8: tl.constexpr,
    PER_HEAD: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_P2)[:, None]
    dims = tl.arange(0, HEAD_P2)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    dst = (
        (slot // BLOCK_SIZE) * stride_cb
        + (slot % BLOCK_SIZE) * stride_co
        + heads * stride_ch
        + dims * stride_cd
    )
    k = tl.load(key_ptr + row * stride_kn + heads * stride_kh + dims * stride_kd, mask=mask)
    v = tl.load(value_ptr + row * stride_vn + heads * stride_vh + dims * stride_vd, mask=mask)
    if KV_FP8 != 0:
        if PER_HEAD:  # each head's own reciprocal scale, [HEADS_P2, 1]
            k_inv = tl.load(k_inv_ptr + heads, mask=heads < NUM_KV_HEADS, other=1.0)
            v_inv = tl.load(v_inv_ptr + heads, mask=heads < NUM_KV_HEADS, other=1.0)
            tl.store(k_cache_ptr + dst, encode_fp8(k.to(tl.float32) * k_inv, KV_FP8), mask=mask)
            tl.store(v_cache_ptr + dst, encode_fp8(v.to(tl.float32) * v_inv, KV_FP8), mask=mask)
        else:
            tl.store(k_cache_ptr + dst, encode_fp8(k.to(tl.float32) * k_inv_scale, KV_FP8), mask=mask)
            tl.store(v_cache_ptr + dst, encode_fp8(v.to(tl.float32) * v_inv_scale, KV_FP8), mask=mask)
    else:
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def as_kernel_cache(cache: Tensor) -> Tensor:
    """What a kernel is given for a cache: an FP8 cache's bytes, any other cache as it is."""
    return cache.view(torch.uint8) if kv_quant.is_fp8(cache) else cache


def store_kv(
    key: Tensor,
    value: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    k_scale: kv_quant.Scale = 1.0,
    v_scale: kv_quant.Scale = 1.0,
) -> None:
    assert k_cache.stride() == v_cache.stride(), "k_cache and v_cache must share one layout"
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    fmt = kv_quant.kernel_format(k_cache)
    per_head = fmt != 0 and (isinstance(k_scale, Tensor) or isinstance(v_scale, Tensor))
    if per_head:  # one float32 reciprocal per head; the scalars are then unused
        k_inv = kv_quant.head_scales(kv_quant.reciprocal(k_scale), num_kv_heads, key.device)
        v_inv = kv_quant.head_scales(kv_quant.reciprocal(v_scale), num_kv_heads, key.device)
        k_inv_scale = v_inv_scale = 1.0
    else:  # the pointers are never read: the slot mapping stands in for them
        k_inv = v_inv = slot_mapping
        k_inv_scale = v_inv_scale = 1.0
        if fmt != 0:
            k_inv_scale, v_inv_scale = (
                float(kv_quant.reciprocal(k_scale)),
                float(kv_quant.reciprocal(v_scale)),
            )
    launch(
        _store_kv_kernel,
        (num_tokens,),
        key,
        value,
        as_kernel_cache(k_cache),
        as_kernel_cache(v_cache),
        slot_mapping,
        k_inv_scale,
        v_inv_scale,
        k_inv,
        v_inv,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        BLOCK_SIZE=k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_P2=triton.next_power_of_2(num_kv_heads),
        HEAD_P2=triton.next_power_of_2(head_dim),
        KV_FP8=fmt,
        PER_HEAD=per_head,
    )
