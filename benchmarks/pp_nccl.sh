#!/usr/bin/env bash
# Issue 8 in one run on a two-GPU machine: check-pp over NCCL for every 2-stage partition of an
# 8-layer model (Engram at layers 1 and 5) in fp32 and bf16, the Engram trace of the stage-entry
# partition 5,3, then serve with PP = 2 (5,3) and PP = 1 on one GPU: bench serve and the same
# greedy outputs from both.
#   bash benchmarks/pp_nccl.sh OUT_DIR
set -uo pipefail
out=${1:-/tmp/pp_nccl}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
model=${MODEL_DIR:-/tmp/pp8}
dev=${DEVICE:-cuda}  # DEVICE=cpu runs the same over gloo, to try the script
parts=${PARTS:-check trace serve}  # which sections to run
log() { echo "== $*" | tee -a "$out/summary.txt"; }
want() { [[ " $parts " == *" $1 "* ]]; }
. "$(dirname "$0")/serve_lib.sh"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpus.txt"
nvidia-smi topo -m > "$out/topo.txt" 2>&1
python3 -c 'import torch; print(torch.__version__, torch.cuda.device_count(), torch.cuda.nccl.version() if torch.cuda.is_available() else "no cuda")' \
  | tee -a "$out/summary.txt"
[ -d "$model" ] || python3 benchmarks/make_models.py --preset pp8 --out "$model" --device "$dev" \
  | tee -a "$out/summary.txt"

want check && for dtype in float32 bfloat16; do
  log "check-pp --dtype $dtype (NCCL, 2 GPUs)"
  python3 -m engramrt check-pp --model "$model" --device "$dev" --stages 2 --dtype $dtype \
    --decode-steps 16 --json "$out/check-pp-$dtype.json" 2>"$out/check-pp-$dtype.err" \
    | tee -a "$out/summary.txt"
  echo "rc=$?" | tee -a "$out/summary.txt"
done
want check && log "check-pp with the stage-entry Engram skipped (must fail)" &&
ENGRAMRT_CHECK_PP_FAULT=skip-entry-engram python3 -m engramrt check-pp --model "$model" \
  --device "$dev" --stages 2 --max-partitions 2 2>"$out/fault.err" | tee -a "$out/summary.txt"
echo "rc=$?" | tee -a "$out/summary.txt"

prompt="A pipeline stage may begin on an Engram layer."
want trace && for pp in 1 2; do
  python3 -m engramrt generate --model "$model" --device "$dev" -pp $pp --pp-layer-partition \
    "$([ $pp = 2 ] && echo 5,3 || echo 8)" --prompt "$prompt" --max-tokens 8 \
    --engram-trace "$out/trace-pp$pp.jsonl" > "$out/generate-pp$pp.txt" 2>&1
done
want trace && log "Engram trace, PP=2 5,3 vs PP=1" && python3 - "$out" <<'EOF' | tee -a "$out/summary.txt"
import json, sys
out = sys.argv[1]
runs = {pp: [json.loads(l) for l in open(f"{out}/trace-pp{pp}.jsonl")] for pp in (1, 2)}
for pp, rows in runs.items():
    for r in rows:
        if r["step"] < 2 and "engram_out_sha256" in r:
            print(f"PP={pp} rank {r['rank']} step {r['step']} layer {r['layer']}: "
                  f"in {r['engram_in_sha256'][:16]} out {r['engram_out_sha256'][:16]} "
                  f"update rms {r['engram_update_rms']:.4g} changed {r['engram_changed_frac']:.3f}")
idx = {pp: {(r["step"], r["layer"]): r for r in rows} for pp, rows in runs.items()}
# stage entry/exit events exist only where a stage begins or ends: compare what both recorded
same = idx[1].keys() == idx[2].keys() and all(
    all(v == idx[2][k][f] for f, v in r.items() if f != "rank" and f in idx[2][k])
    for k, r in idx[1].items()
)
print("every checksum both runs recorded is identical:", same)
EOF
want trace && tail -n 3 "$out/generate-pp1.txt" "$out/generate-pp2.txt" | tee -a "$out/summary.txt"

port=8500
want serve && for pp in 2 1; do
  part=$([ $pp = 2 ] && echo 5,3 || echo 8)
  python3 -m engramrt serve "$model" --port $port --device "$dev" -pp $pp --pp-layer-partition $part \
    --max-num-seqs 64 --max-model-len 2048 > "$out/serve-pp$pp.log" 2>&1 &
  pid=$!
  wait_healthy $port $pid "$out/serve-pp$pp.log" || log "server PP=$pp died"
  python3 benchmarks/greedy_outputs.py get --port $port --out "$out/greedy-pp$pp.json"
  for conc in ${CONCS:-1 16}; do
    log "bench serve PP=$pp ($part), max concurrency $conc"
    bench_serve $port $conc $((conc > 1 ? ${NUM_PROMPTS:-128} : ${NUM_PROMPTS:-128} / 4)) "$out" \
      "bench-pp$pp-c$conc.json" | tee -a "$out/summary.txt"
  done
  kill $pid; wait $pid 2>/dev/null
  port=$((port + 1))
done
want serve && log "greedy outputs, PP=1 vs PP=2 (5,3)" && python3 benchmarks/greedy_outputs.py compare "$out/greedy-pp1.json" "$out/greedy-pp2.json" \
  | tee -a "$out/summary.txt"
