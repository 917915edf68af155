"""Paged attention and KV stores: the torch reference against a naive oracle, the Triton kernels
against the reference (in Triton's CPU interpreter here, compiled on a GPU with the `gpu` mark)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate

import pytest
import torch
from torch import Tensor

from ember_engine.model import attention, triton_attention
from ember_engine.model.attention import (
    paged_attention,
    paged_attention_reference,
    store_kv,
    store_kv_reference,
)
from ember_engine.model.triton_attention import MAX_SPLITS, MIN_KEYS_PER_SPLIT, choose_num_splits

# (cached prefix, new tokens) per sequence: decodes, chunks after a cached prefix, whole prompts.
MIXED = [(0, 7), (12, 1), (20, 5), (0, 1), (33, 1), (9, 17), (0, 3), (5, 1)]
PAD_ROWS = 2
# Table entries past a sequence's blocks; reading one would index far outside the cache.
TABLE_PADDING = 1 << 30


@dataclass
class Batch:
    q: Tensor
    key: Tensor
    value: Tensor
    k_cache: Tensor
    v_cache: Tensor
    block_tables: Tensor
    seq_lens: Tensor
    query_start_loc: Tensor
    slot_mapping: Tensor
    max_query_len: int
    max_seq_len: int
    scale: float
    num_tokens: int  # real rows; PAD_ROWS padding rows follow

    def attention_args(self) -> tuple:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.max_query_len,
            self.max_seq_len,
            self.scale,
        )


def make_batch(
    specs: list[tuple[int, int]],
    block_size: int = 16,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
) -> Batch:
    """A step's inputs with each prefix already cached; this step's K/V not yet stored."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil((cached + new) / block_size) for cached, new in specs]
    num_blocks = sum(blocks_per_seq) + 3
    physical = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.full((len(specs), max(blocks_per_seq) + 1), TABLE_PADDING, dtype=torch.int32)
    cached_slots, new_slots = [], []
    for i, ((cached, new), n) in enumerate(zip(specs, blocks_per_seq, strict=True)):
        block_tables[i, :n] = physical[:n]
        physical = physical[n:]
        positions = torch.arange(cached + new)
        slots = block_tables[i, positions // block_size].long() * block_size + positions % block_size
        cached_slots.append(slots[:cached])
        new_slots.append(slots[cached:])
    slot_mapping = torch.cat([*new_slots, torch.full((PAD_ROWS,), -1)])
    num_tokens = len(slot_mapping) - PAD_ROWS

    # Generated where they are used: the GPU tests' caches run to gigabytes.
    dev_gen = torch.Generator(device).manual_seed(seed)
    caches = torch.randn(2, num_blocks * block_size, num_kv_heads, head_dim, generator=dev_gen, device=device)
    # Memory no prefix owns is nan, so a read outside a sequence's keys poisons the output.
    unowned = torch.ones(num_blocks * block_size, dtype=torch.bool)
    unowned[torch.cat(cached_slots)] = False
    caches[:, unowned.to(device)] = math.nan
    k_cache, v_cache = caches.to(dtype).view(2, num_blocks, block_size, num_kv_heads, head_dim)
    # q and key/value as views of one fused projection, like the model produces them: not contiguous.
    qkv_shape = (num_tokens + PAD_ROWS, num_heads + 2 * num_kv_heads, head_dim)
    qkv = torch.randn(qkv_shape, generator=dev_gen, device=device).to(dtype)
    q_lens = [new for _, new in specs]
    return Batch(
        q=qkv[:, :num_heads],
        key=qkv[:, num_heads : num_heads + num_kv_heads],
        value=qkv[:, num_heads + num_kv_heads :],
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor([c + n for c, n in specs], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, *accumulate(q_lens)], dtype=torch.int32, device=device),
        slot_mapping=slot_mapping.to(device),
        max_query_len=max(q_lens),
        max_seq_len=max(c + n for c, n in specs),
        scale=head_dim**-0.5,
        num_tokens=num_tokens,
    )


def naive_attention(b: Batch) -> Tensor:
    """The definition, one query row and head at a time, in float64."""
    block_size = b.k_cache.shape[1]
    num_heads = b.q.shape[1]
    group = num_heads // b.k_cache.shape[2]
    out = torch.zeros(b.num_tokens, num_heads, b.q.shape[2], dtype=torch.float64)
    starts = b.query_start_loc.tolist()
    for i, seq_len in enumerate(b.seq_lens.tolist()):
        table = b.block_tables[i].tolist()
        where = [(table[pos // block_size], pos % block_size) for pos in range(seq_len)]
        keys = torch.stack([b.k_cache[blk, off] for blk, off in where]).double().cpu()
        values = torch.stack([b.v_cache[blk, off] for blk, off in where]).double().cpu()
        q_len = starts[i + 1] - starts[i]
        for j in range(q_len):
            row = starts[i] + j
            visible = seq_len - q_len + j + 1
            for h in range(num_heads):
                scores = keys[:visible, h // group] @ b.q[row, h].double().cpu() * b.scale
                out[row, h] = scores.softmax(0) @ values[:visible, h // group]
    return out


@pytest.fixture
def use_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_ATTENTION", "triton")


@pytest.fixture
def use_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_ATTENTION", "torch")


def stored(b: Batch) -> Batch:
    store_kv(b.key, b.value, b.k_cache, b.v_cache, b.slot_mapping)
    return b


# --- torch reference ---------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (4, 1), (2, 2)])
@pytest.mark.parametrize("head_dim", [32, 40])
def test_reference_matches_naive(
    use_torch: None, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    b = stored(make_batch(MIXED, block_size, num_heads, num_kv_heads, head_dim, seed=block_size + head_dim))
    out = paged_attention(*b.attention_args())
    assert out.shape == b.q.shape and out.dtype == b.q.dtype
    torch.testing.assert_close(out[: b.num_tokens].double(), naive_attention(b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "specs",
    [
        [(0, 1), (40, 1), (127, 1)],
        [(0, 9)],
        [(130, 4), (3, 2)],
        # verification of speculative tokens (short queries after a long prefix) beside a decode, a short
        # whole prompt and a chunk just past the padded batch's limit
        [(50, 5), (7, 1), (0, 17), (33, 18), (200, 3)],
    ],
)
def test_reference_single_kind_batches(specs: list[tuple[int, int]]) -> None:
    b = make_batch(specs, block_size=128, head_dim=48)
    store_kv_reference(b.key, b.value, b.k_cache, b.v_cache, b.slot_mapping)
    out = paged_attention_reference(*b.attention_args())
    torch.testing.assert_close(out[: b.num_tokens].double(), naive_attention(b), atol=1e-5, rtol=1e-5)


def test_store_kv_reference_writes_slots_and_skips_padding() -> None:
    key, value = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    k_cache, v_cache = torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8)
    store_kv_reference(key, value, k_cache, v_cache, torch.tensor([9, -1, 0, 6]))
    expected_k, expected_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    for row, (blk, off) in zip([0, 2, 3], [(2, 1), (0, 0), (1, 2)], strict=True):
        expected_k[blk, off], expected_v[blk, off] = key[row], value[row]
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


# --- Triton kernels ------------------------------------------------------------------------------
# In the interpreter on CPU; compiled where a GPU is present (conftest sets TRITON_INTERPRET accordingly).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_store_kv_triton_matches_reference(use_triton: None, cache_dtype: torch.dtype) -> None:
    b = make_batch(MIXED, block_size=8, num_kv_heads=2, head_dim=40, device=DEVICE)
    expected_k, expected_v = b.k_cache.to(cache_dtype), b.v_cache.to(cache_dtype)
    store_kv_reference(b.key, b.value, expected_k, expected_v, b.slot_mapping)
    k_cache, v_cache = b.k_cache.to(cache_dtype), b.v_cache.to(cache_dtype)
    store_kv(b.key, b.value, k_cache, v_cache, b.slot_mapping)
    # equal_nan: the cache memory that no slot names must stay exactly as it was.
    torch.testing.assert_close(k_cache, expected_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, expected_v, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize(
    ("block_size", "num_heads", "num_kv_heads", "head_dim"),
    [(8, 4, 2, 32), (16, 4, 1, 40), (16, 2, 2, 48), (8, 8, 2, 32), (128, 4, 2, 40)],
)
def test_triton_unified_matches_reference(
    use_triton: None, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    b = stored(
        make_batch(MIXED, block_size, num_heads, num_kv_heads, head_dim, device=DEVICE, seed=block_size)
    )
    out = triton_attention.paged_attention(*b.attention_args(), num_splits=1)
    expected = paged_attention_reference(*b.attention_args())
    assert out.shape == b.q.shape and out.dtype == b.q.dtype
    torch.testing.assert_close(out[: b.num_tokens], expected[: b.num_tokens], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "block_size"), [(4, 1, 8), (4, 2, 16)])
@pytest.mark.parametrize("num_splits", [2, 3, 5])
def test_triton_split_kv_matches_reference(
    use_triton: None, num_heads: int, num_kv_heads: int, block_size: int, num_splits: int
) -> None:
    decodes = [(299, 1), (127, 1), (190, 1), (0, 1), (256, 1)]
    b = stored(make_batch(decodes, block_size, num_heads, num_kv_heads, 40, device=DEVICE, seed=num_splits))
    out = triton_attention.paged_attention(*b.attention_args(), num_splits=num_splits)
    expected = paged_attention_reference(*b.attention_args())
    torch.testing.assert_close(out[: b.num_tokens], expected[: b.num_tokens], atol=1e-4, rtol=1e-4)


def test_triton_split_kv_handles_prefill_chunks(use_triton: None) -> None:
    # Segments that lie past a chunk row's causal limit must drop out of the merge.
    b = stored(make_batch([(150, 6), (70, 1), (0, 20)], block_size=16, device=DEVICE))
    out = triton_attention.paged_attention(*b.attention_args(), num_splits=3)
    expected = paged_attention_reference(*b.attention_args())
    torch.testing.assert_close(out[: b.num_tokens], expected[: b.num_tokens], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_float16_matches_reference(use_triton: None, num_splits: int) -> None:
    # bfloat16 runs only in the GPU tests: the interpreter's tl.dot multiplies bf16 bit patterns as integers.
    specs = MIXED if num_splits == 1 else [(299, 1), (90, 1), (0, 1)]
    b = stored(make_batch(specs, block_size=16, head_dim=40, dtype=torch.float16, device=DEVICE))
    out = triton_attention.paged_attention(*b.attention_args(), num_splits=num_splits)
    expected = paged_attention_reference(*b.attention_args())
    assert out.dtype == torch.float16
    torch.testing.assert_close(out[: b.num_tokens], expected[: b.num_tokens], atol=2e-3, rtol=2e-3)


def test_choose_num_splits() -> None:
    # Prefill chunks in the batch: never split.
    assert choose_num_splits(max_query_len=2, max_seq_len=8192, num_seqs=1, num_kv_heads=1, num_sms=132) == 1
    # Enough programs to fill the device already.
    assert choose_num_splits(1, 8192, num_seqs=64, num_kv_heads=8, num_sms=132) == 1
    # Too few keys for even two segments of MIN_KEYS_PER_SPLIT.
    assert choose_num_splits(1, 2 * MIN_KEYS_PER_SPLIT - 1, num_seqs=1, num_kv_heads=8, num_sms=132) == 1
    # Small decode batch, long context: fill the idle SMs.
    assert choose_num_splits(1, 4096, num_seqs=4, num_kv_heads=8, num_sms=132) == 264 // 32
    # Bounded by the keys available and by MAX_SPLITS.
    assert choose_num_splits(1, 3 * MIN_KEYS_PER_SPLIT, num_seqs=1, num_kv_heads=1, num_sms=132) == 3
    assert choose_num_splits(1, 1 << 20, num_seqs=1, num_kv_heads=1, num_sms=132) == MAX_SPLITS


def test_dispatch_follows_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(triton_attention, "paged_attention", lambda *a, **kw: calls.append("triton"))
    monkeypatch.setattr(attention, "paged_attention_reference", lambda *a, **kw: calls.append("torch"))
    b = make_batch([(0, 1)])
    for mode, expected in [("triton", "triton"), ("torch", "torch"), ("", "torch")]:
        monkeypatch.setenv("EMBER_ATTENTION", mode)
        paged_attention(*b.attention_args())
        assert calls.pop() == expected


# --- compiled, on a GPU ---------------------------------------------------------------------------


def gpu_batch(specs: list[tuple[int, int]], seed: int) -> Batch:
    b = make_batch(specs, 16, 32, 8, 128, dtype=torch.bfloat16, device="cuda", seed=seed)
    return stored(b)


def assert_close_bf16(b: Batch, num_splits: int | None = None) -> None:
    out = triton_attention.paged_attention(*b.attention_args(), num_splits=num_splits)
    expected = paged_attention_reference(*b.attention_args())
    torch.testing.assert_close(out[: b.num_tokens], expected[: b.num_tokens], atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_store_kv_matches_reference() -> None:
    b = make_batch(MIXED * 8, 16, 32, 8, 128, dtype=torch.bfloat16, device="cuda")
    k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
    triton_attention.store_kv(b.key, b.value, k_cache, v_cache, b.slot_mapping)
    store_kv_reference(b.key, b.value, b.k_cache, b.v_cache, b.slot_mapping)
    torch.testing.assert_close(k_cache, b.k_cache, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, b.v_cache, atol=0, rtol=0, equal_nan=True)


@pytest.mark.gpu
def test_gpu_mixed_batch_matches_reference() -> None:
    contexts = torch.randint(1, 4096, (56,), generator=torch.Generator().manual_seed(1)).tolist()
    chunks = [(0, 512), (1000, 256), (3000, 96), (0, 33), (2048, 300), (17, 1), (64, 64), (4000, 95)]
    assert_close_bf16(gpu_batch([(n, 1) for n in contexts] + chunks, seed=2))


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_gpu_decode_batch_matches_reference(num_splits: int | None) -> None:
    contexts = torch.randint(1, 4096, (64,), generator=torch.Generator().manual_seed(3)).tolist()
    assert_close_bf16(gpu_batch([(n, 1) for n in contexts], seed=4), num_splits)


@pytest.mark.gpu
def test_gpu_small_decode_batch_splits() -> None:
    b = gpu_batch([(4095, 1), (3000, 1), (10, 1), (2500, 1)], seed=5)
    num_sms = torch.cuda.get_device_properties(b.q.device).multi_processor_count
    assert choose_num_splits(1, b.max_seq_len, 4, 8, num_sms) > 1
    assert_close_bf16(b)


@pytest.mark.gpu
def test_gpu_float32_is_exact() -> None:
    b = stored(make_batch(MIXED * 4, 16, 32, 8, 128, device="cuda"))
    out = triton_attention.paged_attention(*b.attention_args())
    expected = paged_attention_reference(*b.attention_args())
    torch.testing.assert_close(out[: b.num_tokens], expected[: b.num_tokens], atol=1e-4, rtol=1e-4)
