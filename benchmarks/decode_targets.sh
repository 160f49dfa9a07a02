#!/usr/bin/env bash
# Issue 14's targets on one H200, in parts that each fit one 10-minute device call:
#   PART=a  GPU tests (overlap, graphs, kernels), 4B bs 1 with and without --async-scheduling, and
#           the HF anchor in the same call; the bs-1 step breakdown
#   PART=b  gpu_runner.py on the 1B model, overlapped: bs 1/16/64/256 step time against the
#           profile's GPU kernel time, offline throughput (nano-vllm protocol, warmed) as is, with
#           the Engram replaced by zero rows and as is again, the 8k prefill
#   PART=c  the same on the 4B model
#   PART=d  PRESET=1b|4b: offline throughput (nano-vllm protocol, `engramrt bench throughput`) of
#           this tree against OLD (a checkout of the before commit), each run twice (the first
#           warms Triton's on-disk kernel cache), alternated; with PRESET=1b also the bs-1 step
#           breakdown
#   bash benchmarks/decode_targets.sh OUT_DIR
set -uo pipefail
out=${1:-/tmp/decode_targets}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
model() {  # preset -> /tmp/m<preset>, made once per machine
  [ -f /tmp/m$1/config.json ] || python3 benchmarks/make_models.py --preset $1 --out /tmp/m$1 \
    --device cuda 2>&1 | tail -1
}
bench() {  # tag preset bs [flags...]
  local tag=$1 preset=$2 bs=$3
  shift 3
  timeout 150 python3 -m engramrt bench throughput --model /tmp/m$preset --device cuda \
    --batch-size $bs --input-len 512 --output-len 128 --max-num-seqs $bs \
    --max-num-batched-tokens 8192 "$@" 2>&1 | grep -E "Decode step|Bytes per|rror" \
    | sed "s/^/$tag $preset bs$bs /" | tee -a "$out/decode.txt"
}
case "${PART:-a}" in
a)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m "gpu or triton" tests/engine/test_overlap.py \
    tests/test_transfer.py tests/runner/test_gpu_runner.py tests/kernels/test_paged_attention.py \
    tests/kernels/test_mhc_fused.py tests/kernels/test_rope.py tests/kernels/test_swiglu.py tests/kernels/test_kernels.py 2>&1 \
    | tail -4 | tee "$out/tests.txt"
  python3 -c "from benchmarks.hash_bench import copy_bandwidth_gbs as c; print('copy_gb_s', c('cuda'))" \
    | tee "$out/copy.txt"
  model 4b
  bench sync 4b 1 --no-async-scheduling
  bench async 4b 1 --async-scheduling
  timeout 150 python3 benchmarks/hf_anchor.py --preset 4b --out "$out/hf_4b.json" | tail -1
  bench async 4b 1 --async-scheduling
  timeout 100 python3 benchmarks/step_breakdown.py --model /tmp/m4b | tail -1 | tee "$out/breakdown_4b.txt"
  ;;
b | c)
  preset=$([ "$PART" = b ] && echo 1b || echo 4b)
  model $preset
  timeout 560 python3 benchmarks/gpu_runner.py --model /tmp/m$preset --out "$out/$preset.json" \
    --async-scheduling 2>&1 | grep -v "^USDT\|profiler_st" | tail -14
  ;;
d)
  preset=${PRESET:-1b}
  model $preset
  offline() {  # tag tree
    (cd "$2" && PYTHONPATH=$PWD timeout 200 python3 -m engramrt bench throughput \
      --model /tmp/m$preset --device cuda --max-num-seqs 256 --max-num-batched-tokens 8192 2>&1 \
      | grep -E "Total time|throughput|rror" | tr '\n' ' ' | sed "s/^/$1 $preset /"; echo) \
      | tee -a "$out/offline.txt"
  }
  for tag in warm-old old warm-new new; do
    case $tag in *old) offline $tag "${OLD:-.old}" ;; *) offline $tag . ;; esac
  done
  [ "$preset" = 1b ] && timeout 100 python3 benchmarks/step_breakdown.py --model /tmp/m1b \
    | tail -1 | tee "$out/breakdown_1b.txt"
  ;;
esac
