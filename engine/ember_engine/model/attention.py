"""Attention over the paged KV cache: writing new K/V into it and attending through block tables.

A step runs a mixed batch flattened into token rows: sequence i owns query rows
`query_start_loc[i]:query_start_loc[i+1]`, its new tokens sit at the last q_len positions of its
`seq_lens[i]` keys, and `block_tables[i, j]` names the cache block holding positions
`j*block_size .. (j+1)*block_size-1`. Rows past `query_start_loc[-1]` are padding: `store_kv` skips
them (slot -1) and their attention output is left unspecified.

The torch reference here is the CPU production path; the Triton kernels in `triton_attention` serve
CUDA tensors. `EMBER_ATTENTION=triton` or `=torch` overrides the choice (tests use the former with
`TRITON_INTERPRET=1` to run the kernels on CPU).

A cache may be FP8, E4M3 or E5M2 (`kv_quant`): writes then quantize with the layer's `k_scale`/`v_scale`
(one float each, or one per KV head), reads dequantize with them; both are ignored for a cache in the
model's dtype.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ember_engine.model import kv_quant
from ember_engine.model.context import ForwardContext


def _use_triton(t: Tensor) -> bool:
    mode = os.environ.get("EMBER_ATTENTION", "")
    if mode == "torch":
        return False
    return mode == "triton" or t.is_cuda


def store_kv(
    key: Tensor,
    value: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    k_scale: kv_quant.Scale = 1.0,
    v_scale: kv_quant.Scale = 1.0,
) -> None:
    """Write each row of key/value `[N, num_kv_heads, head_dim]` into the caches at its slot; slot -1 skips."""
    if _use_triton(key):
        from ember_engine.model import triton_kv_store

        triton_kv_store.store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        store_kv_reference(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


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
    plan: GatherPlan | None = None,
    k_scale: kv_quant.Scale = 1.0,
    v_scale: kv_quant.Scale = 1.0,
) -> Tensor:
    """Causal attention of q `[N, num_heads, head_dim]` over each sequence's cached keys; same shape and dtype.
    `plan` (the reference path's gather plan for this batch layout) saves rebuilding it per layer."""
    args = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len, scale)
    if _use_triton(q):
        from ember_engine.model import triton_attention

        return triton_attention.paged_attention(*args, k_scale=k_scale, v_scale=v_scale)
    return paged_attention_reference(*args, plan, k_scale=k_scale, v_scale=v_scale)


def context_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    ctx: ForwardContext,
    scale: float,
    k_scale: kv_quant.Scale = 1.0,
    v_scale: kv_quant.Scale = 1.0,
) -> Tensor:
    """`paged_attention` over the step's forward context. On the reference path the gather plan is
    built by the first layer and reused by the others (it depends only on the batch layout)."""
    if not _use_triton(q) and ctx.gather_plan is None:
        ctx.gather_plan = plan_gather(ctx.block_tables, ctx.seq_lens, ctx.query_start_loc, k_cache.shape[1])
    return paged_attention(
        q,
        k_cache,
        v_cache,
        ctx.block_tables,
        ctx.seq_lens,
        ctx.query_start_loc,
        ctx.max_query_len,
        ctx.max_seq_len,
        scale,
        plan=ctx.gather_plan,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def store_kv_reference(
    key: Tensor,
    value: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    k_scale: kv_quant.Scale = 1.0,
    v_scale: kv_quant.Scale = 1.0,
) -> None:
    block_size = k_cache.shape[1]
    rows = (slot_mapping >= 0).nonzero().squeeze(1)
    slots = slot_mapping[rows]
    # Index by (block, offset) rather than through a flattened view so non-contiguous caches work too.
    blocks, offsets = slots // block_size, slots % block_size
    if kv_quant.is_fp8(k_cache):  # written as bytes: indexed writes into float8 need not exist on a device
        fmt = k_cache.dtype
        k_cache.view(torch.uint8)[blocks, offsets] = kv_quant.quantize(key[rows], k_scale, fmt).view(
            torch.uint8
        )
        v_cache.view(torch.uint8)[blocks, offsets] = kv_quant.quantize(value[rows], v_scale, fmt).view(
            torch.uint8
        )
        return
    k_cache[blocks, offsets] = key[rows].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[rows].to(v_cache.dtype)


# Sequences with at most this many query rows (decodes, and decodes with speculative tokens) attend as one
# padded batch; longer chunks (prefills) attend one sequence at a time.
SHORT_QUERY = 17


@dataclass(slots=True)
class GatherPlan:
    """Where each sequence's keys sit in the cache (flat slot numbers), for one batch layout."""

    # The short-query sequences, padded to Q query rows and L keys:
    short_rows: Tensor | None  # [B, Q] query row of each (padded: the sequence's last real row)
    short_valid: Tensor | None  # [B, Q] True for real query rows
    short_slots: Tensor | None  # [B, L] slot of each key position; past its length, its first slot
    short_mask: Tensor | None  # [B, 1, Q, L] True where a key is attended (causal within the sequence)
    # per longer sequence: (first query row, end row, slots [seq_len], causal mask [q_len, seq_len]
    # or None when the chunk is the whole sequence and plain causal attention applies)
    prefills: list[tuple[int, int, Tensor, Tensor | None]]


def plan_gather(
    block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor, block_size: int
) -> GatherPlan:
    """Reads the lengths on the host, so it syncs when given CUDA tensors."""
    dev = block_tables.device
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [end - start for start, end in itertools.pairwise(starts)]
    short = [i for i, q_len in enumerate(q_lens) if q_len <= SHORT_QUERY]
    rows = valid = slots = mask = None
    if short:
        idx = torch.tensor(short, device=dev)
        q_len = torch.tensor([q_lens[i] for i in short], device=dev)
        seq_len = seq_lens[idx].long()
        queries = torch.arange(max(q_lens[i] for i in short), device=dev)
        positions = torch.arange(max(lens[i] for i in short), device=dev)
        rows = query_start_loc[idx].long()[:, None] + torch.minimum(queries[None, :], q_len[:, None] - 1)
        valid = queries[None, :] < q_len[:, None]
        query_pos = (seq_len - q_len)[:, None] + queries[None, :]  # [B, Q]
        pad = positions[None, :] >= seq_len[:, None]
        # Table entries past a sequence's used blocks may hold anything: never follow them.
        blocks = block_tables[idx].gather(1, (positions // block_size).expand(len(short), -1)).long()
        slots = blocks * block_size + positions % block_size
        # Padding reads the sequence's own first key (masked out): never another request's slots, so a
        # bad value elsewhere in the cache cannot leak in through a zero weight.
        slots = torch.where(pad, slots[:, :1], slots)
        mask = (positions[None, None, :] <= query_pos[:, :, None]) & ~pad[:, None, :]
        mask = mask[:, None]
    prefills = []
    for i, q_len_i in enumerate(q_lens):
        if q_len_i <= SHORT_QUERY:
            continue
        positions = torch.arange(lens[i], device=dev)
        seq_slots = block_tables[i, positions // block_size].long() * block_size + positions % block_size
        causal = None
        if q_len_i < lens[i]:  # a chunk after a cached prefix or earlier chunks: causal from its offset
            causal = positions[None, :] <= torch.arange(lens[i] - q_len_i, lens[i], device=dev)[:, None]
        prefills.append((starts[i], starts[i + 1], seq_slots, causal))
    return GatherPlan(rows, valid, slots, mask, prefills)


def _gather(cache: Tensor, slots: Tensor) -> Tensor:
    """Cache rows at `slots` (any shape) as float32 `[*slots.shape, num_kv_heads, head_dim]` (an FP8
    cache's stored values, before its scale)."""
    fp8 = kv_quant.is_fp8(cache)
    flat = (cache.view(torch.uint8) if fp8 else cache).flatten(0, 1)  # FP8 rows are selected as bytes
    rows = flat.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[2:])
    return kv_quant.decode_bytes(rows, cache.dtype) if fp8 else rows.float()


def paged_attention_reference(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    plan: GatherPlan | None = None,
    k_scale: kv_quant.Scale = 1.0,
    v_scale: kv_quant.Scale = 1.0,
) -> Tensor:
    """Float32 math in torch: the CPU path and the kernels' oracle. An FP8 cache is dequantized by folding
    its scales into the math: the K scale into the score factor, the V scale into the output; scales per
    KV head multiply each head's gathered keys and values instead."""
    fp8 = kv_quant.is_fp8(k_cache)
    heads = fp8 and (isinstance(k_scale, Tensor) or isinstance(v_scale, Tensor))
    k_heads = kv_quant.head_scales(k_scale, k_cache.shape[2], q.device).view(-1, 1, 1) if heads else None
    v_heads = kv_quant.head_scales(v_scale, k_cache.shape[2], q.device).view(-1, 1, 1) if heads else None
    k_fold = float(k_scale) if fp8 and not heads else 1.0
    v_fold = float(v_scale) if fp8 and not heads else 1.0
    score_scale = scale * k_fold
    if plan is None:
        plan = plan_gather(block_tables, seq_lens, query_start_loc, k_cache.shape[1])
    out = torch.empty_like(q)
    if plan.short_rows is not None and plan.short_slots is not None and plan.short_valid is not None:
        # One padded batch for all short queries: per-sequence kernels would dominate decode steps.
        rows, valid = plan.short_rows, plan.short_valid
        k = _gather(k_cache, plan.short_slots).transpose(1, 2)  # [B, Hk, L, D]
        v = _gather(v_cache, plan.short_slots).transpose(1, 2)
        if k_heads is not None and v_heads is not None:
            k, v = k * k_heads, v * v_heads
        qs = q[rows].float().transpose(1, 2)  # [B, H, Q, D]
        o = F.scaled_dot_product_attention(
            qs, k, v, attn_mask=plan.short_mask, scale=score_scale, enable_gqa=True
        )
        if v_fold != 1.0:
            o = o * v_fold
        out[rows[valid]] = o.transpose(1, 2)[valid].to(q.dtype)
    for start, end, slots, causal in plan.prefills:
        k = _gather(k_cache, slots).transpose(0, 1)  # [Hk, L, D]
        v = _gather(v_cache, slots).transpose(0, 1)
        if k_heads is not None and v_heads is not None:
            k, v = k * k_heads, v * v_heads
        qs = q[start:end].float().transpose(0, 1)
        o = F.scaled_dot_product_attention(
            qs, k, v, attn_mask=causal, is_causal=causal is None, scale=score_scale, enable_gqa=True
        )
        if v_fold != 1.0:
            o = o * v_fold
        out[start:end] = o.transpose(0, 1).to(q.dtype)
    return out
