"""Data parallelism under `torchrun`: each rank trains on its share of every micro-batch and the gradients
of the trainable parameters (the head, or the LoRA) are averaged with one all-reduce per optimizer step.

Why not the DDP wrapper: the trainable parameters are a head called with the backbone as an argument, or
LoRA layers inside the frozen model whose forward never goes through one module call; a flat all-reduce
of exactly those gradients is the same algorithm without routing every forward through a wrapper.
Rank 0 alone builds the data cache, validates, checkpoints and saves; the others wait at barriers.
"""

from __future__ import annotations

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


def init_distributed(device: str) -> DistInfo:
    """Join the process group that torchrun describes in the environment (a single process otherwise)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    if not dist.is_initialized():
        backend = "nccl" if str(device).startswith("cuda") else "gloo"
        # Rank 0 may synthesize data for many minutes while the others wait at a barrier.
        dist.init_process_group(backend, timeout=datetime.timedelta(hours=4))
    info = DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))
    return info


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


def broadcast_tensors_(info: DistInfo, tensors) -> None:
    """Overwrite every rank's tensors with rank 0's (start all replicas from the same weights)."""
    if info.enabled:
        with torch.no_grad():
            for t in tensors:
                dist.broadcast(t.data, src=0)


def all_reduce_mean_(info: DistInfo, flat: torch.Tensor) -> torch.Tensor:
    if info.enabled:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= info.world_size
    return flat


def shutdown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()
