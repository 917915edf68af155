#!/bin/bash
# The quantized GEMMs on a GPU (run from the repository root, in a Python with torch and Triton for CUDA):
# the kernel tests compiled for real, the engine-side GPU tests one at a time (an engine sizes its KV
# cache from the GPU's free memory, so they do not share the device with other test processes), `bench
# gemm` (fp8 also through cuBLAS), and `bench quant` on the packaged trained target. Results go under $OUT.
#
# The kernel tests import compressed-tensors: install it (and pydantic, loguru) where it is missing, e.g.
# from wheels: `pip install --target /tmp/site WHEELS` and PYTHONPATH=/tmp/site. CKPT, when set, is a
# directory of checkpoints of the trained target written by `python tests/quant_build.py TARGET DIR
# PRESET` (nvfp4, mxfp8, fp8_block), added as rows of `bench quant`.
set -u
OUT=${OUT:-.}
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/engine:$PWD/tests PYTHONUNBUFFERED=1
export EMBER_TEST_CACHE=${EMBER_TEST_CACHE:-/tmp/ember-tests}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -m pytest -p no:cacheprovider -q -n 8 -o addopts="-ra" \
  tests/test_quant_kernels.py tests/test_quant_act_kernel.py \
  tests/test_quant_fp8_static.py::test_kernels_quantize_every_token_with_the_static_scale \
  tests/test_quant_mx.py::test_each_path_computes_the_product_of_the_quantized_activations \
  tests/test_quant_nvfp4.py::test_each_path_computes_the_dequantized_product \
  tests/test_quant_w4a8_fp8.py::test_the_triton_kernel_gives_the_e4m3_product > "$OUT/kernels.log" 2>&1
tail -5 "$OUT/kernels.log"
python3 -m pytest -p no:cacheprovider -q -p no:xdist -o addopts="-ra" \
  tests/test_attention.py tests/test_fp8_kv_attention.py tests/test_rejection_sampler.py \
  tests/test_kernel_variants.py tests/test_engine_greedy.py > "$OUT/engine.log" 2>&1
tail -5 "$OUT/engine.log"
python3 -m ember_engine bench gemm --json "$OUT/gemm.json" 2>&1 | tee "$OUT/gemm.log"
# fp8 through cuBLAS's FP8 matmul (`torch._scaled_mm`, the torch path), against the Triton rows above
python3 -m ember_engine bench gemm --layouts fp8 --gemm torch --json "$OUT/gemm-torch.json" 2>&1 | tee "$OUT/gemm-torch.log"
rows=()
if [ -n "${CKPT:-}" ]; then
  for name in nvfp4 mxfp8 fp8_block; do
    [ -d "$CKPT/$name" ] && rows+=(--checkpoint "$name=$CKPT/$name")
  done
fi
python3 -m ember_engine bench quant --dtype bfloat16 --repeats 1 --ppl-windows 4 "${rows[@]}" \
  --json "$OUT/quant.json" 2>&1 | tee "$OUT/quant.log" | tail -14
