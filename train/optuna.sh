#!/usr/bin/env bash
# Optuna (TPE) search over head.exit_layer, head.num_blocks and decode.draft_len, maximizing optimized_metric
# (default val/speedup; e.g. optimized_metric=val/tau).
#   train/optuna.sh                                 # 20 trials on the default experiment
#   train/optuna.sh hydra.sweeper.n_trials=40 head.draft_vocab=4096   # medusa heads: head.num_blocks is searched
# Best parameters: multirun/train/<time>/optimization_results.yaml; every trial: summary.md / summary.csv.
# Killed? Rerun with hydra.sweep.dir=<that sweep dir>: the study (optuna_study.json there) continues.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
exec python -m selfspec.train -m experiment=default hparams_search=optuna "$@"
