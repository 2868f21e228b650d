"""The one module that knows Hugging Face internals.

Everything else in selfspec sees a decoder-only LM as five operations:
  embed(ids) -> h,  run_layers(h, start, end, cache, pos0) -> h,  norm(h),  logits(h),  rotary(...)
so that drafting can stop after layer E and verification can resume at layer E over the same KV cache.
No modeling files are vendored. For the llama family (llama, qwen2, mistral) run_layers computes a decoder
layer itself from the HF module's weights: HF's math with fused projections, as one C call for decode steps
(cpu_kernels) or as a few torch ops elsewhere (_LeanLayer), tested against HF's layers. gemma3 and layers a
LoRA head has adapted run HF's own layer code, with our position-indexed cache, our masks and HF's rotary
module.
"""

from __future__ import annotations

import contextlib
import inspect
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.errors import SelfSpecError
from selfspec.model import cpu_kernels as cpu_kernels_mod

# model_type -> how to reach the parts. All four families share the LlamaModel skeleton
# (model.embed_tokens / model.layers / model.norm / model.rotary_emb / lm_head); they differ in
# sliding-window layers (qwen2, mistral, gemma3_text), per-layer-type rotary (gemma3_text) and
# final-logit soft-capping (gemma3_text).
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral", "gemma3_text")
# Families whose decoder layer is exactly pre-norm RMSNorm -> rotary GQA attention -> SwiGLU-style MLP, which
# run_layers can compute itself with fused projections (see _LeanLayer); gemma3_text always runs HF's layers.
LEAN_ARCHITECTURES = ("llama", "qwen2", "mistral")


def check_architecture(model_type: str) -> None:
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise SelfSpecError(
            f"model: unsupported architecture '{model_type}'; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


_FAST = {"on": False}  # set only while run_layers runs: HF generate on the same modules stays plain F.linear


def _gated_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if _FAST["on"]:
        return cpu_kernels_mod.linear(x, self.weight, self.bias)
    return torch.nn.functional.linear(x, self.weight, self.bias)


@contextlib.contextmanager
def _kernel_linears_on(on: bool):
    prev = _FAST["on"]
    _FAST["on"] = on
    try:
        yield
    finally:
        _FAST["on"] = prev


def _rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """HF's llama RMSNorm (float32 statistics, weight applied in the input dtype), one fused op in float32."""
    if x.dtype == torch.float32:
        return torch.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * xf.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as HF applies it: x * cos + rotate_half(x) * sin; x (B, heads, T, D), cos/sin (B, 1, T, D)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _fuse_rows(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of linears that read the same input into one (sum N, K) matrix,
    and re-point each module's parameters at its rows of it: one matmul instead of several, no extra memory,
    and HF's own forward (HF generate, training) keeps reading the very same numbers."""
    w = torch.cat([m.weight.detach() for m in linears], 0).contiguous()
    b = None
    if any(m.bias is not None for m in linears):
        b = torch.cat([m.bias.detach() if m.bias is not None else w.new_zeros(m.weight.shape[0]) for m in linears])
    off = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(w[off : off + n], requires_grad=False)
        if m.bias is not None:
            m.bias = nn.Parameter(b[off : off + n], requires_grad=False)
        off += n
    return w, b


class _LeanLayer:
    """One llama-family decoder layer computed by selfspec instead of HF's module tree: the same math
    (RMSNorm, rotary, SDPA with GQA, SiLU-gated MLP) with q/k/v and gate/up fused into one matmul each and
    none of the per-call Python of HF's generic layer. On a 135M model that overhead is about as large as the
    matmuls themselves (BENCHMARKS.md). Used only while the layer's modules are the ones fused here: a LoRA
    injected later (head=lora), or weights moved to another device/dtype, sends the layer back to HF's code."""

    def __init__(self, layer: nn.Module):
        attn, mlp = layer.self_attn, layer.mlp
        self.layer = layer
        self.mods = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        self.wqkv, self.bqkv = _fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj])
        self.wgu, self.bgu = _fuse_rows([mlp.gate_proj, mlp.up_proj])
        self.head_dim = attn.head_dim
        self.q_dim, self.kv_dim = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
        self.inter = mlp.gate_proj.weight.shape[0]
        self.scaling = attn.scaling
        self.silu = getattr(mlp.config, "hidden_act", None) == "silu"
        self.act = mlp.act_fn
        # The same layer for the C kernel (float32 CPU weights, SiLU): sizes and pointers into the tensors above.
        self.c_weights = None
        if self.silu and self.wqkv.dtype == torch.float32 and self.wqkv.device.type == "cpu":
            ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
            sizes = dict(hidden=self.wqkv.shape[1], q_heads=self.q_dim // self.head_dim,
                         kv_heads=self.kv_dim // self.head_dim, head_dim=self.head_dim, inter=self.inter)
            tensors = dict(ln1=ln1.weight, ln2=ln2.weight, wqkv=self.wqkv, bqkv=self.bqkv, wo=attn.o_proj.weight,
                           bo=attn.o_proj.bias, wgu=self.wgu, bgu=self.bgu, wd=mlp.down_proj.weight, bd=mlp.down_proj.bias)
            if all(t is None or t.is_contiguous() for t in tensors.values()):
                self.c_weights = cpu_kernels_mod.layer_weights(
                    sizes, ln1.variance_epsilon, ln2.variance_epsilon, self.scaling, tensors
                )

    def usable(self) -> bool:
        attn, mlp = self.layer.self_attn, self.layer.mlp
        return (
            (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj) == self.mods
            and attn.q_proj.weight.data_ptr() == self.wqkv.data_ptr()
            and mlp.gate_proj.weight.data_ptr() == self.wgu.data_ptr()
            and not self.layer.training
        )

    def __call__(self, h, cos, sin, mask, cache, layer_idx: int, lin=F.linear) -> torch.Tensor:
        layer = self.layer
        B, T, _ = h.shape
        D = self.head_dim
        qkv = lin(_rms_norm(h, layer.input_layernorm), self.wqkv, self.bqkv)  # (B, T, q_dim + 2 kv_dim)
        q, k, v = qkv.split((self.q_dim, self.kv_dim, self.kv_dim), dim=-1)
        q = _rotate(q.view(B, T, -1, D).transpose(1, 2), cos, sin)  # (B, Hq, T, D)
        k = _rotate(k.view(B, T, -1, D).transpose(1, 2), cos, sin)  # (B, Hkv, T, D)
        v = v.view(B, T, -1, D).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, layer_idx)  # (B, Hkv, pos0 + T, D)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=q.shape[1] != k.shape[1]
        )  # (B, Hq, T, D)
        o_proj = layer.self_attn.o_proj
        h = h + lin(o.transpose(1, 2).reshape(B, T, self.q_dim), o_proj.weight, o_proj.bias)
        gu = lin(_rms_norm(h, layer.post_attention_layernorm), self.wgu, self.bgu)  # (B, T, 2 * inter)
        g, u = gu.split(self.inter, dim=-1)
        a = F.silu(g) if self.silu else self.act(g)
        down = layer.mlp.down_proj
        return h + lin(a * u, down.weight, down.bias)


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    kv_heads: int
    head_dim: int


class Backbone:
    """A frozen HF causal LM seen layer by layer.

    `run_layers` runs each decoder layer with:
      - a `cache` of ours written at absolute positions (see cache.py): by the C kernel directly, or through
        the `update()` protocol by _LeanLayer and HF's layers,
      - boolean attention masks for the chunk's absolute positions (causal, optionally sliding),
      - rotary (cos, sin) from the model's own rotary module, per layer type.
    """

    def __init__(self, hf_model: nn.Module, cpu_kernels: bool = True):
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

        # selfspec's CPU kernels (cpu_kernels.py): whole llama-family layers for decode steps, and the decoder's
        # nn.Linear modules through cpu_kernels.linear inside run_layers (and the LM head inside logits); outside
        # (HF generate on the same modules, training) they are plain F.linear.
        self.cpu_kernels = bool(cpu_kernels) and cpu_kernels_mod.load_kernel() is not None
        if self.cpu_kernels:
            for module in self.layers.modules():
                if isinstance(module, nn.Linear) and "forward" not in module.__dict__:
                    module.forward = types.MethodType(_gated_linear_forward, module)

        # Our own layer forward for the llama family (same math, fused projections; see _LeanLayer).
        self.lean: list[_LeanLayer] | None = None
        if config.model_type in LEAN_ARCHITECTURES:
            self.lean = [_LeanLayer(layer) for layer in self.layers]

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
        out = (cpu_kernels_mod.linear if self.cpu_kernels else F.linear)(h_normed, w, bias)
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
        rope = self.rotary(h, positions)  # layer type -> (cos, sin), each (1, T, D)
        # Decode steps (batch 1, a few rows, a cache, float32 CPU, no autograd) run whole layers in the C kernel,
        # in place on our own copy of h.
        kernel = (
            self.cpu_kernels
            and self.lean is not None
            and cache is not None
            and h.shape[0] == 1
            and 0 < T <= cpu_kernels_mod.MAX_ROWS
            and h.dtype == torch.float32
            and h.device.type == "cpu"
            and not (torch.is_grad_enabled() and h.requires_grad)
        )
        if kernel:
            cache.check_room(kv_len)
            h = h.clone(memory_format=torch.contiguous_format)
            rope_rows = {t: (c[0].contiguous(), s[0].contiguous()) for t, (c, s) in rope.items()}  # (T, D) each
        lin = cpu_kernels_mod.linear if self.cpu_kernels else F.linear
        masks: dict[int | None, torch.Tensor | None] = {}
        with _kernel_linears_on(self.cpu_kernels):
            for i in range(start, end):
                window, kind = self.windows[i], self.layer_types[i]
                lean = self.lean[i] if self.lean is not None and self.lean[i].usable() else None
                if kernel and lean is not None and lean.c_weights is not None:
                    k_buf, v_buf = cache.layer_buffers(i)
                    cos, sin = rope_rows[kind]
                    cpu_kernels_mod.decoder_layer(lean.c_weights, h[0], cos, sin, k_buf, v_buf, pos0, window)
                    continue
                if window not in masks:
                    masks[window] = self.attention_mask(pos0, T, kv_len, window, h.device)
                if lean is not None:
                    cos, sin = rope[kind]
                    h = lean(h, cos.unsqueeze(1), sin.unsqueeze(1), masks[window], cache, i, lin)
                    continue
                h = self.layers[i](
                    h,
                    attention_mask=masks[window],
                    position_ids=positions,
                    cache=cache,
                    use_cache=cache is not None,
                    position_embeddings=rope[kind],
                )
                if kernel:  # the next kernel layer writes in place
                    h = h.contiguous()
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
