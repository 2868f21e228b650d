#!/usr/bin/env bash
# Data-parallel training under torchrun: N processes (default 2), gloo on CPU, NCCL with model.device=cuda.
#   train/ddp.sh                          # 2 CPU processes, the default experiment
#   NPROC=8 train/ddp.sh trainer=gpu model.device=cuda
# Rank 0 synthesizes data and caches features while the others wait; every rank then reads the cache.
# All ranks must share one run dir, so it is fixed here (Hydra's ${now:} could differ between ranks).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
RUN_DIR=${RUN_DIR:-outputs/train/ddp-$(date +%Y-%m-%d_%H-%M-%S)}
exec python -m torch.distributed.run --standalone --nproc_per_node="${NPROC:-2}" -m selfspec.train \
  experiment=default "hydra.run.dir=$RUN_DIR" "$@"
