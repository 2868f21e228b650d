#!/usr/bin/env bash
# Exit layer E x draft length K sweep; writes sweep.md + heatmap_{speedup,tau}.png into multirun/eval/<time>/.
#   eval/sweep_ek.sh                                      # medusa heads at E=4,8,12, K=1,2,4,6,8
#   HEAD=lens EXITS=2,4,6,8 KS=1,2,3,4 eval/sweep_ek.sh prompts.limit=20
#   HEAD=lens EXITS=6,12,18,24,30 KS=2,4,6 PRECISIONS=full,int8,int4 eval/sweep_ek.sh   # E x K x precision
# One head per E comes from the head cache ($SELFSPEC_CACHE/heads), trained on demand once per E (see
# head_cache.* in conf/eval.yaml). Only our two methods run: the sweep compares against our own autoregressive
# decoding, which is also what the predicted speedup (report.predicted_speedup) is relative to.
set -euo pipefail
cd "$(dirname "$0")/.."
SPEC_BENCH=${SPEC_BENCH:-../shared/data/spec_bench/question.jsonl}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
exec python -m selfspec.eval -m \
  head=${HEAD:-medusa} head.exit_layer=${EXITS:-4,8,12} decode.draft_len=${KS:-1,2,4,6,8} \
  head.draft_precision=${PRECISIONS:-full} \
  'methods=[autoregressive,selfspec]' reference=autoregressive logger=${LOGGER:-none} \
  prompts=spec_bench prompts.path="$SPEC_BENCH" prompts.limit=${LIMIT:-2} prompts.per_category=true \
  decode.max_new_tokens=${MAX_NEW_TOKENS:-128} "$@"
