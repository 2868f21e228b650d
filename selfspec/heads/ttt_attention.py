"""Training-time test's attention (heads/context.py): what step j's queries see, and a cheap way to compute it.

Step j's row t is the j-th draft of a round whose first draft row is c = t-j+1. It sees the keys of step 1 (rows
computed from verified features) at positions s <= t-j+1, and at each later position s = t-j+i (i = 2..j) the one
key of step i (the row computed from i-1 predicted features). `ttt_mask` writes that as one (T, j*T) mask over the
keys of every step; attending through it costs j*T keys per query.

`ttt_attention` computes the same thing with a causal pass over step 1's keys (shifted by j-1 rows, so half the
blocks are skipped) plus j-1 dot products per query for the diagonal keys, merged by log-sum-exp. The causal pass
is the CPU flash kernel, whose log-sum-exp needs a gradient too (`_CausalLSE`): d lse_t / d s_ts = P_ts, so
dq_t += scale g_t (P K)_t and dk_s += scale (P^T (g q))_s, the second being the kernel's value gradient for
grad_out = g q. About 2x cheaper than the mask over every step's keys at T = 2048, forward and backward.
"""

from __future__ import annotations

import torch
from torch import nn

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def ttt_mask(T: int, step: int, device=None) -> torch.Tensor:
    """(T, step*T) bool, True = attend: step `step` (1-based) over the keys of steps 1..step, concatenated step by
    step (T positions each). Query t sees key (i, s) iff s <= t and i == max(1, step - (t - s)). Rows t < step-1
    (no such round) see themselves along the diagonal and are never scored."""
    t = torch.arange(T, device=device)[:, None]
    d = t - torch.arange(T, device=device)[None, :]  # t - s
    want = (step - d).clamp(min=1)
    return torch.cat([(d >= 0) & (want == i) for i in range(1, step + 1)], dim=-1)


class _CausalLSE(torch.autograd.Function):
    """Causal attention of q over k, v ((B, H, T, D), as many heads each) -> (out, lse (B, H, T)), both with
    gradients (the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.set_materialize_grads(False)  # an output nobody used gets None, not zeros
        out, lse = _flash(q, k, v, 0.0, True)
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, g_out, g_lse):
        q, k, v, out, lse = ctx.saved_tensors
        g_out = torch.zeros_like(out) if g_out is None else g_out.contiguous()
        dq, dk, dv = _flash_backward(g_out, q, k, v, out, lse, 0.0, True)
        if g_lse is not None:
            scale, g = q.shape[-1] ** -0.5, g_lse.unsqueeze(-1)
            pk = _flash(q, k, k, 0.0, True)[0]  # (P K)_t
            dk_lse = _flash_backward((g * q).contiguous(), q, k, k, pk, lse, 0.0, True)[2]  # P^T (g q)
            dq = dq + scale * g * pk
            dk = dk + scale * dk_lse
        return dq, dk, dv


def _shift(x: torch.Tensor, n: int, fill: float = 0.0) -> torch.Tensor:
    """x (..., T, D) -> row t holds row t-n of x (rows t < n: fill)."""
    if n == 0:
        return x
    return torch.cat([x.new_full((*x.shape[:-2], n, x.shape[-1]), fill), x[..., : x.shape[-2] - n, :]], dim=-2)


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """q (B, Hq, T, D) of step j = len(keys); keys, values [(B, Hkv, T, D)] of steps 1..j (rotated) -> (B, Hq, T, D):
    what scaled_dot_product_attention through ttt_mask(T, j) over the concatenated keys gives (GQA: Hkv | Hq)."""
    j, (B, Hq, T, D) = len(keys), q.shape
    rep = Hq // keys[0].shape[1]

    def heads(x):
        return x.repeat_interleave(rep, dim=1) if rep > 1 else x

    if q.device.type != "cpu" or T < j:  # the plain mask (other devices: no CPU flash kernel)
        return nn.functional.scaled_dot_product_attention(
            q, torch.cat(keys, dim=2), torch.cat(values, dim=2), attn_mask=ttt_mask(T, j, q.device)[None, None],
            enable_gqa=rep > 1)
    k1, v1 = heads(keys[0]), heads(values[0])
    if j == 1:
        return nn.functional.scaled_dot_product_attention(q, k1, v1, is_causal=True)
    o = j - 1  # query t sees step 1's keys s <= t - o: causal over rows o.. against keys ..T-o
    out1, lse1 = _CausalLSE.apply(q[:, :, o:], k1[:, :, : T - o], v1[:, :, : T - o])
    out1 = torch.cat([out1.new_zeros(B, Hq, o, D), out1], dim=2)
    lse1 = torch.cat([lse1.new_full((B, Hq, o), float("-inf")), lse1], dim=2)
    scale = D**-0.5
    scores, vals = [lse1], [out1]
    for i in range(2, j + 1):  # step i's key at s = t - (j - i)
        n = j - i
        k = _shift(heads(keys[i - 1]), n)
        d = (q * k).sum(-1) * scale
        if n:
            d = d.masked_fill(torch.arange(T, device=q.device) < n, float("-inf"))
        scores.append(d)
        vals.append(_shift(heads(values[i - 1]), n))
    w = torch.stack(scores).softmax(0).unsqueeze(-1)  # (j, B, Hq, T, 1): each part's share
    return (w * torch.stack(vals)).sum(0)
