"""decode.lookup_mode=first: a round drafts context lookup's continuation when the history has a match and the head's
chain otherwise. Greedy == HF generate on the four tiny architectures with every head type (dynamic K and a reduced
draft vocabulary included), lookup taking the rounds it can, sampling exact (one-hot q for lookup drafts), stats,
config errors, tuned settings and eval variants keeping dynamic K."""

from __future__ import annotations

import pytest
import torch

from conftest import ARCHS, make_tiny, randomize_head
from decoding.test_exactness import PROMPTS, check_equal, hf_greedy
from selfspec.decoding.config import DecodeConfig, with_tuned_settings
from selfspec.errors import SelfSpecError

NEW = 32
HEADS = ["lens", "medusa", "adapter", "layer", "lora"]


def echo_prompt(m, p: str) -> list[int]:
    """A prompt whose end repeats an earlier stretch of it, followed by the target's own answer once: lookup
    then has matches to propose from the first round on, some right, some wrong."""
    ids = m.encode(p)
    answer = hf_greedy(m, ids, 12)
    return ids + answer + ids[:3]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_lookup_first_matches_hf_generate(arch):
    m = make_tiny(arch)
    L = m.backbone.num_layers
    near_ties, lookup_rounds, head_rounds = [], 0, 0
    for i, head in enumerate(HEADS):
        E = (1, L // 2, L - 1)[i % 3]
        if head == "lora":
            m = make_tiny(arch)  # the LoRA is injected into the model
        m.set_head(head, exit_layer=E, draft_vocab=200 if i % 2 else None)
        randomize_head(m.head, seed=E, std=0.05 if head == "lora" else 0.2)
        p = PROMPTS[i % 2]
        ids = echo_prompt(m, p)
        ref = hf_greedy(m, ids)
        for threshold in (None, 0.3):
            got = m.generate(ids, max_new_tokens=NEW, lookup=True, lookup_mode="first", lookup_min_ngram=1,
                             lookup_len=4, draft_threshold=threshold)
            check_equal(m, ids, got.token_ids, ref, near_ties)
            s = got.stats
            assert s["tree"] == "chain" and s["lookup"] is True and s["new_tokens"] == len(got.token_ids)
            assert s["drafted_head"] + s["drafted_lookup"] == s["drafted"]
            assert s["accepted_head"] + s["accepted_lookup"] == s["accepted"] <= s["drafted"]
            lookup_rounds += s["drafted_lookup"] > 0
            head_rounds += s["draft_steps"] > 0  # the head ran (its drafts may all fall under the threshold)
    assert len(near_ties) <= 1, near_ties
    assert lookup_rounds == head_rounds == 2 * len(HEADS)  # both kinds of round in every decode


def test_lookup_takes_every_round_it_can():
    """The tiny gemma3 falls into a loop of one token: after the first round lookup always matches, so the head
    drafts only where lookup has nothing (the first round), and lookup's drafts carry most tokens."""
    m = make_tiny("gemma3_text", head="medusa", exit_layer=2)
    randomize_head(m.head, seed=0)
    ids = m.encode(PROMPTS[0])
    ids += hf_greedy(m, ids, 84)
    ref = hf_greedy(m, ids)
    assert ref == ref[:1] * NEW  # the premise: a loop
    got = m.generate(ids, max_new_tokens=NEW, lookup=True, lookup_mode="first", lookup_len=6)
    s = got.stats
    assert got.token_ids == ref
    assert s["accepted_lookup"] >= NEW // 2 and s["verify_steps"] <= NEW // 3
    assert s["draft_steps"] == s["drafted_head"] <= 4  # the head ran only in rounds lookup could not draft
    assert s["draft_len"] == 6  # the deepest draft a round can make: lookup_len beside draft_len 4


def test_without_a_head_lookup_first_is_the_lookup_chain():
    m = make_tiny("llama")
    ids = echo_prompt(m, PROMPTS[1])
    a = m.generate(ids, max_new_tokens=NEW, lookup=True, lookup_mode="first", lookup_min_ngram=1)
    b = m.generate(ids, max_new_tokens=NEW, lookup=True, lookup_min_ngram=1)
    assert a.token_ids == b.token_ids == hf_greedy(m, ids)
    assert a.stats["verify_steps"] == b.stats["verify_steps"] and a.stats["drafted_lookup"] == b.stats["drafted_lookup"] > 0


def _sampled(m, ids, n, **kw):
    from test_sampling import T, TOP_K

    outs, drafted, accepted = [], 0, 0
    for seed in range(n):
        r = m.generate(ids, decode=DecodeConfig(temperature=T, top_k=TOP_K, seed=seed, max_new_tokens=3, lookup=True,
                                                lookup_mode="first", lookup_min_ngram=1, lookup_len=2, draft_len=2, **kw))
        outs.append(r.token_ids)
        drafted, accepted = drafted + r.stats["drafted_lookup"], accepted + r.stats["accepted_lookup"]
    return outs, drafted, accepted


def test_lookup_first_sampling_keeps_the_target_distribution(monkeypatch):
    """Lookup drafts are deterministic: q is one-hot, acceptance min(1, p(d)), the residual p without d. The first
    three sampled tokens follow the target's exact distribution; a lookup draft scored with q = 0 (always accepted)
    fails the same check."""
    from test_sampling import TOP_K, exact_marginals, marginal_failures, next_dists, support_violations

    import selfspec.decoding.proposers as proposers

    m = make_tiny("llama")
    m.set_head("medusa", exit_layer=2, draft_vocab=200)
    randomize_head(m.head, seed=3, std=0.03)
    # "x t ... x" (x nowhere else): the 1-gram "x" matches at once, so the first round is lookup's, proposing t; t is
    # one of the target's likely next tokens there, so its drafts are both accepted and rejected
    base = m.encode("Sampling test")
    ids = None
    for x in [i for i in range(1, 250) if i not in base][:20]:
        for t in next_dists(m, [base + [x]])[0].topk(TOP_K).indices.tolist():
            cand = [x, t] + base + [x]
            if 0.15 < float(next_dists(m, [cand])[0, t]) < 0.85:
                ids = ids or cand
    assert ids is not None, "no candidate prompt gives lookup's draft a middling probability"
    marginals = exact_marginals(m, ids, 3)
    outs, drafted, accepted = _sampled(m, ids, 400)
    assert 0 < accepted < drafted  # lookup drafts both accepted and rejected
    assert not support_violations(m, ids, outs) and not marginal_failures(outs, marginals)

    real = proposers.LookupFirst.propose

    def zero_q(self, state):
        draft = real(self, state)
        draft.q[: draft.lookup] = [torch.zeros_like(q) for q in draft.q[: draft.lookup]]
        return draft

    monkeypatch.setattr(proposers.LookupFirst, "propose", zero_q)
    bad, _, _ = _sampled(m, ids, 200)
    assert marginal_failures(bad, marginals), "lookup drafts accepted regardless of p went unnoticed"


def test_lookup_first_config():
    cfg = DecodeConfig(lookup=True, lookup_mode="first", draft_threshold=0.5)  # chain rounds: dynamic K allowed
    assert cfg.lookup_first and not cfg.uses_tree and cfg.tree_depth(head=True) == max(cfg.draft_len, cfg.lookup_len)
    assert not DecodeConfig(lookup_mode="first").lookup_first  # without decode.lookup nothing changes
    for kw, message in [
        (dict(lookup_mode="always"), r"decode.lookup_mode='always': allowed branch, first"),
        (dict(lookup=True, lookup_mode="first", tree="dynamic"), r"decode.lookup_mode=first: .* not with decode.tree=dynamic"),
        (dict(lookup=True, draft_threshold=0.5), r"decode.draft_threshold=0.5: not supported .* or decode.lookup_mode=first"),
    ]:
        with pytest.raises(SelfSpecError, match=message):
            DecodeConfig(**kw)


def test_tuned_lookup_first_keeps_dynamic_k():
    tuned = {"draft_len": 4, "draft_threshold": 0.6, "lookup": True, "lookup_mode": "first"}
    cfg, used = with_tuned_settings(DecodeConfig(), tuned, set())
    assert cfg.lookup_first and cfg.draft_threshold == 0.6 and used == sorted(tuned)
    cfg, used = with_tuned_settings(DecodeConfig(), tuned, {"lookup_mode"})  # the user's branch mode: a tree round
    assert cfg.lookup and cfg.lookup_mode == "branch" and cfg.draft_threshold is None
    cfg, used = with_tuned_settings(DecodeConfig(tree="dynamic"), tuned, {"tree"})  # the user's tree keeps branches
    assert cfg.tree == "dynamic" and cfg.lookup_mode == "branch" and cfg.draft_threshold is None


def test_eval_variant_keeps_dynamic_k():
    from selfspec.evaluation.runner import method_decode_config, parse_method

    decode = DecodeConfig(draft_threshold=0.6)
    first = method_decode_config(parse_method("selfspec+lookup:lookup_mode=first"), decode)
    assert first.lookup_first and first.draft_threshold == 0.6
    assert method_decode_config(parse_method("selfspec+lookup"), decode).draft_threshold is None


def test_eval_checks_duplicates_after_the_heads_settings():
    """Before the model loads, decode.* may still change (a saved head's tuned settings): `selfspec` and
    `selfspec:lookup=false` decode alike under plain decode.*, and differ once the head turns lookup on."""
    from selfspec.evaluation.runner import check_methods

    names = ["selfspec", "selfspec:lookup=false"]
    with pytest.raises(SelfSpecError, match="decode with the same settings"):
        check_methods(names, DecodeConfig())
    assert [s.name for s in check_methods(names, DecodeConfig(), duplicates=False)] == names
    tuned, _ = with_tuned_settings(DecodeConfig(), {"lookup": True, "lookup_mode": "first"}, set())
    assert [s.name for s in check_methods(names, tuned)] == names
