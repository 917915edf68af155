"""Compiles the engine's Triton kernels ahead of time for NVIDIA GPUs, on a machine without one, and prints
what came of each variant as JSON: `python kernel_compile.py [--resources] [VARIANTS]`. The quantized GEMM and the
activation quantizer in every variant their configuration gives; the attention and KV-cache kernels in the
variants an engine launched (VARIANTS: a JSON file of the launch ledger's entries, as
`test_kernels_compile.ledger_variants` writes them).

Run in its own process with TRITON_INTERPRET unset: under the interpreter, which the test process sets,
`@triton.jit` gives functions Triton's compiler cannot take. Each variant is compiled with the constexprs
and launch options `triton_gemm_config.kernel_options` gives the engine on that GPU, through Triton's
own compiler and the ptxas it ships. With `--resources` each variant also gives the registers a thread
uses and the bytes it spills to local memory, from ptxas's report on the PTX (`-v`)."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ember_engine.model.quant import triton_act_quant, triton_gemm  # noqa: E402
from ember_engine.model.quant import triton_gemm_config as cfg  # noqa: E402

# 7.5 (T4) has no bfloat16: its models run in float16
CAPABILITIES = [(7, 5), (8, 0), (8, 9), (9, 0)]
POINTERS = ("x_ptr", "w_ptr", "scale_ptr", "x_scale_ptr", "y_ptr")
# weight kind -> (x, w, scale, x_scale as the wrappers in triton_gemm pass them; "act": the activations'
# dtype), the group size a layer of that kind takes, the kind's name, and the row strides of its scale and
# x_scale for a 4096 x 4096 weight (0: no x_scale, the kernel given the scale in its place)
KINDS: dict[int, tuple[tuple[str, str, str, str], int, str, tuple[int, int]]] = {
    cfg.INT8: (("act", "*i8", "*fp32", "*fp32"), 128, "w8a16", (32, 0)),
    cfg.INT4: (("act", "*u8", "*fp32", "*fp32"), 128, "w4a16", (32, 0)),
    cfg.FP8: (("*u8", "*u8", "*fp32", "*fp32"), 1, "fp8", (1, 1)),
    cfg.FP8_BLOCK: (("*u8", "*u8", "*fp32", "*fp32"), 128, "fp8-block", (32, 32)),
    cfg.W8A8: (("*i8", "*i8", "*fp32", "*fp32"), 1, "w8a8", (1, 1)),
    cfg.FP4: (("act", "*u8", "*u8", "*fp32"), 16, "nvfp4", (256, 1)),
    cfg.CODEBOOK: (("act", "*u8", "*fp32", "*fp32"), 64, "codebook", (64, 1)),
    cfg.FP8_WEIGHT: (("act", "*u8", "*fp32", "*fp32"), 128, "w8a16-fp8", (32, 0)),
    cfg.W4_FP8: (("*u8", "*u8", "*u8", "*fp32"), 128, "w4a8-fp8", (512, 1)),
}
PACKED = (cfg.INT4, cfg.FP4, cfg.CODEBOOK, cfg.W4_FP8)  # two weights a byte: rows of K / 2 bytes
TRITON_TYPE = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}
ROWS = (1, 16, 32, 64, 128, 256, 512)  # every tile class of `triton_gemm_config.blocks`
# block-scaled fp8's other block widths (any multiple of 16 columns is taken): the K steps that fit them
BLOCK_WIDTHS = (16, 32, 64)
# the kernels launched through `kernel_launch.launch`, by name
LAUNCHED = {
    "_attention_kernel": "ember_engine.model.triton_attention",
    "_merge_splits_kernel": "ember_engine.model.triton_attention",
    "_store_kv_kernel": "ember_engine.model.triton_kv_store",
}


# Each variant to compile, by its key (`_compile`): planned first, then compiled in parallel (`main`).
_PLANNED: dict[str, tuple[Any, dict[str, str], dict[str, Any], tuple[int, int]]] = {}


def specialize(integers: dict[str, int], signature: dict[str, str], constexprs: dict[str, Any]) -> None:
    """Integer arguments as Triton's launcher passes them to the compiler: 1 as the constant it
    specializes it to, a multiple of 16 as an i32 known to be one (`:16`), else a plain i32."""
    for name, value in integers.items():
        if value == 1:
            signature[name], constexprs[name] = "constexpr", 1
        else:
            signature[name] = "i32:16" if value % 16 == 0 else "i32"


def _compile(fn: Any, signature: dict[str, str], constexprs: dict[str, Any], cc: tuple[int, int]) -> str:
    """The key of compiling `fn` so, planned; row classes that share a tile (128 and 256 rows) share one
    compilation. A type marked `:16` (a pointer 16-byte aligned, an integer a multiple of 16) is
    compiled with that divisibility known, as Triton's launcher specializes every launch on it."""
    key = json.dumps([fn.__name__, signature, constexprs, cc], sort_keys=True, default=str)
    _PLANNED.setdefault(key, (fn, signature, constexprs, cc))
    return key


def _compile_planned(key: str) -> tuple[str, dict[str, Any]]:
    fn, signature, constexprs, cc = _PLANNED[key]
    return key, _compile_once(fn, dict(signature), dict(constexprs), cc) | {"signature": signature}


def _compile_once(
    fn: Any, signature: dict[str, str], constexprs: dict[str, Any], cc: tuple[int, int]
) -> dict[str, Any]:
    options = {key: constexprs.pop(key) for key in ("num_warps", "num_stages") if key in constexprs}
    for name in fn.arg_names:
        signature.setdefault(name, "constexpr" if name in constexprs else "i32")
    attrs = {
        (fn.arg_names.index(name),): [["tt.divisibility", 16]]
        for name, kind in signature.items()
        if kind.endswith(":16")
    }
    signature = {name: kind.removesuffix(":16") for name, kind in signature.items()}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    log = io.StringIO()  # Triton prints its ptxas run's report here (`dump_ptxas_log`)
    try:
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(source, target=GPUTarget("cuda", cc[0] * 10 + cc[1], 32), options=options)
    except Exception as e:  # a variant the GPU's compiler refuses: reported, not raised
        return {"ok": False, "error": str(e).strip().splitlines()[-1][:400]}
    ptx = str(kernel.asm["ptx"])
    result = {
        "ok": bool(kernel.asm["cubin"]),
        "fp8_dots": bool(re.search(r"mma[\w.]*\.e4m3", ptx)),
        "e4m3": "e4m3" in ptx,
        "div_rn": "div.rn.f32" in ptx,
        "div_approx": bool(re.search(r"div\.(full|approx)", ptx)),
        "shared": int(kernel.metadata.shared),  # bytes of shared memory a program needs at launch
        # loads from global memory of one byte each (a weight tile's loads not vectorized)
        "byte_loads": len(re.findall(r"ld\.global[\w.]*\.[bus]8\b", ptx)),
    }
    if RESOURCES:
        result |= resources(log.getvalue() or ptxas_report(ptx, cc))
    return result


def ptxas_report(ptx: str, cc: tuple[int, int]) -> str:
    """ptxas's report (`-v`) on this PTX, run as Triton runs it to make the cubin
    (`triton.backends.nvidia.compiler.CUDABackend.make_cubin`: line info, `--regAllocOptLevel=2`), for a
    variant whose cubin came from Triton's cache, where Triton ran no ptxas to report."""
    arch = re.search(r"^\.target\s+(\w+)", ptx, re.MULTILINE)
    assert arch, "no .target in the PTX"
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        # the ptxas Triton itself runs for this GPU (`triton.backends.nvidia.compiler.get_ptxas`)
        ptxas = get_ptxas(cc[0] * 10 + cc[1]).path
        command = [ptxas, "-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={arch.group(1)}"]
        command += [str(source), "-o", str(Path(tmp) / "kernel.cubin")]
        return subprocess.run(command, capture_output=True, text=True, check=True).stderr


def resources(log: str) -> dict[str, int]:
    """Registers a thread and bytes of spill stores and loads, from ptxas's report on one kernel."""
    used = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert used and spills, log
    return {
        "registers": int(used.group(1)),
        "spill_stores": int(spills.group(1)),
        "spill_loads": int(spills.group(2)),
    }


def gemm(kind: int, m: int, dtype: torch.dtype, cc: tuple[int, int], group: int = 0) -> str:
    """The GEMM variant a layer of kind `kind` with a 4096 x 4096 weight launches for `m` rows: every
    tensor 16-byte aligned, each integer specialized as Triton's launcher does. `group`: block-scaled
    fp8's block width, where not its usual 128."""
    operands, usual, _, (stride_sn, stride_xsm) = KINDS[kind]
    if group:  # a scale per row tile and group of `group` columns, the activations' per group of them
        stride_sn = stride_xsm = 4096 // group
    group = group or usual
    x_type = operands[0] if operands[0] != "act" else TRITON_TYPE[dtype]
    pointers = [x_type, *operands[1:], TRITON_TYPE[dtype]]
    signature = {name: f"{t}:16" for name, t in zip(POINTERS, pointers, strict=True)}
    # run_gemm passes the activations it is given: for fp8, w8a8 and w4a8-fp8 their quantized bytes
    x_dtype = dtype if operands[0] == "act" else torch.uint8
    constexprs = cfg.kernel_options(kind, m, 4096, group, x_dtype, cc)
    k = n = 4096
    integers = {"M": m, "N": n, "K": k, "stride_xm": k, "stride_wn": k // 2 if kind in PACKED else k}
    integers |= {"stride_sn": stride_sn, "stride_xsm": stride_xsm, "stride_ym": n}
    specialize(integers, signature, constexprs)
    return _compile(triton_gemm._gemm_kernel, signature, constexprs, cc)


def quantizer(kind: int, static: bool, cc: tuple[int, int], dtype: torch.dtype) -> str:
    """The activation quantizer as a 4096-wide layer launches it, per token (or per group of 128: the
    same specialization) or with a static scale."""
    signature = {"x_ptr": TRITON_TYPE[dtype], "q_ptr": "*u8" if kind == triton_act_quant.FP8 else "*i8"}
    signature |= {"scale_ptr": "*fp32", "static_ptr": "*fp32"}
    signature = {name: f"{t}:16" for name, t in signature.items()} | {"ub": "fp32"}
    constexprs = {"QMAX": 448.0, "KIND": kind, "STATIC": static, "CLAMP_UB": not static, "BLOCK": 1024}
    integers = {"group": 4096, "stride_xm": 4096, "stride_qm": 4096, "stride_sm": 0 if static else 1}
    specialize(integers, signature, constexprs)
    return _compile(triton_act_quant._quantize_kernel, signature, constexprs, cc)


def launched(variant: dict[str, Any], cc: tuple[int, int]) -> str:
    """One ledger variant compiled: an integer Triton saw as 1 as the constant it specializes it to; a
    tensor it saw 16-byte aligned and an integer a multiple of 16 marked so (`:16`); an integer not
    recorded (not specialized on) as a plain int32."""
    fn = getattr(importlib.import_module(LAUNCHED[variant["kernel"]]), variant["kernel"])
    constexprs = dict(variant["constexprs"])
    signature = {}
    for arg, kind in variant["args"].items():
        if kind == "one":
            constexprs[arg] = 1
        else:
            signature[arg] = kind
    return _compile(fn, signature, constexprs, cc)


RESOURCES = "--resources" in sys.argv[1:]
# Triton runs ptxas with `-v` to make each cubin; its report is printed where this asks for it
triton.knobs.nvidia.dump_ptxas_log = RESOURCES


def main() -> int:
    results: dict[str, str] = {}  # each variant's name -> its compilation's key
    paths = [a for a in sys.argv[1:] if a != "--resources"]
    variants = json.loads(Path(paths[0]).read_text()) if paths else []
    for cc in CAPABILITIES:
        arch = f"sm{cc[0]}{cc[1]}"
        half = torch.bfloat16 if cc >= (8, 0) else torch.float16
        for kind, (operands, _, name, _) in KINDS.items():
            if kind == cfg.W8A8 and cc < (8, 0):  # int8 dots need 8.0: the layer takes its torch path
                continue
            for m in ROWS:  # every tile class
                results[f"gemm/{name}/{arch}/{str(half).removeprefix('torch.')}/{m}"] = gemm(
                    kind, m, half, cc
                )
            if operands[0] == "act":  # float32 activations: IEEE dots, in every tile class too
                for m in ROWS:
                    results[f"gemm/{name}/{arch}/float32/{m}"] = gemm(kind, m, torch.float32, cc)
        for width in BLOCK_WIDTHS:
            for m in ROWS:
                results[f"blocks/{width}/{arch}/{str(half).removeprefix('torch.')}/{m}"] = gemm(
                    cfg.FP8_BLOCK, m, half, cc, width
                )
        for kind, name in ((triton_act_quant.FP8, "fp8"), (triton_act_quant.INT8, "int8")):
            for static in (False, True):
                results[f"quantize/{name}/{arch}/{'static' if static else 'dynamic'}"] = quantizer(
                    kind, static, cc, half
                )
        for i, variant in enumerate(variants):
            if cc < (8, 0) and any(kind.startswith("*bf16") for kind in variant["args"].values()):
                continue
            results[f"launched/{variant['kernel']}/{arch}/{i}"] = launched(variant, cc)
    # Each compilation in a process of its own, as many at once as there are cores (forked: the kernels
    # and the plan are inherited): Triton's compiler and ptxas run on one core each. At most 8: each holds
    # its own compiler state.
    with multiprocessing.get_context("fork").Pool(min(os.cpu_count() or 1, 8)) as pool:
        compiled = dict(pool.imap_unordered(_compile_planned, _PLANNED, chunksize=1))
    json.dump({name: compiled[key] for name, key in results.items()}, sys.stdout, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
