"""Triton kernels for the paged KV cache; semantics and layout are documented in `attention`.

One attention kernel serves every batch shape. Its grid is (query block, KV head, key segment): a
program takes BLOCK_Q query tokens of one sequence times the query heads sharing one KV head, so each
K/V tile it loads serves the whole group, and walks that sequence's keys through the block table with
an online softmax. Decode-heavy batches with long contexts occupy few programs, so they also split the
keys into segments ("flash-decoding"): each segment writes a normalized partial output and its
log-sum-exp, and a second kernel merges the segments.

An FP8 cache (E4M3 or E5M2) is read as bytes and decoded in registers (`triton_kv_store.decode_fp8`);
its K scale is folded into the score factor and its V scale into the output's normalization.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ember_engine.model import kv_quant
from ember_engine.model.kernel_launch import jit, launch
from ember_engine.model.triton_kv_store import as_kernel_cache, decode_fp8
from ember_engine.model.triton_kv_store import store_kv as store_kv

# A segment shorter than this costs more in partial writes and merging than its parallelism earns.
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 16
# Programs per SM that keep an SM busy; fewer programs than this across the device leave SMs idle.
_PROGRAMS_PER_SM = 2
_LOG2_E = 1.4426950408889634


def choose_num_splits(
    max_query_len: int, max_seq_len: int, num_seqs: int, num_kv_heads: int, num_sms: int
) -> int:
    """How many key segments each sequence gets; 1 means no split-KV.

    Only pure decode batches split: a prefill chunk already yields many programs. The split fills the
    SMs that the `num_seqs * num_kv_heads` programs leave idle, keeping at least MIN_KEYS_PER_SPLIT
    keys per segment.
    """
    if max_query_len > 1:
        return 1
    by_occupancy = _PROGRAMS_PER_SM * num_sms // (num_seqs * num_kv_heads)
    by_length = max_seq_len // MIN_KEYS_PER_SPLIT
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


# Integer arguments that change while serving (batch size, segment length, the partials' strides, which
# follow the split count): specializing on them would compile variants mid-serving.
@jit(do_not_specialize=["num_seqs", "segment_len", "stride_on", "stride_oh", "stride_os", "stride_bt"])
def _attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    lse_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale_log2,
    v_scale,
    k_heads_ptr,
    v_heads_ptr,
    num_seqs,
    segment_len,
    stride_qn,
    stride_qh,
    stride_qd,
    stride_cb,
    stride_co,
    stride_ch,
    stride_cd,
    stride_on,
    stride_oh,
    stride_os,
    stride_od,
    stride_bt,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_P2: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr,
    KV_FP8: tl.constexpr,
    PER_HEAD: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    if PER_HEAD:  # an FP8 cache's scales per KV head: this program's head's
        scale_log2 = scale_log2 * tl.load(k_heads_ptr + kv_head)
        v_scale = tl.load(v_heads_ptr + kv_head)

    # Sequence i owns the q blocks from query_start_loc[i] // BLOCK_Q + i on: at least ceil(q_len / BLOCK_Q)
    # of them, so the host sizes the grid without reading the lengths. Counting the sequences that start
    # at or before this block finds its owner with independent vector loads, not a chain of scalar ones.
    seq = tl.zeros((), tl.int32) - 1
    for chunk in range(0, num_seqs, SEARCH_BLOCK):
        idx = chunk + tl.arange(0, SEARCH_BLOCK)
        starts = tl.load(query_start_loc_ptr + idx, mask=idx < num_seqs, other=0)
        seq += tl.sum(((starts // BLOCK_Q + idx <= q_block) & (idx < num_seqs)).to(tl.int32), 0)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first = (q_block - q_start // BLOCK_Q - seq) * BLOCK_Q
    if first >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)

    # Row r of the tile is query token r // GROUP_P2 with query head r % GROUP_P2 of this KV group.
    rows = tl.arange(0, BLOCK_Q * GROUP_P2)
    tok = first + rows // GROUP_P2
    head = kv_head * GROUP + rows % GROUP_P2
    row_ok = (tok < q_len) & (rows % GROUP_P2 < GROUP)
    dims = tl.arange(0, HEAD_P2)
    dim_ok = dims < HEAD_DIM
    q_rows = (q_start + tok) * stride_qn + head * stride_qh
    q_mask = row_ok[:, None] & dim_ok[None, :]
    # Zeros, not undefined lanes: padded dimensions must add nothing to the scores.
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :] * stride_qd, mask=q_mask, other=0.0)
    q_pos = seq_len - q_len + tok

    # Causality: no row of this block sees past the position of its last token.
    key_hi = tl.minimum(seq_len, seq_len - q_len + first + BLOCK_Q)
    key_lo = 0
    if SPLIT:
        key_lo = segment * segment_len
        key_hi = tl.minimum(key_hi, key_lo + segment_len)

    # A finite floor keeps exp2(m_old - m_new) from becoming nan while a row has seen no key yet.
    m = tl.full([BLOCK_Q * GROUP_P2], -1.0e30, tl.float32)
    denom = tl.zeros([BLOCK_Q * GROUP_P2], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P2, HEAD_P2], tl.float32)
    for start in range(key_lo, key_hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < key_hi
        block = tl.load(block_tables_ptr + seq * stride_bt + keys // BLOCK_SIZE, mask=key_ok, other=0)
        kv_off = block.to(tl.int64) * stride_cb + (keys % BLOCK_SIZE) * stride_co + kv_head * stride_ch
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off[:, None] + dims[None, :] * stride_cd, mask=kv_mask, other=0)
        v = tl.load(v_cache_ptr + kv_off[:, None] + dims[None, :] * stride_cd, mask=kv_mask, other=0)
        if KV_FP8 != 0:  # exact in q's dtype: every E4M3 and E5M2 value is a bfloat16, float16, float32 value
            k = decode_fp8(k, KV_FP8).to(q_ptr.dtype.element_ty)
            v = decode_fp8(v, KV_FP8).to(q_ptr.dtype.element_ty)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(key_ok[None, :] & (keys[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        denom = denom * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    # Only a split segment can hold no visible key for a row; it then contributes nothing to the merge.
    seen = denom > 0
    denom = tl.where(seen, denom, 1.0)
    acc = acc / denom[:, None]
    if KV_FP8 != 0:
        acc = acc * v_scale
    out_rows = (q_start + tok) * stride_on + head * stride_oh + segment * stride_os
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + out_rows[:, None] + dims[None, :] * stride_od, out, mask=q_mask)
    if SPLIT:
        # Base-2 log-sum-exp like the scores; the partial buffer is contiguous [N, H, S, HEAD_P2], so
        # dropping its last dimension indexes lse [N, H, S].
        lse = tl.where(seen, m + tl.log2(denom), float("-inf"))
        tl.store(lse_ptr + out_rows // HEAD_P2, lse, mask=row_ok)


@jit(do_not_specialize=["num_seqs", "num_splits"])
def _merge_splits_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    query_start_loc_ptr,
    num_seqs,
    num_heads,
    num_splits,
    stride_on,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    HEAD_P2: tl.constexpr,
    SPLITS_P2: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    # Padding rows have no partials to merge.
    if row >= tl.load(query_start_loc_ptr + num_seqs):
        return
    splits = tl.arange(0, SPLITS_P2)
    dims = tl.arange(0, HEAD_P2)
    split_ok = splits < num_splits
    dim_ok = dims < HEAD_DIM
    base = (row * num_heads + head) * num_splits + splits
    lse = tl.load(lse_ptr + base, mask=split_ok, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))
    part_mask = split_ok[:, None] & dim_ok[None, :]
    part = tl.load(part_ptr + base[:, None] * HEAD_P2 + dims[None, :], mask=part_mask, other=0.0)
    out = tl.sum(part * weight[:, None], 0) / tl.sum(weight, 0)
    dst = out_ptr + row * stride_on + head * stride_oh + dims * stride_od
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    num_splits: int | None = None,
    k_scale: kv_quant.Scale = 1.0,
    v_scale: kv_quant.Scale = 1.0,
) -> Tensor:
    """`num_splits` forces the number of key segments; by default `choose_num_splits` picks it.
    `k_scale`/`v_scale` dequantize an FP8 cache, one float each or one per KV head (and are ignored for
    any other cache)."""
    assert k_cache.stride() == v_cache.stride(), "k_cache and v_cache must share one layout"
    assert k_cache.dtype == v_cache.dtype, "the caches must share one dtype"
    fp8 = kv_quant.is_fp8(k_cache)
    assert fp8 or q.dtype == k_cache.dtype, "q and the caches must share one dtype"
    if not fp8:
        k_scale = v_scale = 1.0
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    per_head = isinstance(k_scale, Tensor) or isinstance(v_scale, Tensor)
    if per_head:  # the scalar factors carry no scale; each program loads its head's
        k_heads = kv_quant.head_scales(k_scale, num_kv_heads, q.device)
        v_heads = kv_quant.head_scales(v_scale, num_kv_heads, q.device)
        k_fold = v_fold = 1.0
    else:  # the pointers are never read: the sequence lengths stand in for them
        k_heads = v_heads = seq_lens
        k_fold, v_fold = float(k_scale), float(v_scale)
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = choose_num_splits(max_query_len, max_seq_len, num_seqs, num_kv_heads, _num_sms(q.device))
    group = num_heads // num_kv_heads
    group_p2 = triton.next_power_of_2(group)
    head_p2 = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs every dimension >= 16
    # Decode rows waste all but one token of a q block, so decode-only batches use the smallest tile.
    block_q = max(1, (16 if max_query_len == 1 else 64) // group_p2)
    # Tiles that keep every variant's values in registers on compute capability 7.5 to 9.0 (ptxas's report,
    # as Triton runs it: `python tests/kernel_compile.py --resources`). 128-wide heads on 4 warps spilled in
    # every variant; FP8 caches (their keys decoded in registers) and float32's IEEE dots spilled in tiles
    # of 64 keys a step, and in decode tiles on 4 warps. A decode of 128-wide heads over an FP8 cache is the
    # exception: on 8 warps it spilled 8 bytes a thread on 9.0, on 4 none on 8.0 to 9.0.
    decode, costly = max_query_len == 1, fp8 or q.dtype == torch.float32
    block_n = 64 if not costly else 16 if q.dtype == torch.float32 and not decode else 32
    warps = 8 if head_p2 >= 128 or (decode and costly) else 4
    if decode and fp8 and head_p2 >= 128:
        warps = 4
    segment_len = triton.cdiv(triton.cdiv(max_seq_len, num_splits), block_n) * block_n
    num_splits = triton.cdiv(max_seq_len, segment_len)

    if num_splits > 1:
        part = torch.empty(num_tokens, num_heads, num_splits, head_p2, device=q.device, dtype=torch.float32)
        lse = torch.empty(num_tokens, num_heads, num_splits, device=q.device, dtype=torch.float32)
        target, part_strides = part, part.stride()
    else:
        lse = out  # never written: SPLIT is off
        target, part_strides = out, (out.stride(0), out.stride(1), 0, out.stride(2))

    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    launch(
        _attention_kernel,
        grid,
        q,
        as_kernel_cache(k_cache),
        as_kernel_cache(v_cache),
        target,
        lse,
        block_tables,
        seq_lens,
        query_start_loc,
        scale * _LOG2_E * k_fold,
        v_fold,
        k_heads,
        v_heads,
        num_seqs,
        segment_len,
        *q.stride(),
        *k_cache.stride(),
        *part_strides,
        block_tables.stride(0),
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        HEAD_P2=head_p2,
        GROUP=group,
        GROUP_P2=group_p2,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        num_warps=warps,
        SPLIT=num_splits > 1,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SEARCH_BLOCK=128,
        KV_FP8=kv_quant.kernel_format(k_cache),
        PER_HEAD=per_head,
    )
    if num_splits > 1:
        launch(
            _merge_splits_kernel,
            (num_tokens, num_heads),
            part,
            lse,
            out,
            query_start_loc,
            num_seqs,
            num_heads,
            num_splits,
            *out.stride(),
            HEAD_DIM=head_dim,
            HEAD_P2=head_p2,
            SPLITS_P2=triton.next_power_of_2(num_splits),
        )
    return out
