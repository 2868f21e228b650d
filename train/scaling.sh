#!/usr/bin/env bash
# Data-scaling curve (issue 10): the same head trained on growing subsets of one dataset, then scored
# teacher-forced on Spec-Bench answers by the analysis instrument. Does agreement grow with data or flatten?
#   train/scaling.sh                          # medusa@6 on data=mix at 10k, 30k, 100k answer tokens and all of it
#   TOKENS="20000 80000" HEAD=layer train/scaling.sh head.intermediate=768
#   EXPERIMENT=context HEAD=context BASELINE=lens@2 STEPS=900 TOKENS="100000 500000 all" train/scaling.sh
#       (issue 21: the context head on subsets of the 2M-token ShareGPT build; no rebuild per size)
#   EXPERIMENT=context HEAD=context BASELINE=lens@2 TOKENS="100000 500000" STEPS="45 225" WARMUP="3 12" train/scaling.sh
#       (one pass over each subset: steps in proportion to tokens, ~2.2k supervised positions per step)
# Each run: trainer.train_tokens=N (a seeded subset of whole sequences). One STEPS value: the same steps for every
# N, so the small subsets see more epochs; a list: one per size, in TOKENS' order (WARMUP likewise, optional).
# Runs land in $OUT/tokens-N (resumable: rerun the script after an interruption);
# the analysis table is $OUT/analyze/analysis.md. Build the data first: python -m selfspec.cli.build_data data=mix
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/scaling}
HEAD=${HEAD:-medusa}
EXPERIMENT=${EXPERIMENT:-mix}
BASELINE=${BASELINE:-lens@6}
STEPS=${STEPS:-600}
TOKENS=${TOKENS:-"10000 30000 100000 all"}
SPEC_BENCH=${SPEC_BENCH:-../shared/data/spec_bench/question.jsonl}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
read -r -a sizes <<< "$TOKENS"; read -r -a steps <<< "$STEPS"; read -r -a warmups <<< "${WARMUP:-}"
if [ ${#steps[@]} -ne 1 ] && [ ${#steps[@]} -ne ${#sizes[@]} ]; then
  echo "STEPS='$STEPS': one value, or one per size in TOKENS='$TOKENS'" >&2; exit 2
fi
if [ ${#warmups[@]} -gt 0 ] && [ ${#warmups[@]} -ne ${#sizes[@]} ]; then
  echo "WARMUP='${WARMUP:-}': one value per size in TOKENS='$TOKENS', or unset" >&2; exit 2
fi
heads=()
for i in "${!sizes[@]}"; do
  n=${sizes[$i]}
  dir="$OUT/tokens-$n"
  heads+=("$dir/head")
  [ -f "$dir/head/head_config.json" ] && continue
  tokens=$([ "$n" = all ] && echo null || echo "$n")
  s=${steps[$(( ${#steps[@]} == 1 ? 0 : i ))]}
  warm=()
  [ ${#warmups[@]} -gt 0 ] && warm=(trainer.warmup_steps="${warmups[$i]}")
  python -m selfspec.train experiment=$EXPERIMENT head=$HEAD trainer.max_steps=$s trainer.train_tokens=$tokens \
    "${warm[@]}" trainer.resume=true trainer.compare_lens=false logger=none hydra.run.dir="$dir" "$@"
done
list=$(IFS=,; echo "${heads[*]}")
python -m selfspec.analyze model=smollm2_135m "heads=[$BASELINE,$list]" prompts=spec_bench prompts.path="$SPEC_BENCH" \
  prompts.limit=2 prompts.per_category=true max_new_tokens=128 costs=false logger=none hydra.run.dir="$OUT/analyze"
