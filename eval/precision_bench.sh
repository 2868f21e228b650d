#!/usr/bin/env bash
# Issue 19's Spec-Bench runs: the low-precision self-draft alone (lookup off) and the shipped setting, against our
# autoregressive path, one interleaved run per model, greedy, 10 prompts per task, 128 tokens, 2 threads.
#   eval/precision_bench.sh smollm2_135m 30 6      # model, E (= L: the whole model as the draft), K
#   eval/precision_bench.sh qwen2.5_coder_0.5b 24 6
# Run it on a quiet machine: two timing runs at once corrupt each other's numbers.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-smollm2_135m}; E=${2:-30}; K=${3:-6}; PRECISION=${PRECISION:-int8}; LIMIT=${LIMIT:-10}
SPEC_BENCH=${SPEC_BENCH:-../shared/data/spec_bench/question.jsonl}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} MKL_NUM_THREADS=${MKL_NUM_THREADS:-2}
exec python -m selfspec.eval model="$MODEL" head=lens head.exit_layer="$E" head.draft_precision="$PRECISION" \
  decode.draft_len="$K" decode.lookup=true decode.lookup_mode=checked \
  prompts=spec_bench prompts.path="$SPEC_BENCH" prompts.limit="$LIMIT" prompts.per_category=true \
  decode.max_new_tokens=128 logger=none reference=autoregressive \
  "methods=${METHODS:-[autoregressive,\"selfspec:lookup=false\",selfspec]}" "${@:4}"
