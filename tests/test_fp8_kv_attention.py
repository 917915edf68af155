"""The FP8 KV cache at the kernel level (E4M3, and E5M2 where marked): stores quantize like `kv_quant.quantize` (the Triton kernel to the
byte), attention over an FP8 cache equals attention over the dequantized cache (tight), and stays close to
attention over the full-precision cache (loose, stated below). Triton runs in its CPU interpreter here and
compiled where a GPU is present."""

from __future__ import annotations

import pytest
import torch
from test_attention import MIXED, Batch, make_batch

from ember_engine.model import kv_quant, triton_attention, triton_kv_store
from ember_engine.model.attention import paged_attention_reference, store_kv, store_kv_reference
from ember_engine.model.kernel_launch import launch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
# Attention over an FP8 cache against the full-precision cache it was quantized from (unit-variance keys
# and values, scale 1): E4M3 keeps 3 mantissa bits, a relative error of at most 2**-4 per element; the
# largest error over the batch stays under 0.15 and the mean under 0.02.
MAX_ERR, MEAN_ERR = 0.15, 0.02


@pytest.fixture
def use_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_ATTENTION", "triton")


# Per format: around saturation (its largest value, the midpoint past it), far beyond, half the smallest
# subnormal, and a negative subnormal.
EXTRA = {
    FP8: [0.0, -0.0, 447.9, 449.0, 463.9, 464.0, 1e6, -1e6, 2.0**-10, 1e-30, -1.4e-3],
    E5M2: [0.0, -0.0, 57343.0, 57345.0, 61439.0, 61440.0, 1e9, -1e9, 2.0**-17, 1e-30, -3e-5],
}


def edge_values(dtype: torch.dtype = FP8) -> torch.Tensor:
    """Every finite value of the format, the midpoints between neighbours (ties), values just off them,
    subnormals, saturation and zeros of both signs."""
    finite = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    finite = finite[finite.isfinite()].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    near = torch.cat([mids * (1 + 2**-20), mids * (1 - 2**-20)])
    return torch.cat([finite, mids, near, torch.tensor(EXTRA[dtype])])


def quantized(b: Batch, k_scale: float, v_scale: float, dtype: torch.dtype = FP8) -> Batch:
    """The batch with FP8 caches quantized from its full-precision ones."""
    b.k_cache = kv_quant.quantize(b.k_cache, k_scale, dtype)
    b.v_cache = kv_quant.quantize(b.v_cache, v_scale, dtype)
    return b


def test_reference_store_quantizes_saturates_and_rounds_to_nearest_even() -> None:
    values = torch.tensor([1.0, 1.0625, 1.1875, 500.0, -500.0, 0.0009765625, 0.0029296875, 3.0])
    key = values.view(8, 1, 1)
    k_cache = torch.zeros(2, 4, 1, 1, dtype=FP8)
    v_cache = torch.zeros(2, 4, 1, 1, dtype=FP8)
    store_kv_reference(key, key * 2, k_cache, v_cache, torch.arange(8), k_scale=1.0, v_scale=2.0)
    # 1.0625 lies halfway between 1.0 and 1.125 (even: 1.0); 1.1875 between 1.125 and 1.25 (even: 1.25);
    # 2**-10 halfway between 0 and the smallest subnormal 2**-9 (even: 0); 3 * 2**-10 rounds to 2 * 2**-9.
    expected = [1.0, 1.0, 1.25, 448.0, -448.0, 0.0, 0.00390625, 3.0]
    assert k_cache.flatten().float().tolist() == expected
    assert v_cache.flatten().float().tolist() == expected  # values twice as large, scale 2


def test_dequantized_reads_are_the_values_times_the_scale() -> None:
    x = torch.randn(64)
    q = kv_quant.quantize(x, 0.25)
    assert torch.equal(kv_quant.dequantize(q, 0.25), q.float() * 0.25)
    assert (kv_quant.dequantize(q, 0.25) - x).abs().max() <= 2**-4 * x.abs().max()


@pytest.mark.parametrize("cache", [FP8, E5M2])
@pytest.mark.parametrize("scale", [1.0, 0.37, 3.5])
def test_triton_store_writes_the_reference_bytes(use_triton: None, scale: float, cache: torch.dtype) -> None:
    values = edge_values(cache) * scale
    values = values[torch.randperm(len(values), generator=torch.Generator().manual_seed(0))]
    n = len(values) // 8
    key = values[: n * 8].view(n, 2, 4).to(DEVICE)
    value = -key.flip(0)
    slots = torch.randperm(n + 5, generator=torch.Generator().manual_seed(1))[:n].to(DEVICE)
    slots[::7] = -1  # padding rows are skipped
    caches = [torch.full((n + 5, 1, 2, 4), 7.0, device=DEVICE).to(cache) for _ in range(4)]
    store_kv_reference(key, value, caches[0], caches[1], slots, k_scale=scale, v_scale=scale / 2)
    store_kv(key, value, caches[2], caches[3], slots, k_scale=scale, v_scale=scale / 2)
    assert torch.equal(caches[2].view(torch.uint8), caches[0].view(torch.uint8))
    assert torch.equal(caches[3].view(torch.uint8), caches[1].view(torch.uint8))
    assert caches[0].float().isfinite().all()  # saturated, never inf


def test_triton_decode_is_exact_for_every_byte() -> None:
    import triton
    import triton.language as tl

    @triton.jit
    def decode_all(src_ptr, dst_ptr):
        idx = tl.arange(0, 256)
        tl.store(dst_ptr + idx, triton_kv_store.decode_e4m3(tl.load(src_ptr + idx)))

    every = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    out = torch.empty(256, device=DEVICE)
    launch(decode_all, (1,), every, out)
    expected = every.view(FP8).float()
    assert torch.equal(out.isnan(), expected.isnan())
    finite = ~expected.isnan()
    assert torch.equal(out[finite], expected[finite])
    assert torch.equal(out[finite].signbit(), expected[finite].signbit())


@pytest.mark.parametrize("dtype", [FP8, E5M2])
def test_the_torch_path_reads_every_byte_as_torch_converts_it(dtype: torch.dtype) -> None:
    every = torch.arange(256, dtype=torch.uint8).repeat(3).view(3, 16, 16)
    out, expected = kv_quant.decode_bytes(every, dtype), every.view(dtype).float()
    assert out.shape == expected.shape and out.dtype == torch.float32
    assert torch.equal(out.isnan(), expected.isnan())
    known = ~expected.isnan()
    assert torch.equal(out[known], expected[known]) and torch.equal(out.signbit(), expected.signbit())


def _dequantized(b: Batch, k_scale: float, v_scale: float) -> tuple:
    args = list(b.attention_args())
    args[1] = kv_quant.dequantize(b.k_cache, k_scale)
    args[2] = kv_quant.dequantize(b.v_cache, v_scale)
    return tuple(args)


@pytest.mark.parametrize("cache", [FP8, E5M2])
@pytest.mark.parametrize(("k_scale", "v_scale"), [(1.0, 1.0), (0.05, 0.02)])
def test_reference_on_fp8_equals_reference_on_the_dequantized_cache(
    k_scale: float, v_scale: float, cache: torch.dtype
) -> None:
    b = make_batch(MIXED, block_size=8, head_dim=40, seed=3)
    b.k_cache, b.v_cache = b.k_cache * k_scale * 20, b.v_cache * v_scale * 20
    b = quantized(b, k_scale, v_scale, cache)
    store_kv_reference(b.key, b.value, b.k_cache, b.v_cache, b.slot_mapping, k_scale, v_scale)
    out = paged_attention_reference(*b.attention_args(), k_scale=k_scale, v_scale=v_scale)
    expected = paged_attention_reference(*_dequantized(b, k_scale, v_scale))
    torch.testing.assert_close(out[: b.num_tokens], expected[: b.num_tokens], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("cache", [FP8, E5M2])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_on_fp8_matches_the_reference(
    use_triton: None, num_splits: int, dtype: torch.dtype, cache: torch.dtype
) -> None:
    specs = MIXED if num_splits == 1 else [(299, 1), (90, 1), (0, 1), (150, 6)]
    b = make_batch(specs, block_size=16, num_heads=4, num_kv_heads=2, head_dim=40, dtype=dtype, device=DEVICE)
    b = quantized(b, 0.5, 0.25, cache)
    store_kv(b.key, b.value, b.k_cache, b.v_cache, b.slot_mapping, k_scale=0.5, v_scale=0.25)
    out = triton_attention.paged_attention(
        *b.attention_args(), num_splits=num_splits, k_scale=0.5, v_scale=0.25
    )
    assert out.dtype == dtype
    expected = paged_attention_reference(*_dequantized(b, 0.5, 0.25))
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out[: b.num_tokens], expected[: b.num_tokens].to(dtype), atol=tol, rtol=tol)


def test_fp8_attention_stays_close_to_full_precision(use_triton: None) -> None:
    full = make_batch(MIXED, block_size=16, head_dim=40, device=DEVICE, seed=5)
    store_kv(full.key, full.value, full.k_cache, full.v_cache, full.slot_mapping)
    expected = paged_attention_reference(*full.attention_args())
    fp8 = quantized(make_batch(MIXED, block_size=16, head_dim=40, device=DEVICE, seed=5), 1.0, 1.0)
    store_kv(fp8.key, fp8.value, fp8.k_cache, fp8.v_cache, fp8.slot_mapping)
    for out in (
        triton_attention.paged_attention(*fp8.attention_args()),
        paged_attention_reference(*fp8.attention_args()),
    ):
        err = (out - expected)[: fp8.num_tokens].abs()
        assert 0 < err.max().item() < MAX_ERR  # not exact (the cache is quantized), but close
        assert err.mean().item() < MEAN_ERR


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [FP8, E5M2])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_gpu_bfloat16_queries_over_an_fp8_cache(num_splits: int | None, dtype: torch.dtype) -> None:
    contexts = torch.randint(1, 4096, (48,), generator=torch.Generator().manual_seed(7)).tolist()
    specs = [(n, 1) for n in contexts] + [(0, 512), (1000, 256), (17, 1), (4000, 95)]
    b = make_batch(specs, 16, 32, 8, 128, dtype=torch.bfloat16, device="cuda", seed=8)
    b = quantized(b, 0.5, 0.25, dtype)
    store_kv(b.key, b.value, b.k_cache, b.v_cache, b.slot_mapping, k_scale=0.5, v_scale=0.25)
    expected_k = kv_quant.quantize(b.key.float(), 0.5, dtype)
    written = b.k_cache.view(-1, 8, 128)[b.slot_mapping[: b.num_tokens]]
    assert torch.equal(written.view(torch.uint8), expected_k[: b.num_tokens].view(torch.uint8))
    out = triton_attention.paged_attention(
        *b.attention_args(), num_splits=num_splits, k_scale=0.5, v_scale=0.25
    )
    expected = paged_attention_reference(*_dequantized(b, 0.5, 0.25))
    torch.testing.assert_close(out[: b.num_tokens], expected[: b.num_tokens].bfloat16(), atol=2e-2, rtol=2e-2)
