#!/usr/bin/env bash
# Spec-Bench with every method (hf_generate, hf_early_exit, hf_prompt_lookup, autoregressive, selfspec).
#   eval/spec_bench.sh                                   # all 480 prompts, default model, lens head
#   eval/spec_bench.sh prompts.limit=10 prompts.per_category=true head=medusa head.path=DIR
# The question file: $SPEC_BENCH, else ../shared/data/spec_bench/question.jsonl (never commit a copy).
set -euo pipefail
cd "$(dirname "$0")/.."
SPEC_BENCH=${SPEC_BENCH:-../shared/data/spec_bench/question.jsonl}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
exec python -m selfspec.eval prompts=spec_bench prompts.path="$SPEC_BENCH" decode.max_new_tokens=${MAX_NEW_TOKENS:-256} "$@"
