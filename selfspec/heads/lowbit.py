"""A trained low-bit draft: the model's own layers < E in a low precision, made to agree with the full model.

The untrained low-bit draft (the lens with head.draft_precision=int4_a8, ...) rounds each matrix W of layers < E to
a grid that quantize() picks. This head learns, per matrix, a low-rank delta B @ A (a LoRA) such that the draft
reads W + B @ A rounded to *that same grid* (quant.requantize: the model's own scales and zeros, new codes). So:
  - the draft reads exactly the bytes of the untrained one and runs the same kernels (the C chain included):
    training costs nothing at draft time;
  - training is quantization-aware: its forward reads exactly the weights the kernels read (quant.fake_quantize,
    straight-through gradients; the _a8 activation rounding too), on KL to the full model's distribution;
  - verification is the full-precision model, untouched: output stays exactly the target's.
The readout is the model's final norm + LM head in the draft's precision, as the lens's (training scores with the
float LM head: the int4_a8 readout rescores its shortlist from the float rows, model/quant.py: RESCORE).

With head.learn_grid=true it also learns each matrix's grid: the scales (and int4 zeros) the untrained draft takes
from quantize(), as a log-multiplier and a shift in steps per group (per row for int8); the draft then reads the
same bytes, its scales and zeros being the learned ones.

Its layers must be llama-family ones (llama, qwen2, mistral: the fused "lean" layers of model/backbone.py). The
head stores A and B per matrix: 8448 x rank numbers per SmolLM2 layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from selfspec.errors import SelfSpecError, check
from selfspec.heads.base import ExitHead
from selfspec.heads.config import HeadConfig, check_int_field, check_number_field, register_head
from selfspec.model.backbone import QuantStack
from selfspec.model.quant import INT4_GROUP, KINDS, PRECISIONS, TrainingCopy

MATRICES = ("wqkv", "wo", "wgu", "wd")  # a lean layer's matrices (LeanLayer.matrices: q/k/v and gate/up fused)
DEFAULT_PRECISION = "int4_a8"


def _part(key: str) -> str:
    return "mlp" if key in ("wgu", "wd") else "attn"


@dataclass
class LowbitConfig(HeadConfig):
    type: str = "lowbit"
    lora_rank: int = 8
    lora_alpha: float = 16.0
    # which of each layer's matrices get a delta: wqkv (q, k, v fused), wo, wgu (gate, up fused), wd
    lowbit_targets: list[str] = field(default_factory=lambda: list(MATRICES))
    # also learn each target matrix's grid: its scales (and int4 zeros), as EfficientQAT / OmniQuant train the
    # quantizer's own parameters; as many numbers as the grid has (a thirty-second of the weights for int4)
    learn_grid: bool = False

    def __post_init__(self):
        if self.draft_precision is None and self.path is None:
            self.draft_precision = DEFAULT_PRECISION
        super().__post_init__()
        check(self.draft_precision != "full",
              f"head.draft_precision=full: a lowbit head drafts in low precision; allowed "
              f"{', '.join(p for p in PRECISIONS if p != 'full')}")
        check_int_field("head", "lora_rank", self.lora_rank, 1)
        check_number_field("head", "lora_alpha", self.lora_alpha, 0)
        targets = [self.lowbit_targets] if isinstance(self.lowbit_targets, str) else self.lowbit_targets
        check(isinstance(targets, (list, tuple)) and len(targets) > 0 and all(t in MATRICES for t in targets)
              and len(set(targets)) == len(targets),
              f"head.lowbit_targets={self.lowbit_targets!r}: a non-empty list of distinct names among {', '.join(MATRICES)}")
        self.lowbit_targets = list(targets)
        check(isinstance(self.learn_grid, bool), f"head.learn_grid={self.learn_grid!r}: allowed true or false")

    def size_limits(self, backbone):
        H = backbone.hidden_size
        return super().size_limits(backbone) | {"lora_rank": (1, H, f"its hidden size {H}")}


class _TrainingStack:
    """What Backbone.run_layers reads as `quant` while the head trains: each layer's matrices as TrainingCopy objects
    (differentiable, on the grid of the model's own copies); no C kernel."""

    def __init__(self, head: "LowbitHead", own):
        self.head, self.own, self.precision = head, own, own.precision

    def lean_layer(self, bb, i: int) -> dict:
        own = self.own.lean_layer(bb, i)
        return {k: TrainingCopy(w.detach(), own[k], lambda i=i, k=k: self.head.delta(i, k),
                                lambda i=i, k=k, own=own[k]: self.head.grid(i, k, own))
                for k, w in bb.lean[i].matrices().items()}

    def c_layer(self, bb, i: int):
        return None

    def module_map(self, bb, i: int) -> dict:
        raise SelfSpecError("head.type=lowbit: trains on llama-family decoder layers only")


@register_head("lowbit", LowbitConfig)
class LowbitHead(ExitHead):
    training_input = "ids"
    full_depth_default = True  # head.exit_layer=null: the whole stack, as the shipped untrained low-bit drafts
    plain_readout = True  # the final norm + LM head on its (trained) low-bit layers: the one-call C chain applies

    def __init__(self, config: LowbitConfig, exit_layer: int, backbone):
        super().__init__(config, exit_layer, backbone)
        lean = getattr(backbone, "lean", None)
        check(lean is not None and all(lean[i].usable() for i in range(exit_layer)),
              f"head.type=lowbit: needs llama-family decoder layers (llama, qwen2, mistral) run by selfspec's own layer "
              f"code; this {backbone.config.model_type} model's layers < {exit_layer} are not")
        self.scaling = config.lora_alpha / config.lora_rank
        r = config.lora_rank
        self.lora_a, self.lora_b = nn.ParameterDict(), nn.ParameterDict()
        self.grid_scale, self.grid_zero = nn.ParameterDict(), nn.ParameterDict()
        g = torch.Generator().manual_seed(0)
        for i in range(exit_layer):
            for key, w in lean[i].matrices().items():
                if key not in config.lowbit_targets:
                    continue
                N, K = w.shape
                name = f"{i}_{key}"
                self.lora_a[name] = nn.Parameter(torch.randn(r, K, generator=g) / K**0.5)  # B = 0: the untrained draft
                self.lora_b[name] = nn.Parameter(torch.zeros(N, r))
                if config.learn_grid:  # log-multipliers of the scales, shifts of the zeros in steps: 0 = the own grid
                    groups = (N,) if KINDS[config.draft_precision][_part(key)] == "int8" else (N, K // INT4_GROUP)
                    self.grid_scale[name] = nn.Parameter(torch.zeros(groups))
                    if len(groups) == 2:
                        self.grid_zero[name] = nn.Parameter(torch.zeros(groups))
        self._copies = None  # (the parameters' versions, precision, QuantStack) the draft reads
        self._grid_precision = config.draft_precision  # what a learned grid's shapes are for

    def delta(self, i: int, key: str) -> torch.Tensor | None:
        """The trained change to layer i's matrix `key` (None: not a target, or beyond the exit layer)."""
        name = f"{i}_{key}"
        if name not in self.lora_b:
            return None
        return (self.lora_b[name] @ self.lora_a[name]) * self.scaling

    def grid(self, i: int, key: str, own) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The learned grid of layer i's matrix `key` from the model's own copy `own`: (scale, zero), or (None, None)
        for the own grid (learn_grid off, or not a target)."""
        name = f"{i}_{key}"
        if name not in self.grid_scale:
            return None, None
        ls = self.grid_scale[name]
        check(tuple(ls.shape) == tuple(own.scale.shape),
              f"head.draft_precision={self.draft_precision}: this lowbit head learned its grid for another precision "
              f"({self._grid_precision}); draft in that one")
        scale = own.scale * torch.exp(ls)
        zero = None if own.zero is None else own.zero + own.scale * self.grid_zero[name]
        return scale, zero

    def draft_copies(self, backbone):
        """The draft's low-bit layers: the model's own grid, W + delta's codes (made again after the weights change)."""
        stamp = (tuple(p._version for p in self.parameters()), self.draft_precision, id(backbone))
        if self._copies is None or self._copies[0] != stamp:
            self._copies = (stamp, QuantStack(self.draft_precision, adjust=_Frozen(self)))
        return self._copies[1]

    def early_states(self, backbone, ids: torch.Tensor) -> torch.Tensor:
        """Training: ids (B, T) -> layer-E states through the quantization-aware low-bit layers (differentiable)."""
        own = backbone.quantized(self.draft_precision)
        return backbone.run_layers(backbone.embed(ids), 0, self.exit_layer, quant=_TrainingStack(self, own))


class _Frozen:
    """The head's deltas as values (no autograd) for the draft's copies."""

    def __init__(self, head: LowbitHead):
        self.head = head

    def delta(self, i: int, key: str) -> torch.Tensor | None:
        with torch.no_grad():
            d = self.head.delta(i, key)
        return None if d is None else d.detach()

    def grid(self, i: int, key: str, own):
        with torch.no_grad():
            return tuple(None if t is None else t.detach() for t in self.head.grid(i, key, own))
