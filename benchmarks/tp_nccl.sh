#!/usr/bin/env bash
# Two GPUs over NCCL (issues 21 and 36), in sections (PARTS, default all): "check" check-pp over
# NCCL at TP = 2, PP = 1 against one GPU and PP = 2 (every partition still bitwise), fp32 and
# bf16, on the pp8 preset, then on v41-small every legal PP cut (bitwise) and TP = 2 (within
# tolerance); "decode" bench throughput latency mode at bs 1 and 64 on each of PRESETS (default
# "4b v41-wide"), TP = 2 vs one GPU vs PP = 2, and the NCCL kernels' share of a step
# (benchmarks/tp_profile.py); "offline" nano-vllm's protocol TP = 2 vs one GPU, and TP = 2 with
# host tables (on the first of PRESETS); "serve" serve -tp 2 vs one GPU with bench serve at
# concurrency 1 and 16 (bf16) and the greedy outputs of both compared (fp32: tokens must match;
# bf16: reported). The raw outputs go to RAW (default /tmp/two-gpu, kept across the calls of one
# warm machine); after each section all of them so far are packed into OUT_DIR/two-gpu.tar.gz
# (a device call returns at most 8 files, and a command stops at 10 minutes: run the sections
# in separate calls, PARTS=check, PARTS=decode, ...): unpack the last one under
# benchmarks/results/two-gpu/ and commit it.
#   bash benchmarks/tp_nccl.sh OUT_DIR
# A dry run of the script on one GPU: BACKEND=gloo PRESETS=pp8 (two ranks share the GPU over
# gloo, eagerly; the profile runs one rank) proves the commands, not the numbers.
set -uo pipefail
dest=${1:-/tmp/tp_nccl}
out=${RAW:-/tmp/two-gpu}
mkdir -p "$dest" "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
parts=${PARTS:-check decode offline serve}
presets=${PRESETS:-${PRESET:-4b v41-wide}}
big=${presets%% *}
backend=${BACKEND:+--distributed-backend $BACKEND}
log() { echo "== $*" | tee -a "$out/summary.txt"; }
want() { [[ " $parts " == *" $1 "* ]]; }
pack() { want "$1" && log "packed after $1: $dest/two-gpu.tar.gz" \
  && tar czf "$dest/two-gpu.tar.gz" -C "$out" .; }
. "$(dirname "$0")/serve_lib.sh"
model() { [ -f /tmp/m$1/config.json ] || python3 benchmarks/make_models.py --preset $1 \
  --out /tmp/m$1 --device cuda 2>&1 | tail -1 | tee -a "$out/summary.txt"; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpus.txt"
nvidia-smi -L >> "$out/gpus.txt"
python3 -c 'import torch; print(torch.__version__, torch.cuda.device_count(), torch.cuda.nccl.version())' \
  | tee -a "$out/summary.txt"

want check && model pp8 && for dtype in float32 bfloat16; do
  for stages in 1 2; do
    tp=$([ $stages = 1 ] && echo 2 || echo 1)
    log "check-pp --stages $stages -tp $tp --dtype $dtype (${BACKEND:-nccl}, 2 ranks)"
    timeout 300 python3 -m engramrt check-pp --model /tmp/mpp8 --device cuda --stages $stages \
      -tp $tp $backend --dtype $dtype --decode-steps 16 --rtol 1 \
      --json "$out/check-$stages-$dtype.json" \
      2>"$out/check-$stages-$dtype.err" | tail -4 | tee -a "$out/summary.txt"
  done
done

want check && model v41-small && for dtype in float32 bfloat16; do
  for stages in 2 1; do  # every legal cut of the V4.1 preset, then its TP = 2
    tp=$([ $stages = 1 ] && echo 2 || echo 1)
    log "check-pp v41-small --stages $stages -tp $tp --dtype $dtype (${BACKEND:-nccl}, 2 ranks)"
    timeout 300 python3 -m engramrt check-pp --model /tmp/mv41-small --device cuda \
      --stages $stages -tp $tp $backend --dtype $dtype --decode-steps 16 \
      --json "$out/check-v41-$stages-$dtype.json" \
      2>"$out/check-v41-$stages-$dtype.err" | tail -4 | tee -a "$out/summary.txt"
  done
done

pack check

bench() {  # tag flags... (the model: $big)
  local tag=$1; shift
  timeout 400 python3 -m engramrt bench throughput --model /tmp/m$big --device cuda \
    --dtype bfloat16 $backend "$@" > "$out/$tag.txt" 2> "$out/$tag.err"
  echo "$tag: $(grep -E 'Output token throughput|Decode step|Achieved' "$out/$tag.txt" | tr '\n' ' ')" \
    | tee -a "$out/summary.txt"
}
ranks=$([ "$(nvidia-smi -L | wc -l)" -ge 2 ] && echo 2 || echo 1)
first=$big
want decode && for big in $presets; do
  model $big || continue
  for bs in 1 64; do
    for cfg in "tp2:-tp 2" "tp1:" "pp2:-pp 2"; do
      bench "decode-$big-${cfg%%:*}-bs$bs" --batch-size $bs --input-len 128 --output-len 128 \
        ${cfg#*:}
    done
  done
  for bs in 1 64; do
    log "the NCCL kernels' share of a TP decode step ($big, profile, $ranks ranks, bs $bs)"
    timeout 200 torchrun --standalone --nproc-per-node $ranks benchmarks/tp_profile.py \
      --model /tmp/m$big --batch-size $bs 2>>"$out/profile.err" | tail -1 \
      | tee -a "$out/summary.txt"
  done
done
big=$first
pack decode

want offline && model $big && for cfg in "tp2:-tp 2" "tp1:" "tp2-host:-tp 2 --engram-table-memory host"; do
  bench "offline-${cfg%%:*}" ${cfg#*:}
done
pack offline

want serve && model $big && port=8600 && for tp in 2 1; do
  for dtype in bfloat16 float32; do  # bf16 for speed; fp32 for the greedy outputs' equality
    tag=tp$tp-$dtype
    python3 -m engramrt serve /tmp/m$big --port $port --device cuda --dtype $dtype \
      -tp $tp $backend --max-num-seqs 64 --max-model-len 2048 > "$out/serve-$tag.log" 2>&1 &
    pid=$!
    wait_healthy $port $pid "$out/serve-$tag.log" || log "server $tag died"
    python3 benchmarks/greedy_outputs.py get --port $port --out "$out/greedy-$tag.json"
    for conc in 1 16; do
      [ $dtype = bfloat16 ] || break
      log "bench serve TP=$tp, max concurrency $conc"
      bench_serve $port $conc $((conc > 1 ? 128 : 32)) "$out" "serve-tp$tp-c$conc.json" \
        | tee -a "$out/summary.txt"
    done
    kill $pid; wait $pid 2>/dev/null
    port=$((port + 1))
  done
done
want serve && for dtype in float32 bfloat16; do
  log "greedy outputs, TP=1 vs TP=2, $dtype"
  python3 benchmarks/greedy_outputs.py compare "$out/greedy-tp1-$dtype.json" \
    "$out/greedy-tp2-$dtype.json" | tee -a "$out/summary.txt"
done
pack serve
