#!/bin/bash
# The quantized GEMMs and the engine on a GPU, in one sitting (run from the repository root, in a Python with
# torch and Triton for CUDA); each step has a time cap, the whole a budget (BUDGET seconds, default 540), and
# the steps run in order of what they tell:
#   1. the kernel tests compiled for real (every scheme's Triton GEMM and the activation quantizers);
#   2. `bench gemm`: each layout against bf16 `F.linear` at Llama 3 8B's projection shapes (where the run
#      breaks, each layout short of its rows is run again alone), then fp8 through cuBLAS;
#   3. the GPU-marked attention and sampler tests, against their references;
#   4. `bench quant` on the packaged trained target in bfloat16 (quality on the GPU's kernels, and rates);
#   5. `bench quant --repeats 1` on a random model of Llama 3 8B's layer shapes (WIDE_LAYERS layers, default
#      8): decode tokens/s at batch 1 and 32 where the weights, not the launches, take the time;
#   6. the engine's tests one at a time (an engine sizes its KV cache from the GPU's free memory, so they
#      do not share the device with other test processes): greedy output against transformers, the
#      kernels compiled once, the FP8 KV cache's attention.
# Logs and JSON go under $OUT (at most seven files: the JSON in one archive). The kernel tests import
# compressed-tensors: install it (and pydantic, loguru) where it is missing, e.g. from wheels:
# `pip install --target /tmp/site WHEELS` and PYTHONPATH=/tmp/site.
set -u
OUT=${OUT:-.}
BUDGET=${BUDGET:-540}
WIDE_LAYERS=${WIDE_LAYERS:-8}
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/engine:$PWD/tests PYTHONUNBUFFERED=1
export EMBER_TEST_CACHE=${EMBER_TEST_CACHE:-/tmp/ember-tests}
WORK=$(mktemp -d)
START=$(date +%s)

# step CAP COMMAND...: runs COMMAND for at most CAP seconds, and never past the budget
step() {
  local cap=$1 left
  shift
  left=$((BUDGET - ($(date +%s) - START)))
  [ "$cap" -gt "$left" ] && cap=$left
  if [ "$cap" -lt 15 ]; then
    echo "skipped, out of time: $*"
    return 124
  fi
  timeout -k 5 "$cap" "$@"
}
stamp() { echo "== $* (at $(($(date +%s) - START)) s)"; }

stamp setup
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
step 60 python3 - > "$OUT/smoke.log" 2>&1 <<'EOF'
# the engine on the GPU at all: a test model's greedy text in bfloat16, on the device the engine chose
import time, tempfile
from ember_engine import LLM, SamplingParams
from ember_engine.tools import testmodel
d = testmodel.make_test_model(tempfile.mkdtemp(), size="tiny", force=True)
t = time.perf_counter()
llm = LLM(str(d), dtype="bfloat16")
print("device", llm.engine.runner.device, f"loaded in {time.perf_counter() - t:.1f} s")
out = llm.generate(["hello world"], SamplingParams(max_tokens=16, temperature=0))
print(repr(out[0].outputs[0].text))
EOF
echo "smoke rc=$?"; tail -3 "$OUT/smoke.log"

stamp kernel tests
step 130 python3 -m pytest -p no:cacheprovider -q -n 8 -o addopts="-ra" \
  tests/test_quant_kernels.py tests/test_quant_act_kernel.py \
  tests/test_quant_fp8_static.py::test_kernels_quantize_every_token_with_the_static_scale \
  tests/test_quant_mx.py::test_each_path_computes_the_product_of_the_quantized_activations \
  tests/test_quant_nvfp4.py::test_each_path_computes_the_dequantized_product \
  tests/test_quant_w4a8.py::test_each_path_computes_the_product_of_the_quantized_activations \
  tests/test_quant_w4a8_fp8.py::test_the_triton_kernel_gives_the_e4m3_product > "$OUT/kernels.log" 2>&1
echo "kernel tests rc=$?"; tail -4 "$OUT/kernels.log"

stamp bench gemm
LAYOUTS=$(python3 -c "from ember_engine.bench.gemm import LAYOUTS; print(' '.join(LAYOUTS))")
step 130 python3 -m ember_engine bench gemm --json "$WORK/gemm.json" > "$OUT/gemm.log" 2>&1
rc=$?
echo "bench gemm rc=$rc"
[ $rc -eq 0 ] || [ $rc -eq 124 ] || for layout in $LAYOUTS; do  # a layout short of its 15 rows (3 shapes x 5 row counts) again, alone
  [ "$(grep -c "^$layout " "$OUT/gemm.log")" -ge 15 ] && continue
  echo "-- $layout again, alone" >> "$OUT/gemm.log"
  step 40 python3 -m ember_engine bench gemm --layouts "$layout" --json "$WORK/gemm-$layout.json" >> "$OUT/gemm.log" 2>&1
  echo "$layout alone rc=$?"
done
echo "-- fp8 through cuBLAS (torch._scaled_mm)" >> "$OUT/gemm.log"
step 40 python3 -m ember_engine bench gemm --layouts fp8 --gemm torch --json "$WORK/gemm-torch.json" >> "$OUT/gemm.log" 2>&1
echo "bench gemm torch rc=$?"

stamp engine tests
step 60 python3 -m pytest -p no:cacheprovider -q -p no:xdist -o addopts="-ra" -m gpu \
  tests/test_attention.py tests/test_rejection_sampler.py > "$OUT/engine.log" 2>&1
echo "gpu-marked tests rc=$?"; tail -3 "$OUT/engine.log"


stamp bench quant, trained target
step 80 python3 -m ember_engine bench quant --dtype bfloat16 --repeats 1 --ppl-windows 4 \
  --json "$WORK/quant.json" > "$OUT/quant.log" 2>&1
echo "bench quant rc=$?"; tail -9 "$OUT/quant.log"

stamp bench quant, 8B layer shapes
step 45 python3 - "$WORK/wide" "$WIDE_LAYERS" <<'EOF'
import sys
from ember_engine.tools import testmodel
# Llama 3 8B's hidden size, MLP width and heads; fewer layers; the test tokenizer's vocabulary
testmodel.make_test_model(sys.argv[1], size=testmodel.ModelSize(4096, 14336, int(sys.argv[2]), 32, 8, 2048), force=True)
EOF
step 110 python3 -m ember_engine bench quant --model "$WORK/wide" --dtype bfloat16 --repeats 1 --ppl-windows 1 \
  --prompts 4 --kv-cache-memory $((4 << 30)) --json "$WORK/wide.json" > "$OUT/wide.log" 2>&1
echo "bench quant wide rc=$?"; tail -9 "$OUT/wide.log"

stamp engine tests, the rest
step 150 python3 -m pytest -p no:cacheprovider -q -p no:xdist -o addopts="-ra" \
  tests/test_kernel_variants.py tests/test_engine_greedy.py tests/test_fp8_kv_attention.py >> "$OUT/engine.log" 2>&1
echo "engine tests rc=$?"; tail -3 "$OUT/engine.log"

stamp done
(cd "$WORK" && tar czf "$OUT/json.tgz" ./*.json 2>/dev/null)
grep -h "^fp8\|^w\|^nf4" "$OUT/gemm.log" | awk '$3 == 1 || $3 == 1024' | head -60
