#!/usr/bin/env bash
# The (head type, size, E) table of BENCHMARKS.md (issue 10): heads of several kinds and sizes trained on the same
# data=mix, then scored together by the analysis instrument on Spec-Bench (agreement, c, predicted speedup; a medusa
# head with extra heads also with several drafts per pass).
#   train/heads_table.sh                 # medusa 4 heads, medusa 4x wide, LoRA rank 8 and 32 (all E=6)
#   STEPS=600 LORA_STEPS=300 train/heads_table.sh
# Runs land in $OUT/<name> (resumable: rerun after an interruption); the table is $OUT/analyze/analysis.md, and
# $OUT/analyze-lora32/analysis.md for the second LoRA (an analysis takes one head that changes the model). Pass
# more heads to compare (the shipped one is `default`) with EXTRA_HEADS="default,outputs/full/head".
# Build the data first: python -m selfspec.cli.build_data data=mix
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/heads_table}
STEPS=${STEPS:-300}
LORA_STEPS=${LORA_STEPS:-150}
SPEC_BENCH=${SPEC_BENCH:-../shared/data/spec_bench/question.jsonl}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
heads=()
train() {
  local name=$1; shift
  if [ "$name" != lora32 ]; then heads+=("$OUT/$name/head"); fi  # lora32: its own analysis (one LoRA per run)
  [ -f "$OUT/$name/head/head_config.json" ] && return
  python -m selfspec.train experiment=mix trainer.compare_lens=false trainer.resume=true logger=none \
    hydra.run.dir="$OUT/$name" "$@"
}
train medusa4 head.num_heads=4 trainer.max_steps="$STEPS" trainer.ckpt_every=100
train medusa_wide head.intermediate=2304 trainer.max_steps="$STEPS" trainer.ckpt_every=100
train lora8 head=lora '~head.num_blocks' head.lora_rank=8 trainer.max_steps="$LORA_STEPS" trainer.ckpt_every=50
train lora32 head=lora '~head.num_blocks' head.lora_rank=32 trainer.max_steps="$LORA_STEPS" trainer.ckpt_every=50
analyze() {  # $1: heads, $2: output dir
  python -m selfspec.analyze model=smollm2_135m "heads=[$1]" prompts=spec_bench prompts.path="$SPEC_BENCH" \
    prompts.limit=10 prompts.per_category=true max_new_tokens=128 logger=none hydra.run.dir="$2"
}
analyze "$(IFS=,; echo "lens@6,${heads[*]}${EXTRA_HEADS:+,$EXTRA_HEADS}")" "$OUT/analyze"
analyze "$OUT/lora32/head" "$OUT/analyze-lora32"
