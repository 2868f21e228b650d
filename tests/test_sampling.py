"""Sampling is lossless: the accept/reject rule reproduces p, alone and end to end."""

from __future__ import annotations

import torch

from conftest import make_tiny, randomize_head
from selfspec.decoding.engine import DecodeConfig
from selfspec.decoding.sampling import process_logits, speculative_accept


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def test_accept_reject_reproduces_p():
    """vLLM-style: random q and p on a 10-token vocabulary; the emitted token's histogram converges to p.
    Checked on the first emitted token of k=3 drafts (accept or residual) and on the bonus path."""
    g = torch.Generator().manual_seed(0)
    V, k, n = 10, 3, 20000
    for trial in range(3):
        q = torch.rand(k, V, generator=g).pow(3)
        q /= q.sum(-1, keepdim=True)
        p = torch.rand(k + 1, V, generator=g).pow(3)
        p /= p.sum(-1, keepdim=True)
        counts = torch.zeros(V)
        for _ in range(n):
            drafts = torch.stack([torch.multinomial(q[i], 1, generator=g)[0] for i in range(k)])
            a, nxt = speculative_accept(drafts, q, p, g)
            first = drafts[0] if a > 0 else nxt
            counts[first] += 1
        hist = counts / n
        err = tv(hist, p[0])
        assert err < 0.02, f"trial {trial}: TV(hist, p) = {err:.4f}"
        # the test has power: the draft's own distribution and a random one are far away
        assert tv(hist, q[0]) > 5 * err
        other = torch.rand(V, generator=g).pow(3)
        assert tv(hist, other / other.sum()) > 5 * err


def test_all_accepted_when_q_equals_p():
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(4, 7, generator=g), -1)
    drafts = torch.tensor([int(torch.multinomial(p[i], 1, generator=g)) for i in range(3)])
    a, _ = speculative_accept(drafts, p[:3], p, g)
    assert a == 3


def test_process_logits_top_k_top_p():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    probs = process_logits(logits, 1.0, top_k=2)
    assert (probs[2:] == 0).all() and abs(float(probs.sum()) - 1) < 1e-6
    full = logits.softmax(-1)
    probs = process_logits(logits, 1.0, top_p=float(full[0]) + 1e-3)  # needs the top two tokens
    assert (probs[:2] > 0).all() and (probs[2:] == 0).all()
    probs = process_logits(logits, 1.0, top_p=0.01)  # the top token always stays
    assert probs[0] == 1.0
    hot = process_logits(logits, 2.0)
    assert torch.allclose(hot, (logits / 2).softmax(-1))


def test_end_to_end_first_tokens_match_plain_sampling():
    """Self-speculative sampling with a (randomized, so q != p) head: the first two generated tokens follow
    the target's exact distribution, computed from the model's own logits."""
    m = make_tiny("llama")
    m.set_head("medusa", exit_layer=2)
    randomize_head(m.head, seed=3, std=0.03)
    ids = m.encode("Sampling test")
    T, top_k = 1.0, 6

    with torch.no_grad():
        def dist(seq):
            return process_logits(m.hf_model(torch.tensor([seq])).logits[0, -1], T, top_k)

        p1 = dist(ids)
        p2 = torch.zeros_like(p1)
        for t1 in p1.nonzero().flatten().tolist():
            p2 += p1[t1] * dist(ids + [t1])

    n = 1500
    c1, c2 = torch.zeros_like(p1), torch.zeros_like(p1)
    drafted = accepted = 0
    for seed in range(n):
        r = m.generate(ids, decode=DecodeConfig(draft_len=3, temperature=T, top_k=top_k, seed=seed, max_new_tokens=3))
        c1[r.token_ids[0]] += 1
        c2[r.token_ids[1]] += 1
        drafted += r.stats["drafted"]
        accepted += r.stats["accepted"]
    assert 0 < accepted < drafted  # both branches of the test ran
    assert tv(c1 / n, p1) < 0.06, tv(c1 / n, p1)
    assert tv(c2 / n, p2) < 0.06, tv(c2 / n, p2)
    # same seed -> same sample (reproducible)
    a = m.generate(ids, decode=DecodeConfig(draft_len=3, temperature=T, seed=7, max_new_tokens=8))
    b = m.generate(ids, decode=DecodeConfig(draft_len=3, temperature=T, seed=7, max_new_tokens=8))
    assert a.token_ids == b.token_ids
