# Shell helpers for the benchmark scripts that start `engramrt serve` and measure it (sourced).

# wait_healthy PORT PID LOG: until /health answers; 1 (and the log's tail) if the server died.
wait_healthy() {
  for _ in $(seq 300); do
    curl -sf "localhost:$1/health" > /dev/null && return 0
    kill -0 "$2" 2>/dev/null || { echo "server died:"; tail -20 "$3"; return 1; }
    sleep 1
  done
  return 1
}

# bench_serve PORT CONCURRENCY PROMPTS OUT_DIR RESULT_FILE: nano-vllm-style random prompts (256
# in, 64 out, EOS ignored); prints the result block.
bench_serve() {
  timeout 300 python3 -m engramrt bench serve --port "$1" --num-prompts "$3" \
    --random-input-len 256 --random-output-len 64 --ignore-eos --max-concurrency "$2" \
    --disable-tqdm --save-result --result-dir "$4" --result-filename "$5" \
    | sed -n '/Serving Benchmark Result/,/^=*$/p'
}
