"""The one-launch activation quantizers of the GPU path (`triton_act_quant`) against the torch reference
(`schemes.quantize_activation_*`, run on the CPU, where torch divides exactly), byte for byte and scale
for scale; on CPU they run in Triton's interpreter, on a GPU compiled."""

from __future__ import annotations

import pytest
import torch

from ember_engine.model.quant import schemes
from ember_engine.model.quant import triton_act_quant as act
from ember_engine.model.quant.linear import quantize_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rows, columns): one decode row, a width under one block, several blocks with a ragged last one.
SHAPES = [(1, 128), (3, 1000), (2, 4160)]


def _same(got: tuple[torch.Tensor, torch.Tensor], expected: tuple[torch.Tensor, torch.Tensor]) -> None:
    (q, s), (q_ref, s_ref) = got, expected
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape
    assert s.shape == s_ref.shape and s.dtype == torch.float32
    as_bytes = torch.uint8 if q.dtype == torch.float8_e4m3fn else torch.int8
    differ = (q.cpu().view(as_bytes) != q_ref.view(as_bytes)).sum().item()
    assert differ == 0, f"{differ} values differ"
    assert torch.equal(s.cpu(), s_ref)


def _rows(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows of very different magnitudes (1e-6 to 1e3), the first starting with zeros."""
    m, k = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-6, 3, max(m, 2))[:m, None]
    x[0, :7] = 0.0
    x[0, 7] = -0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_dynamic_rows_match_the_reference(shape: tuple[int, int], dtype: torch.dtype) -> None:
    x = _rows(shape, dtype, shape[1])
    _same(act.fp8_rows(x.to(DEVICE)), schemes.quantize_activation_fp8(x))
    _same(act.int8_rows(x.to(DEVICE)), schemes.quantize_activation_int8(x))
    # fbgemm's activation_scale_ub: rows larger than it saturate at +-448
    _same(act.fp8_rows(x.to(DEVICE), 0.5), schemes.quantize_activation_fp8(x, 0.5))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_torch_reference_quantizes_alike_on_every_device(dtype: torch.dtype) -> None:
    """The torch quantizers (a GPU's torch path, and the reference the kernel tests take there) give the
    CPU's bytes and scales on this device. On CUDA torch divided by a Python number through its
    reciprocal, one unit in the last place off the quotient at times: on an H200 a w8a8 product's
    reference came out a code away from the Triton kernel's, which divides exactly."""
    for shape in [*SHAPES, (64, 4096)]:
        x = _rows(shape, dtype, 7)
        on_device = x.to(DEVICE)
        _same(schemes.quantize_activation_int8(on_device), schemes.quantize_activation_int8(x))
        _same(schemes.quantize_activation_fp8(on_device), schemes.quantize_activation_fp8(x))
        if shape[1] % 128 == 0:
            _same(
                schemes.quantize_activation_fp8_groups(on_device, 128),
                schemes.quantize_activation_fp8_groups(x, 128),
            )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_groups_match_the_reference(dtype: torch.dtype) -> None:
    x = _rows((3, 512), dtype, 7)
    x[1, 128:256] = 0.0  # a group of zeros: its scale is 1e-12 / 448
    for group in (64, 128):
        _same(act.fp8_groups(x.to(DEVICE), group), schemes.quantize_activation_fp8_groups(x, group))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_static_scales_saturate_as_the_reference(dtype: torch.dtype) -> None:
    x = _rows((3, 300), dtype, 11)
    for scale in (torch.tensor(0.003), torch.tensor([0.25])):
        got = act.fp8_static(x.to(DEVICE), scale.to(DEVICE))
        expected = schemes.quantize_activation_fp8_static(x, scale)
        _same(got, expected)
        assert bool((expected[0].float().abs() == 448).any())
        _same(
            act.int8_static(x.to(DEVICE), scale.to(DEVICE)), schemes.quantize_activation_int8_static(x, scale)
        )


def test_ties_round_to_even() -> None:
    """Under scale 1: every midpoint between neighbouring E4M3 values (subnormals included) and beyond
    448, and every half-integer from -130.5 to 130.5 for int8."""
    values = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).float()[:127]  # 0 .. 448
    mids = (values[:-1] + values[1:]) / 2
    fp8_x = torch.cat([mids, -mids, values, -values, torch.tensor([449.0, 464.0, 1e6, -1e6])])[None, :]
    one = torch.tensor(1.0)
    _same(
        act.fp8_static(fp8_x.to(DEVICE), one.to(DEVICE)), schemes.quantize_activation_fp8_static(fp8_x, one)
    )
    halves = (torch.arange(-261, 262, dtype=torch.float32) / 2)[None, :]
    _same(
        act.int8_static(halves.to(DEVICE), one.to(DEVICE)),
        schemes.quantize_activation_int8_static(halves, one),
    )
    ties = schemes.quantize_activation_int8_static(halves, one)[0]
    assert ties[0, 261 + 1].item() == 0 and ties[0, 261 + 3].item() == 2  # 0.5 -> 0, 1.5 -> 2


def test_no_rows() -> None:
    x = torch.zeros(0, 64, device=DEVICE)
    q, s = act.fp8_rows(x)
    assert q.shape == (0, 64) and s.shape == (0, 1)


def _same_with_nans(
    got: tuple[torch.Tensor, torch.Tensor], expected: tuple[torch.Tensor, torch.Tensor]
) -> None:
    """As `_same`, NaN matching NaN (a NaN's sign bit, which IEEE leaves open, not compared)."""
    (q, s), (q_ref, s_ref) = got, expected
    q, q_ref = q.cpu().float(), q_ref.float()
    assert torch.equal(q.isnan(), q_ref.isnan()) and torch.equal(q.nan_to_num(), q_ref.nan_to_num())
    assert torch.equal(s.cpu().isnan(), s_ref.isnan()) and torch.equal(
        s.cpu().nan_to_num(), s_ref.nan_to_num()
    )


def test_a_nan_reaches_its_scale_as_in_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN in a row (or group) gives that row's (group's) scale NaN and an int8 value of 0, as the
    reference does, so the product's row is NaN. The quantizer's maxima dropped the NaN: the row's scale
    came from its other values, int8 saturated the NaN to -128, and a w8a8 layer returned a finite row."""
    x = _rows((3, 1000), torch.float32, 5)
    x[1, 600] = float("nan")
    cases = [
        (act.fp8_rows(x.to(DEVICE)), schemes.quantize_activation_fp8(x)),
        (act.fp8_rows(x.to(DEVICE), 0.5), schemes.quantize_activation_fp8(x, 0.5)),
        (act.int8_rows(x.to(DEVICE)), schemes.quantize_activation_int8(x)),
        (act.fp8_groups(x[:, :768].to(DEVICE), 128), schemes.quantize_activation_fp8_groups(x[:, :768], 128)),
    ]
    scale = torch.tensor(0.003)
    cases.append(
        (act.int8_static(x.to(DEVICE), scale.to(DEVICE)), schemes.quantize_activation_int8_static(x, scale))
    )
    cases.append(
        (act.fp8_static(x.to(DEVICE), scale.to(DEVICE)), schemes.quantize_activation_fp8_static(x, scale))
    )
    for i, (got, expected) in enumerate(cases):
        assert bool(expected[1].isnan().any()) == (i < 4)  # the dynamic scales of row 1 (group 4) are NaN
        _same_with_nans(got, expected)
    monkeypatch.setenv("EMBER_QUANT_GEMM", "triton")
    layer = quantize_linear(torch.nn.Linear(1000, 48, bias=False), "w8a8", group_size=0).to(DEVICE)
    with torch.inference_mode():
        y = layer(x.to(DEVICE)).cpu()
    assert bool(y[1].isnan().all()) and bool(y[[0, 2]].isfinite().all())
