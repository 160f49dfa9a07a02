#!/usr/bin/env bash
# Issue 7 on one H200: the GPU tests, check-pp with CUDA graphs, then benchmarks/gpu_runner.py on
# the ~1B and ~4B models (QUICK=1: a smoke run on the small pp8 model instead).
#   bash benchmarks/gpu_runner.sh OUT_DIR
set -uo pipefail
out=${1:-/tmp/gpu_runner}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
if [ "${TESTS:-1}" = 1 ]; then
  python3 -m pytest -q -m "gpu or triton" tests/runner/test_gpu_runner.py tests/kernels/test_paged_attention.py \
    tests/kernels/test_kernels.py 2>&1 | tail -15 | tee "$out/tests.txt"
  for dtype in float32 bfloat16; do
    python3 -m engramrt check-pp --device cuda --distributed-backend gloo --dtype $dtype \
      2>&1 | tail -6 | tee "$out/check-pp-graphs-$dtype.txt"
  done
fi
if [ "${QUICK:-0}" = 1 ]; then
  python3 benchmarks/make_models.py --preset pp8 --out /tmp/pp8 --device cuda
  python3 benchmarks/gpu_runner.py --model /tmp/pp8 --out "$out/pp8-quick.json" --quick 2>&1 \
    | grep -v "^USDT\|profiler_st" | tail -20
  exit 0
fi
for preset in ${PRESETS:-1b 4b}; do
  python3 benchmarks/make_models.py --preset $preset --out /tmp/m$preset --device cuda
  python3 benchmarks/gpu_runner.py --model /tmp/m$preset --out "$out/$preset.json" 2>&1 \
    | grep -v "^USDT\|profiler_st" | tail -20
  rm -rf /tmp/m$preset
done
