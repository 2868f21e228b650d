"""A full decoder layer on top of layer E (EAGLE-style draft layer): attention with its own KV cache + a SiLU-gated
MLP, both pre-normed, then the shared final norm + LM head.

Beside the attention-only adapter (Kangaroo), this gives the exit the capacity to stand in for the skipped
layers. `init_from=j` starts it as a copy of the model's own layer j (llama family), so an untrained head is
"layer j applied to layer E's states": a far better start than the lens for j near E. Without it the output
projections are zero-initialised and an untrained head is exactly the logit lens. `num_layers` stacks several.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from selfspec.errors import SelfSpecError
from selfspec.heads.base import ExitHead
from selfspec.heads.config import HeadConfig, check_int_field, register_head
from selfspec.model.cache import KVCache


@dataclass
class LayerHeadConfig(HeadConfig):
    type: str = "layer"
    num_layers: int = 1  # decoder layers stacked on layer E
    init_from: int | None = None  # copy the model's own layer j (None: zero-init outputs = the lens)
    intermediate: int | None = None  # MLP width; None = the model's (required equal to it with init_from)

    def __post_init__(self):
        super().__post_init__()
        check_int_field("head", "num_layers", self.num_layers, 1)
        check_int_field("head", "init_from", self.init_from, 0, nullable=True)
        check_int_field("head", "intermediate", self.intermediate, 1, nullable=True)

    def size_limits(self, backbone):
        L, H = backbone.num_layers, backbone.hidden_size
        return super().size_limits(backbone) | {
            "num_layers": (1, L, f"its {L} layers"), "init_from": (0, L - 1, "its last layer"),
            "intermediate": (1, 16 * H, f"16 x its hidden size {H}")}


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


class DraftLayer(nn.Module):
    """One pre-norm decoder layer with grouped-query attention (the model's head layout) and a gated MLP."""

    def __init__(self, hidden: int, q_heads: int, kv_heads: int, head_dim: int, inter: int, eps: float, bias: bool):
        super().__init__()
        self.q_heads, self.kv_heads, self.head_dim = q_heads, kv_heads, head_dim
        self.ln1, self.ln2 = _RMSNorm(hidden, eps), _RMSNorm(hidden, eps)
        self.q = nn.Linear(hidden, q_heads * head_dim, bias=bias)
        self.k = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o = nn.Linear(q_heads * head_dim, hidden, bias=False)
        self.gate = nn.Linear(hidden, inter, bias=False)
        self.up = nn.Linear(hidden, inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)
        nn.init.zeros_(self.o.weight)
        nn.init.zeros_(self.down.weight)

    def load_from(self, w: dict) -> None:
        with torch.no_grad():
            self.ln1.weight.copy_(w["ln1"]); self.ln2.weight.copy_(w["ln2"])  # noqa: E702
            self.ln1.eps, self.ln2.eps = w["eps1"], w["eps2"]
            for name in ("q", "k", "v", "o", "gate", "up", "down"):
                mod = getattr(self, name)
                mod.weight.copy_(w[name])
                if mod.bias is not None:
                    b = w.get(name + "_bias")
                    mod.bias.copy_(b if b is not None else torch.zeros_like(mod.bias))

    def forward(self, h: torch.Tensor, backbone, cache: KVCache | None, layer_idx: int, pos0: int) -> torch.Tensor:
        B, T, _ = h.shape
        x = self.ln1(h)
        q = self.q(x).view(B, T, self.q_heads, self.head_dim).transpose(1, 2)  # (B, Hq, T, D)
        k = self.k(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        positions = torch.arange(pos0, pos0 + T, device=h.device)[None]
        q, k = backbone.apply_rotary(q, k, positions, dtype=h.dtype)
        if cache is not None:
            cache.write_pos = pos0
            k, v = cache.update(k, v, layer_idx)
            mask = backbone.attention_mask(pos0, T, pos0 + T, None, h.device)
            causal = False
        else:
            mask, causal = None, T > 1
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                         enable_gqa=self.q_heads != self.kv_heads)
        h = h + self.o(out.transpose(1, 2).reshape(B, T, -1))
        x = self.ln2(h)
        return h + self.down(nn.functional.silu(self.gate(x)) * self.up(x))


@register_head("layer", LayerHeadConfig)
class LayerHead(ExitHead):
    training_input = "sequence"

    def __init__(self, config: LayerHeadConfig, exit_layer: int, backbone):
        super().__init__(config, exit_layer, backbone)
        ks = backbone.kv_shape
        H, inter = backbone.hidden_size, config.intermediate or backbone.intermediate_size
        weights = backbone.layer_weights(config.init_from) if config.init_from is not None else None
        if weights is not None and inter != weights["gate"].shape[0]:
            raise SelfSpecError(f"head.intermediate={config.intermediate}: must be null or {weights['gate'].shape[0]} with head.init_from")
        bias = weights is not None and weights["q_bias"] is not None
        eps = weights["eps1"] if weights is not None else 1e-6
        self.kv_heads, self.head_dim = ks.kv_heads, ks.head_dim
        self.layers = nn.ModuleList(
            DraftLayer(H, backbone.num_attention_heads, ks.kv_heads, ks.head_dim, inter, eps, bias) for _ in range(config.num_layers)
        )
        if weights is not None:
            for layer in self.layers:
                layer.load_from(weights)

    def new_state(self, backbone, max_len: int, batch: int = 1):
        return KVCache(range(len(self.layers)), batch, self.kv_heads, self.head_dim, max_len, backbone.dtype, backbone.device)

    def next_token_logits(self, h, backbone, state=None, pos0=0):
        return self(h, backbone, state, pos0=pos0, last_only=True)[0, -1]  # every row goes into its cache

    def transform(self, h, backbone, state=None, pos0=0):
        for i, layer in enumerate(self.layers):
            h = layer(h, backbone, state, i, pos0)
        return h
