#!/usr/bin/env bash
# Issue 31's before/after in one device call: this tree against OLD (a worktree of the commit
# before, carried in the call), alternated on the same machine and model.
#   - benchmarks/engine_core.py (1B preset, bs 64 and 256, 512 in / 128 out, overlap off and on)
#     with each tree's engramrt (this script's copy of engine_core.py imports the tree's own)
#   - serving the 1B preset (serve_gpu.sh of each tree: c = 1, 16, 64, 512 in / 128 out), the
#     old tree with --async-scheduling (its opt-in), this one with its default
#   OLD=.old [PARTS="core serve"] bash benchmarks/engine_core_ab.sh OUT_DIR
#   (git worktree add .old <commit>)
set -uo pipefail
out=${1:-/tmp/engine_core_ab}
old=$(cd "${OLD:-.old}" && pwd)
new=$PWD
mkdir -p "$out" /tmp/ab-scripts
cp -r "$new/benchmarks" /tmp/ab-scripts/  # this tree's scripts, each tree's engramrt
export PYTHONUNBUFFERED=1
[ -f /tmp/m1b/config.json ] || PYTHONPATH=$new${PYTHONPATH:+:$PYTHONPATH} python3 \
  benchmarks/make_models.py --preset 1b --out /tmp/m1b --device cuda 2>&1 | tail -1
core() {  # tree tag
  (cd "$1" && PYTHONPATH=/tmp/ab-scripts:$1${PYTHONPATH:+:$PYTHONPATH} timeout 200 python3 \
    /tmp/ab-scripts/benchmarks/engine_core.py --model /tmp/m1b --out "$out/core-$2.json" 2>&1 \
    | grep -E "^bs|rror" | sed "s/^/$2 /")
}
serve() {  # tree tag flags...
  local tree=$1 tag=$2
  shift 2
  (cd "$tree" && PRESET=1b CONCURRENCY="1 16 64" BENCH_SIZES=none bash benchmarks/serve_gpu.sh \
    "$out/$tag" "$@" 2>&1 | grep -E "concurrency|Median TTFT|Median TPOT|Output token|rror" \
    | sed "s/^/$tag /")
}
parts=${PARTS:-core serve}
if [[ $parts == *core* ]]; then
  for round in 1 2; do
    core "$old" old
    core "$new" new
  done
fi
if [[ $parts == *serve* ]]; then
  serve "$old" old --async-scheduling
  serve "$new" new
fi
