#!/usr/bin/env bash
# engramrt serve + engramrt bench serve on the bundled model, per device, in one run.
#   bash benchmarks/serve_bench.sh OUT_DIR [devices...]   (default devices: cpu, and cuda if present)
set -euo pipefail
out=${1:-/tmp/serve_bench}; shift || true
devices=${*:-cpu $(python3 -c 'import torch; print("cuda" if torch.cuda.is_available() else "")')}
mkdir -p "$out"
. "$(dirname "$0")/serve_lib.sh"
port=8431
for dev in $devices; do
  python3 -m engramrt serve --port $port --device "$dev" --max-num-seqs 64 > "$out/serve-$dev.log" 2>&1 &
  pid=$!
  wait_healthy $port $pid "$out/serve-$dev.log" || exit 1
  for conc in 1 16 64; do
    echo "== device $dev, max concurrency $conc"
    python3 -m engramrt bench serve --port $port --num-prompts $((conc * 4 > 32 ? conc * 4 : 32)) \
      --random-input-len 128 --random-output-len 32 --ignore-eos --max-concurrency $conc \
      --disable-tqdm --save-result --result-dir "$out" \
      --result-filename "bench-$dev-c$conc.json" | sed -n '/Serving Benchmark Result/,/^=*$/p'
  done
  kill $pid; wait $pid 2>/dev/null || true
  port=$((port + 1))
done
