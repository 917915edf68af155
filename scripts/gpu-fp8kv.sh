#!/bin/bash
# The FP8 KV cache on a GPU (run from the repository root, in a Python with torch and Triton for CUDA):
# the kernels compiled for real, the engine tests, and bench quant's kv-fp8 row. Results go under $OUT.
OUT=${OUT:-.}
export PYTHONPATH=$PWD/engine PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/test_fp8_kv_attention.py tests/test_fp8_kv_engine.py tests/test_attention.py \
  -k "not scales_come and not bad_kv and not kv_cache_only and not serve_flag" 2>&1 | tee $OUT/pytest.log | tail -25
python3 -m ember_engine bench quant --schemes "" --dtype bfloat16 --repeats 2 --ppl-windows 4 \
  --prompts 8 --json $OUT/quant.json 2>&1 | tee $OUT/quant.log | tail -12
