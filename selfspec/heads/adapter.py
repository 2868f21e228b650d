"""Kangaroo-style adapter (Liu et al. 2024): one attention-only decoder layer on top of layer E.

h' = h + Attn(RMSNorm(h)), then the shared final norm + LM head. The output projection is zero-initialised,
so an untrained adapter is the logit lens. Its attention needs keys/values for every earlier position, so it
keeps its own small KV cache per generation (written by position, like the main one).
"""

from __future__ import annotations

import torch
from torch import nn

from selfspec.heads.base import ExitHead, HeadConfig
from selfspec.model.cache import KVCache


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class AdapterHead(ExitHead):
    kind = "adapter"

    def __init__(self, cfg: HeadConfig, exit_layer: int, hidden_size: int, head_dim: int, num_heads: int):
        super().__init__(cfg, exit_layer, hidden_size)
        self.num_heads = cfg.adapter_heads or num_heads
        self.head_dim = head_dim
        inner = self.num_heads * head_dim
        self.norm = nn.RMSNorm(hidden_size, eps=1e-6)
        self.q_proj = nn.Linear(hidden_size, inner, bias=False)
        self.k_proj = nn.Linear(hidden_size, inner, bias=False)
        self.v_proj = nn.Linear(hidden_size, inner, bias=False)
        self.o_proj = nn.Linear(inner, hidden_size, bias=False)
        nn.init.zeros_(self.o_proj.weight)

    def new_state(self, backbone, max_len: int, batch: int = 1):
        return KVCache([0], batch, self.num_heads, self.head_dim, max_len, backbone.dtype, backbone.device)

    def transform(self, h, backbone, state=None, pos0=0):
        B, T, _ = h.shape
        positions = torch.arange(pos0, pos0 + T, device=h.device)[None]
        rope = backbone.rotary(h, positions)
        cos, sin = rope.get("full_attention", next(iter(rope.values())))
        cos, sin = cos[:, None], sin[:, None]  # (1, 1, T, D)
        x = self.norm(h)
        q, k, v = (proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if state is not None:
            state.write_pos = pos0
            k, v = state.update(k, v, 0)
            mask = backbone.attention_mask(pos0, T, pos0 + T, None, h.device)
            out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=T > 1)
        out = out.transpose(1, 2).reshape(B, T, -1)
        return h + self.o_proj(out)
