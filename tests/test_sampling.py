"""Sampling is lossless: the accept/reject rule reproduces p, alone and end to end.

Every statistical check compares an empirical histogram with the exact distribution by total variation,
with a threshold sized from the sample size (`tv_threshold`: the expected TV of n samples plus six standard
deviations), so a check neither passes on noise nor misses a real bias because its bar sat above the noise.

The suite must catch the ways this rule is usually broken. `test_planted_bugs_fail_the_checks` (unit level)
and `test_planted_bugs_fail_end_to_end` (through the engine, the mutant monkeypatched into the decoding
modules) plant each of them and assert that the same checks then fail:
  - the bonus token drawn from the wrong row (p[k-1] instead of p[k]),
  - a rejection resampled from p instead of the residual norm(max(0, p - q)),
  - the acceptance ratio inverted (q/p instead of p/q),
  - greedy drafting under sampling (the draft's argmax instead of a sample from q).
"""

from __future__ import annotations

import math
import sys
from contextlib import contextmanager

import pytest
import torch

from conftest import make_tiny, randomize_head
from selfspec.decoding import sampling
from selfspec.decoding.engine import DecodeConfig
from selfspec.decoding.sampling import process_logits, speculative_accept


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def tv_threshold(p: torch.Tensor, n: int, z: float = 6.0) -> float:
    """A bound that TV(histogram of n samples of p, p) stays under unless the sampler is biased: its mean plus
    z standard deviations. Per category |hist - p| is about half-normal with sigma = sqrt(p(1-p)/n), so it
    has mean sqrt(2/pi) sigma and variance (1 - 2/pi) sigma^2 (categories taken as independent, which
    overstates the variance a little: the bound is conservative)."""
    sigma = (p.double() * (1 - p.double()) / n).sqrt()
    mean = 0.5 * math.sqrt(2 / math.pi) * float(sigma.sum())
    sd = 0.5 * math.sqrt((1 - 2 / math.pi) * float((sigma**2).sum()))
    return mean + z * sd


def test_tv_threshold_is_sized_from_the_sample_size():
    g = torch.Generator().manual_seed(5)
    p = torch.rand(10, generator=g).pow(3)
    p /= p.sum()
    for n in (500, 5000, 50000):
        errs = [tv(torch.bincount(torch.multinomial(p, n, replacement=True, generator=g), minlength=10) / n, p) for _ in range(40)]
        bound = tv_threshold(p, n)
        assert max(errs) < bound  # honest samples pass
        assert sum(errs) / len(errs) > bound / 6  # and the bar is not far above the noise (it has power)
    assert tv_threshold(p, 400) == pytest.approx(2 * tv_threshold(p, 1600), rel=1e-9)  # shrinks as 1/sqrt(n)


# ------------------------------------------------------------------------------------------------ unit level
def random_dists(g: torch.Generator, rows: int, V: int) -> torch.Tensor:
    d = torch.rand(rows, V, generator=g).pow(3)  # peaked, like a model's
    return d / d.sum(-1, keepdim=True)


def sample_drafts(q: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    return torch.stack([torch.multinomial(q[i], 1, generator=g)[0] for i in range(q.shape[0])])


def greedy_drafts(q: torch.Tensor, g: torch.Generator) -> torch.Tensor:  # a planted bug: argmax under sampling
    return q.argmax(-1)


def emitted_histograms(q, p, n, g, accept=speculative_accept, draft=sample_drafts):
    """Run n rounds of k = len(q) drafts. Position j's row of the result counts the token emitted at j,
    over the rounds that reached j: j < a (an accepted draft) or j == a (the residual or bonus token).
    With rows that do not depend on earlier tokens, position j's tokens follow p[j] exactly."""
    k, V = q.shape
    counts = torch.zeros(k + 1, V)
    for _ in range(n):
        drafts = draft(q, g)
        a, nxt = accept(drafts, q, p, g)
        for j, t in enumerate(drafts[:a].tolist() + [int(nxt)]):
            counts[j, t] += 1
    return counts


def failures(counts: torch.Tensor, p: torch.Tensor, min_samples: int = 200) -> list[str]:
    """The positions whose histogram is not p's (TV above its sample-size threshold)."""
    bad = []
    for j in range(counts.shape[0]):
        n = int(counts[j].sum())
        if n >= min_samples and (err := tv(counts[j] / n, p[j])) > (bar := tv_threshold(p[j], n)):
            bad.append(f"position {j}: TV {err:.4f} > {bar:.4f} (n={n})")
    return bad


def scenarios(seed: int = 0):
    """(name, q, p): random q != p (accept and reject both happen), and q == p on the drafted rows, where
    every draft is accepted and the last emitted token is always the bonus from p[k]."""
    g = torch.Generator().manual_seed(seed)
    V, k = 10, 3
    q, p = random_dists(g, k, V), random_dists(g, k + 1, V)
    yield "q != p", q, p
    p = random_dists(g, k + 1, V)
    yield "all accepted", p[:k].clone(), p


def test_accept_reject_reproduces_p_at_every_position():
    """vLLM-style: on a 10-token vocabulary every emitted position, the residual and the bonus included,
    follows p; with q == p every draft is accepted and the bonus row p[k] is the one used."""
    g = torch.Generator().manual_seed(0)
    for name, q, p in scenarios():
        counts = emitted_histograms(q, p, 12000, g)
        assert not failures(counts, p), (name, failures(counts, p))
        if name == "all accepted":
            assert counts.sum(-1).tolist() == [12000] * 4  # every round reached the bonus position
        else:
            assert 200 <= counts[-1].sum() < 12000  # the bonus path was taken, but not always
        # the test has power: the draft's own distribution is far from what was emitted
        assert tv(counts[0] / counts[0].sum(), q[0]) > 5 * tv_threshold(p[0], int(counts[0].sum())) or name == "all accepted"


def _bonus_from_previous_row(drafts, q, p, generator=None):
    k = drafts.shape[0]
    wrong = p.clone()
    if k:
        wrong[k] = p[k - 1]
    return speculative_accept(drafts, q, wrong, generator)


def _residual_is_p(drafts, q, p, generator=None):
    k = drafts.shape[0]
    idx = torch.arange(k)
    u = torch.rand(k, generator=generator)
    a = int((u * q[idx, drafts] < p[idx, drafts]).int().cumprod(0).sum()) if k else 0
    dist = p[a]  # should be norm(max(0, p[a] - q[a])) after a rejection
    return a, torch.multinomial(dist, 1, generator=generator)[0]


def _inverted_ratio(drafts, q, p, generator=None):
    k = drafts.shape[0]
    idx = torch.arange(k)
    u = torch.rand(k, generator=generator)
    a = int((u * p[idx, drafts] < q[idx, drafts]).int().cumprod(0).sum()) if k else 0  # should be u * q < p
    if a < k:
        residual = (p[a] - q[a]).clamp_min(0)
        dist = residual / residual.sum() if residual.sum() > 0 else p[a]
    else:
        dist = p[k]
    return a, torch.multinomial(dist, 1, generator=generator)[0]


MUTANTS = {
    "bonus from p[k-1]": (_bonus_from_previous_row, sample_drafts),
    "residual sampled from p": (_residual_is_p, sample_drafts),
    "acceptance ratio q/p": (_inverted_ratio, sample_drafts),
    "greedy drafting": (speculative_accept, greedy_drafts),
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_planted_bugs_fail_the_checks(mutant):
    """Each planted bug makes the very check above fail in at least one scenario."""
    accept, draft = MUTANTS[mutant]
    g = torch.Generator().manual_seed(1)
    found = []
    for name, q, p in scenarios():
        found += [f"{name}: {f}" for f in failures(emitted_histograms(q, p, 6000, g, accept, draft), p)]
        if found:
            break
    assert found, f"the sampling checks do not catch the planted bug '{mutant}'"


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


# ------------------------------------------------------------------------------------------------ end to end
T, TOP_K = 1.0, 6


def next_dists(m, prefixes: list[list[int]], temperature: float = T, top_k: int = TOP_K, top_p: float = 1.0) -> torch.Tensor:
    """(n, V) the target's processed next-token distributions after each prefix (all the same length)."""
    with torch.no_grad():
        return process_logits(m.hf_model(torch.tensor(prefixes)).logits[:, -1], temperature, top_k, top_p)


def exact_marginals(m, ids: list[int], depth: int, temperature: float = T, top_k: int = TOP_K,
                    top_p: float = 1.0) -> list[torch.Tensor]:
    """The exact distribution of each of the first `depth` sampled tokens, by enumerating every prefix of
    positive probability (top-k keeps TOP_K tokens per step; a small top-p nucleus keeps few too)."""
    frontier = {(): 1.0}
    out = []
    for _ in range(depth):
        keys = list(frontier)
        dists = next_dists(m, [ids + list(key) for key in keys], temperature, top_k, top_p)
        marginal = torch.zeros(dists.shape[-1], dtype=torch.float64)
        nxt: dict = {}
        for key, d in zip(keys, dists):
            marginal += frontier[key] * d.double()
            for t in d.nonzero().flatten().tolist():
                nxt[key + (t,)] = frontier[key] * float(d[t])
        out.append(marginal.float())
        frontier = nxt
    return out


def exact_draft_model():
    """A tiny model whose layers >= 2 add nothing (o_proj and down_proj zero): the lens head at E=2 drafts
    exactly the target's distribution, so every draft is accepted and each round ends with the bonus token."""
    m = make_tiny("llama")
    with torch.no_grad():
        for layer in m.hf_model.model.layers[2:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    m.set_head("lens", exit_layer=2)
    return m


def run_samples(m, ids, n, max_new_tokens, seed0=0):
    outs, drafted, accepted = [], 0, 0
    for seed in range(seed0, seed0 + n):
        r = m.generate(ids, decode=DecodeConfig(draft_len=3, temperature=T, top_k=TOP_K, seed=seed, max_new_tokens=max_new_tokens))
        outs.append(r.token_ids)
        drafted += r.stats["drafted"]
        accepted += r.stats["accepted"]
    return outs, drafted, accepted


def support_violations(m, ids, outs) -> list[str]:
    """Emitted tokens that the target's processed distribution gives probability 0 after their prefix
    (a token from the wrong row lands outside top-k almost always)."""
    prefixes = sorted({tuple(o[:j]) for o in outs for j in range(len(o))}, key=len)
    bad = []
    for length in sorted({len(p) for p in prefixes}):
        group = [p for p in prefixes if len(p) == length]
        dists = dict(zip(group, next_dists(m, [ids + list(p) for p in group])))
        for o in outs:
            if len(o) > length and tuple(o[:length]) in dists and dists[tuple(o[:length])][o[length]] == 0:
                bad.append(f"token {o[length]} at position {length} after {o[:length]}")
    return bad


def marginal_failures(outs, marginals) -> list[str]:
    bad = []
    for j, p in enumerate(marginals):
        tokens = torch.tensor([o[j] for o in outs if len(o) > j])
        hist = torch.bincount(tokens, minlength=p.numel()).float() / tokens.numel()
        if (err := tv(hist, p)) > (bar := tv_threshold(p, tokens.numel())):
            bad.append(f"token {j + 1}: TV {err:.4f} > {bar:.4f}")
    return bad


def test_end_to_end_tokens_match_plain_sampling():
    """Self-speculative sampling with a randomized head (q != p): the first three generated tokens follow the
    target's exact distribution; with max_new_tokens=4 a round drafts three positions, so every draft
    position is exercised (accepts and rejections both)."""
    m = make_tiny("llama")
    m.set_head("medusa", exit_layer=2)
    randomize_head(m.head, seed=3, std=0.03)
    ids = m.encode("Sampling test")
    outs, drafted, accepted = run_samples(m, ids, 1200, max_new_tokens=4)
    assert 0 < accepted < drafted  # both branches of the test ran
    assert not support_violations(m, ids, outs)
    assert not marginal_failures(outs, exact_marginals(m, ids, 3))
    # same seed -> same sample (reproducible)
    a = m.generate(ids, decode=DecodeConfig(draft_len=3, temperature=T, seed=7, max_new_tokens=8))
    b = m.generate(ids, decode=DecodeConfig(draft_len=3, temperature=T, seed=7, max_new_tokens=8))
    assert a.token_ids == b.token_ids


def test_end_to_end_every_draft_accepted_uses_the_bonus_row():
    """q == p: all three drafts are accepted every time, and the fourth token (the bonus, p[k]) follows the
    target's distribution after the three drafts, not the row before."""
    m = exact_draft_model()
    ids = m.encode("Bonus test")
    outs, drafted, accepted = run_samples(m, ids, 400, max_new_tokens=4)
    assert drafted == accepted == 3 * 400 and all(len(o) == 4 for o in outs)
    assert not support_violations(m, ids, outs)
    assert not marginal_failures(outs, exact_marginals(m, ids, 4))


@contextmanager
def planted(name: str, replacement):
    """Replace sampling.<name> in every selfspec.decoding module that uses it (however the engine imports it)."""
    original = getattr(sampling, name)
    patched = [mod for mod_name, mod in list(sys.modules.items())
               if mod_name.startswith("selfspec.decoding") and getattr(mod, name, None) is original]
    for mod in patched:
        setattr(mod, name, replacement)
    try:
        yield
    finally:
        for mod in patched:
            setattr(mod, name, original)


def test_planted_bugs_fail_end_to_end():
    """The engine with a planted bug fails the end-to-end checks above."""
    m = exact_draft_model()
    ids = m.encode("Bonus test")
    with planted("speculative_accept", _bonus_from_previous_row):
        outs, _, _ = run_samples(m, ids, 60, max_new_tokens=4)
    assert support_violations(m, ids, outs), "a bonus token from p[k-1] went unnoticed"
    with planted("sample", lambda probs, generator=None: probs.argmax()):
        outs, _, _ = run_samples(m, ids, 200, max_new_tokens=4)
    assert marginal_failures(outs, exact_marginals(m, ids, 1)), "greedy drafting under sampling went unnoticed"
