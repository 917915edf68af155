"""The Triton GEMM kernels of each scheme against the torch reference (dequantize, then matmul); on CPU
they run in Triton's interpreter, on a GPU compiled."""

from __future__ import annotations

import pytest
import torch

from ember_engine.model.quant import schemes
from ember_engine.model.quant.linear import quantize_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The torch path's tolerance for fp8 activations: on the CPU float32 sums (their rounding only); on a GPU
# cuBLAS's FP8 matmul, whose tensor cores (Hopper's) add the products with fewer bits than float32 has.
TORCH_FP8_TOLERANCE = 1e-3 if DEVICE == "cuda" else 1e-5
# (rows, in, out): a decode row, ragged tiles on every side, a prefill-sized block.
SHAPES = [(1, 128, 64), (5, 256, 96), (33, 128, 200)]


# (scheme, group size): w8a16 both per group (llm-compressor's W8A16) and per output channel (online);
# fp8 per output channel (online, compressed-tensors) and block-scaled in 64x64 tiles (Hugging Face's
# `weight_block_size` checkpoints), its activations quantized per token and group of 64 columns; w8a8 per
# output channel, its activations quantized to int8 per token.
LAYOUTS = [(scheme, 64) for scheme in schemes.SCHEMES if scheme != "w8a8"] + [
    ("w8a16", 0),
    ("fp8", 0),
    ("w8a8", 0),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda s: f"{s[0]}-g{s[1]}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_matches_reference(layout: tuple[str, int], shape: tuple[int, int, int], monkeypatch) -> None:  # type: ignore[no-untyped-def]
    scheme, group_size = layout
    m, k, n = shape
    g = torch.Generator().manual_seed(m * 1000 + n)
    linear = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
    layer = quantize_linear(linear, scheme, group_size=group_size).to(DEVICE)
    x = torch.randn(m, k, generator=g).to(DEVICE)
    if scheme == "fp8" and group_size:  # the reference quantizes activations the same way
        xq, xs = schemes.quantize_activation_fp8_groups(x, group_size)
        expected = (xq.float() * xs.repeat_interleave(group_size, dim=1)) @ layer.dequantized().t()
    elif scheme == "fp8":
        xq, xs = schemes.quantize_activation_fp8(x)
        expected = (xq.float() * xs) @ layer.dequantized().t()
    elif scheme == "w8a8":
        xq, xs = schemes.quantize_activation_int8(x)
        expected = (xq.float() * xs) @ layer.dequantized().t()
    else:
        expected = x @ layer.dequantized().t()
    monkeypatch.setenv("EMBER_QUANT_GEMM", "triton")
    got = layer(x)
    monkeypatch.setenv("EMBER_QUANT_GEMM", "torch")
    torch_path = layer(x)
    assert got.shape == expected.shape == (m, n)
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() <= 1e-3 * scale, scheme
    # The torch path computes in the activations' dtype (float32 here): rounding of the sums only.
    tolerance = TORCH_FP8_TOLERANCE if scheme == "fp8" and not group_size else 1e-5
    assert (torch_path - expected).abs().max().item() <= tolerance * scale, scheme


@pytest.mark.parametrize("tile", [0, 32], ids=["per-channel", "tiles-32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp8_weight_only_kernel_matches_reference(
    shape: tuple[int, int, int], tile: int, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """w8a16-fp8 (a checkpoint's FP8 weights with activations as they are): E4M3 bytes widened in the
    Triton kernel and in the CPU loops, times their channel's scale, or their tile's (block-scaled: each
    row holding the scales of its tiles, one per `tile` input columns)."""
    from ember_engine.model.quant.fp8_linear import Fp8WeightOnlyLinear

    m, k, n = shape
    g = torch.Generator().manual_seed(m * 1000 + n + 1)
    layer = Fp8WeightOnlyLinear(k, n, False, torch.float32, tile)
    w = torch.randn(n, k, generator=g) * 0.05
    if tile:
        q, tiles = schemes.quantize_fp8_blocks(w, (tile, tile))
        layer.set_rows(0, q, schemes.block_scales_per_row(tiles, n, tile))
        assert len(set(layer.weight_scale[0].tolist())) == k // tile  # the row's tiles differ
    else:
        layer.set_rows(0, *schemes.quantize_fp8(w))
    layer = layer.to(DEVICE)
    x = torch.randn(m, k, generator=g).to(DEVICE)
    expected = (x.double() @ layer.dequantized().double().t()).float()
    assert (layer.dequantized().cpu() - w).abs().max().item() <= 0.07 * w.abs().max().item()  # E4M3's step
    monkeypatch.setenv("EMBER_QUANT_GEMM", "triton")
    got = layer(x)
    monkeypatch.setenv("EMBER_QUANT_GEMM", "torch")
    torch_path = layer(x)
    scale = expected.abs().max().item()
    assert got.shape == torch_path.shape == (m, n)
    assert (got - expected).abs().max().item() <= 1e-3 * scale
    assert (torch_path - expected).abs().max().item() <= 1e-5 * scale


# GGUF's forms (`model/gguf/blocks.py`): int4 values in groups of 16 (Q3_K, and Q2_K with a float zero point
# per group) and 32 (Q4_K), int8 values in groups of 16 and 32 with float zero points (Q5_K, Q6_K, merged
# parts of different types held alike).
GGUF_FORMS = [
    ("w4a16", 16, False),
    ("w4a16", 16, True),
    ("w4a16", 32, True),
    ("w8a16", 16, True),
    ("w8a16", 32, True),
]


@pytest.mark.parametrize("form", GGUF_FORMS, ids=lambda f: f"{f[0]}-g{f[1]}{'-zeros' if f[2] else ''}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gguf_forms_kernel_matches_reference(
    form: tuple[str, int, bool], shape: tuple[int, int, int], monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    from ember_engine.model.quant.int_linear import Int4Linear, Int8Linear

    scheme, group, zeros = form
    m, k, n = shape
    g = torch.Generator().manual_seed(m * 1000 + n + group)
    if scheme == "w4a16":
        layer = Int4Linear(k, n, False, torch.float32, group, zero_points=zeros, float_zeros=zeros)
        values = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    else:
        layer = Int8Linear(k, n, False, torch.float32, group_size=group, zero_points=zeros)
        values = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    layer.set_rows(0, values, torch.rand(n, k // group, generator=g) * 0.01)
    if zeros:
        layer.set_zero_rows(0, torch.randn(n, k // group, generator=g) * 5)
    layer = layer.to(DEVICE)
    x = torch.randn(m, k, generator=g).to(DEVICE)
    expected = (x.double() @ layer.dequantized(torch.float64).t()).float()
    monkeypatch.setenv("EMBER_QUANT_GEMM", "triton")
    got = layer(x)
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() <= 1e-3 * scale, form


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_w8a8_with_a_static_input_scale_matches_reference(shape: tuple[int, int, int], monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """int8 activations under a checkpoint's calibrated scale (llm-compressor's static W8A8), values beyond
    its range saturating at -128 and 127: the Triton kernel and the CPU's int8 matmul."""
    m, k, n = shape
    g = torch.Generator().manual_seed(m + k + n)
    linear = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
    layer = quantize_linear(linear, "w8a8", group_size=0)
    layer.set_input_scale(torch.tensor([0.02]), "probe")
    layer.to(DEVICE)
    x = (torch.randn(m, k, generator=g) * 2).to(DEVICE)  # some beyond 127 * 0.02
    xq, xs = schemes.quantize_activation_int8_static(x, layer.input_scale)
    assert bool((xq == 127).any()) and bool((xq == -128).any())
    expected = (xq.float() * xs) @ layer.dequantized().t()
    for path in ("triton", "torch"):
        monkeypatch.setenv("EMBER_QUANT_GEMM", path)
        got = layer(x)
        assert (got - expected).abs().max().item() <= 1e-5 * expected.abs().max().item(), path


@pytest.mark.parametrize("kind", ["fp8", "fp8-block", "nvfp4", "w8a16-fp8", "w4a8-fp8"])
def test_e4m3_decoded_with_integers_gives_the_same_product(kind: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Where Triton has no E4M3 type (compute capability 8.0) the GEMM decodes E4M3 bytes with integer
    arithmetic; the product is the one the E4M3 type gives, to the bit. (On a GPU of 8.9 or more, the
    E4M3 type's path multiplies fp8, block-scaled fp8 and w4a8-fp8 with E4M3 tensor-core dots, whose sums
    round otherwise: there, within 1e-3 of the range.)"""
    from ember_engine.model.quant import triton_gemm
    from ember_engine.model.quant import triton_gemm_config as cfg

    g = torch.Generator().manual_seed(5)
    m, k, n = 5, 256, 96

    def e4m3_bytes(*shape: int) -> torch.Tensor:
        raw = torch.randint(0, 256, shape, generator=g, dtype=torch.int32).to(torch.uint8)
        return torch.where((raw & 0x7F) == 0x7F, raw & 0x80, raw)  # no NaN

    x = torch.randn(m, k, generator=g)
    scale = torch.rand(n, k // 64, generator=g) + 0.5
    calls = {
        "fp8": (
            e4m3_bytes(m, k),
            e4m3_bytes(n, k),
            scale[:, 0].contiguous(),
            cfg.FP8,
            1,
            torch.rand(m) + 0.1,
        ),
        "fp8-block": (
            e4m3_bytes(m, k),
            e4m3_bytes(n, k),
            scale,
            cfg.FP8_BLOCK,
            64,
            torch.rand(m, k // 64) + 0.1,
        ),
        "nvfp4": (x, e4m3_bytes(n, k // 2), e4m3_bytes(n, k // 16) & 0x7F, cfg.FP4, 16, torch.rand(n) + 1),
        "w8a16-fp8": (x, e4m3_bytes(n, k), scale, cfg.FP8_WEIGHT, 64, None),
        "w4a8-fp8": (
            e4m3_bytes(m, k),
            e4m3_bytes(n, k // 2),
            e4m3_bytes(n, k // 64 * 16),
            cfg.W4_FP8,
            64,
            torch.rand(n),
        ),
    }
    xs, w, s, weight, group, x_scale = (
        t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in calls[kind]
    )
    out = torch.float32
    native = triton_gemm.run_gemm(xs, w, s, n, weight, group=group, x_scale=x_scale, out_dtype=out)
    monkeypatch.setattr(triton_gemm, "capability", lambda device: (8, 0))
    decoded = triton_gemm.run_gemm(xs, w, s, n, weight, group=group, x_scale=x_scale, out_dtype=out)
    assert torch.isfinite(native).all() and native.abs().max() > 0
    if DEVICE == "cpu" or kind in ("nvfp4", "w8a16-fp8"):
        assert torch.equal(decoded, native)
    else:
        assert (decoded - native).abs().max().item() <= 1e-3 * native.abs().max().item()


# Every layout the online schemes give, in the two widest tile classes (64 x 128 at 100 rows, 128 x 64 at
# 300), with the K steps each capability's GPU compiles; w8a8 not on 7.5, where its int8 dots do not exist
# and the layer takes its torch path
CAPABILITY_LAYOUTS = [
    pytest.param(layout, cc, id=f"{layout[0]}-g{layout[1]}-sm{cc[0]}{cc[1]}")
    for cc in [(7, 5), (8, 0), (8, 9)]
    for layout in LAYOUTS
    if not (layout[0] == "w8a8" and cc < (8, 0))
]


def test_decode_tiles_on_9_0_take_the_longest_k_step_their_groups_allow() -> None:
    """On 9.0 a decode tile (up to 16 rows) of the kinds measured there takes 32 columns and K steps of
    256 (an H200's figures are under `ember bench gemm`); a K step lies in one group of scales, so groups
    of 128 take 128 (the choice had gone from a longer step straight to 64). Float32 activations, other
    GPUs and the kinds not measured keep their tiles."""
    from ember_engine.model.quant import triton_gemm_config as cfg

    def tile(
        weight: int, group: int, dtype: torch.dtype = torch.bfloat16, cc: tuple[int, int] = (9, 0)
    ) -> tuple[int, int]:
        options = cfg.kernel_options(weight, 1, 14336, group, dtype, cc)
        return options["BLOCK_N"], options["BLOCK_K"]

    assert tile(cfg.INT8, 4096) == tile(cfg.FP8, 1) == tile(cfg.W8A8, 1) == (32, 256)
    assert tile(cfg.INT8, 128) == tile(cfg.INT4, 128) == tile(cfg.FP8_BLOCK, 128) == (32, 128)
    assert tile(cfg.INT4, 64) == (32, 64)
    assert tile(cfg.INT8, 4096, torch.float32) == (64, 32)
    assert tile(cfg.INT8, 4096, cc=(8, 9)) == tile(cfg.CODEBOOK, 128) == (64, 128)


_OWN_TILES: dict[tuple[str, int, int], tuple[torch.nn.Module, torch.Tensor, torch.Tensor]] = {}


def _own_tiles_product(
    scheme: str, group_size: int, m: int
) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A layer of `scheme` (seeded by `m`), its input and the product in the interpreter's own tiles: the
    same for every capability compared with it, so made once (each is seconds of interpreted programs)."""
    key = (scheme, group_size, m)
    if key not in _OWN_TILES:
        g = torch.Generator().manual_seed(m + 7)
        k, n = 128, 160
        linear = torch.nn.Linear(k, n, bias=False)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
        layer = quantize_linear(linear, scheme, group_size=group_size).to(DEVICE)
        x = torch.randn(m, k, generator=g).to(DEVICE)
        _OWN_TILES[key] = (layer, x, layer(x))
    return _OWN_TILES[key]


@pytest.mark.parametrize("m", [100, 300])
@pytest.mark.parametrize(("layout", "cc"), CAPABILITY_LAYOUTS)
def test_each_capability_s_tiles_give_the_product(
    layout: tuple[str, int], m: int, cc: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiles a GPU of compute capability `cc` runs (`triton_gemm_config.kernel_options`: shorter K
    steps below 9.0, 16 on 7.5 and for block-scaled fp8 decoded with integers on 8.0; for these float32
    activations of the unquantized kinds, 64 x 64 tiles with K steps of 16) give the product the
    interpreter's own tiles give: the same sums in another order, within float32 rounding. (8.9's E4M3
    dots run here as the interpreter's.)"""
    from ember_engine.model.quant import triton_gemm

    scheme, group_size = layout
    monkeypatch.setenv("EMBER_QUANT_GEMM", "triton")
    layer, x, default = _own_tiles_product(scheme, group_size, m)
    monkeypatch.setattr(triton_gemm, "capability", lambda device: cc)
    got = layer(x)
    # On a GPU the fp8 kinds' own tiles multiply E4M3 on its tensor cores, which add a K step's products
    # in fewer bits than float32 has (9.0's warpgroup dots): the products agree to that precision.
    tolerance = TORCH_FP8_TOLERANCE if scheme == "fp8" else 1e-5
    assert (got - default).abs().max().item() <= tolerance * default.abs().max().item(), scheme


@pytest.mark.parametrize(
    "cc", [None, (8, 0), (8, 9), (9, 0)], ids=lambda cc: f"sm{cc[0]}{cc[1]}" if cc else "own"
)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda s: f"{s[0]}-g{s[1]}")
def test_half_activations_give_the_product(
    layout: tuple[str, int], cc: tuple[int, int] | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """float16 activations, in the tiles and K steps each capability takes for a half type: the dots take
    half operands where float32 activations take IEEE float32 ones, so this is the path bfloat16 models
    run on a GPU (the same kernel, another type: Triton's interpreter cannot run bfloat16's, converting
    int8 to it as NaN). The reference is the float32 product of the same operands; the kernel rounds the
    dequantized weights to float16, hence the wider tolerance."""
    from ember_engine.model.quant import triton_gemm

    scheme, group_size = layout
    m, k, n = 65, 128, 200
    g = torch.Generator().manual_seed(m + n)
    linear = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
    layer = quantize_linear(linear, scheme, group_size=group_size).to(DEVICE)
    x = torch.randn(m, k, generator=g).half()
    if scheme == "fp8" and group_size:
        xq, xs = schemes.quantize_activation_fp8_groups(x, group_size)
        operand = xq.float() * xs.repeat_interleave(group_size, dim=1)
    elif scheme == "fp8":
        xq, xs = schemes.quantize_activation_fp8(x)
        operand = xq.float() * xs
    elif scheme == "w8a8":
        xq, xs = schemes.quantize_activation_int8(x)
        operand = xq.float() * xs
    else:
        operand = x.float()
    expected = operand @ layer.dequantized().float().cpu().t()
    monkeypatch.setenv("EMBER_QUANT_GEMM", "triton")
    if cc is not None:
        monkeypatch.setattr(triton_gemm, "capability", lambda device: cc)
    got = layer(x.to(DEVICE)).cpu()
    assert got.dtype == torch.float16 and got.shape == (m, n)
    assert (got.float() - expected).abs().max().item() <= 4e-3 * expected.abs().max().item(), scheme
