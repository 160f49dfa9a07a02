#!/usr/bin/env bash
# Issue 31 on one H200, in one device call per part. The GPU image lacks msgspec and the server
# stack: download cp312 manylinux wheels into .whl (ignored by git) and carry it, then install
# with pip --target /tmp/site and PYTHONPATH (the device tool's README): msgspec, fastapi,
# starlette, pydantic, pydantic_core, annotated-types, typing-inspection, annotated-doc, uvicorn,
# openai, jiter, sniffio, distro, opentelemetry-api, llguidance (1.6.1 has an x86_64 cp312 wheel).
#   PART=a  the whole `-m "gpu or triton"` selection
#   PART=b  benchmarks/engine_core.py on the 1B preset (bs 64 and 256, 512 in / 128 out: decode
#           step against GPU kernel time, overlap off and on, alternated); serving the 1B preset
#           (serve_gpu.sh: bench serve c = 16 and 64, 512 in / 128 out) with overlap on (the
#           default) and off, and bench throughput at bs 16 and 64
#   bash benchmarks/engine_core.sh OUT_DIR
set -uo pipefail
out=${1:-/tmp/engine_core}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
model() {
  [ -f /tmp/m1b/config.json ] || python3 benchmarks/make_models.py --preset 1b --out /tmp/m1b \
    --device cuda 2>&1 | tail -1
}
case "${PART:-a}" in
  a)
    timeout 580 python3 -m pytest -q -m "gpu or triton" tests -p no:cacheprovider 2>&1 \
      | tee "$out/gpu_tests.txt" | tail -25
    ;;
  b)
    model
    timeout 200 python3 benchmarks/engine_core.py --model /tmp/m1b --out "$out/engine_core.json" \
      2>&1 | grep -E "^bs|rror" | tee "$out/engine_core.txt"
    CONCURRENCY="16 64" BENCH_SIZES="16 64" bash benchmarks/serve_gpu.sh "$out/on" 2>&1 \
      | tee "$out/serve-on.txt"
    CONCURRENCY="16 64" BENCH_SIZES=none bash benchmarks/serve_gpu.sh "$out/off" \
      --no-async-scheduling 2>&1 | tee "$out/serve-off.txt"
    ;;
esac
