"""The quantized GEMM's tiles on a GPU, measured: for each layout, shape and row count, the product timed
under every candidate (BLOCK_N, BLOCK_K, warps, stages) beside the tile the engine gives it
(`triton_gemm_config.kernel_options`), with bf16 `F.linear` timed in the same run, and each product's
error. Timing as `ember bench gemm` times (CUDA graphs over copies of the weight larger than the L2
cache).

    python scripts/gpu_gemm_tiles.py OUT.json [--layouts fp8,w8a16,...] [--rows 1,16]

Candidates go through `kernel_options` as any tile does, so a K step it must shorten (a group of scales
narrower than the step) is shortened; candidates that come out the same are timed once."""

from __future__ import annotations

import argparse
import copy
import functools
import json
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

from ember_engine.bench import gemm as bench
from ember_engine.model.quant import triton_gemm
from ember_engine.model.quant import triton_gemm_config as cfg
from ember_engine.model.quant.linear import quantize_linear

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]
CANDIDATES = [
    (bn, bk, warps, stages)
    for bn in (16, 32, 64)
    for bk in (128, 256)
    for warps, stages in ((4, 4), (4, 6), (2, 4), (8, 4))
]


def layers_for(name: str, k: int, n: int, device: torch.device) -> tuple[list[Any], list[torch.Tensor], Any]:
    scheme, group, inputs = bench.LAYOUTS[name]
    g = torch.Generator().manual_seed(k * 31 + n)
    linear = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=g) * 0.02)
    layer = (
        bench.modelopt_w4a8(linear, group)
        if scheme == "w4a8-fp8"
        else quantize_linear(linear, scheme, group_size=group)
    )
    if inputs:
        layer.input_quant = inputs
    layer = layer.to(device)
    weight = linear.weight.detach().to(device)
    weights = [weight] + [weight.clone() for _ in range(bench.copies_for(weight.numel() * 2, device) - 1)]
    layers = [layer] + [
        copy.deepcopy(layer) for _ in range(bench.copies_for(bench.layer_bytes(layer), device) - 1)
    ]
    return layers, weights, (scheme, group, inputs)


def timed(
    layers: list[Any], x: torch.Tensor, expected: torch.Tensor, device: torch.device
) -> tuple[float, float]:
    with torch.inference_mode():
        err = (layers[0](x).float() - expected).abs().max().item() / expected.abs().max().item()
        t = bench.time_call([functools.partial(q, x) for q in layers], 20, device)
    return t * 1e6, err


def tile_of(o: dict[str, Any]) -> list[int]:
    return [o["BLOCK_M"], o["BLOCK_N"], o["BLOCK_K"], o["num_warps"], o["num_stages"]]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--layouts", default="w8a16,w8a16-g128,w4a16-g128,fp8,w8a8,fp8-block128")
    p.add_argument("--rows", default="1,16")
    p.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES), help="K x N, comma-separated")
    p.add_argument("--device", default="cuda", help="cuda (cpu: the interpreter, to try the script)")
    args = p.parse_args()
    device = torch.device(args.device)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    blocks, options = cfg.blocks, triton_gemm.kernel_options
    results: list[dict[str, Any]] = []
    start = time.perf_counter()
    captured: dict[str, Any] = {}

    def capture(*a: Any, **kw: Any) -> dict[str, Any]:
        o = options(*a, **kw)
        captured.clear()
        captured.update(o)
        return o

    triton_gemm.kernel_options = capture
    for name in args.layouts.split(","):
        for k, n in shapes:
            layers, weights, (scheme, group, inputs) = layers_for(name, k, n, device)
            for m in rows:
                g = torch.Generator().manual_seed(m)
                x = torch.randn(m, k, generator=g).to(device=device, dtype=torch.bfloat16)
                with torch.inference_mode():
                    expected = bench.reference(layers[0], x, scheme, group, inputs)
                    full = (
                        bench.time_call([functools.partial(F.linear, x, w) for w in weights], 20, device)
                        * 1e6
                    )
                base_us, base_err = timed(layers, x, expected, device)
                engine = tile_of(captured)
                row = {
                    "layout": name,
                    "k": k,
                    "n": n,
                    "rows": m,
                    "full_us": full,
                    "engine_us": base_us,
                    "engine_err": base_err,
                    "engine_tile": engine,
                    "candidates": [],
                }
                seen = {tuple(engine)}
                for bn, bk, warps, stages in CANDIDATES:
                    cfg.blocks = lambda mm, nn, c=(16, bn, bk, warps, stages): c
                    try:
                        with torch.inference_mode():
                            layers[0](x)  # compiles; `captured` holds the tile kernel_options made of it
                        tile = tile_of(captured)
                        if tuple(tile) in seen:
                            continue
                        seen.add(tuple(tile))
                        us, err = timed(layers, x, expected, device)
                        row["candidates"].append({"tile": tile, "us": us, "err": err})
                    except Exception as e:  # a tile the compiler or the GPU refuses: recorded
                        row["candidates"].append({"tile": [16, bn, bk, warps, stages], "error": str(e)[:200]})
                    finally:
                        cfg.blocks = blocks
                ok = [c for c in row["candidates"] if "us" in c]
                best = min(ok, key=lambda c: c["us"]) if ok else None
                row["best"] = best
                results.append(row)
                if best:
                    print(
                        f"{name:<13} {k:>5}x{n:<5} {m:>4} bf16 {full:7.1f} engine {base_us:7.1f} {row['engine_tile']} "
                        f"best {best['us']:7.1f} {best['tile']} ({full / best['us']:.2f}x bf16, err {best['err']:.1e})",
                        flush=True,
                    )
        print(f"-- {name} done at {time.perf_counter() - start:.0f} s", flush=True)
    triton_gemm.kernel_options = options
    with open(args.out, "w") as f:
        json.dump(
            {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "results": results},
            f,
            indent=1,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
