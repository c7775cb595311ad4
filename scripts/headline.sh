#!/usr/bin/env bash
# The headline run: the README's at-a-glance table and docs/benchmarks.md's headline tables come from it.
# One run per model: compression, KL and top-1 against `full` (teacher-forced after a long essay prefix),
# and decode/prefill time against `full` (every method interleaved in one process), at 2K and 8K tokens.
#
#   scripts/headline.sh                                   # embedded SmolLM2 -> benchmarks/headline/smollm2.json
#   scripts/headline.sh qwen2.5-coder-1.5b MODEL.gguf     # another model -> benchmarks/headline/qwen2.5-coder-1.5b.json
#   kvshrink report --docs README.md docs/benchmarks.md   # then redraw the published tables from the JSON files
#
# Run it from the repository root. Environment overrides (the tests use them for a tiny run): KVSHRINK (the
# command; default .venv/bin/kvshrink when `make` made it, else kvshrink), LENGTHS, METHODS, REPEATS, THREADS,
# SCRATCH (the results folder; a rerun resumes it), DEST (where the JSON goes).
set -euo pipefail
NAME=${1:-smollm2}
MODEL=${2:-}
if [ -z "${KVSHRINK:-}" ]; then
    if [ -x .venv/bin/kvshrink ]; then KVSHRINK=.venv/bin/kvshrink; else KVSHRINK=kvshrink; fi
fi
LENGTHS=${LENGTHS:-2048,8000}
METHODS=${METHODS:-full,shard,shard:evict=0,lrqk,kivi:bits=2,streaming:window=640,turboquant:key_bits=3,value_bits=2}
REPEATS=${REPEATS:-2}
THREADS=${THREADS:-2}
SCRATCH=${SCRATCH:-results/headline-$NAME}
DEST=${DEST:-benchmarks/headline}

model_args=()
if [ -n "$MODEL" ]; then model_args=(--model "$MODEL"); fi

$KVSHRINK eval ppl --lengths "$LENGTHS" --methods "$METHODS" --threads "$THREADS" \
    "${model_args[@]}" --no-progress --out "$SCRATCH"
$KVSHRINK eval cost --lengths "$LENGTHS" --repeats "$REPEATS" --interleave --methods "$METHODS" \
    --threads "$THREADS" "${model_args[@]}" --no-progress --out "$SCRATCH"
mkdir -p "$DEST"
$KVSHRINK report "$SCRATCH" --export "$DEST/$NAME.json"
