"""Data parallelism under `torchrun`, on torch's own DistributedDataParallel.

Each rank runs on its own device (`cuda:LOCAL_RANK`, set with torch.cuda.set_device; gloo on CPU) and:
  - builds its share of the data: the target answers (and samples prompts for) every W-th request, and the
    answers are gathered so that every rank holds the whole dataset (`sharding`: synthesis.generate reads it;
    data=mix chooses each stage's prompts on rank 0, and rank 0 alone writes its stages and answer shards);
  - computes and loads only its part of the feature cache: the layer-E states of its own sequences
    (sequence b belongs to rank b % W; features.py);
  - trains on its own sequences of every global micro-batch: the trainable parameters sit in one small module
    wrapped by DistributedDataParallel, which averages their gradients (Trainer). Each rank's loss is its rows'
    share of the whole micro-batch's mean, so the average is the one-process gradient of the same global batch.
Rank 0 alone validates, checkpoints, logs and saves the head.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def owns(self, index: int) -> bool:
        """Sequence / request `index` is this rank's (index % world_size == rank)."""
        return index % self.world_size == self.rank


def rank_device(device: str, info: DistInfo) -> str:
    """The device a rank runs on: `cuda:LOCAL_RANK` for model.device=cuda (or cuda:N) under torchrun, else `device`."""
    if info.enabled and str(device).startswith("cuda"):
        return f"cuda:{info.local_rank}"
    return str(device)


def init_distributed(device: str) -> DistInfo:
    """Join the process group that torchrun describes in the environment (a single process otherwise). On CUDA
    the rank's device is set first (cuda:LOCAL_RANK), so NCCL and every later tensor use it."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = str(device).startswith("cuda")
    if cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        # Rank 0 may wait for another job's data build (the cache lock) while the others wait for it.
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(hours=4))
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank)


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def broadcast_object(info: DistInfo, obj):
    """Rank 0's obj on every rank."""
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(info: DistInfo, obj) -> list:
    """[rank 0's obj, rank 1's, ...] on every rank."""
    if not info.enabled:
        return [obj]
    out = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def all_reduce_sum_(info: DistInfo, t: torch.Tensor) -> torch.Tensor:
    if info.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def shutdown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ sharded work
_SHARD: contextvars.ContextVar[DistInfo | None] = contextvars.ContextVar("selfspec_shard", default=None)


@contextlib.contextmanager
def sharding(info: DistInfo):
    """Inside the block, data synthesis (synthesis.generate, score_sequences) is split across the ranks: each
    does every W-th request and the results are gathered on every rank, in order."""
    token = _SHARD.set(info if info.enabled else None)
    try:
        yield
    finally:
        _SHARD.reset(token)


def current_shard() -> DistInfo | None:
    return _SHARD.get()


def gather_in_order(info: DistInfo, n: int, mine: dict) -> list:
    """Every rank's {index: result} for indices [0, n) -> the full list, on every rank."""
    merged: dict = {}
    for part in all_gather_object(info, mine):
        merged.update(part)
    missing = [i for i in range(n) if i not in merged]
    if missing:
        raise RuntimeError(f"data-parallel synthesis: no rank produced results {missing[:5]}")
    return [merged[i] for i in range(n)]


class TrainableModule(torch.nn.Module):
    """The trainable parameters (a head's, or the LoRA matrices inside the frozen model) as one module whose forward
    calls a function: what DistributedDataParallel wraps. The parameters are the same objects, not copies."""

    def __init__(self, params):
        super().__init__()
        self.params = torch.nn.ParameterList(list(params))

    def forward(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)


def data_parallel(params, info: DistInfo, device: torch.device):
    """DistributedDataParallel over `params` (rank 0's values broadcast to every rank), or None in one process."""
    if not info.enabled:
        return None
    from torch.nn.parallel import DistributedDataParallel

    module = TrainableModule(params)
    cuda = device.type == "cuda"
    return DistributedDataParallel(module, device_ids=[device.index if device.index is not None else info.local_rank] if cuda else None,
                                   broadcast_buffers=False)
