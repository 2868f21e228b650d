"""Low-precision copies of the model's own weights for the draft pass
(`head.draft_precision=int8|int4|int4_mlp`).

The draft of a self-speculative round only proposes tokens; verification runs the full-precision model and
decides. So the draft may read the same layers in fewer bits: a draft step is bound by reading the weights, and
int8 is a quarter of float32's bytes (int4 an eighth). The copies are made from the loaded model's own weights
when a drafter first asks for them (no file, no second model) and kept on the Backbone, one per precision.

Precisions: int8 and int4 store every draft matrix in that format; int4_mlp stores the MLP's matrices in int4 and
attention's and the LM head in int8 (KINDS). Each has an `_a8` twin (int8_a8, int4_a8, int4_mlp_a8) that stores the
same weights and also rounds the draft's activations to int8 per group of 32, so that the products run in integers
(kernels/group_gemm.c, AVX512-VNNI where the CPU has it): the same bytes in fewer instructions, at some cost in
agreement (BENCHMARKS.md, "Integer activations").

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
float64 (for either format); `group_reference` is the _a8 precisions' math.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from selfspec.errors import check

PRECISIONS = ("full", "int8", "int4", "int4_mlp", "int8_a8", "int4_a8", "int4_mlp_a8")
A8 = "_a8"  # the suffix of the precisions whose activations are rounded to int8 per group of ACT_GROUP
ACT_GROUP = 32
# What each precision stores per part of a layer: the MLP's matrices, the rest (attention), the LM head.
# int4_mlp: the MLP (three quarters of a llama layer's weights) in int4, attention and the LM head in int8.
KINDS = {"int8": {"mlp": "int8", "attn": "int8", "lm": "int8"}, "int4": {"mlp": "int4", "attn": "int4", "lm": "int4"},
         "int4_mlp": {"mlp": "int4", "attn": "int8", "lm": "int8"}}
KINDS.update({p + A8: KINDS[p] for p in list(KINDS)})
PACK_ROWS = 16  # output rows per block of the _a8 kernels' weight layout (kernels/group_gemm.c)
# An _a8 LM head in int4 (int4_a8) rescores each row's RESCORE largest logits from the model's own float32 LM head:
# int4 picks the candidates, float32 ranks them. Alone, the int4 LM head agreed with the model on 90.9% of SmolLM2's
# Spec-Bench tokens (the int8 one on 98.1%); its top 8 held the model's token 99.9% of the time.
RESCORE = 32
X16_MAX = 16383.0  # the int8 kernel's input rounding: round(x / s) with s = max |x| / X16_MAX per row
INT4_GROUP = 32
_INT4_SHRINK = (1.0, 0.95, 0.9, 0.85, 0.8)  # candidate fractions of a group's range for int4 rounding


def check_precision(precision, where: str = "head.draft_precision") -> str:
    check(precision in PRECISIONS, f"{where}={precision!r}: allowed {', '.join(PRECISIONS)}")
    return precision


@dataclass
class QuantWeight:
    """An (N, K) weight in 8 or 4 bits. int8: q int8 (N, K), scale (N,). int4: q uint8 (N, K/2), scale and
    zero (N, K/INT4_GROUP). act8: the activations it multiplies are rounded to int8 per group (the _a8
    precisions); the kernel then reads `packed()`, the same weights laid out for kernels/group_gemm.c."""

    kind: str
    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    shape: tuple[int, int]
    act8: bool = False
    exact: torch.Tensor | None = field(default=None, repr=False, compare=False)  # float32 (N, K): see RESCORE
    _packed: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        """The bytes a draft step reads: the packed layout's for an _a8 weight (its padding and float16 int4 scales
        included), else the codes, scales and zeros."""
        if self.act8:
            N, K = self.shape
            blocks, G = -(-N // PACK_ROWS), -(-K // ACT_GROUP)
            per_group = PACK_ROWS * ACT_GROUP if self.kind == "int8" else PACK_ROWS * (ACT_GROUP // 2 + 4)
            return blocks * G * per_group + (4 * N if self.kind == "int8" else 0)
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
                           None if self.zero is None else self.zero[ids].contiguous(), (int(ids.numel()), self.shape[1]),
                           self.act8, None if self.exact is None else self.exact[ids].contiguous())

    def codes(self) -> torch.Tensor:
        """The integer codes (N, K): int8 in [-127, 127], int4 in [0, 15] (as int16)."""
        N, K = self.shape
        if self.kind == "int8":
            return self.q.to(torch.int16)
        lo, hi = (self.q & 0x0F), (self.q >> 4)
        G = K // INT4_GROUP
        return torch.cat([lo.view(N, G, 16), hi.view(N, G, 16)], dim=-1).reshape(N, K).to(torch.int16)

    def packed(self) -> torch.Tensor:
        """The weights as kernels/group_gemm.c reads them (made once, kept): N padded to PACK_ROWS, K to ACT_GROUP.
        int8 (kind 3): uint8 (nb, G, 8, 16, 4), [b, g, v, r, j] = code[16b + r, 32g + 4v + j] + 128; the row scales
        stay in `scale`. int4 (kind 4): uint8 (nb, G, 320): per block and group the codes [v, r, j] with code[.., 32g
        + 8v + j] in the low nibble and code[.., 32g + 8v + 4 + j] in the high one, then the 16 rows' scales, then
        their zeros, in float16 (an _a8 int4 weight's scales and zeros are float16 values: quantize)."""
        if self._packed is None:
            self._packed = _pack(self)
        return self._packed


def _pack(w: QuantWeight) -> torch.Tensor:
    N, K = w.shape
    R, G = PACK_ROWS, -(-K // ACT_GROUP)
    nb = -(-N // R)
    codes = torch.zeros(nb * R, G * ACT_GROUP, dtype=torch.int16)
    codes[:N, :K] = w.codes()
    if w.kind == "int8":
        u = (codes + 128).to(torch.uint8).view(nb, R, G, 8, 4)  # padding: 128, the code of weight 0
        return u.permute(0, 2, 3, 1, 4).contiguous()
    c = codes.to(torch.uint8).view(nb, R, G, 4, 2, 4)  # k = 32g + 8v + 4h + j
    nibbles = (c[:, :, :, :, 0, :] | (c[:, :, :, :, 1, :] << 4)).permute(0, 2, 3, 1, 4).reshape(nb, G, 256)
    scale, zero = (torch.zeros(nb * R, G, dtype=torch.float16) for _ in range(2))
    scale[:N], zero[:N] = w.scale, w.zero  # float16 values already (quantize): exact
    halves = torch.cat([t.view(nb, R, G).permute(0, 2, 1) for t in (scale, zero)], dim=-1).contiguous()  # (nb, G, 32)
    return torch.cat([nibbles, halves.view(torch.uint8).view(nb, G, 2 * R * 2)], dim=-1).contiguous()


def quantize(w: torch.Tensor, kind: str, precision: str | None = None) -> QuantWeight:
    """An (N, K) float weight in `kind` ("int8" | "int4"); int4 needs K divisible by INT4_GROUP (`precision`, the
    draft precision that asked for it, names the setting in that error)."""
    check(kind in ("int8", "int4"), f"quantize: kind={kind!r}: allowed int8, int4")
    check(w.dim() == 2, f"quantize: a 2-D weight, not {tuple(w.shape)}")
    N, K = w.shape
    act8 = bool(precision) and precision.endswith(A8)
    with torch.no_grad():
        wf = w.detach().to(torch.float32)
        if kind == "int8":
            scale = wf.abs().amax(dim=1) / 127.0
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            q = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8)
            return QuantWeight("int8", q.contiguous(), scale.contiguous(), None, (N, K), act8)
        check(K % INT4_GROUP == 0,
              f"head.draft_precision={precision or kind}: a weight of width {K} is not divisible by the int4 group of "
              f"{INT4_GROUP}; use int8")
        groups = wf.view(N, K // INT4_GROUP, INT4_GROUP)
        q, scale, zero = _int4_groups(groups)
        if act8:  # the _a8 layout stores scales and zeros in float16: round them, then the codes to them
            check(bool(wf.abs().max() <= 65504) if wf.numel() else True,
                  f"head.draft_precision={precision}: int4 scales and zeros are float16 there, and this weight exceeds "
                  f"its range (|w| > 65504); use int4")
            scale, zero = scale.half().float(), zero.half().float()
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            q = torch.round((groups - zero[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
        lo, hi = q[..., :16], q[..., 16:]
        packed = (lo | (hi << 4)).to(torch.uint8).reshape(N, K // 2)
        return QuantWeight("int4", packed.contiguous(), scale.contiguous(), zero.contiguous(), (N, K), act8)


def quantize_readout(w: torch.Tensor, precision: str) -> QuantWeight:
    """An LM head (or its draft-vocabulary rows) in `precision`'s format for it; an _a8 int4 one keeps the float32
    rows for rescoring its shortlist (RESCORE)."""
    qw = quantize(w, KINDS[precision]["lm"], precision)
    if qw.act8 and qw.kind == "int4":
        qw.exact = w.detach().to(torch.float32).contiguous()
    return qw


def rescore(x: torch.Tensor, y: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y (.., N) with each row's RESCORE largest entries recomputed as x . w.exact[n] (+ bias): the torch path of
    the shortlist (kernels/group_gemm.c; ties may fall otherwise there)."""
    top = y.topk(min(RESCORE, y.shape[-1]), dim=-1).indices
    vals = (x.to(torch.float32)[..., None, :] * w.exact[top]).sum(-1)
    if bias is not None:
        vals = vals + bias[top]
    return y.scatter(-1, top, vals.to(y.dtype))


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


def _group_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """x (.., K) -> (codes (.., G, ACT_GROUP) float32 in [-127, 127], scales (.., G, 1), K) as the _a8 kernels round
    it: per group s = max |x| / 127 (1 for an all-zero group), round(x / s) (float32 division, nearest even); the
    last group is padded with zeros."""
    xf = x.to(torch.float32)
    K = xf.shape[-1]
    G = -(-K // ACT_GROUP)
    pad = torch.nn.functional.pad(xf, (0, G * ACT_GROUP - K)).reshape(*xf.shape[:-1], G, ACT_GROUP)
    s = pad.abs().amax(-1, keepdim=True) / torch.tensor(127.0, dtype=torch.float32)
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round(pad / s), s, K


def round_groups(x: torch.Tensor) -> torch.Tensor:
    """x (.., K) as the _a8 kernels see it, in float32 (the torch path of the _a8 precisions)."""
    q, s, K = _group_codes(x)
    return (q * s).flatten(-2)[..., :K]


def group_reference(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the _a8 kernels compute, in float64: x rounded per group times the dequantized weight, plus bias."""
    q, s, K = _group_codes(x)
    y = (q.double() * s.double()).flatten(-2)[..., :K] @ w.dequantize(torch.float64).T
    return y if bias is None else y + bias.double()


# ---------------------------------------------------------------- trained low-bit drafts (heads/lowbit.py)
def grid_of(ref: QuantWeight, scale: torch.Tensor | None = None, zero: torch.Tensor | None = None):
    """(scale, zero) of a grid: `ref`'s own, or the given (a trained draft's learned ones, heads/lowbit.py); an _a8
    int4 grid's scales and zeros are float16 values (as `quantize` stores them), rounded with a straight-through
    gradient."""
    s = ref.scale if scale is None else scale
    z = ref.zero if zero is None else zero
    if ref.act8 and ref.kind == "int4" and (scale is not None or zero is not None):
        s = s + (s.half().float() - s).detach()
        z = z + (z.half().float() - z).detach()
    return s, z


def _codes_on(w: torch.Tensor, ref: QuantWeight, scale, zero) -> torch.Tensor:
    """w (N, K) float rounded to the codes of the grid (scale, zero) in ref's format, float32 (N, K)."""
    N, K = ref.shape
    wf = w.to(torch.float32)
    if ref.kind == "int8":
        return torch.round(wf / scale[:, None]).clamp(-127, 127)
    g = wf.view(N, K // INT4_GROUP, INT4_GROUP)
    return torch.round((g - zero[..., None]) / scale[..., None]).clamp(0, 15).view(N, K)


def requantize(w: torch.Tensor, ref: QuantWeight, scale: torch.Tensor | None = None,
               zero: torch.Tensor | None = None) -> QuantWeight:
    """w (a trained draft's W + delta) in `ref`'s format, on `ref`'s grid (its scales and zeros, new codes) or on the
    grid (scale, zero) a trained draft learned from it (grid_of). With ref's grid the draft reads exactly as many
    bytes as the untrained one; a learned grid has as many scales and zeros as ref's."""
    N, K = ref.shape
    check(tuple(w.shape) == (N, K), f"requantize: a weight of shape {tuple(w.shape)} on a grid of shape {(N, K)}")
    with torch.no_grad():
        s, z = grid_of(ref, scale, zero)
        s = s.detach().to(torch.float32).contiguous()
        z = None if z is None else z.detach().to(torch.float32).contiguous()
        if ref.kind == "int8":
            s = torch.where(s > 0, s, torch.ones_like(s))
        q = _codes_on(w.detach(), ref, s, z)
        if ref.kind == "int8":
            return QuantWeight("int8", q.to(torch.int8).contiguous(), s, None, (N, K), ref.act8)
        q = q.to(torch.uint8).view(N, K // INT4_GROUP, INT4_GROUP)
        packed = (q[..., :16] | (q[..., 16:] << 4)).reshape(N, K // 2)
        return QuantWeight("int4", packed.contiguous(), s, z, (N, K), ref.act8)


def fake_quantize(w: torch.Tensor, ref: QuantWeight, scale: torch.Tensor | None = None,
                  zero: torch.Tensor | None = None) -> torch.Tensor:
    """w (N, K), differentiable, as `requantize(w, ref, scale, zero).dequantize()` (the same values, bit for bit),
    with straight-through gradients: to w, identity where a weight's code is inside the format's range and zero where
    it is clamped; to a learned grid's scale and zero, those of code x scale + zero (quantization-aware training:
    the forward reads exactly what the kernels will read)."""
    N, K = ref.shape
    s, z = grid_of(ref, scale, zero)
    wf = w.to(torch.float32)
    if ref.kind == "int8":
        u = wf / s[:, None]
        q = (u + (torch.round(u) - u).detach()).clamp(-127, 127)
        return (q * s[:, None]).to(w.dtype)
    g = wf.view(N, K // INT4_GROUP, INT4_GROUP)
    u = (g - z[..., None]) / s[..., None]
    q = (u + (torch.round(u) - u).detach()).clamp(0, 15)
    return (q * s[..., None] + z[..., None]).view(N, K).to(w.dtype)


def round_groups_ste(x: torch.Tensor) -> torch.Tensor:
    """round_groups(x) (the _a8 activations) with a straight-through gradient."""
    return x + (round_groups(x).to(x.dtype) - x).detach()


class TrainingCopy:
    """One draft matrix while a trained low-bit draft trains: `base + delta()` on the grid of `ref` (the model's own
    copy) or the learned one `grid()` returns, through fake_quantize, and the _a8 activation rounding when ref has it.
    cpu_kernels.linear calls it in place of a weight: `copy(x, bias)`."""

    def __init__(self, base: torch.Tensor, ref: QuantWeight, delta, grid=None):
        self.base, self.ref, self.delta, self.grid = base, ref, delta, grid

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        xr = round_groups_ste(x) if self.ref.act8 else x
        d = self.delta()
        scale, zero = self.grid() if self.grid is not None else (None, None)
        w = fake_quantize(self.base if d is None else self.base + d, self.ref, scale, zero)
        return torch.nn.functional.linear(xr, w.to(x.dtype), bias)
