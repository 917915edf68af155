"""`ember bench gemm`: each quantized layer's product against the full-precision product of the same shape,
side by side in one run, on one device.

A row per (layout, rows): the layer's forward on `rows` activation rows (on CUDA the Triton GEMM, on the
CPU its compiled loops and torch), the time of `F.linear` on the full-precision weight in the same dtype
and the ratio of the two (above 1: the quantized product is faster), its weight bytes against the
full-precision weight's, and its error: the largest difference from the product of the activations (as
the layout quantizes them) with the dequantized weight, over that product's largest magnitude. Shapes are
`K x N` (input by output features); the defaults are a 8B model's attention and MLP projections.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ember_engine.model.quant import schemes
from ember_engine.model.quant.layer import QuantLinear
from ember_engine.model.quant.linear import quantize_linear
from ember_engine.model.quant.w4a8_linear import W4Fp8Linear

# name -> (scheme given to quantize_linear, group size, inputs quantized at run time)
LAYOUTS: dict[str, tuple[str, int, str]] = {
    "fp8": ("fp8", 0, ""),
    "fp8-block128": ("fp8", 128, ""),
    "w8a16": ("w8a16", 0, ""),
    "w8a16-g128": ("w8a16", 128, ""),
    "w8a8": ("w8a8", 0, ""),
    "w4a16-g128": ("w4a16", 128, ""),
    "w4afp8-g128": ("w4a16", 128, "fp8"),
    "nf4-b64": ("bitsandbytes", 64, ""),
    "w4a8fp8-g128": ("w4a8-fp8", 128, ""),  # ModelOpt's W4A8_AWQ arithmetic (`modelopt_w4a8`)
}
# w4a8fp8's static activation scale: the inputs are standard normal, E4M3's largest value is 448
W4A8_INPUT_SCALE = 5.0 / 448


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of: {', '.join(LAYOUTS)}")
    p.add_argument("--shapes", default="4096x4096,4096x14336,14336x4096", help="K x N, comma-separated")
    p.add_argument("--rows", default="1,16,64,256,1024", help="activation rows, comma-separated")
    p.add_argument("--dtype", default="auto", help="activations and full weights (auto: bfloat16 on CUDA)")
    p.add_argument("--device", default="auto", help="cuda or cpu (auto: cuda when available)")
    p.add_argument("--repeats", type=int, default=20, help="calls per timing run (see `time_call`)")
    p.add_argument(
        "--gemm",
        choices=["auto", "triton", "torch"],
        default="auto",
        help="the layers' path (EMBER_QUANT_GEMM): auto, the engine's (Triton on CUDA, the compiled loops on "
        "the CPU); torch on CUDA: cuBLAS's FP8 matmul for fp8, the dequantized weight otherwise; triton: CUDA only",
    )
    p.add_argument("--json", help="write the results here")


def _parse(args: argparse.Namespace) -> tuple[list[str], list[tuple[int, int]], list[int]]:
    layouts = [s for s in args.layouts.split(",") if s]
    unknown = [s for s in layouts if s not in LAYOUTS]
    if unknown:
        raise SystemExit(f"--layouts: unknown {', '.join(unknown)}; known: {', '.join(LAYOUTS)}")
    try:
        shapes = [(int(k), int(n)) for k, n in (s.lower().split("x") for s in args.shapes.split(",") if s)]
        rows = [int(r) for r in args.rows.split(",") if r]
    except ValueError as e:
        raise SystemExit(f"--shapes takes KxN,... and --rows M,...: {e}") from None
    if not shapes or not rows or min(min(s) for s in shapes) < 1 or min(rows) < 1:
        raise SystemExit("--shapes and --rows need positive sizes")
    return layouts, shapes, rows


def time_call(fns: list[Callable[[], Any]], repeats: int, device: torch.device) -> float:
    """Seconds per call, over calls of `fns` in turn (copies of one product over different weights, so that
    on a GPU the weights come from memory, not from the L2 cache), after a warm-up (the first call compiles
    a kernel). On CUDA the calls are captured once in a CUDA graph and replayed `repeats` times between two
    events: the GPU's time, not the host's launches; the median of five such runs. On the CPU the median
    of `repeats` timed calls of each."""
    for fn in fns:
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            for fn in fns:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    runs: list[float] = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            graph.replay()
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) / 1e3 / (repeats * len(fns)))
    return statistics.median(runs)


def copies_for(nbytes: int, device: torch.device) -> int:
    """How many copies of a weight of `nbytes` make a working set well above a GPU's L2 cache (60 MB on an
    H200): at least 256 MB. One on the CPU."""
    return max(1, -(-(256 << 20) // nbytes)) if device.type == "cuda" else 1


def reference(layer: QuantLinear, x: torch.Tensor, scheme: str, group: int, inputs: str) -> torch.Tensor:
    """The product the layer should compute: its quantized activations times its dequantized weight."""
    if inputs:
        xr = schemes.fake_quantize_input(x.float(), inputs)
    elif scheme == "w4a8-fp8":
        assert isinstance(layer, W4Fp8Linear) and layer.input_scale is not None
        xq, xs = schemes.quantize_activation_fp8_static(x.float(), layer.input_scale)  # on x's device
        xr = xq.float() * xs
    elif scheme == "fp8" and group:
        xq, xs = schemes.quantize_activation_fp8_groups(x.float(), group)
        xr = xq.float() * xs.repeat_interleave(group, dim=1)
    elif scheme == "fp8":
        xq, xs = schemes.quantize_activation_fp8(x.float())
        xr = xq.float() * xs
    elif scheme == "w8a8":
        xq, xs = schemes.quantize_activation_int8(x.float())
        xr = xq.float() * xs
    else:
        xr = x.float()
    return xr @ layer.dequantized().float().t()


def modelopt_w4a8(linear: torch.nn.Linear, group: int) -> W4Fp8Linear:
    """A weight rounded as ModelOpt's W4A8_AWQ rounds it, without AWQ's smoothing: int4 values v under a
    scale s_g per row and group of `group` columns (the group's max|w| / 7), then each v * s_g to E4M3 under
    one scale per tensor (the largest |v * s_g| / 448); activations E4M3 under `W4A8_INPUT_SCALE`."""
    w = linear.weight.detach().float()
    n, k = w.shape
    grouped = w.reshape(n, k // group, group)
    group_scale = grouped.abs().amax(dim=-1).clamp_min(1e-12) / 7
    values = torch.round(grouped / group_scale[..., None]).clamp(-8, 7)
    outer = (values * group_scale[..., None]).abs().max() / 448
    codes = torch.arange(-8, 8, dtype=torch.float32)
    table = (codes * group_scale[..., None] / outer).to(torch.float8_e4m3fn)
    layer = W4Fp8Linear(k, n, bias=False, dtype=linear.weight.dtype, group_size=group)
    layer.set_rows(0, values.reshape(n, k).to(torch.int8), table)
    layer.set_outer_rows(0, n, outer)
    layer.set_input_scale(torch.tensor(W4A8_INPUT_SCALE), "input")
    return layer


def layer_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.buffers(), *module.parameters()])


def measure(
    name: str, k: int, n: int, rows: list[int], dtype: torch.dtype, device: torch.device, repeats: int
) -> list[dict[str, Any]]:
    scheme, group, inputs = LAYOUTS[name]
    g = torch.Generator().manual_seed(k * 31 + n)
    linear = torch.nn.Linear(k, n, bias=False, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=g) * 0.02)
    if scheme == "w4a8-fp8":
        layer: QuantLinear = modelopt_w4a8(linear, group)
    else:
        layer = quantize_linear(linear, scheme, group_size=group)
    if inputs:
        layer.input_quant = inputs
    layer = layer.to(device)
    weight = linear.weight.detach().to(device)
    weights = [weight] + [
        weight.clone() for _ in range(copies_for(weight.numel() * weight.element_size(), device) - 1)
    ]
    layers = [layer] + [copy.deepcopy(layer) for _ in range(copies_for(layer_bytes(layer), device) - 1)]
    out = []
    for m in rows:
        x = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
        with torch.inference_mode():
            expected = reference(layer, x, scheme, group, inputs)
            err = (layer(x).float() - expected).abs().max().item() / expected.abs().max().item()
            full_s = time_call([functools.partial(F.linear, x, w) for w in weights], repeats, device)
            quant_s = time_call([functools.partial(q, x) for q in layers], repeats, device)
        out.append(
            {
                "layout": name,
                "k": k,
                "n": n,
                "rows": m,
                "full_us": full_s * 1e6,
                "quant_us": quant_s * 1e6,
                "speedup": full_s / quant_s,
                "weight_ratio": layer_bytes(layer) / (weight.numel() * weight.element_size()),
                "rel_error": err,
            }
        )
    return out


def _run(
    layouts: list[str],
    shapes: list[tuple[int, int]],
    rows: list[int],
    dtype: torch.dtype,
    device: torch.device,
    repeats: int,
) -> list[dict[str, Any]]:
    results = []
    for k, n in shapes:
        for layout in layouts:
            try:
                measured = measure(layout, k, n, rows, dtype, device, repeats)
            except schemes.UnsupportedQuantizationError as e:
                raise SystemExit(f"{layout} at {k}x{n}: {e}") from None
            for r in measured:
                results.append(r)
                print(
                    f"{r['layout']:<13} {f'{k}x{n}':>11} {r['rows']:>5} {r['full_us']:9.1f} {r['quant_us']:9.1f}"
                    f" {r['speedup']:7.2f} {r['weight_ratio']:8.3f} {r['rel_error']:9.2e}"
                )
    return results


def main(args: argparse.Namespace) -> int:
    layouts, shapes, rows = _parse(args)
    kind = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    if kind not in ("cuda", "cpu") or (kind == "cuda" and not torch.cuda.is_available()):
        raise SystemExit(f"--device: {args.device!r} is not available here (cuda when there is one, or cpu)")
    device = torch.device(kind)
    if args.gemm == "triton" and kind != "cuda":
        raise SystemExit("--gemm triton: the Triton kernels run compiled on CUDA only (here: cpu)")
    if args.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        named = getattr(torch, args.dtype, None)
        if not isinstance(named, torch.dtype) or not named.is_floating_point:
            raise SystemExit(f"--dtype: not a floating-point torch dtype: {args.dtype!r}")
        dtype = named
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({torch.get_num_threads()} threads)"
    )
    path = args.gemm if args.gemm != "auto" else os.environ.get("EMBER_QUANT_GEMM") or "auto"
    print(
        f"device: {name}; dtype {str(dtype).removeprefix('torch.')}; {args.repeats} calls a run; path {path}"
    )
    print(
        f"{'layout':<13} {'K x N':>11} {'rows':>5} {'full us':>9} {'quant us':>9} {'x full':>7} {'bytes x':>8} {'rel err':>9}"
    )
    before = os.environ.get("EMBER_QUANT_GEMM")
    if args.gemm != "auto":
        os.environ["EMBER_QUANT_GEMM"] = args.gemm
    try:
        results = _run(layouts, shapes, rows, dtype, device, args.repeats)
    finally:
        if before is None:
            os.environ.pop("EMBER_QUANT_GEMM", None)
        else:
            os.environ["EMBER_QUANT_GEMM"] = before
    if args.json:
        meta = {
            "device": name,
            "dtype": str(dtype).removeprefix("torch."),
            "repeats": args.repeats,
            "gemm": path,
        }
        Path(args.json).write_text(json.dumps({**meta, "rows": results}, indent=2) + "\n")
    return 0
