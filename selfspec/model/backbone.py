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
import itertools
import operator
import threading
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.errors import SelfSpecError, check
from selfspec.model import cpu_kernels as cpu_kernels_mod
from selfspec.model.quant import KINDS, check_precision, quantize, quantize_readout, requantize

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


# Per-thread switches for the decoder's nn.Linear modules (their forward is _gated_linear_forward once a Backbone
# patched them): `fast` while this thread's run_layers runs on the CPU kernels, `quant` (id(module) -> QuantWeight)
# while it runs a low-precision draft through HF's layer code. Thread-local, so another thread's HF generate, verify
# pass or training on the same modules computes plain F.linear whatever this one does.
_LINEARS = threading.local()


def _gated_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    quant = getattr(_LINEARS, "quant", None)
    if quant is not None:
        qw = quant.get(id(self))
        if qw is not None:
            return cpu_kernels_mod.linear(x, qw, self.bias)
    if getattr(_LINEARS, "fast", False):
        return cpu_kernels_mod.linear(x, self.weight, self.bias)
    return torch.nn.functional.linear(x, self.weight, self.bias)


@contextlib.contextmanager
def _linears(fast: bool, quant: dict | None = None):
    prev = getattr(_LINEARS, "fast", False), getattr(_LINEARS, "quant", None)
    _LINEARS.fast, _LINEARS.quant = fast, quant
    try:
        yield
    finally:
        _LINEARS.fast, _LINEARS.quant = prev


def _patch_linears(layers: nn.Module) -> None:
    for module in layers.modules():
        if isinstance(module, nn.Linear) and "forward" not in module.__dict__:
            module.forward = types.MethodType(_gated_linear_forward, module)


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


# What _LeanLayer.usable() compares its weights by: each tensor's storage address and in-place version counter
# (attribute getters that map() runs without a Python frame per tensor), and the generations it hands out.
_DATA_PTR = torch.Tensor.data_ptr
_VERSION = operator.attrgetter("_version")
_GENERATIONS = itertools.count(1)


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


def _version_of(t: torch.Tensor) -> int:
    """t's in-place version counter; -1 for an inference tensor, which keeps none (and is edited in place only
    inside inference mode)."""
    return -1 if t.is_inference() else t._version


def _stamp(tensors: list) -> list[int]:
    """What a copy made from `tensors` was made from: each one's storage address and in-place version counter."""
    return list(map(_DATA_PTR, tensors)) + list(map(_version_of, tensors))


def _same_tensors(now: list, then: list, stamp: list[int]) -> bool:
    """Whether `now` are the very tensors `then` (by identity: a tensor's == is elementwise), unchanged since
    `stamp` was taken of them."""
    return len(now) == len(then) and all(map(operator.is_, now, then)) and _stamp(now) == stamp


class _LeanLayer:
    """One llama-family decoder layer computed by selfspec instead of HF's module tree: the same math
    (RMSNorm, rotary, SDPA with GQA, SiLU-gated MLP) with q/k/v and gate/up fused into one matmul each and
    none of the per-call Python of HF's generic layer. On a 135M model that overhead is about as large as the
    matmuls themselves (BENCHMARKS.md). Used only while the layer's modules are the ones fused here: a LoRA
    injected later (head=lora), or weights moved to another device/dtype, sends the layer back to HF's code.

    The fused matrices and the C struct (pointers) are made from the weights as they were: usable() also checks
    every tensor they read. One replaced since (a new Parameter, new storage: `load_state_dict(assign=True)`, a
    hand edit) has the layer fused again from the modules' weights; one edited in place is in the fused rows
    already (the modules' weights are views of them). Either bumps `generation`, from which the copies made of
    them (low-precision draft copies, the C stacks kept on a cache) know that they are stale."""

    def __init__(self, layer: nn.Module):
        attn, mlp = layer.self_attn, layer.mlp
        self.layer = layer
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        projs = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        # where usable() finds each module: (container's _modules, name, the module fused here)
        self._slots = [(layer._modules, n, getattr(layer, n))
                       for n in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")]
        self._slots += [(attn._modules, n, getattr(attn, n)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        self._slots += [(mlp._modules, n, getattr(mlp, n)) for n in ("gate_proj", "up_proj", "down_proj")]
        self._slot_dicts, self._slot_names = [d for d, _, _ in self._slots], [n for _, n, _ in self._slots]
        self._slot_mods = [m for _, _, m in self._slots]
        # where it finds every weight and bias the layer and its kernel read: (a module's _parameters, name)
        sources = [(m._parameters, n) for m in (*norms, *projs) for n in ("weight", "bias") if n in m._parameters]
        self._src_dicts, self._src_names = [d for d, _ in sources], [n for _, n in sources]
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.silu = getattr(mlp.config, "hidden_act", None) == "silu"
        self.act = mlp.act_fn
        self._lock = threading.Lock()
        self.generation = 0
        self._fuse()

    def _fuse(self) -> None:
        """Fuse q/k/v and gate/up, make the C struct, and note the tensors they were made from (usable())."""
        layer = self.layer
        attn, mlp = layer.self_attn, layer.mlp
        with torch.inference_mode(False), torch.no_grad():  # the model's weights: plain tensors whatever the caller
            self.wqkv, self.bqkv = _fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj])
            self.wgu, self.bgu = _fuse_rows([mlp.gate_proj, mlp.up_proj])
        self.q_dim, self.kv_dim = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
        self.inter = mlp.gate_proj.weight.shape[0]
        # The same layer for the C kernel (float32 CPU weights, SiLU): sizes and pointers into the tensors above.
        self.c_weights = self.c_args = None
        if self.silu and self.wqkv.dtype == torch.float32 and self.wqkv.device.type == "cpu":
            ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
            sizes = dict(hidden=self.wqkv.shape[1], q_heads=self.q_dim // self.head_dim,
                         kv_heads=self.kv_dim // self.head_dim, head_dim=self.head_dim, inter=self.inter)
            tensors = dict(ln1=ln1.weight, ln2=ln2.weight, wqkv=self.wqkv, bqkv=self.bqkv, wo=attn.o_proj.weight,
                           bo=attn.o_proj.bias, wgu=self.wgu, bgu=self.bgu, wd=mlp.down_proj.weight, bd=mlp.down_proj.bias)
            if all(t is None or t.is_contiguous() for t in tensors.values()):
                self.c_args = (sizes, ln1.variance_epsilon, ln2.variance_epsilon, self.scaling, tensors)
                self.c_weights = cpu_kernels_mod.layer_weights(*self.c_args)
        self._params = list(map(dict.get, self._src_dicts, self._src_names))
        self._live = [p for p in self._params if p is not None]
        self._tracked = [p for p in self._live if not p.is_inference()]  # inference tensors keep no version
        self._ptrs, self._versions = list(map(_DATA_PTR, self._live)), list(map(_VERSION, self._tracked))
        self._kind = (self.wqkv.dtype, self.wqkv.device)
        self.generation = next(_GENERATIONS)

    def matrices(self) -> dict[str, torch.Tensor]:
        """The four (fused) weight matrices a low-precision copy replaces."""
        attn, mlp = self.layer.self_attn, self.layer.mlp
        return {"wqkv": self.wqkv, "wo": attn.o_proj.weight, "wgu": self.wgu, "wd": mlp.down_proj.weight}

    def usable(self) -> bool:
        # Read through the _modules / _parameters dicts, not nn.Module.__getattr__: a decode step asks every layer
        # (3-4 us a call for its 13 tensors, as the two-pointer check before it on a 2-core EPYC). list == list
        # compares modules by identity first (they define no __eq__ of their own); tensors define an elementwise
        # one, so they are compared with `is`.
        if self.layer.training or list(map(dict.get, self._slot_dicts, self._slot_names)) != self._slot_mods:
            return False
        params = list(map(dict.get, self._src_dicts, self._src_names))
        if not (all(map(operator.is_, params, self._params)) and list(map(_DATA_PTR, self._live)) == self._ptrs):
            return self._refuse()
        if list(map(_VERSION, self._tracked)) != self._versions:  # edited in place: in the fused rows, not in copies
            with self._lock:
                self._versions = list(map(_VERSION, self._tracked))
                self.generation = next(_GENERATIONS)
        return True

    def _refuse(self) -> bool:
        """A weight replaced since the layer was fused: fuse again from the modules' weights -> True; False (HF's
        code) when they are no longer all of the dtype and device fused here (the model cast or moved)."""
        with self._lock:
            params = list(map(dict.get, self._src_dicts, self._src_names))
            if any(p is not None and (p.dtype, p.device) != self._kind for p in params):
                return False
            if not (all(map(operator.is_, params, self._params)) and list(map(_DATA_PTR, self._live)) == self._ptrs):
                self._fuse()  # (another thread may have done it meanwhile)
        return True

    def __call__(self, h, cos, sin, mask, cache, layer_idx: int, lin=F.linear, weights: dict | None = None) -> torch.Tensor:
        """`weights`: the four matrices to use instead of the layer's (a low-precision draft copy, see matrices())."""
        layer = self.layer
        B, T, _ = h.shape
        D = self.head_dim
        w = weights or self.matrices()
        qkv = lin(_rms_norm(h, layer.input_layernorm), w["wqkv"], self.bqkv)  # (B, T, q_dim + 2 kv_dim)
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
        h = h + lin(o.transpose(1, 2).reshape(B, T, self.q_dim), w["wo"], o_proj.bias)
        gu = lin(_rms_norm(h, layer.post_attention_layernorm), w["wgu"], self.bgu)  # (B, T, 2 * inter)
        g, u = gu.split(self.inter, dim=-1)
        a = F.silu(g) if self.silu else self.act(g)
        down = layer.mlp.down_proj
        return h + lin(a * u, w["wd"], down.bias)


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
        self._rope_static = getattr(self._rotary, "rope_type", None) in ("default", "linear", "llama3")
        self._rope_table: dict = {}  # (dtype, device) -> (cos, sin) for positions [0, n): see _rotary_rows

        # selfspec's CPU kernels (cpu_kernels.py): whole llama-family layers for decode steps, and the decoder's
        # nn.Linear modules through cpu_kernels.linear inside run_layers (and the LM head inside logits); outside
        # (HF generate on the same modules, training) they are plain F.linear.
        # Only for a model on the CPU: on CUDA nothing is compiled, loaded or patched.
        self.cpu_kernels = (bool(cpu_kernels) and self.lm_head.weight.device.type == "cpu"
                            and cpu_kernels_mod.load_kernel() is not None)
        if self.cpu_kernels:
            _patch_linears(self.layers)
        self._quant: dict[str, QuantStack] = {}  # precision -> the draft pass's low-precision copies (quantized())

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
        if self.lean is not None and h.dtype == torch.float32:  # llama family: one fused op, as in its layers
            return _rms_norm(h, self.final_norm)
        return self.final_norm(h)

    def logits(self, h_normed: torch.Tensor, weight: torch.Tensor | None = None, quant: "QuantStack | None" = None) -> torch.Tensor:
        """LM head on normed hidden states; `weight` may be a row subset (a reduced draft vocabulary); with `quant`
        (a low-precision draft, quantized()) the LM head or that subset in its precision."""
        w = self.lm_head.weight if weight is None else weight
        bias = self.lm_head.bias if weight is None else None
        if quant is not None:
            out = cpu_kernels_mod.linear(h_normed, quant.lm_weight(self, weight), bias)
        else:
            out = (cpu_kernels_mod.linear if self.cpu_kernels else F.linear)(h_normed, w, bias)
        if self.softcap:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out

    def rotary(self, h: torch.Tensor, positions: torch.Tensor,
               chain_start: int | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) for each layer type present, at the given (1, T) absolute positions; chain_start=p when they
        are p, p+1, ..., p+T-1 (rows cut from a table, see _rotary_rows)."""
        if self._rotary_takes_type:
            return {t: self._rotary(h, positions, t) for t in set(self.layer_types)}
        cs = None
        if chain_start is not None and self._rope_static:
            cs = self._rotary_rows(h, chain_start, positions.shape[-1])
        if cs is None:
            cs = self._rotary(h, positions)
        return {t: cs for t in set(self.layer_types)}

    def _rotary_rows(self, h: torch.Tensor, p0: int, T: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Positions p0..p0+T-1 of a rotary module whose angles depend on the position alone (rope_type default,
        linear, llama3): (cos, sin) views into a table it computed once for positions [0, n), n doubling as
        needed. Element by element the same arithmetic as a call (position * inv_freq, cos, sin, the scaling),
        without a decode step's ~0.15 ms of module overhead, and no read of the device. None outside the model's
        context."""
        if p0 < 0 or p0 + T > self.max_positions:
            return None
        key = (h.dtype, h.device)
        table = self._rope_table.get(key)
        if table is None or table[0].shape[0] < p0 + T:
            n = min(self.max_positions, max(1024, 2 * (p0 + T)))
            with torch.inference_mode(False), torch.no_grad():  # a plain tensor: training may use it later
                cos, sin = self._rotary(h, torch.arange(n, device=h.device)[None])
            table = self._rope_table[key] = (cos[0], sin[0])
        return table[0][None, p0 : p0 + T], table[1][None, p0 : p0 + T]

    # ---------------------------------------------------------------- for exit heads (no HF internals there)
    @property
    def num_attention_heads(self) -> int:
        return self.config.num_attention_heads

    def lm_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """(N,) token ids -> (N, H) copy of their LM-head rows, contiguous (a reduced draft vocabulary)."""
        return self.lm_head.weight.detach()[ids.to(self.device)].contiguous()

    def apply_rotary(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                     dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k (B, heads, T, D) rotated as the model's full-attention layers rotate them at the (1, T) absolute
        positions; cos/sin in `dtype` (default q's)."""
        kind = "full_attention" if "full_attention" in self.layer_types else self.layer_types[0]
        like = q if dtype is None else q.new_empty(0, dtype=dtype)  # HF's rotary reads only device and dtype
        cos, sin = self._rotary(like, positions, kind) if self._rotary_takes_type else self._rotary(like, positions)
        cos, sin = cos[:, None], sin[:, None]  # (1, 1, T, D)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def layer_weights(self, index: int) -> dict[str, torch.Tensor | float | None]:
        """Copies of decoder layer `index`'s weights under architecture-neutral names, for heads initialised from
        one of the model's own layers: ln1, q, k, v, o (+ q_bias, k_bias, v_bias, o_bias or None), ln2, gate,
        up, down, eps1, eps2. llama-family layers only (a one-line error otherwise)."""
        check(0 <= index < self.num_layers, f"head.init_from={index}: must be a layer index in [0, {self.num_layers - 1}]")
        check(self.config.model_type in LEAN_ARCHITECTURES,
              f"head.init_from: initialising from a layer needs a llama-family model ({', '.join(sorted(LEAN_ARCHITECTURES))}), not {self.config.model_type}")
        layer = self.layers[index]
        attn, mlp = layer.self_attn, layer.mlp

        def copy(t):
            return None if t is None else t.detach().clone()

        out: dict = {"ln1": copy(layer.input_layernorm.weight), "ln2": copy(layer.post_attention_layernorm.weight),
                     "eps1": float(layer.input_layernorm.variance_epsilon), "eps2": float(layer.post_attention_layernorm.variance_epsilon)}
        for name, mod in (("q", attn.q_proj), ("k", attn.k_proj), ("v", attn.v_proj), ("o", attn.o_proj),
                          ("gate", mlp.gate_proj), ("up", mlp.up_proj), ("down", mlp.down_proj)):
            out[name], out[name + "_bias"] = copy(mod.weight), copy(mod.bias)
        return out

    @property
    def intermediate_size(self) -> int:
        return int(self.config.intermediate_size)

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

    @staticmethod
    def tree_attention_mask(positions: torch.Tensor, tree_mask: torch.Tensor, kv_len: int, window: int | None) -> torch.Tensor:
        """Boolean (1, 1, T, kv_len) mask, True = attend, for T tree rows over keys at slots 0..kv_len-1.

        tree_mask (T, S) bool covers the last S slots [kv_len - S, kv_len): row t sees those set in tree_mask[t]
        (its ancestors and itself, one position apart) and every slot before them (a chain: slot == position).
        A window is counted in rotary positions: prefix slot j stays when j > positions[t] - window; a tree slot
        when fewer than `window` of the row's visible tree slots lie from it up to the row itself."""
        T, S = tree_mask.shape
        base = kv_len - S
        tree = tree_mask.to(device=positions.device, dtype=torch.bool)
        prefix = torch.ones(T, base, dtype=torch.bool, device=positions.device)
        if window is not None:
            prefix &= torch.arange(base, device=positions.device)[None, :] > positions[:, None] - window
            dist = tree.flip(-1).cumsum(-1).flip(-1) - 1  # visible slots after this one, up to the row: its distance
            tree = tree & (dist < window)
        return torch.cat([prefix, tree], dim=-1)[None, None]

    @staticmethod
    def ragged_attention_mask(positions: torch.Tensor, key_positions: torch.Tensor, window: int | None) -> torch.Tensor:
        """Boolean (B, 1, T, kv_len) mask, True = attend: each row's queries at `positions` (B, T) over its
        slots holding `key_positions` (B, kv_len), -1 = empty (see run_layers: ragged batches)."""
        q, k = positions[:, :, None], key_positions.to(positions.device)[:, None, :]  # (B, T, 1), (B, 1, kv)
        mask = (k >= 0) & (k <= q)
        if window is not None:
            mask = mask & (k > q - window)
        return mask[:, None]

    # ---------------------------------------------------------------- layers
    def run_capturing(self, h: torch.Tensor, start: int, end: int, depths, cache=None, **kw) -> tuple[torch.Tensor, list]:
        """run_layers over [start, end), also keeping the states after each of `depths` layers (start <= d <= end;
        d = start is the input): -> (the output, [the state at each depth]). Same arguments as run_layers; each
        stretch between two depths is one run_layers call (one kernel call on the CPU path)."""
        out, at = [], start
        for d in depths:
            assert start <= d <= end, f"run_capturing: depth {d} outside [{start}, {end}]"
            h, at = self.run_layers(h, at, d, cache, **kw), d
            out.append(h)
        return self.run_layers(h, at, end, cache, **kw), out

    def run_layers(
        self,
        h: torch.Tensor,
        start: int,
        end: int,
        cache=None,
        pos0: int = 0,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        key_positions: torch.Tensor | None = None,
        quant: "QuantStack | None" = None,
    ) -> torch.Tensor:
        """Run decoder layers [start, end) on h (B, T, H) whose tokens sit at positions pos0..pos0+T-1.

        `quant` (from quantized()): the layers' matrices in that low precision (a draft pass; its K/V are written
        to the cache like any other, where verification overwrites them).

        With a cache, each layer writes its K/V at those positions and attends over [0, pos0+T);
        without one (training, feature extraction) the chunk attends causally to itself (pos0 must be 0).

        Tree rows (draft trees): `tree_mask` (T, S) bool, T <= S <= pos0+T, says which of the last S cache slots
        [pos0+T-S, pos0+T) each row sees: its ancestors and itself (the tree's nodes written at consecutive slots,
        parents first; S > T when earlier depths were written by earlier calls). Every slot before them is
        visible (the committed sequence). `positions` (T,) are the rows' rotary positions; they default to the
        depth under a root at slot pos0+T-S (position = slot there): pos0+T-S + tree_mask.sum(1) - 1. K/V are
        still written at slots pos0..pos0+T-1. Sliding windows count rotary positions (tree_attention_mask).
        `positions` alone means a chain at those rotary positions.

        Ragged batches (batched synthesis, every row at its own length): `key_positions` (B, kv_len) long is the
        position each cache slot holds in its row (-1: empty), `positions` (B, T) the rows' query positions. A
        query sees the slots of its row at positions <= its own (and inside a window); where K/V are written is
        up to the cache's update() (pos0 is ignored). Always torch code, never the batch-1 C kernel.
        """
        if start >= end:
            return h
        if cache is not None:
            cache.write_pos = pos0
        else:
            assert pos0 == 0, "without a cache the chunk must start at position 0"
        positions, tree_mask, kv_len, tree = self._rows(h, pos0, positions, tree_mask, key_positions)
        rope = self.rotary(h, positions, None if tree or key_positions is not None else pos0)  # type -> (cos, sin)
        rope_rows = tree_c = None
        if self._kernel_applies(h, cache, tree, key_positions is not None):  # in place on our own copy of h
            cache.check_room(kv_len)
            h = h.clone(memory_format=torch.contiguous_format)
            rope_rows = {t: (c[0].contiguous(), s[0].contiguous()) for t, (c, s) in rope.items()}  # (T, D) each
            tree_c = cpu_kernels_mod.tree_args(positions[0], tree_mask) if tree else None
            if self._run_stack(h, start, end, cache, pos0, rope_rows, tree_c, quant):
                return h
        return self._layer_by_layer(h, range(start, end), cache, pos0, (positions, tree_mask, key_positions, kv_len, tree),
                                    rope, rope_rows, tree_c, quant)

    def _layer_by_layer(self, h: torch.Tensor, layers: range, cache, pos0: int, rows: tuple, rope: dict,
                        rope_rows: dict | None, tree_c, quant: "QuantStack | None") -> torch.Tensor:
        """run_layers' layers one call each (when the whole run is not one C call): the C decoder layer where
        `rope_rows` is given (the batch-1 kernel applies) and the layer is lean, else the lean torch layer, else the
        model's own module. `rows`: _rows' (positions, tree_mask, key_positions, kv_len, tree); masks are made once
        per window."""
        positions, tree_mask, key_positions, kv_len, tree = rows
        kernel = rope_rows is not None
        lin = cpu_kernels_mod.linear if self.cpu_kernels or quant is not None else F.linear
        masks: dict[int | None, torch.Tensor | None] = {}
        with _linears(self.cpu_kernels):
            for i in layers:
                window, kind = self.windows[i], self.layer_types[i]
                lean = self.lean[i] if self.lean is not None and self.lean[i].usable() else None
                c_weights = None if lean is None else lean.c_weights if quant is None else quant.c_layer(self, i)
                if kernel and c_weights is not None:
                    k_buf, v_buf = cache.layer_buffers(i)
                    cos, sin = rope_rows[kind]
                    cpu_kernels_mod.decoder_layer(c_weights, h[0], cos, sin, k_buf, v_buf, pos0, window, tree_c)
                    continue
                if window not in masks:
                    masks[window] = self._mask(h, window, pos0, kv_len, positions, tree_mask, key_positions, tree)
                if lean is not None:
                    cos, sin = rope[kind]
                    w = None if quant is None else quant.lean_layer(self, i)
                    h = lean(h, cos.unsqueeze(1), sin.unsqueeze(1), masks[window], cache, i, lin, w)
                    continue
                with _linears(self.cpu_kernels, None if quant is None else quant.module_map(self, i)):
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

    def _rows(self, h: torch.Tensor, pos0: int, positions, tree_mask, key_positions):
        """run_layers' rows, checked: -> (rotary positions (1, T), or (B, T) for a ragged batch; the tree mask (a
        chain's causal one when only positions are given); kv_len, the slots attended over; whether they are
        tree rows)."""
        T = h.shape[1]
        kv_len = pos0 + T
        ragged = key_positions is not None
        tree = not ragged and (tree_mask is not None or positions is not None)
        if ragged:
            B = h.shape[0]
            if tree_mask is not None or positions is None or tuple(positions.shape) != (B, T) or key_positions.shape[0] != B:
                raise SelfSpecError(f"run_layers: key_positions needs positions of shape ({B}, {T}) and no tree_mask")
            positions = positions.to(device=h.device, dtype=torch.long)
            kv_len = key_positions.shape[1]
        elif tree:
            if tree_mask is None:
                tree_mask = torch.ones(T, T, dtype=torch.bool, device=h.device).tril()
            S = tree_mask.shape[-1]
            if tree_mask.shape != (T, S) or not T <= S <= kv_len:
                raise SelfSpecError(f"run_layers: tree_mask of shape {tuple(tree_mask.shape)}: must be (T, S) with T={T} <= S <= pos0+T={kv_len}")
            if positions is None:
                positions = kv_len - S - 1 + tree_mask.to(device=h.device, dtype=torch.long).sum(-1)
            positions = positions.to(device=h.device, dtype=torch.long).reshape(-1)
            if positions.shape[0] != T:
                raise SelfSpecError(f"run_layers: positions has {positions.shape[0]} entries: must be one per row ({T})")
            positions = positions[None]
        else:
            positions = torch.arange(pos0, kv_len, device=h.device)[None]
        return positions, tree_mask, kv_len, tree

    def _mask(self, h, window: int | None, pos0: int, kv_len: int, positions, tree_mask, key_positions, tree: bool):
        """The attention mask of run_layers' rows in layers with this window (None: full attention)."""
        if key_positions is not None:
            return self.ragged_attention_mask(positions, key_positions, window)
        if tree:
            return self.tree_attention_mask(positions[0], tree_mask, kv_len, window)
        return self.attention_mask(pos0, h.shape[1], kv_len, window, h.device)

    def _kernel_applies(self, h: torch.Tensor, cache, tree: bool, ragged: bool) -> bool:
        """Decode steps (batch 1, a few rows, a cache, float32 CPU, no autograd) run whole layers in the C kernel."""
        T = h.shape[1]
        return (
            self.cpu_kernels
            and self.lean is not None
            and cache is not None
            and h.shape[0] == 1
            and not ragged
            and 0 < T <= (cpu_kernels_mod.TREE_MAX_ROWS if tree else cpu_kernels_mod.MAX_ROWS)
            and h.dtype == torch.float32
            and h.device.type == "cpu"
            and not (torch.is_grad_enabled() and h.requires_grad)
        )

    def _kinds(self, start: int, end: int) -> list[str]:
        """The distinct layer types of layers [start, end), in order of first use (a LayerStack's rotary kinds)."""
        return list(dict.fromkeys(self.layer_types[start:end]))

    def _run_stack(self, h, start: int, end: int, cache, pos0: int, rope_rows: dict, tree_c, quant) -> bool:
        """Every layer of [start, end) in one C call, in place on h -> True; False when some layer cannot run in C."""
        stack = self._layer_stack(cache, start, end, quant)
        if stack is None:
            return False
        cpu_kernels_mod.decoder_layers(stack, h[0], [rope_rows[t] for t in self._kinds(start, end)], pos0, tree_c)
        return True

    def _layer_stack(self, cache, start: int, end: int, quant: "QuantStack | None"):
        """Layers [start, end) of `cache` prepared for one C call (cpu_kernels.LayerStack), made once and kept on
        the cache while the layers' weights stay as they were (their generations); None when a layer cannot run in
        C (not ours, a LoRA injected, no C weights)."""
        lean = self.lean[start:end]
        if any(not layer.usable() for layer in lean):
            return None
        key = (start, end, None if quant is None else quant.precision)
        generations = [layer.generation for layer in lean]
        hit = cache.kernel_stacks.get(key)
        if hit is not None and hit[0] is quant and hit[1] == generations:
            return hit[2]
        weights = [self.lean[i].c_weights if quant is None else quant.c_layer(self, i) for i in range(start, end)]
        if any(w is None for w in weights):
            return None
        bufs = [cache.layer_buffers(i) for i in range(start, end)]
        kinds = self._kinds(start, end)
        stack = cpu_kernels_mod.LayerStack(weights, [k for k, _ in bufs], [v for _, v in bufs], self.windows[start:end],
                                           [kinds.index(t) for t in self.layer_types[start:end]])
        cache.kernel_stacks[key] = (quant, generations, stack)
        return stack

    def _chain_readout(self, tokens: torch.Tensor, first: int, stop: int, quant: "QuantStack | None",
                       lm_weight: torch.Tensor | None):
        """The readout a draft chain in one C call reads (the LM head or its draft-vocabulary rows, in `quant`'s
        precision or in full), or None where such a chain over cache slots [first, stop) cannot run in C: no
        kernels, not the llama family, rotary angles that need a call per position, a soft-capped head, an LM head
        the kernels cannot take."""
        emb = self.embed_tokens.weight
        if not (self.cpu_kernels and self.lean is not None and self._rope_static and not self._rotary_takes_type
                and not self.softcap and type(self.embed_tokens) is nn.Embedding and emb.dtype == torch.float32
                and tokens.device.type == "cpu" and not torch.is_grad_enabled()
                and 0 <= first and stop <= self.max_positions):
            return None
        lm = lm_weight if lm_weight is not None else self.lm_head.weight
        if quant is not None:
            lm = quant.lm_weight(self, lm_weight)
            if lm.kind == "int4" and lm.shape[1] % 32:
                return None
        return lm

    def draft_chain(self, cache, end: int, tokens: torch.Tensor, pos0: int, count: int, quant: "QuantStack | None" = None,
                    lm_weight: torch.Tensor | None = None, vocab_ids: torch.Tensor | None = None,
                    hidden_out: torch.Tensor | None = None, sampled: tuple | None = None) -> bool:
        """A logit lens's draft chain in one C call (cpu_kernels.draft_chain), in place in `tokens` (the generation's
        (N,) ids): step s runs tokens[pos0+s] through layers [0, end) at cache slot pos0+s, in `quant`'s precision
        or in full, and writes to tokens[pos0+s+1] the argmax of the final norm + LM head (or its draft-vocabulary
        rows `lm_weight`, whose token ids are `vocab_ids`), or with sampled = (temperature, top_p, uniforms, q_out) a
        draw from its tempered top-p distribution (written to q_out); hidden_out (count, H) gets the layer-`end` states.
        -> True; False, with nothing run, where it cannot run in C (no kernels, not the llama family, rotary
        angles that need a call per position, a soft-capped head, a layer or LM head the kernels cannot take). Each
        draft is the argmax of run_layers + norm + logits, summed in the kernel's order."""
        emb = self.embed_tokens.weight
        lm = self._chain_readout(tokens, pos0, pos0 + count, quant, lm_weight)
        if lm is None:
            return False
        stack = self._layer_stack(cache, 0, end, quant)
        if stack is None:
            return False
        cache.check_room(pos0 + count)
        cos, sin = self._rotary_rows(emb[None, :1], pos0, count)
        bias = self.lm_head.bias if lm_weight is None else None
        cpu_kernels_mod.draft_chain(stack, [(cos[0], sin[0])] * stack.num_kinds, emb, self.final_norm.weight,
                                    self.final_norm.variance_epsilon, lm, bias, vocab_ids, tokens, pos0, count, hidden_out,
                                    sampled)
        return True

    def context_chain(self, cache, end: int, tokens: torch.Tensor, hidden: torch.Tensor, head: "cpu_kernels_mod.ContextChainHead",
                      early: int, seen: int, p0: int, count: int, threshold: float = 0.0, cont: float = 0.0,
                      quant: "QuantStack | None" = None, lm_weight: torch.Tensor | None = None,
                      vocab_ids: torch.Tensor | None = None, sampled: tuple | None = None) -> tuple[int, int] | None:
        """A context head's draft chain in one C call (cpu_kernels.context_chain): layers [0, end) over
        tokens[early .. p0] (the target's cache, in `quant`'s precision or in full) into hidden (max_len, H), the
        head's rows seen .. p0, then a draft after each row until `count` drafts, `threshold` or `cont` stop it; each
        draft's layers [0, end) run too; greedy, or drawn as `sampled` says (as draft_chain). -> (drafts, head
        passes); None, with nothing run, where it cannot run in C (as draft_chain)."""
        emb = self.embed_tokens.weight
        lm = self._chain_readout(tokens, min(early, seen), p0 + count + 1, quant, lm_weight)
        if lm is None or not cpu_kernels_mod.load_kernel():
            return None
        stack = None
        if end > 0:
            stack = self._layer_stack(cache, 0, end, quant)
            if stack is None:
                return None
            cache.check_room(p0 + count + 1)
        base = min(early, seen)
        cos, sin = self._rotary_rows(emb[None, :1], base, p0 + count + 1 - base)
        bias = self.lm_head.bias if lm_weight is None else None
        return cpu_kernels_mod.context_chain(stack, (cos[0], sin[0]), base, emb, head, self.final_norm.weight,
                                             self.final_norm.variance_epsilon, lm, bias, vocab_ids, tokens, hidden,
                                             early, seen, p0, count, threshold, cont, sampled)

    # ---------------------------------------------------------------- low-precision draft copies
    def quantized(self, precision: str) -> "QuantStack | None":
        """The low-precision copies of this model's weights for draft passes (head.draft_precision): one
        QuantStack per precision, filled layer by layer as drafts first use them; None for "full"."""
        check_precision(precision)
        if precision == "full":
            return None
        if precision not in self._quant:
            _patch_linears(self.layers)  # HF-code layers (gemma3, a LoRA's) read their copies through the patch
            self._quant[precision] = QuantStack(precision)
        return self._quant[precision]

    def copy_in(self, dtype: torch.dtype) -> "Backbone":
        """A copy of the model in `dtype`, with weights of its own and without selfspec's CPU kernels (HF's code
        runs it): the lower-precision writer of training data (training/synthesis.py: synthesis_backbone)."""
        import copy

        return Backbone(copy.deepcopy(self.hf_model).to(dtype), cpu_kernels=False)

    # ---------------------------------------------------------------- identity
    def fingerprint(self) -> dict:
        """The model's identity, cheap to compute (milliseconds, no copy of the weights): its sizes, the
        config fields that change outputs (rope_theta, rms_norm_eps, windows, ...), every weight tensor's
        name and shape, and a strided sample of FINGERPRINT_SAMPLES values of each weight tensor. Heads and
        data caches made for another model (a merged fine-tune of the same sizes, another rope_theta) are
        told apart; the same model in another dtype still matches (fingerprints_match compares the samples
        with a tolerance). `weight_probe` (16 block means of |embedding|) is what version 1 stored."""
        import base64
        import hashlib

        c = self.config
        shapes, samples = [], []
        with torch.no_grad():
            for name, p in sorted(_base_weights(self.hf_model)):
                flat = p.detach().reshape(-1)
                # float64: in float32 the last index of a > 2^24-element tensor rounds past its end
                idx = torch.linspace(0, flat.numel() - 1, FINGERPRINT_SAMPLES, dtype=torch.float64, device=flat.device).long()
                samples.append(flat[idx].float().cpu())
                shapes.append(f"{name}:{tuple(p.shape)}")
            w = self.embed_tokens.weight.detach().reshape(-1)
            blocks = w[: (w.numel() // 16) * 16].reshape(16, -1)
            legacy = [round(float(b.float().abs().mean()), 6) for b in blocks]
        probe = torch.cat(samples).numpy().astype("<f4").tobytes()
        return {
            "model_type": c.model_type,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "weight_probe": legacy,
            "version": 2,
            "config": _output_config(c),
            "tensors": hashlib.sha256("\n".join(shapes).encode()).hexdigest()[:16],
            "tensor_probe": base64.b64encode(probe).decode("ascii"),
        }


class QuantStack:
    """One precision's copies of the decoder's matrices and the LM head (model/quant.py formats), made from the
    model's own weights the first time a draft pass needs each layer: a llama-family layer's four fused matrices
    (and its C-kernel struct), a layer run by HF's code its nn.Linear weights (by module), the LM head and any
    draft-vocabulary row subset of it. `nbytes` is what they hold (the eval summary's draft MB)."""

    def __init__(self, precision: str, adjust=None):
        """adjust: a trained low-bit draft (heads/lowbit.py) whose `delta(i, key)` (or None) is added to layer i's
        matrix `key` of LeanLayer.matrices() before it is put on the grid quantize() chose for the model's own
        matrix, or on the grid `grid(i, key, own)` it learned from that one (quant.requantize); such a draft runs
        llama-family (lean) layers only."""
        self.precision = precision
        self.adjust = adjust
        self._lean: dict[int, dict] = {}
        self._c: dict[int, object] = {}
        self._modules: dict[int, dict] = {}
        self._lm: dict[tuple, object] = {}
        # what each copy was made from, to make it again once that changed: a lean layer's generation (by
        # ("lean" | "c", i)), a module-run layer's Linear weights and their stamp (by i), the LM head's version
        self._made: dict[tuple, int] = {}
        self._module_src: dict[int, tuple] = {}
        self._lm_version: dict[tuple, int] = {}
        self._lock = threading.Lock()

    def prepare(self, bb: "Backbone", exit_layer: int, lm_weight: torch.Tensor | None, own_layers: bool = False) -> None:
        """Make every copy a draft through layers [0, exit_layer) and this LM head (or draft-vocabulary rows) reads.
        own_layers: the layers run HF's code (a LoRA head's adapted layers), whose copies are per module."""
        for i in range(exit_layer):
            lean = bb.lean[i] if bb.lean is not None and not own_layers and bb.lean[i].usable() else None
            if lean is None:
                self.module_map(bb, i)
            elif bb.cpu_kernels and lean.c_args is not None:
                self.c_layer(bb, i)
            else:
                self.lean_layer(bb, i)
        self.lm_weight(bb, lm_weight)

    @property
    def nbytes(self) -> int:
        weights = [w for d in self._lean.values() for w in d.values()]
        weights += [w for d in self._modules.values() for w in d.values()] + [q for _, q in self._lm.values()]
        return sum(w.nbytes for w in weights)

    def lean_layer(self, bb: "Backbone", i: int) -> dict:
        generation = bb.lean[i].generation
        if self._made.get(("lean", i)) != generation:
            with self._lock:
                if self._made.get(("lean", i)) != generation:
                    self._lean[i] = {k: self._copy(i, k, w) for k, w in bb.lean[i].matrices().items()}
                    self._made["lean", i] = generation
        return self._lean[i]

    def c_layer(self, bb: "Backbone", i: int):
        lean = bb.lean[i]
        if lean.c_args is None:
            return None
        generation = lean.generation
        if self._made.get(("c", i)) != generation:
            q = self.lean_layer(bb, i)
            with self._lock:
                if self._made.get(("c", i)) != generation:
                    self._c[i] = cpu_kernels_mod.layer_weights(*lean.c_args, quant=q)
                    self._made["c", i] = generation
        return self._c[i]

    def _copy(self, i: int, key: str, w: torch.Tensor):
        """Layer i's matrix `key` in this precision; with a trained draft's delta, on the grid of the model's own."""
        own = self.quantize(w, "mlp" if key in ("wgu", "wd") else "attn")
        if self.adjust is None:
            return own
        delta, (scale, zero) = self.adjust.delta(i, key), self.adjust.grid(i, key, own)
        if delta is None and scale is None:
            return own
        return requantize(w.detach() if delta is None else w.detach() + delta.to(w.dtype), own, scale, zero)

    def module_map(self, bb: "Backbone", i: int) -> dict:
        """id(nn.Linear) -> its copy, for layer i run by HF's code (a LoRA's adapters stay in full precision); made
        again when one of those weights was replaced or edited in place since."""
        check(self.adjust is None, f"a trained low-bit draft runs llama-family decoder layers only; layer {i} of this "
                                   f"{bb.config.model_type} model runs HF's code")
        src = self._module_src.get(i)
        if src is None or not _same_tensors([m.weight for m in src[0]], src[1], src[2]):
            with self._lock:
                mods = [(name, m) for name, m in bb.layers[i].named_modules()
                        if isinstance(m, nn.Linear) and "lora_" not in name]
                self._modules[i] = {id(m): self.quantize(m.weight, "mlp" if ".mlp." in f".{name}." else "attn")
                                    for name, m in mods}
                weights = [m.weight for _, m in mods]
                self._module_src[i] = ([m for _, m in mods], weights, _stamp(weights))
        return self._modules[i]

    def lm_weight(self, bb: "Backbone", weight: torch.Tensor | None):
        """The LM head's copy (weight None) or the copy of a row subset `weight` (a draft vocabulary), made again
        after an edit in place."""
        w = bb.lm_head.weight if weight is None else weight
        key = (w.data_ptr(), tuple(w.shape))
        hit = self._lm.get(key)
        # the source is kept alive, so its address is never reused while cached
        if hit is None or hit[0] is not w or self._lm_version.get(key) != _version_of(w):
            with self._lock:
                hit = self._lm[key] = (w, quantize_readout(w, self.precision))
                self._lm_version[key] = _version_of(w)
        return hit[1]

    def quantize(self, w: torch.Tensor, part: str):
        """w in the format this precision gives `part` ("mlp", "attn" or "lm"; quant.KINDS)."""
        return quantize(w, KINDS[self.precision][part], self.precision)


FINGERPRINT_SAMPLES = 8  # values sampled from each weight tensor (about 2k values for a 30-layer model)
# Config fields that change a model's outputs (matched against the config's keys): rotary, norms, windows,
# attention shape, activations, biases, soft-capping, tying.
_OUTPUT_CONFIG = (
    "rope", "theta", "eps", "softcap", "window", "sliding", "layer_types", "head_dim", "attention_heads",
    "key_value_heads", "intermediate_size", "hidden_act", "hidden_activation", "bias", "query_pre_attn_scalar",
    "partial_rotary", "tie_word_embeddings", "scaling", "bidirectional",
)


def _output_config(config) -> dict:
    import json

    d = {k: v for k, v in config.to_dict().items() if any(word in k for word in _OUTPUT_CONFIG)}
    return json.loads(json.dumps(d, sort_keys=True, default=str))  # as it reads back from a JSON file


def _base_weights(hf_model):
    """(name, parameter) of the base model's weights: tied ones once, LoRA matrices a head injected left out,
    and peft's wrapped `*.base_layer.*` named as before the wrap."""
    for name, p in hf_model.named_parameters():
        if "lora_" not in name:
            yield name.replace(".base_layer", ""), p


def _probe_values(fp: dict):
    import base64

    try:
        return torch.frombuffer(bytearray(base64.b64decode(fp["tensor_probe"])), dtype=torch.float32)
    except (KeyError, TypeError, ValueError):
        return None


def fingerprints_match(a: dict, b: dict, rtol: float = 2**-8, atol: float = 1e-7) -> bool:
    """Whether two fingerprints are the same model (in any dtype). Version 2 (both): sizes, output config
    and tensor shapes equal, and every sampled weight within one bfloat16 step (rtol 2^-8). A fingerprint
    saved before version 2 (heads saved by older selfspec) is checked as it was then: sizes, and the
    embedding probe within 2%."""
    keys = ("model_type", "num_layers", "hidden_size", "vocab_size")
    if any(a.get(k) != b.get(k) for k in keys):
        return False
    if a.get("version", 1) >= 2 and b.get("version", 1) >= 2:
        if a.get("config") != b.get("config") or a.get("tensors") != b.get("tensors"):
            return False
        pa, pb = _probe_values(a), _probe_values(b)
        if pa is None or pb is None or pa.shape != pb.shape:
            return False
        close = (pa - pb).abs() <= rtol * torch.maximum(pa.abs(), pb.abs()) + atol
        return bool((close | (pa == pb) | (pa.isnan() & pb.isnan())).all())
    pa, pb = a.get("weight_probe") or [], b.get("weight_probe") or []
    return len(pa) == len(pb) and all(abs(x - y) <= 2e-2 * max(abs(x), abs(y), 1e-8) for x, y in zip(pa, pb))
