"""A head that reads the verified context (EAGLE-style, issue 21): decoder layers over the full-depth states.

Row t (token x_t at position t) sees the newest token's layer-E state h_t (E = 0: its embedding) and the full-depth
feature f_{t-1} of the position before: the final layer's output before the final norm, as verification computes
it. One or two decoder layers with a KV cache of their own attend over the earlier rows and predict f̂_t, scored by
the model's final norm and LM head (or the draft vocabulary's rows) as the logits for token t+1:

    x_t = fc([norm(h_t), norm(f_{t-1})])  ->  context_layers x (attention + SwiGLU)  ->  f̂_t  ->  norm, LM head

Inside a round only the first draft has a verified f_{t-1}; later drafts read the head's own f̂ (EAGLE). The
per-generation `ContextState` keeps both by position in one buffer (`feats`: verified features below `real_upto`,
the head's predictions above, never overwriting a verified one) and knows which rows of its cache were computed from
verified features (`exact_upto`): once verification hands the real features over (`observe`), the rows after that
are recomputed (`refeed_from`).

Training runs training-time test (HASS, EAGLE-3; `train_steps`): step 1 reads the real f_{t-1} everywhere; step j
reads step j-1's prediction for t-1 and attends to exactly what decoding attends to in the j-th draft of a round
(heads/ttt_attention.py: the rule, `ttt_mask`, and a causal pass plus the diagonal keys that computes it).

Initialised as the logit lens at layer E: fc passes norm(h_t) through, and each layer's output projections are
zero (layer.py's DraftLayer).

`context_source=fused` (EAGLE-3): f_t is not the final layer's state alone but a learned projection of the states
after several depths (`fuse_depths`, default low/mid/high = max(E, L/4), max(E, L/2), L), side by side, the
shallower ones RMS-normalised: f_t = fuse([rms(s_low), rms(s_mid), s_L]). The verify pass captures those depths
(drafters.py: verify_stack), training reads them from the feature cache, and `fuse` starts as the final state alone,
so a fused head initialised from a final-source one (trainer.init_from) starts as that head.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from selfspec.errors import check, is_int, is_number
from selfspec.heads.base import ExitHead
from selfspec.heads.config import HeadConfig, register_head
from selfspec.heads.layer import DraftLayer, _RMSNorm
from selfspec.heads.ttt_attention import ttt_attention, ttt_mask  # noqa: F401  (ttt_mask: the rule, for readers and tests)
from selfspec.model import cpu_kernels
from selfspec.model.cache import KVCache
from selfspec.model.quant import quantize

# Which full-depth states the head reads: the final layer's, or several depths' fused by a learned projection
# (EAGLE-3's low/mid/high layers).
CONTEXT_SOURCES = ("final", "fused")
# The head's own matrices in a CPU draft step (ContextHeadConfig.own_precision)
OWN_PRECISIONS = ("full", "int8")


@dataclass
class ContextHeadConfig(HeadConfig):
    type: str = "context"
    context_layers: int = 1  # decoder layers over the context (1 or 2)
    mlp_ratio: float | None = None  # MLP width = mlp_ratio x hidden size; None = the model's intermediate size
    context_source: str = "final"  # the full-depth feature: the final layer's output before the final norm, or
    # "fused": the states after fuse_depths layers, side by side, through a learned projection (EAGLE-3)
    fuse_depths: list[int] | None = None  # context_source=fused: depths E <= d_1 < ... < d_k = L, k in 2..4;
    # null = low, mid, high: max(E, L/4), max(E, L/2), L
    ttt_steps: int = 3  # training-time test: drafts 1..ttt_steps of a round, each trained on what decoding feeds it
    ttt_decay: float = 0.8  # step j's loss weighs ttt_decay^(j-1)
    feature_loss: float = 0.0  # weight of the smooth-L1 regression of f̂_t on f_t (EAGLE); 0 = off
    own_precision: str = "full"  # the head's own matrices in a CPU draft step: "full" (float32) or "int8" (one scale
    # per row, the int8 kernel; a head exported --dtype int8 holds exactly these rows) in a chain's draft steps (at
    # most MAX_ROWS rows; the pass over the prompt reads the float weights).
    # head.draft_precision is the target's layers < E and LM head; training, analysis and tree rows read float32

    def __post_init__(self):
        super().__post_init__()
        check(is_int(self.context_layers) and 1 <= self.context_layers <= 2,
              f"head.context_layers={self.context_layers!r}: must be 1 or 2")
        check(self.mlp_ratio is None or is_number(self.mlp_ratio) and 0 < self.mlp_ratio <= 16,
              f"head.mlp_ratio={self.mlp_ratio!r}: must be a number in (0, 16] (or null for the model's MLP width)")
        check(self.context_source in CONTEXT_SOURCES,
              f"head.context_source={self.context_source!r}: allowed {', '.join(CONTEXT_SOURCES)}")
        d = self.fuse_depths
        if d is not None:
            check(self.context_source == "fused", f"head.fuse_depths={d!r}: only with head.context_source=fused")
            check(isinstance(d, (list, tuple)) and 2 <= len(d) <= 4 and all(is_int(x) for x in d)
                  and all(a < b for a, b in zip(d, d[1:])),
                  f"head.fuse_depths={d!r}: must be 2 to 4 increasing layer depths ending at the model's last layer, or null")
            self.fuse_depths = [int(x) for x in d]
        check(is_int(self.ttt_steps) and 1 <= self.ttt_steps <= 8, f"head.ttt_steps={self.ttt_steps!r}: must be an integer in [1, 8]")
        check(is_number(self.ttt_decay) and 0 < self.ttt_decay <= 1, f"head.ttt_decay={self.ttt_decay!r}: must be a number in (0, 1]")
        check(is_number(self.feature_loss) and self.feature_loss >= 0, f"head.feature_loss={self.feature_loss!r}: must be a number >= 0")
        check(self.own_precision in OWN_PRECISIONS,
              f"head.own_precision={self.own_precision!r}: allowed {', '.join(OWN_PRECISIONS)}")


def context_depths(cfg: ContextHeadConfig, exit_layer: int, num_layers: int) -> tuple[int, ...]:
    """The depths whose states a context head reads: (L,) for the final layer; fused: cfg.fuse_depths, checked
    against this model (E <= d_1, d_k = L: the verify pass computes them), or low/mid/high."""
    L = num_layers
    if cfg.context_source == "final":
        return (L,)
    d = tuple(cfg.fuse_depths or sorted({max(exit_layer, L // 4), max(exit_layer, L // 2), L}))
    check(len(d) >= 2, f"head.context_source=fused: needs two depths or more between head.exit_layer={exit_layer} and "
                       f"the last layer, {L}")
    check(d[0] >= exit_layer and d[-1] == L,
          f"head.fuse_depths={list(d)}: must run from at least head.exit_layer={exit_layer} to the last layer, {L}")
    return d


@dataclass
class ContextState:
    """One generation's state of a context head (batch B, positions < max_len)."""

    cache: KVCache  # the head's own K/V, written by position
    feats: torch.Tensor  # (B, max_len, H): f_t at position t: verified below real_upto, else the head's f̂_t
    real_upto: int = 0  # feats[:, :real_upto] hold verified full-depth features
    exact_upto: int = 0  # the cache's rows [0, exact_upto) were computed from verified features (exact prefix)


class ContextLayer(DraftLayer):
    """DraftLayer (pre-norm attention + SwiGLU MLP, zero-initialised outputs) split into its projections and the
    rest, so that training-time test attends over keys of several steps."""

    own_precision = "full"  # its matrices in a CPU draft step (the head's config sets it; ContextHeadConfig)

    def qkv(self, h: torch.Tensor, positions: torch.Tensor, backbone):
        """h (B, T, H) at (1, T) positions -> q (B, Hq, T, D), k and v (B, Hkv, T, D), rotated."""
        B, T, _ = h.shape
        x = self.ln1(h)
        q = self.q(x).view(B, T, self.q_heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = backbone.apply_rotary(q, k, positions, dtype=h.dtype)
        return q, k, v

    def attend(self, h: torch.Tensor, q, k, v, mask: torch.Tensor | None, causal: bool = False) -> torch.Tensor:
        """The rest of the layer: attention of q over k, v (mask: bool, True = attend), the residual, the MLP."""
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                         enable_gqa=self.q_heads != self.kv_heads)
        return self.finish(h, out)

    def finish(self, h: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """h (B, T, H), the attention's output att (B, Hq, T, D) -> the layer's output: residual, MLP."""
        B, T, _ = h.shape
        h = h + self.o(att.transpose(1, 2).reshape(B, T, -1))
        x = self.ln2(h)
        return h + self.down(nn.functional.silu(self.gate(x)) * self.up(x))

    def forward(self, h: torch.Tensor, backbone, cache: KVCache | None, layer_idx: int, pos0: int) -> torch.Tensor:
        T = h.shape[1]
        if cache is not None and self._kernel_applies(h, backbone):
            return self._kernel_forward(h, backbone, cache, layer_idx, pos0)
        q, k, v = self.qkv(h, torch.arange(pos0, pos0 + T, device=h.device)[None], backbone)
        if cache is None:
            return self.attend(h, q, k, v, None, causal=T > 1)
        cache.write_pos = pos0
        k, v = cache.update(k, v, layer_idx)
        return self.attend(h, q, k, v, backbone.attention_mask(pos0, T, pos0 + T, None, h.device))


    # ---- drafting through the C decoder-layer kernel (the target's own decode-step kernel, model/cpu_kernels.py)
    def _kernel_applies(self, h: torch.Tensor, backbone) -> bool:
        """A draft (no autograd) of one float32 CPU sequence in a chain, at most MAX_ROWS rows (tree rows, and the
        prompt's many rows, where torch's blocked GEMM is faster, take the torch path)."""
        return (not torch.is_grad_enabled() and h.dtype == torch.float32 and h.device.type == "cpu" and h.shape[0] == 1
                and h.shape[1] <= cpu_kernels.MAX_ROWS and not hasattr(backbone, "tree_mask")
                and cpu_kernels.load_kernel() is not None)

    def _kernel_weights(self):
        """The kernel's view of this layer (q/k/v and gate/up fused; with own_precision int8 also their int8 copies,
        which the kernel reads instead), rebuilt whenever a weight or the precision changed."""
        params = [self.ln1.weight, self.ln2.weight] + [getattr(self, n).weight for n in ("q", "k", "v", "o", "gate", "up", "down")]
        key = tuple((p.data_ptr(), p._version) for p in params)
        kernels = self.__dict__.setdefault("_kernels", {})  # own_precision -> (key, struct, tensors)
        hit = kernels.get(self.own_precision)
        if hit is None or hit[0] != key:
            def c(t):
                return t.detach().float().contiguous()

            bias = None if self.q.bias is None else c(torch.cat([self.q.bias, self.k.bias, self.v.bias]))
            tensors = dict(ln1=c(self.ln1.weight), ln2=c(self.ln2.weight),
                           wqkv=c(torch.cat([self.q.weight, self.k.weight, self.v.weight])), bqkv=bias,
                           wo=c(self.o.weight), bo=None, wgu=c(torch.cat([self.gate.weight, self.up.weight])), bgu=None,
                           wd=c(self.down.weight), bd=None)
            sizes = dict(hidden=self.q.weight.shape[1], q_heads=self.q_heads, kv_heads=self.kv_heads,
                         head_dim=self.head_dim, inter=self.gate.weight.shape[0])
            quant = None
            if self.own_precision == "int8":
                quant = {n: quantize(tensors[n], "int8") for n in ("wqkv", "wo", "wgu", "wd")}
            lw = cpu_kernels.layer_weights(sizes, self.ln1.eps, self.ln2.eps, self.head_dim**-0.5, tensors, quant)
            hit = kernels[self.own_precision] = (key, lw, tensors)  # the tensors outlive the struct (it keeps quant)
        return hit[1]

    def _kernel_forward(self, h: torch.Tensor, backbone, cache: KVCache, layer_idx: int, pos0: int) -> torch.Tensor:
        """forward() in one C call: the same layer, causal over the cache's rows [0, pos0+t], written at pos0.."""
        T = h.shape[1]
        cache.check_room(pos0 + T)
        rope = backbone.rotary(h, torch.arange(pos0, pos0 + T, device=h.device)[None], chain_start=pos0)
        cos, sin = rope.get("full_attention") or next(iter(rope.values()))  # the rotation apply_rotary uses
        k_buf, v_buf = cache.layer_buffers(layer_idx)
        out = h[0].clone(memory_format=torch.contiguous_format)
        cpu_kernels.decoder_layer(self._kernel_weights(), out, cos[0].contiguous(), sin[0].contiguous(), k_buf, v_buf,
                                  pos0, None)
        return out[None]


@register_head("context", ContextHeadConfig)
class ContextHead(ExitHead):
    training_input = "context"
    reads_context = True
    min_exit_layer = 0

    def __init__(self, config: ContextHeadConfig, exit_layer: int, backbone):
        super().__init__(config, exit_layer, backbone)
        ks, H = backbone.kv_shape, backbone.hidden_size
        inter = round(config.mlp_ratio * H) if config.mlp_ratio else backbone.intermediate_size
        self.kv_heads, self.head_dim = ks.kv_heads, ks.head_dim
        self.norm_h, self.norm_f = _RMSNorm(H, 1e-6), _RMSNorm(H, 1e-6)
        self.fc = nn.Linear(2 * H, H, bias=False)
        with torch.no_grad():  # x_t = norm(h_t): with zero layer outputs, the logit lens at E
            self.fc.weight.zero_()
            self.fc.weight[:, :H] = torch.eye(H)
        self.context_depths = context_depths(config, exit_layer, backbone.num_layers)
        self.fuse = None
        if len(self.context_depths) > 1:
            self.config = replace(config, fuse_depths=list(self.context_depths))  # saved as resolved  # f = fuse([rms(s_1), .., rms(s_{k-1}), s_k]): at first the final state
            self.fuse = nn.Linear(len(self.context_depths) * H, H, bias=False)
            with torch.no_grad():
                self.fuse.weight.zero_()
                self.fuse.weight[:, -H:] = torch.eye(H)
        self.layers = nn.ModuleList(
            ContextLayer(H, backbone.num_attention_heads, ks.kv_heads, ks.head_dim, inter, 1e-6, False)
            for _ in range(config.context_layers)
        )
        self._fc_kernels: dict = {}  # own_precision -> (key, the fc matrix a CPU draft step reads): _draft_fc

    @property
    def ttt_steps(self) -> int:
        return self.config.ttt_steps

    # ---- per generation
    def new_state(self, backbone, max_len: int, batch: int = 1) -> ContextState:
        cache = KVCache(range(len(self.layers)), batch, self.kv_heads, self.head_dim, max_len, backbone.dtype, backbone.device)
        feats = torch.zeros(batch, max_len, backbone.hidden_size, dtype=backbone.dtype, device=backbone.device)
        return ContextState(cache, feats)

    def context_feature(self, states: torch.Tensor) -> torch.Tensor:
        """states (B, T, k*H): the states at context_depths side by side (k = 1: the final layer's) -> the feature f
        (B, T, H) the head reads: the final state itself, or fused (the shallower states RMS-normalised first)."""
        if self.fuse is None:
            return states
        *low, top = states.split(self.fc.weight.shape[0], dim=-1)
        low = [x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) for x in low]
        return self.fuse(torch.cat([*low, top], dim=-1).to(self.fuse.weight.dtype))

    def observe(self, state: ContextState, final_h: torch.Tensor, pos0: int) -> None:
        """final_h (B, T, k*H): the states at context_depths (the final layer's output before the final norm, or
        several depths side by side) of positions pos0..pos0+T-1, just verified (later rejected ones are dropped by
        `rollback`)."""
        T = final_h.shape[1]
        if pos0 > state.real_upto:
            raise ValueError(f"ContextHead.observe: features from position {pos0}, but only [0, {state.real_upto}) are "
                             "known; observe every verified position")
        state.feats[:, pos0 : pos0 + T] = self.context_feature(final_h).to(state.feats.dtype)
        state.real_upto = max(state.real_upto, pos0 + T)

    def rollback(self, state: ContextState, keep: int) -> None:
        """Positions >= keep are stale (rejected drafts): neither their features nor their cache rows count."""
        state.real_upto = min(state.real_upto, keep)
        state.exact_upto = min(state.exact_upto, keep)

    def assume_verified(self, state: ContextState, pos: int) -> None:
        """For timing single steps (evaluation/costs.py): treat the features and cache rows of [0, pos) as verified
        and exact, whatever they hold."""
        state.real_upto = state.exact_upto = pos

    def refeed_from(self, state: ContextState) -> int:
        """The first position whose cache rows were computed from a predicted feature: what the head must see again
        now that verified features may have arrived (the drafter lowers what the head has seen to it)."""
        return state.exact_upto

    # ---- the head proper
    def _inputs(self, h: torch.Tensor, prev: torch.Tensor, chain: bool = True) -> torch.Tensor:
        """h (B, T, H) layer-E states, prev (B, T, H) the features of the positions before -> the layers' input.
        A CPU draft step of a chain (at most MAX_ROWS rows) multiplies by fc in the small-row kernel (both cores; int8 with
        own_precision=int8), as its layers run in the decoder-layer kernel; tree rows (chain=False) and longer passes (the
        prompt, where torch's blocked GEMM is faster) run in torch, float32."""
        x = torch.cat([self.norm_h(h), self.norm_f(prev.to(h.dtype))], dim=-1)
        if (chain and not torch.is_grad_enabled() and x.shape[0] == 1 and x.shape[1] <= cpu_kernels.MAX_ROWS
                and x.device.type == "cpu" and cpu_kernels.load_kernel() is not None):
            return cpu_kernels.linear(x, self._draft_fc())
        return self.fc(x)  # training, tree rows, and a pass over many rows (the prompt): torch, float weights

    def _draft_fc(self):
        """fc's matrix as a CPU draft step reads it: the float weight, or its int8 copy (own_precision=int8),
        made again whenever the weight or the setting changed."""
        w, precision = self.fc.weight, self.config.own_precision
        key = (w.data_ptr(), w._version)
        hit = self._fc_kernels.get(precision)
        if hit is None or hit[0] != key:
            hit = self._fc_kernels[precision] = (key, quantize(w, "int8") if precision == "int8" else w.detach())
        return hit[1]

    def chain_parts(self, state: ContextState) -> cpu_kernels.ContextChainHead | None:
        """What a draft chain in one C call reads of this head (Backbone.context_chain): its norms, fc and layers as
        a CPU draft step reads them (own_precision), its cache's buffers and the generation's features; None where
        that call cannot take it (not float32 on the CPU, a batch, norms of two epsilons)."""
        w = self.fc.weight
        if (state.feats.shape[0] != 1 or w.dtype != torch.float32 or w.device.type != "cpu"
                or self.norm_h.eps != self.norm_f.eps or cpu_kernels.load_kernel() is None):
            return None
        for layer in self.layers:
            layer.own_precision = self.config.own_precision
        bufs = [state.cache.layer_buffers(i) for i in range(len(self.layers))]
        return cpu_kernels.ContextChainHead(
            norm_h=self.norm_h.weight.detach(), norm_f=self.norm_f.weight.detach(), eps=self.norm_h.eps,
            fc=self._draft_fc(), layers=[layer._kernel_weights() for layer in self.layers],
            k_bufs=[k for k, _ in bufs], v_bufs=[v for _, v in bufs], feats=state.feats[0], real_upto=state.real_upto)

    def chain_ran(self, state: ContextState, seen: int, p0: int) -> None:
        """After a chain in one C call whose head rows started at `seen` (its first pass: rows seen .. p0, all
        reading verified features): the cache's exact prefix, as `transform` extends it."""
        if state.exact_upto >= seen:
            state.exact_upto = max(state.exact_upto, min(p0 + 1, state.real_upto + 1))

    def next_token_logits(self, h, backbone, state=None, pos0=0):
        return self(h, backbone, state, pos0=pos0, last_only=True)[0, -1]  # every row goes into its cache

    def transform(self, h, backbone, state: ContextState | None = None, pos0: int = 0) -> torch.Tensor:
        """h (B, T, H): layer-E states of positions pos0.. -> (B, T, H) predicted features f̂. Rows whose previous
        feature is known before the call (verified, or predicted by an earlier call) run in one batch; the rest
        one by one, each reading the one before's prediction. Without a state: a fresh one (no verified feature)."""
        if hasattr(backbone, "tree_mask"):  # drafters.TreeRows: one depth of a draft tree
            return self._tree_rows(h, backbone, state, pos0)
        B, T, _ = h.shape
        for layer in self.layers:  # what their draft steps read (the config may have been replaced since)
            layer.own_precision = self.config.own_precision
        if state is None:
            check(pos0 == 0, "ContextHead.transform: without a state the rows must start at position 0")
            state = self.new_state(backbone, T, batch=B)
        feats, out, t, stop = state.feats, [], pos0, pos0 + T
        while t < stop:
            end = min(stop, max(state.real_upto, t) + 1)  # rows r in [t, end) have f_{r-1} in feats already
            prev = feats[:, max(t - 1, 0) : end - 1]
            if t == 0:  # position 0 has no previous feature
                prev = torch.cat([feats.new_zeros(B, 1, feats.shape[-1]), prev], dim=1)
            x = self._inputs(h[:, t - pos0 : end - pos0], prev)
            for i, layer in enumerate(self.layers):
                x = layer(x, backbone, state.cache, i, t)
            w = max(t, state.real_upto)  # never overwrite a verified feature
            if w < end:
                feats[:, w:end] = x[:, w - t :]
            if state.exact_upto >= t:  # the cache's rows before t are exact: so are those fed verified features
                state.exact_upto = max(state.exact_upto, min(end, state.real_upto + 1))
            out.append(x)
            t = end
        return torch.cat(out, dim=1)

    def _tree_rows(self, h: torch.Tensor, backbone, state: ContextState | None, pos0: int) -> torch.Tensor:
        """A draft tree's frontier rows at slots pos0.. (backbone: drafters.TreeRows, its tree_mask (F, S) over the
        slots root .. pos0+F-1): each row reads its parent's feature (the parent is the row's deepest ancestor, the
        last slot it sees before its own; the root's f̂ for depth 1), in one batch, and writes its f̂ at its slot."""
        check(state is not None, "ContextHead: draft trees need the generation's state")
        mask = backbone.tree_mask.to(h.device)
        F, S = mask.shape
        root = pos0 + F - S
        check(root >= state.real_upto - 1 and pos0 > root, "ContextHead: tree rows must follow the verified context")
        cols = torch.arange(S, device=h.device)
        ancestors = mask & (cols[None] < (S - F + torch.arange(F, device=h.device))[:, None])
        parent = torch.where(ancestors, cols[None], -1).amax(-1)  # (F,) column of each row's parent
        check(bool((parent >= 0).all()), "ContextHead: every tree row needs a parent among the slots it sees")
        x = self._inputs(h, state.feats[:, root + parent], chain=False)
        for i, layer in enumerate(self.layers):
            x = layer(x, backbone, state.cache, i, pos0)
        state.feats[:, pos0 : pos0 + F] = x  # predictions at draft slots, past every verified feature
        return x

    def commit_path(self, state: ContextState, slots: list[int], root: int) -> None:
        """After a tree round: verification observed every node's full-depth state by verify slot; the accepted
        path's (`slots`, from the root) move to positions root, root+1, ... and only they count as verified. The
        head's cache rows past the root were computed on draft slots: they are fed again (`refeed_from`)."""
        n = len(slots)
        state.feats[:, root : root + n] = state.feats[:, slots].clone()
        state.real_upto = root + n
        state.exact_upto = min(state.exact_upto, root + 1)

    # ---- training-time test
    def train_steps(self, h: torch.Tensor, final: torch.Tensor, backbone, steps: int | None = None) -> list[torch.Tensor]:
        """h (B, T, H) layer-E states and final (B, T, k*H) the states at context_depths of whole (right-padded)
        sequences -> [(B, T, H)] predicted features of steps 1..steps (default ttt_steps): step j's row t is the j-th
        draft of a round that starts at row t-j+1 (meaningful for t >= j-1), as decoding computes it."""
        steps = steps or self.config.ttt_steps
        B, T, H = h.shape
        positions = torch.arange(T, device=h.device)[None]
        f = self.context_feature(final)
        zero = f.new_zeros(B, 1, H)
        a = self.norm_h(h)
        prev = torch.cat([zero, f[:, :-1]], dim=1)  # step 1: the verified f_{t-1}
        keys: list[list[torch.Tensor]] = [[] for _ in self.layers]
        values: list[list[torch.Tensor]] = [[] for _ in self.layers]
        outs = []
        for j in range(1, steps + 1):
            x = self.fc(torch.cat([a, self.norm_f(prev.to(h.dtype))], dim=-1))
            for i, layer in enumerate(self.layers):
                q, k, v = layer.qkv(x, positions, backbone)
                keys[i].append(k)
                values[i].append(v)
                x = layer.finish(x, ttt_attention(q, keys[i], values[i]))  # = attention through ttt_mask(T, j)
            outs.append(x)
            prev = torch.cat([zero.to(x.dtype), x[:, :-1]], dim=1)  # step j+1 reads step j's f̂_{t-1}
        return outs
