#!/usr/bin/env bash
# Data-parallel training under torchrun: N processes (default 2), gloo on CPU, NCCL with model.device=cuda.
#   train/ddp.sh                          # 2 CPU processes, the default experiment
#   NPROC=8 train/ddp.sh trainer=gpu model.device=cuda
# The ranks synthesize the data together (rank 0 writes the cache) and each caches only its part of the features;
# DistributedDataParallel over the head's parameters, each rank on cuda:LOCAL_RANK with model.device=cuda.
# All ranks must share one run dir, so it is fixed here (Hydra's ${now:} could differ between ranks).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
RUN_DIR=${RUN_DIR:-outputs/train/ddp-$(date +%Y-%m-%d_%H-%M-%S)}
exec python -m torch.distributed.run --standalone --nproc_per_node="${NPROC:-2}" -m selfspec.train \
  experiment=default "hydra.run.dir=$RUN_DIR" "$@"
