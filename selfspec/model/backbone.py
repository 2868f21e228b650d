"""The one module that knows Hugging Face internals.

Everything else in selfspec sees a decoder-only LM as five operations:
  embed(ids) -> h,  run_layers(h, start, end, cache, pos0) -> h,  norm(h),  logits(h),  rotary(...)
so that drafting can stop after layer E and verification can resume at layer E over the same KV cache.
No modeling files are vendored: we call HF's own decoder layers with our own position-indexed cache,
our own masks and HF's own rotary embedding module.
"""

from __future__ import annotations

import contextlib
import inspect
import types
from dataclasses import dataclass

import torch
from torch import nn

from selfspec.errors import SelfSpecError
from selfspec.model import fast_linear as fast_linear_mod

# model_type -> how to reach the parts. All four families share the LlamaModel skeleton
# (model.embed_tokens / model.layers / model.norm / model.rotary_emb / lm_head); they differ in
# sliding-window layers (qwen2, mistral, gemma3_text), per-layer-type rotary (gemma3_text) and
# final-logit soft-capping (gemma3_text).
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral", "gemma3_text")


def check_architecture(model_type: str) -> None:
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise SelfSpecError(
            f"model: unsupported architecture '{model_type}'; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


_FAST = {"on": False}  # set only while run_layers runs: HF generate on the same modules stays plain F.linear


def _gated_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if _FAST["on"]:
        return fast_linear_mod.linear(x, self.weight, self.bias)
    return torch.nn.functional.linear(x, self.weight, self.bias)


@contextlib.contextmanager
def _fast_linear_on(on: bool):
    prev = _FAST["on"]
    _FAST["on"] = on
    try:
        yield
    finally:
        _FAST["on"] = prev


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    kv_heads: int
    head_dim: int


class Backbone:
    """A frozen HF causal LM seen layer by layer.

    `run_layers` calls HF decoder layers with:
      - a `cache` object of ours whose `update()` writes K/V at absolute positions (see cache.py),
      - boolean attention masks we build for the chunk's absolute positions (causal, optionally sliding),
      - rotary (cos, sin) from the model's own rotary module, per layer type.
    """

    def __init__(self, hf_model: nn.Module, fast_linear: bool = True):
        config = hf_model.config
        check_architecture(config.model_type)
        self.hf_model = hf_model
        self.config = config
        inner = hf_model.model
        self.embed_tokens = inner.embed_tokens
        self.layers = inner.layers
        self.final_norm = inner.norm
        self.lm_head = hf_model.lm_head
        self._rotary = inner.rotary_emb
        self.num_layers = len(self.layers)
        self.hidden_size = config.hidden_size
        self.vocab_size = self.lm_head.weight.shape[0]
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.max_positions = int(getattr(config, "max_position_embeddings", 2048) or 2048)

        # Per-layer attention kind: the sliding window (int) or None for full attention.
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * self.num_layers
        self.layer_types = list(layer_types)[: self.num_layers]
        window = getattr(config, "sliding_window", None)
        if config.model_type == "mistral":  # mistral applies its window on every layer when set
            self.windows = [window] * self.num_layers
        else:
            use_sliding = getattr(config, "use_sliding_window", True)
            self.windows = [
                window if (t == "sliding_attention" and window and use_sliding is not False) else None
                for t in self.layer_types
            ]
        # gemma3's rotary module takes the layer type (local and global layers use different bases).
        self._rotary_takes_type = "layer_type" in inspect.signature(self._rotary.forward).parameters

        # The decoder layers' nn.Linear modules run through fast_linear.linear inside run_layers (and the LM head
        # inside logits); outside (HF generate on the same modules, training) they are plain F.linear.
        self.fast_linear = bool(fast_linear) and fast_linear_mod.load_kernel() is not None
        if self.fast_linear:
            for module in self.layers.modules():
                if isinstance(module, nn.Linear) and "forward" not in module.__dict__:
                    module.forward = types.MethodType(_gated_linear_forward, module)

        attn = self.layers[0].self_attn
        head_dim = getattr(attn, "head_dim", config.hidden_size // config.num_attention_heads)
        self.kv_shape = KVShape(self.num_layers, config.num_key_value_heads, head_dim)

    # ---------------------------------------------------------------- parts
    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, H). Gemma's embedding scale lives inside its embedding module."""
        return self.embed_tokens(ids)

    def norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.final_norm(h)

    def logits(self, h_normed: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """LM head on normed hidden states; `weight` may be a row subset (a reduced draft vocabulary)."""
        w = self.lm_head.weight if weight is None else weight
        bias = self.lm_head.bias if weight is None else None
        if self.fast_linear:
            out = fast_linear_mod.linear(h_normed, w, bias)
        else:
            out = torch.nn.functional.linear(h_normed, w, bias)
        if self.softcap:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out

    def rotary(self, h: torch.Tensor, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) for each layer type present, at the given (1, T) absolute positions."""
        if self._rotary_takes_type:
            return {t: self._rotary(h, positions, t) for t in set(self.layer_types)}
        cs = self._rotary(h, positions)
        return {t: cs for t in set(self.layer_types)}

    # ---------------------------------------------------------------- masks
    @staticmethod
    def attention_mask(
        pos0: int, q_len: int, kv_len: int, window: int | None, device: torch.device
    ) -> torch.Tensor | None:
        """Boolean (1, 1, q_len, kv_len) mask, True = attend, for queries at absolute positions
        pos0..pos0+q_len-1 over keys at 0..kv_len-1. None when every key is visible (one query,
        no window cut), which lets SDPA take its fastest path."""
        if q_len == 1 and (window is None or kv_len <= window):
            return None
        q = torch.arange(pos0, pos0 + q_len, device=device)[:, None]
        k = torch.arange(kv_len, device=device)[None, :]
        mask = k <= q
        if window is not None:
            mask = mask & (k > q - window)  # HF's sliding_window_overlay: kv_idx > q_idx - window
        return mask[None, None]

    # ---------------------------------------------------------------- layers
    def run_layers(
        self,
        h: torch.Tensor,
        start: int,
        end: int,
        cache=None,
        pos0: int = 0,
    ) -> torch.Tensor:
        """Run decoder layers [start, end) on h (B, T, H) whose tokens sit at positions pos0..pos0+T-1.

        With a cache, each layer writes its K/V at those positions and attends over [0, pos0+T);
        without one (training, feature extraction) the chunk attends causally to itself (pos0 must be 0).
        """
        if start >= end:
            return h
        T = h.shape[1]
        kv_len = pos0 + T
        if cache is not None:
            cache.write_pos = pos0
        else:
            assert pos0 == 0, "without a cache the chunk must start at position 0"
        positions = torch.arange(pos0, kv_len, device=h.device)[None]
        rope = self.rotary(h, positions)
        masks: dict[int | None, torch.Tensor | None] = {}
        with _fast_linear_on(self.fast_linear):
            h = self._run(h, start, end, cache, pos0, T, kv_len, positions, rope, masks)
        return h

    def _run(self, h, start, end, cache, pos0, T, kv_len, positions, rope, masks):
        for i in range(start, end):
            window = self.windows[i]
            if window not in masks:
                masks[window] = self.attention_mask(pos0, T, kv_len, window, h.device)
            if masks[window] is None and T > 1:  # pragma: no cover - T>1 always gets a mask
                raise AssertionError
            h = self.layers[i](
                h,
                attention_mask=masks[window],
                position_ids=positions,
                cache=cache,
                use_cache=cache is not None,
                position_embeddings=rope[self.layer_types[i]],
            )
        return h

    # ---------------------------------------------------------------- identity
    def fingerprint(self) -> dict:
        """Sizes plus a probe of the weights: 16 block means of |embedding|. A head saved for another
        model (other sizes, or other weights of the same sizes) is refused on load; the probe is
        compared with a tolerance so that the same model in another dtype still matches."""
        c = self.config
        with torch.no_grad():
            w = self.embed_tokens.weight.detach().float().abs().reshape(-1)
            probe = [float(b.mean()) for b in w[: (w.numel() // 16) * 16].reshape(16, -1)]
        return {
            "model_type": c.model_type,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "weight_probe": [round(x, 6) for x in probe],
        }


def fingerprints_match(a: dict, b: dict, rtol: float = 2e-2) -> bool:
    keys = ("model_type", "num_layers", "hidden_size", "vocab_size")
    if any(a.get(k) != b.get(k) for k in keys):
        return False
    pa, pb = a.get("weight_probe") or [], b.get("weight_probe") or []
    return len(pa) == len(pb) and all(abs(x - y) <= rtol * max(abs(x), abs(y), 1e-8) for x, y in zip(pa, pb))
