"""Low-precision copies of the model's own weights for the draft pass
(`head.draft_precision=int8|int4|int4_mlp`).

The draft of a self-speculative round only proposes tokens; verification runs the full-precision model and
decides. So the draft may read the same layers in fewer bits: a draft step is bound by reading the weights, and
int8 is a quarter of float32's bytes (int4 an eighth). The copies are made from the loaded model's own weights
when a drafter first asks for them (no file, no second model) and kept on the Backbone, one per precision.

Precisions: int8 and int4 store every draft matrix in that format; int4_mlp stores the MLP's matrices in int4 and
attention's and the LM head in int8 (KINDS).

Formats (weight-only: activations and sums stay in the model's float dtype):
  int8  symmetric per output row: scale = max|w| / 127, q = round(w / scale) in [-127, 127]
  int4  asymmetric in groups of INT4_GROUP along the input: per group lo = min, scale = (max - min) / 15,
        q = round((w - lo) / scale) in [0, 15], w' = scale * q + lo; the rounding range is chosen per group
        among a few shrunk ranges by the smallest squared error (a cheap version of GPTQ/AWQ-style clipping).
        Two 4-bit values per byte: byte j of a group holds element j (low nibble) and element j + 16 (high).

`QuantWeight.dequantize()` is the reference (and the torch path: on CUDA and without the C kernels a draft
matmul is dequantize-then-matmul); cpu_kernels.linear runs the C kernel (kernels/quant_gemm.c) on the CPU. For int8
the C kernel also rounds each input row to 14-bit integers with a scale of its own (int16 multiplies: half the
instructions per weight), and so does the int4 kernel under AVX-512; `int8_reference` is exactly that math in
float64 (for either format).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selfspec.errors import check

PRECISIONS = ("full", "int8", "int4", "int4_mlp")
# What each precision stores per part of a layer: the MLP's matrices, the rest (attention), the LM head.
# int4_mlp: the MLP (three quarters of a llama layer's weights) in int4, attention and the LM head in int8.
KINDS = {"int8": {"mlp": "int8", "attn": "int8", "lm": "int8"}, "int4": {"mlp": "int4", "attn": "int4", "lm": "int4"},
         "int4_mlp": {"mlp": "int4", "attn": "int8", "lm": "int8"}}
X16_MAX = 16383.0  # the int8 kernel's input rounding: round(x / s) with s = max |x| / X16_MAX per row
INT4_GROUP = 32
_INT4_SHRINK = (1.0, 0.95, 0.9, 0.85, 0.8)  # candidate fractions of a group's range for int4 rounding


def check_precision(precision, where: str = "head.draft_precision") -> str:
    check(precision in PRECISIONS, f"{where}={precision!r}: allowed {', '.join(PRECISIONS)}")
    return precision


@dataclass
class QuantWeight:
    """An (N, K) weight in 8 or 4 bits. int8: q int8 (N, K), scale (N,). int4: q uint8 (N, K/2), scale and
    zero (N, K/INT4_GROUP)."""

    kind: str
    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.zero) if t is not None)

    @property
    def device(self) -> torch.device:
        return self.q.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The (N, K) weight this copy stands for."""
        N, K = self.shape
        if self.kind == "int8":
            return (self.q.to(torch.float32) * self.scale[:, None]).to(dtype)
        lo, hi = (self.q & 0x0F), (self.q >> 4)  # (N, K/2): elements j and j + 16 of each group
        G = K // INT4_GROUP
        q = torch.cat([lo.view(N, G, 16), hi.view(N, G, 16)], dim=-1).to(torch.float32)  # (N, G, 32)
        w = q * self.scale[..., None] + self.zero[..., None]
        return w.reshape(N, K).to(dtype)

    def rows(self, ids: torch.Tensor) -> "QuantWeight":
        """The copy of rows `ids` (a draft vocabulary's LM-head rows): per-row formats, so a plain index."""
        ids = ids.to(self.q.device)
        return QuantWeight(self.kind, self.q[ids].contiguous(), self.scale[ids].contiguous(),
                           None if self.zero is None else self.zero[ids].contiguous(), (int(ids.numel()), self.shape[1]))


def quantize(w: torch.Tensor, kind: str, precision: str | None = None) -> QuantWeight:
    """An (N, K) float weight in `kind` ("int8" | "int4"); int4 needs K divisible by INT4_GROUP (`precision`, the
    draft precision that asked for it, names the setting in that error)."""
    check(kind in ("int8", "int4"), f"quantize: kind={kind!r}: allowed int8, int4")
    check(w.dim() == 2, f"quantize: a 2-D weight, not {tuple(w.shape)}")
    N, K = w.shape
    with torch.no_grad():
        wf = w.detach().to(torch.float32)
        if kind == "int8":
            scale = wf.abs().amax(dim=1) / 127.0
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            q = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8)
            return QuantWeight("int8", q.contiguous(), scale.contiguous(), None, (N, K))
        check(K % INT4_GROUP == 0,
              f"head.draft_precision={precision or kind}: a weight of width {K} is not divisible by the int4 group of "
              f"{INT4_GROUP}; use int8")
        q, scale, zero = _int4_groups(wf.view(N, K // INT4_GROUP, INT4_GROUP))
        lo, hi = q[..., :16], q[..., 16:]
        packed = (lo | (hi << 4)).to(torch.uint8).reshape(N, K // 2)
        return QuantWeight("int4", packed.contiguous(), scale.contiguous(), zero.contiguous(), (N, K))


def _int4_groups(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """g (N, G, 32) float -> (q uint8 (N, G, 32) in [0, 15], scale (N, G), zero (N, G)), per group the shrunk
    range with the smallest squared error."""
    lo0, hi0 = g.amin(-1), g.amax(-1)
    mid = (lo0 + hi0) / 2
    best_err = best = None
    for f in _INT4_SHRINK:
        lo, hi = mid + (lo0 - mid) * f, mid + (hi0 - mid) * f
        scale = (hi - lo) / 15.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15)
        err = ((q * scale[..., None] + lo[..., None]) - g).pow(2).sum(-1)
        if best is None:
            best_err, best = err, (q, scale, lo)
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = (torch.where(better[..., None], q, best[0]), torch.where(better, scale, best[1]),
                    torch.where(better, lo, best[2]))
    q, scale, lo = best
    return q.to(torch.uint8), scale, lo


def int8_reference(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the C int8 kernel (and the AVX-512 int4 kernel) computes, in float64: each row of x rounded to round(x / s) * s with s = max |x| /
    X16_MAX (float32 division, as the kernel), times the dequantized weight, plus bias."""
    xf = x.to(torch.float32)
    s = xf.abs().amax(-1, keepdim=True) / torch.tensor(X16_MAX, dtype=torch.float32)
    s = torch.where(s > 0, s, torch.ones_like(s))
    xr = torch.round(xf / s).double() * s.double()
    y = xr @ w.dequantize(torch.float64).T
    return y if bias is None else y + bias.double()
