"""Triton side of the KV cache's storage: the kernel writing new K/V rows into their slots, and the E4M3
encoding and decoding an FP8 cache goes through (`kv_quant` states the format).

The FP8 cache is passed to the kernels as its bytes (a uint8 view) and E4M3 is encoded and decoded with
integer arithmetic rather than through Triton's float8 type: the result is the same on every GPU
(compute capability 8.0 has no E4M3 conversion instruction) and in the CPU interpreter, and rounds to
nearest-even like torch's own conversion, so the Triton and torch paths store identical bytes.
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
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_inv_scale,
    v_inv_scale,
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
    if KV_FP8:
        tl.store(k_cache_ptr + dst, encode_e4m3(k.to(tl.float32) * k_inv_scale), mask=mask)
        tl.store(v_cache_ptr + dst, encode_e4m3(v.to(tl.float32) * v_inv_scale), mask=mask)
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
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    assert k_cache.stride() == v_cache.stride(), "k_cache and v_cache must share one layout"
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    launch(
        _store_kv_kernel,
        (num_tokens,),
        key,
        value,
        as_kernel_cache(k_cache),
        as_kernel_cache(v_cache),
        slot_mapping,
        kv_quant.reciprocal(k_scale),
        kv_quant.reciprocal(v_scale),
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        BLOCK_SIZE=k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_P2=triton.next_power_of_2(num_kv_heads),
        HEAD_P2=triton.next_power_of_2(head_dim),
        KV_FP8=kv_quant.is_fp8(k_cache),
    )
