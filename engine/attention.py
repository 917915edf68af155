"""Attention over the paged KV cache: writing new K/V into it and attending through block tables.

A step runs a mixed batch flattened into token rows: sequence i owns query rows
`query_start_loc[i]:query_start_loc[i+1]`, its new tokens sit at the last q_len positions of its
`seq_lens[i]` keys, and `block_tables[i, j]` names the cache block holding positions
`j*block_size .. (j+1)*block_size-1`. Rows past `query_start_loc[-1]` are padding: `store_kv` skips
them (slot -1) and their attention output is left unspecified.

The torch reference here is the CPU production path; the Triton kernels in `triton_attention` serve
CUDA tensors. `EMBER_ATTENTION=triton` or `=torch` overrides the choice (tests use the former with
`TRITON_INTERPRET=1` to run the kernels on CPU).
"""

from __future__ import annotations

import itertools
import os

import torch
import torch.nn.functional as F
from torch import Tensor


def _use_triton(t: Tensor) -> bool:
    mode = os.environ.get("EMBER_ATTENTION", "")
    if mode == "torch":
        return False
    return mode == "triton" or t.is_cuda


def store_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write each row of key/value `[N, num_kv_heads, head_dim]` into the caches at its slot; slot -1 skips."""
    if _use_triton(key):
        from ember_engine import triton_attention

        triton_attention.store_kv(key, value, k_cache, v_cache, slot_mapping)
    else:
        store_kv_reference(key, value, k_cache, v_cache, slot_mapping)


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
) -> Tensor:
    """Causal attention of q `[N, num_heads, head_dim]` over each sequence's cached keys; same shape and dtype."""
    if _use_triton(q):
        from ember_engine import triton_attention

        return triton_attention.paged_attention(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len, scale
        )
    return paged_attention_reference(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len, scale
    )


def store_kv_reference(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    block_size = k_cache.shape[1]
    rows = (slot_mapping >= 0).nonzero().squeeze(1)
    slots = slot_mapping[rows]
    # Index by (block, offset) rather than through a flattened view so non-contiguous caches work too.
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[rows].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[rows].to(v_cache.dtype)


def _gather_kv(cache: Tensor, block_tables: Tensor, seq_lens: Tensor, max_len: int) -> Tensor:
    """Keys of each sequence as `[B, max_len, num_kv_heads, head_dim]` float32, zeros past its length."""
    block_size = cache.shape[1]
    positions = torch.arange(max_len, device=cache.device)
    valid = positions[None, :] < seq_lens[:, None]
    table_cols = (positions // block_size).expand(seq_lens.shape[0], -1)
    # Table entries past a sequence's used blocks may hold anything, so never index the cache with them.
    blocks = torch.where(valid, block_tables.gather(1, table_cols), 0)
    kv = cache[blocks.long(), (positions % block_size)[None, :]].float()
    return kv.masked_fill_(~valid[:, :, None, None], 0.0)


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
) -> Tensor:
    """Float32 math in torch; reads the lengths on the host, so it syncs when given CUDA tensors."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [end - start for start, end in itertools.pairwise(starts)]

    decodes = [i for i, q_len in enumerate(q_lens) if q_len == 1]
    if decodes:
        # One padded batch for all single-token rows: per-sequence kernels would dominate decode steps.
        idx = torch.tensor(decodes, device=q.device)
        dec_lens = seq_lens[idx]
        longest = max(lens[i] for i in decodes)
        k = _gather_kv(k_cache, block_tables[idx], dec_lens, longest)
        v = _gather_kv(v_cache, block_tables[idx], dec_lens, longest)
        rows = query_start_loc[idx].long()
        qd = q[rows].float().view(len(decodes), num_kv_heads, group, head_dim)
        scores = torch.einsum("bkgd,blkd->bkgl", qd, k) * scale
        padding = torch.arange(longest, device=q.device)[None, :] >= dec_lens[:, None]
        scores = scores.masked_fill(padding[:, None, None, :], float("-inf"))
        probs = scores.softmax(dim=-1)
        out[rows] = torch.einsum("bkgl,blkd->bkgd", probs, v).reshape(-1, num_heads, head_dim).to(q.dtype)

    for i, q_len in enumerate(q_lens):
        if q_len == 1:
            continue
        seq_len = lens[i]
        k = _gather_kv(k_cache, block_tables[i : i + 1], seq_lens[i : i + 1], seq_len)[0]
        v = _gather_kv(v_cache, block_tables[i : i + 1], seq_lens[i : i + 1], seq_len)[0]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        causal = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        qs = q[starts[i] : starts[i + 1]].float().transpose(0, 1)
        o = F.scaled_dot_product_attention(
            qs, k.transpose(0, 1), v.transpose(0, 1), attn_mask=causal, scale=scale, enable_gqa=True
        )
        out[starts[i] : starts[i + 1]] = o.transpose(0, 1).to(q.dtype)
    return out
