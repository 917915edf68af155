"""How the quantized GEMM kernel (`triton_gemm._gemm_kernel`) is configured for a product on a device:
its weight kinds, its tiles by rows and output width, and its FP8 choices by compute capability. Pure
functions of sizes and capability, so that every variant a GPU would compile can be compiled ahead of
time for it (`tests/test_kernels_compile.py`)."""

from __future__ import annotations

from typing import Any

import torch

from ember_engine.model.quant.triton_fp8 import fp8_types_on

# WEIGHT: 0 int8, 1 packed int4, 2 fp8 (bytes, reinterpreted in the kernel), 3 block-scaled fp8, 4 int8 with
# int8 activations, 5 packed FP4 (E2M1), 6 4-bit codes of a 16-value table, 7 fp8 weights with unquantized
# activations, 8 4-bit codes of E4M3 tables per row and group (w4a8-fp8).
INT8, INT4, FP8, FP8_BLOCK, W8A8, FP4, CODEBOOK, FP8_WEIGHT, W4_FP8 = 0, 1, 2, 3, 4, 5, 6, 7, 8
# the kinds whose decode tiles were measured on 9.0 (`kernel_options`)
DECODE_TUNED = (INT8, INT4, FP8, FP8_BLOCK, W8A8)


def blocks(m: int, n: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, pipeline stages) for an [m, K] x [K, n] product. Decode-sized
    batches read the weight once and are bound by memory: thin M tiles, N tiles narrow enough that every
    multiprocessor has programs (132 on an H100/H200), long K steps with several loads in flight. Larger
    batches are bound by the dots: wide tiles, on 8 warps, which is what keeps the widened weight tile and
    the float32 sums in registers (on 4 warps the 64 x 64 and 64 x 128 tiles, and on 8 a 128 x 128 one,
    spill 120 to 670 bytes a thread to local memory for most weight kinds on 9.0; ptxas's report for every
    variant: `python tests/kernel_compile.py --resources`). tl.dot needs every tile side >= 16."""
    if m <= 16:
        return 16, (32 if n <= 8192 else 64), 128, 4, 4
    if m <= 32:
        return 32, 64, 64, 4, 4
    if m <= 64:
        return 64, 64, 64, 8, 4
    if m <= 256:
        return 64, 128, 64, 8, 3
    return 128, 64, 64, 8, 3


def capability(device: torch.device) -> tuple[int, int] | None:
    """The GPU's compute capability; None in Triton's CPU interpreter."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def kernel_options(
    weight: int, m: int, n: int, group: int, dtype: torch.dtype, cc: tuple[int, int] | None
) -> dict[str, Any]:
    """`_gemm_kernel`'s constexprs and launch options for an [m, K] x [K, n] product of weight kind
    `weight` in activations of `dtype`, on a GPU of compute capability `cc` (None: the interpreter)."""
    bm, bn, bk, warps, stages = blocks(m, n)
    fp8_types = fp8_types_on(cc)
    if bm == 16 and cc is not None and cc >= (9, 0) and dtype != torch.float32 and weight in DECODE_TUNED:
        # Decode on 9.0, measured on an H200 (`scripts/gpu_gemm_tiles.py`, 8B-model shapes, 1 and 16
        # rows, 24 tiles a product): 32 columns and K steps of 256 (where a group of scales allows) came
        # within 5 % of each product's best tile on geometric mean, and took per-channel int8 weights
        # from 0.83x to 1.15x bf16's speed at 14336 x 4096 (`ember bench gemm` there, before and after);
        # shorter steps left too few bytes in flight.
        bn, bk = 32, 256
    # Shorter K steps where longer ones would spill (ptxas's report on every tile for each capability):
    # 32 for float32 operands of IEEE dots in the decode tile; on a GPU, float32 operands in tiles of 32
    # rows or more (IEEE dots are FMAs, each thread holding its slices of both operands beside its sums)
    # take 16 and tiles of at most 64 x 64, which spilled up to 11 KB a thread with K steps of 32 and 64
    # and 8 to 24 bytes as 64 x 128 or 128 x 64; below compute capability 9.0 (mma.sync rather than
    # wgmma), in every tile of more than 32 rows, 32 (16 on 7.5, the T4, in the 32-row tile too), and 16
    # for block-scaled fp8 decoded with integers (no E4M3 type: 8.0) in the 64 x 128 and 128 x 64 tiles;
    # 64 for the decode tile on 7.5. The 32-row tile keeps 64 on 8.0 and 8.9: with 32, int8 weights in
    # bfloat16 spilled 8 bytes on 8.9 (as launched: aligned operands, sizes multiples of 16).
    if dtype == torch.float32 and bm == 16:
        bk = 32
    elif dtype == torch.float32 and cc is not None:
        bm, bn, bk = min(bm, 64), min(bn, 64), 16
    elif cc is not None and cc < (9, 0):
        if bm == 16:
            bk = 64 if cc < (8, 0) else bk
        elif cc < (8, 0) or (weight == FP8_BLOCK and not fp8_types and bm * bn >= 64 * 128):
            bk = 16
        elif bm > 32:
            bk = 32
    if weight in (INT4, FP4, CODEBOOK) and bk < 32:
        # Two weights a byte: a step's dots each take half its columns (a byte's low nibbles, then its high
        # ones), at least 16. On 7.5 the 64 x 128 tile then spilled for int4: 64 columns there.
        bk = 32
        if cc is not None and cc < (8, 0):
            bn = min(bn, 64)
    if weight == FP8_BLOCK:  # a BLOCK_K step must lie within one group of scales
        bk = next((b for b in (bk, 128, 64, 32, 16) if b <= bk and group % b == 0), 0)
        if not bk:  # the loaders refuse such blocks by name
            raise ValueError(f"block-scaled fp8: blocks of {group} columns are not a multiple of 16")
    # Scales per group applied to each step's sums where a step lies in one group (groups of 32 columns
    # or more); nvfp4's groups of 16 are scaled value by value.
    step_scale = weight in (INT8, INT4, CODEBOOK, FP8_WEIGHT) and group % 32 == 0
    if step_scale:
        bk = next(b for b in (bk, 128, 64, 32) if b <= bk and group % b == 0)
    return {
        "GROUP": group,
        "WEIGHT": weight,
        # E4M3 tensor-core dots take K steps of 32 or more (Triton refuses 16: "K >= 32"); block-scaled
        # fp8 in blocks of 16 (48, ...) columns decodes its E4M3 bytes to float32 instead (exact in TF32)
        "FP8_DOT": weight in (FP8, FP8_BLOCK, W4_FP8) and cc is not None and fp8_types and bk >= 32,
        "FP8_TYPES": fp8_types,
        "STEP_SCALE": step_scale,
        "IEEE": dtype == torch.float32,
        "BLOCK_M": bm,
        "BLOCK_N": bn,
        "BLOCK_K": bk,
        "num_warps": warps,
        "num_stages": stages,
    }
