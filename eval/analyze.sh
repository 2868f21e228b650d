#!/usr/bin/env bash
# Teacher-forced draft analysis on Spec-Bench: agreement, top-k coverage, KL, conditional agreement by
# position, expected and replayed tau by K, step costs and predicted speedup, per head and per task.
#   eval/analyze.sh                                        # 2 prompts per task, lens at E=4 and E=6
#   eval/analyze.sh 'heads=[lens@2-12,medusa@6,DIR]' prompts.limit=10
#   eval/analyze.sh model=qwen2.5_coder_0.5b 'heads=[lens@4,DIR]' costs=false
# The question file: $SPEC_BENCH, else ../shared/data/spec_bench/question.jsonl (never commit a copy).
# The target's answers are cached ($SELFSPEC_CACHE/analysis), so a second run with other heads starts scoring
# at once. Writes analysis.json, analysis.md and PNGs into outputs/analyze/<time>/.
set -euo pipefail
cd "$(dirname "$0")/.."
SPEC_BENCH=${SPEC_BENCH:-../shared/data/spec_bench/question.jsonl}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
exec python -m selfspec.analyze prompts=spec_bench prompts.path="$SPEC_BENCH" prompts.limit=2 prompts.per_category=true \
    max_new_tokens=${MAX_NEW_TOKENS:-128} 'heads=[lens@4,lens@6]' "$@"
