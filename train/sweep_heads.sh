#!/usr/bin/env bash
# A grid over head types and exit layers on the default data (synthesized once, cached, shared by all jobs).
#   train/sweep_heads.sh                                   # medusa/adapter/lora x E=4,6,10,14
#   train/sweep_heads.sh trainer.max_steps=300 decode.draft_len=3
#   train/sweep_heads.sh hydra/launcher=slurm hydra.launcher.partition=gpu trainer=gpu model.device=cuda
# Writes summary.md + summary.csv (one row per job, failed ones included) into multirun/train/<time>/.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
exec python -m selfspec.train -m experiment=default head=medusa,adapter,lora head.exit_layer=4,6,10,14 "$@"
