"""Medusa-style ResBlock heads (Cai et al. 2024) on an early exit."""

from __future__ import annotations

import torch
from torch import nn

from selfspec.heads.base import ExitHead, HeadConfig


class ResBlock(nn.Module):
    """x + SiLU(W x + b), W and b zero-initialised: an untrained block is the identity, so an untrained
    head is exactly the logit lens and training can only start from there."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHead(ExitHead):
    kind = "medusa"

    def __init__(self, cfg: HeadConfig, exit_layer: int, hidden_size: int):
        super().__init__(cfg, exit_layer, hidden_size)
        # One stack per predicted offset: heads[0] predicts t+1 (the draft), heads[i] predicts t+1+i.
        self.heads = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden_size) for _ in range(cfg.num_blocks)]) for _ in range(cfg.num_heads)
        )

    def transform(self, h, backbone, state=None, pos0=0):
        return self.heads[0](h)

    def extra_logits(self, h, backbone):
        return [backbone.logits(backbone.norm(head(h)), self.lm_weight(backbone)) for head in self.heads[1:]]
