#!/usr/bin/env bash
# Issue 15's measurements in one device call: the 1B preset behind `engramrt serve` (one warm-up
# run, then `engramrt bench serve` at concurrency 1/16/64, 512 tokens in, 128 out, EOS ignored),
# the Triton compilations the server counted (/metrics) after start-up and after the runs, and
# `engramrt bench throughput` at batch 1/16/64 with the same lengths on the same model: the
# engine-side ceiling. Extra arguments go to the server (e.g. --async-scheduling); BENCH_FLAGS
# to bench throughput, BENCH_SIZES its batch sizes (default 1 16 64; "none": no such run),
# CONCURRENCY the client's levels (default 1 16 64). With PYSPY set to a py-spy binary, the server
# process is sampled (py-spy record, every thread, 5 s; PYSPY_FLAGS adds flags, e.g. --gil) while
# the highest level runs. PRESET picks the make_models preset (default 1b); the start-up time
# (launch to /health) and the server's resident memory after start-up are printed.
#   bash benchmarks/serve_gpu.sh OUT_DIR [serve flags...]
set -uo pipefail
out=${1:-/tmp/serve_gpu}
shift || true
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
model=/tmp/m${PRESET:-1b}
[ -f $model/config.json ] || python3 benchmarks/make_models.py --preset ${PRESET:-1b} --out $model \
  --device cuda 2>&1 | tail -1
port=8437
launched=$(date +%s.%N)
python3 -m engramrt serve $model --port $port --device cuda --dtype bfloat16 \
  --max-num-seqs 128 --max-model-len 2048 "$@" > "$out/serve.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null' EXIT
. "$(dirname "$0")/serve_lib.sh"
wait_healthy $port $pid "$out/serve.log" || exit 1
rss=$(ps -o rss= -p $pid | awk '{printf "%.2f GiB", $1 / 2^20}')
echo "start-up: $(python3 -c "import time; print(round(time.time() - $launched, 1))") s to" \
  "/health; server RSS $rss"
grep "engramrt:" "$out/serve.log" | tail -4
compiles() { curl -s localhost:$port/metrics | awk '/^engramrt:triton_compilations_total/{print $2}'; }
bench() {  # concurrency prompts tag
  timeout 300 python3 -m engramrt bench serve --port $port --num-prompts "$2" \
    --random-input-len 512 --random-output-len 128 --ignore-eos --max-concurrency "$1" \
    --disable-tqdm --save-result --result-dir "$out" --result-filename "serve-c$1$3.json" \
    | sed -n '/Serving Benchmark Result/,/^=*$/p'
}
bench 16 32 -warmup > /dev/null
echo "Triton compilations after start-up and a warm-up run: $(compiles)"
levels=${CONCURRENCY:-1 16 64}
for c in $levels; do
  echo "== concurrency $c"
  if [ -n "${PYSPY:-}" ] && [ "$c" = "${levels##* }" ]; then
    (sleep 1; "$PYSPY" record --pid $pid --duration 5 --rate 250 --threads ${PYSPY_FLAGS:-} --format raw \
      -o "$out/pyspy-c$c.txt" > "$out/pyspy.log" 2>&1) &
    spy=$!
  fi
  bench $c $((c == 1 ? 16 : c * 4)) ""
done
[ -n "${spy:-}" ] && wait $spy
echo "Triton compilations after the runs: $(compiles)"
kill $pid
wait $pid 2> /dev/null
for bs in ${BENCH_SIZES:-1 16 64}; do
  [ "$bs" = none ] && break
  timeout 200 python3 -m engramrt bench throughput --model $model --device cuda \
    --batch-size $bs --input-len 512 --output-len 128 --max-num-seqs 128 ${BENCH_FLAGS:-} 2>&1 \
    | grep -E "Output token|Decode step|Prefill time|rror" | sed "s/^/bench throughput bs$bs: /"
done
