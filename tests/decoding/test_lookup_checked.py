"""decode.lookup_mode=checked: context lookup's chain goes through the head in one pass, its tokens are kept up to the
first one the head disagrees with, and the head drafts on from there. Greedy == HF generate on the four tiny
architectures (full and int8 drafts, a stateful head), one pass for a kept prefix, and the exact sampling distribution
(kept lookup tokens are deterministic proposals: one-hot q)."""

from __future__ import annotations

import pytest
import torch

from conftest import ARCHS, make_tiny, randomize_head
from decoding.test_exactness import PROMPTS, check_equal, hf_greedy
from decoding.test_lookup_first import echo_prompt
from selfspec.decoding.config import DecodeConfig
from selfspec.errors import SelfSpecError

NEW = 32


@pytest.mark.parametrize("arch", list(ARCHS))
def test_checked_lookup_matches_hf_generate(arch):
    m = make_tiny(arch)
    L = m.backbone.num_layers
    near_ties = []
    for i, (head, precision, E) in enumerate((("lens", "int8", L), ("medusa", "full", 2), ("adapter", "int8", L // 2))):
        m.set_head(head, exit_layer=E, draft_precision=precision)
        if head != "lens":
            randomize_head(m.head, seed=E, std=0.2)
        ids = echo_prompt(m, PROMPTS[i % 2])
        ref = hf_greedy(m, ids)
        for K in (2, 5):
            got = m.generate(ids, decode=DecodeConfig(draft_len=K, max_new_tokens=NEW, lookup=True, lookup_mode="checked",
                                                      lookup_min_ngram=1, lookup_len=4))
            check_equal(m, ids, got.token_ids, ref, near_ties)
            s = got.stats
            assert s["accepted_lookup"] <= s["drafted_lookup"] <= s["drafted"] and s["accepted"] <= s["drafted"]
    assert len(near_ties) <= 1  # kept prefixes: test_a_kept_lookup_prefix_costs_one_pass


def test_a_kept_lookup_prefix_costs_one_pass():
    """A loop the target repeats: lookup proposes the loop, the int8 whole-model draft agrees, and a round of K drafts
    takes one pass through the draft's layers instead of K."""
    m = make_tiny("gemma3_text", head="lens", exit_layer=6)
    m.head.set_draft_precision("int8")
    ids = m.encode(PROMPTS[0])
    ids += hf_greedy(m, ids, 84)
    ref = hf_greedy(m, ids)
    assert ref == ref[:1] * NEW  # the premise: a loop
    cfg = dict(draft_len=4, max_new_tokens=NEW, lookup=True, lookup_len=4)
    checked = m.generate(ids, decode=DecodeConfig(**cfg, lookup_mode="checked")).stats
    plain = m.generate(ids, decode=DecodeConfig(draft_len=4, max_new_tokens=NEW)).stats
    assert checked["accepted_lookup"] >= NEW // 2
    assert checked["draft_steps"] <= checked["verify_steps"] + 1 < plain["draft_steps"] // 2


def test_checked_lookup_sampling_keeps_the_target_distribution(monkeypatch):
    """Sampling: kept lookup tokens carry a one-hot q, the head's token at the first disagreement its own q; the
    first three sampled tokens follow the target's exact distribution. Scoring the kept tokens with q = 0 (always
    accepted) fails the same check."""
    from test_sampling import TOP_K, T, exact_marginals, marginal_failures, next_dists, support_violations

    import selfspec.decoding.proposers as proposers

    m = make_tiny("llama")
    m.set_head("lens", exit_layer=m.backbone.num_layers, draft_precision="int8")
    base = m.encode("Sampling test")
    ids = None
    for x in [i for i in range(1, 250) if i not in base][:20]:
        for t in next_dists(m, [base + [x]])[0].topk(TOP_K).indices.tolist():
            cand = [x, t] + base + [x]
            p = next_dists(m, [cand])[0]
            if 0.15 < float(p[t]) < 0.85 and int(p.argmax()) == t:  # the draft keeps t (its argmax), the target doubts it
                ids = ids or cand
    assert ids is not None, "no candidate prompt gives lookup's draft a middling probability as the target's argmax"
    marginals = exact_marginals(m, ids, 3)

    def sampled(n):
        outs, drafted, accepted = [], 0, 0
        for seed in range(n):
            r = m.generate(ids, decode=DecodeConfig(temperature=T, top_k=TOP_K, seed=seed, max_new_tokens=3, lookup=True,
                                                    lookup_mode="checked", lookup_min_ngram=1, lookup_len=2, draft_len=2))
            outs.append(r.token_ids)
            drafted, accepted = drafted + r.stats["drafted"], accepted + r.stats["accepted"]
        return outs, drafted, accepted

    outs, drafted, accepted = sampled(400)
    assert 0 < accepted < drafted
    assert not support_violations(m, ids, outs) and not marginal_failures(outs, marginals)

    real = proposers.LookupChecked.checked

    def zero_q(self, state, draft):
        made = real(self, state, draft)
        draft.q[: draft.lookup] = [torch.zeros_like(q) for q in draft.q[: draft.lookup]]
        return made

    monkeypatch.setattr(proposers.LookupChecked, "checked", zero_q)
    bad, _, _ = sampled(200)
    assert marginal_failures(bad, marginals), "kept lookup drafts accepted regardless of p went unnoticed"


def test_checked_lookup_config():
    assert DecodeConfig(lookup=True, lookup_mode="checked").lookup_first  # chain rounds with lookup
    with pytest.raises(SelfSpecError, match="decode.lookup_mode=checked: rounds are chains"):
        DecodeConfig(lookup=True, lookup_mode="checked", tree="dynamic")
    with pytest.raises(SelfSpecError, match="decode.tokens_per_pass=2: not with decode.lookup_mode=checked"):
        DecodeConfig(lookup=True, lookup_mode="checked", tokens_per_pass=2)
    with pytest.raises(SelfSpecError, match="allowed branch, first, checked"):
        DecodeConfig(lookup=True, lookup_mode="nope")
