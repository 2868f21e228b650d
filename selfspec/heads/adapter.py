"""Kangaroo-style adapter (Liu et al. 2024): one attention-only decoder layer on top of layer E.

h' = h + Attn(RMSNorm(h)), then the shared final norm + LM head. The output projection is zero-initialised,
so an untrained adapter is the logit lens. Its attention needs keys/values for every earlier position, so it
keeps its own small KV cache per generation (written by position, like the main one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from selfspec.heads.base import ExitHead
from selfspec.heads.config import HeadConfig, check_int_field, register_head
from selfspec.model.cache import KVCache


@dataclass
class AdapterConfig(HeadConfig):
    type: str = "adapter"
    adapter_heads: int | None = None  # attention heads; None = the model's

    def __post_init__(self):
        super().__post_init__()
        check_int_field("head", "adapter_heads", self.adapter_heads, 1, nullable=True)

    def size_limits(self, backbone):
        n = backbone.num_attention_heads
        return super().size_limits(backbone) | {"adapter_heads": (1, 4 * n, f"4 x its {n} attention heads")}


@register_head("adapter", AdapterConfig)
class AdapterHead(ExitHead):
    training_input = "sequence"

    def __init__(self, config: AdapterConfig, exit_layer: int, backbone):
        super().__init__(config, exit_layer, backbone)
        H = backbone.hidden_size
        self.num_heads = config.adapter_heads or backbone.num_attention_heads
        self.head_dim = backbone.kv_shape.head_dim
        inner = self.num_heads * self.head_dim
        self.norm = nn.RMSNorm(H, eps=1e-6)
        self.q_proj = nn.Linear(H, inner, bias=False)
        self.k_proj = nn.Linear(H, inner, bias=False)
        self.v_proj = nn.Linear(H, inner, bias=False)
        self.o_proj = nn.Linear(inner, H, bias=False)
        nn.init.zeros_(self.o_proj.weight)

    def new_state(self, backbone, max_len: int, batch: int = 1):
        return KVCache([0], batch, self.num_heads, self.head_dim, max_len, backbone.dtype, backbone.device)

    def next_token_logits(self, h, backbone, state=None, pos0=0):
        return self(h, backbone, state, pos0=pos0, last_only=True)[0, -1]  # every row goes into its cache

    def transform(self, h, backbone, state=None, pos0=0):
        B, T, _ = h.shape
        positions = torch.arange(pos0, pos0 + T, device=h.device)[None]
        x = self.norm(h)
        q, k, v = (proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = backbone.apply_rotary(q, k, positions, dtype=h.dtype)
        if state is not None:
            state.write_pos = pos0
            k, v = state.update(k, v, 0)
            mask = backbone.attention_mask(pos0, T, pos0 + T, None, h.device)
            out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=T > 1)
        out = out.transpose(1, 2).reshape(B, T, -1)
        return h + self.o_proj(out)
