"""heads/ttt_attention.py: the causal pass plus diagonal keys equals attention through ttt_mask over every step's
keys, in the outputs and in every gradient (q and each step's k and v), with grouped-query heads."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from selfspec.heads.ttt_attention import ttt_attention, ttt_mask


def _masked(q, keys, values):
    rep = q.shape[1] // keys[0].shape[1]
    return nn.functional.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2),
                                                      attn_mask=ttt_mask(q.shape[2], len(keys))[None, None],
                                                      enable_gqa=rep > 1)


@pytest.mark.parametrize("step", [1, 2, 3, 5])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2)])
def test_equals_the_mask_over_every_steps_keys(step, hq, hkv):
    g = torch.Generator().manual_seed(10 * step + hq)
    B, T, D = 2, 37, 16
    q = (torch.randn(B, hq, T, D, generator=g) * 2).requires_grad_()
    keys = [(torch.randn(B, hkv, T, D, generator=g) * 2).requires_grad_() for _ in range(step)]
    values = [torch.randn(B, hkv, T, D, generator=g).requires_grad_() for _ in range(step)]
    w = torch.randn(B, hq, T, D, generator=g)  # a loss that weighs every output
    got = ttt_attention(q, keys, values)
    ref = _masked(q, keys, values)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad((got * w).sum(), [q, *keys, *values])
    refs = torch.autograd.grad((ref * w).sum(), [q, *keys, *values])
    for a, b in zip(grads, refs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_wrong_diagonal_would_show():
    """The comparison has power: attending to step 1's key where step 2's is due differs."""
    g = torch.Generator().manual_seed(0)
    q, k1, k2, v1, v2 = (torch.randn(1, 2, 9, 8, generator=g) for _ in range(5))
    assert not torch.allclose(ttt_attention(q, [k1, k2], [v1, v2]), ttt_attention(q, [k1, k1], [v1, v1]), atol=1e-3)
