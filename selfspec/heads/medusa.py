"""Medusa-style ResBlock heads (Cai et al. 2024) on an early exit."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from selfspec.heads.base import ExitHead
from selfspec.heads.config import HeadConfig, check_int_field, register_head


WIDTH_FACTOR = 16  # a block's inner width at most this many times the model's hidden size


@dataclass
class MedusaConfig(HeadConfig):
    type: str = "medusa"
    num_blocks: int = 1  # ResBlocks per head
    # Heads: extra ones predict t+2, t+3, ... from the same hidden state; decode.tokens_per_pass=m drafts m tokens
    # from one pass through layers < E with the first m of them.
    num_heads: int = 1
    intermediate: int | None = None  # a block's hidden width: None = x + SiLU(W x) (H x H); else x + W2 SiLU(W1 x)

    def __post_init__(self):
        super().__post_init__()
        check_int_field("head", "num_blocks", self.num_blocks, 0)
        check_int_field("head", "num_heads", self.num_heads, 1)
        check_int_field("head", "intermediate", self.intermediate, 1, nullable=True)

    def size_limits(self, backbone):
        L, H = backbone.num_layers, backbone.hidden_size
        return super().size_limits(backbone) | {
            "num_blocks": (0, L, f"its {L} layers"), "num_heads": (1, L, f"its {L} layers"),
            "intermediate": (1, WIDTH_FACTOR * H, f"{WIDTH_FACTOR} x its hidden size {H}")}


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


class WideResBlock(nn.Module):
    """x + W2 SiLU(W1 x + b1) with an inner width of its own (head.intermediate); W2 zero-initialised, so an
    untrained block is the identity as well."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.up = nn.Linear(hidden, inner)
        self.down = nn.Linear(inner, hidden, bias=False)
        nn.init.zeros_(self.down.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.silu(self.up(x)))


@register_head("medusa", MedusaConfig)
class MedusaHead(ExitHead):
    def __init__(self, config: MedusaConfig, exit_layer: int, backbone):
        super().__init__(config, exit_layer, backbone)
        H, inner = backbone.hidden_size, config.intermediate

        def block():
            return ResBlock(H) if inner is None else WideResBlock(H, inner)

        # One stack per predicted offset: heads[0] predicts t+1 (the draft), heads[i] predicts t+1+i.
        self.heads = nn.ModuleList(
            nn.Sequential(*[block() for _ in range(config.num_blocks)]) for _ in range(config.num_heads)
        )

    @property
    def max_ahead(self) -> int:
        return len(self.heads)

    def transform(self, h, backbone, state=None, pos0=0):
        return self.heads[0](h)

    def extra_logits(self, h, backbone):
        return [backbone.logits(backbone.norm(head(h)), self.lm_weight(backbone)) for head in self.heads[1:]]
