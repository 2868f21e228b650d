"""decode.tokens_per_pass=m: m drafts per pass through layers < E, from a medusa head's extra heads (t+2, t+3, ...).
Greedy == HF generate on the four tiny architectures (wide blocks, dynamic K, a reduced draft vocabulary and lookup
first included), the passes counted, the exact sampling distribution with a planted wrong-q bug that the same check
catches, config errors, tuned settings and eval variants."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import ARCHS, make_tiny, randomize_head
from decoding.test_exactness import PROMPTS, check_equal, hf_greedy
from selfspec.decoding.config import DecodeConfig, with_tuned_settings
from selfspec.errors import SelfSpecError

NEW = 32


@pytest.mark.parametrize("arch", list(ARCHS))
def test_parallel_drafts_match_hf_generate(arch):
    m = make_tiny(arch)
    L = m.backbone.num_layers
    near_ties = []
    for i, (E, m_pass, K, wide) in enumerate([(1, 2, 4, None), (L // 2, 3, 5, 48), (L - 1, 3, 3, None)]):
        m.set_head("medusa", exit_layer=E, num_heads=3, num_blocks=1, intermediate=wide,
                   draft_vocab=200 if i % 2 else None)
        randomize_head(m.head, seed=E + i, std=0.2)
        ids = m.encode(PROMPTS[i % 2])
        ref = hf_greedy(m, ids)
        for kw in (dict(), dict(draft_threshold=0.3), dict(lookup=True, lookup_mode="first", lookup_min_ngram=1)):
            got = m.generate(ids, max_new_tokens=NEW, draft_len=K, tokens_per_pass=m_pass, **kw)
            check_equal(m, ids, got.token_ids, ref, near_ties)
            s = got.stats
            assert s["new_tokens"] == len(got.token_ids) and s["accepted"] <= s["drafted"]
            if not kw:  # each round of k drafts makes ceil(k / m) passes: fewer passes than drafts
                rounds = s["verify_steps"]
                assert s["draft_steps"] <= rounds * math.ceil(K / m_pass) and s["drafted"] > s["draft_steps"]
    assert len(near_ties) <= 1, near_ties


def test_one_pass_per_m_drafts():
    """With K=4 and m=2 a full round makes exactly 2 passes through layers < E (m=1: 4)."""
    m = make_tiny("llama")
    m.set_head("medusa", exit_layer=2, num_heads=2)
    randomize_head(m.head, seed=1)
    ids = m.encode(PROMPTS[0])
    for m_pass, passes in ((1, 4), (2, 2)):
        s = m.generate(ids, max_new_tokens=6, draft_len=4, tokens_per_pass=m_pass).stats
        full = s["drafted_per_position"][3]  # rounds that drafted all four
        assert full >= 1 and s["draft_steps"] >= passes * full
        assert s["draft_steps"] == sum(math.ceil(k / m_pass) for k in _round_lengths(s))


def _round_lengths(stats) -> list[int]:
    """Drafts per round, from the per-position counts (no dynamic K: a round drafts positions 1..k)."""
    d = stats["drafted_per_position"] + [0]
    return [k for k in range(1, len(d)) for _ in range(d[k - 1] - d[k])]


def _sampled(m, ids, n):
    from test_sampling import T, TOP_K

    outs, drafted, accepted = [], 0, 0
    for seed in range(n):
        r = m.generate(ids, decode=DecodeConfig(temperature=T, top_k=TOP_K, seed=seed, max_new_tokens=4, draft_len=3,
                                                tokens_per_pass=3))
        outs.append(r.token_ids)
        drafted, accepted = drafted + r.stats["drafted"], accepted + r.stats["accepted"]
    return outs, drafted, accepted


def test_parallel_drafts_keep_the_target_distribution():
    """Each draft is sampled from the distribution of the head that proposed it and scored with that q: the first
    three sampled tokens follow the target's exact distribution, drafts accepted and rejected."""
    from test_sampling import exact_marginals, marginal_failures, support_violations

    m = make_tiny("llama")
    m.set_head("medusa", exit_layer=2, num_heads=3)
    randomize_head(m.head, seed=3, std=0.03)
    ids = m.encode("Sampling test")
    outs, drafted, accepted = _sampled(m, ids, 1200)
    assert 0 < accepted < drafted
    assert not support_violations(m, ids, outs) and not marginal_failures(outs, exact_marginals(m, ids, 3))


def test_each_draft_is_scored_with_its_own_heads_q(monkeypatch):
    """Speculative sampling is exact for any q as long as each draft is scored with the q it was drawn from. Every
    round's q[i] is the distribution of the head that proposed draft i, in the pass that proposed it (extra heads
    differ from the first); the same check flags a round whose drafts are all scored with the first head's q."""
    from selfspec.decoding.proposers import AheadChain
    from selfspec.decoding.verify import Draft
    from selfspec.decoding.sampling import process_logits
    from selfspec.heads.medusa import MedusaHead

    m = make_tiny("llama")
    m.set_head("medusa", exit_layer=2, num_heads=3, draft_vocab=200)
    randomize_head(m.head, seed=5, std=0.2)
    cfg = DecodeConfig(temperature=0.9, top_p=0.9, seed=1, max_new_tokens=24, draft_len=5, tokens_per_pass=3)
    passes: list[torch.Tensor] = []
    real_ahead, real_draft = MedusaHead.ahead_logits, AheadChain.propose

    def recording(self, *args, **kw):
        out = real_ahead(self, *args, **kw)
        passes.append(out.clone())
        return out

    def mismatches(draft, drafter) -> int:
        rows = torch.cat(passes) if passes else None
        return sum(not torch.equal(q, drafter.full_distribution(process_logits(rows[i], cfg.temperature, cfg.top_k, cfg.top_p)))
                   or float(q[tok]) == 0.0 for i, (tok, q) in enumerate(zip(draft.tokens, draft.q)))

    seen = {"drafts": 0, "bad": 0, "planted": 0}

    def checking(self, state):
        passes.clear()
        draft = real_draft(self, state)
        assert len(passes) == -(-len(draft.tokens) // 3) or not draft.tokens  # one pass per 3 drafts
        seen["drafts"] += len(draft.tokens)
        seen["bad"] += mismatches(draft, state.drafter)
        planted = Draft(draft.tokens, draft.q[:1] * len(draft.q))  # the wrong-q bug
        seen["planted"] += mismatches(planted, state.drafter)
        return draft

    monkeypatch.setattr(MedusaHead, "ahead_logits", recording)
    monkeypatch.setattr(AheadChain, "propose", checking)
    m.generate(m.encode(PROMPTS[0]), decode=cfg)
    assert seen["drafts"] >= 10 and seen["bad"] == 0
    assert seen["planted"] > 0, "drafts scored with the first head's q went unnoticed"


def test_tokens_per_pass_errors():
    with pytest.raises(SelfSpecError, match=r"decode.tokens_per_pass=0: must be an integer >= 1"):
        DecodeConfig(tokens_per_pass=0)
    with pytest.raises(SelfSpecError, match=r"decode.tokens_per_pass=2: chain rounds only; not with decode.tree=dynamic"):
        DecodeConfig(tokens_per_pass=2, tree="dynamic")
    with pytest.raises(SelfSpecError, match=r"decode.tokens_per_pass=2: chain rounds only"):
        DecodeConfig(tokens_per_pass=2, lookup=True)  # lookup branches are a tree
    m = make_tiny("llama")
    m.set_head("medusa", exit_layer=2, num_heads=2)
    ids = m.encode(PROMPTS[0])
    with pytest.raises(SelfSpecError, match=r"decode.tokens_per_pass=3: this head proposes at most 2 tokens per pass"):
        m.generate(ids, max_new_tokens=4, tokens_per_pass=3)
    m.set_head("layer", exit_layer=2)
    with pytest.raises(SelfSpecError, match=r"decode.tokens_per_pass=2: this head proposes at most 1 token per pass"):
        m.generate(ids, max_new_tokens=4, tokens_per_pass=2)
    # the autoregressive path ignores it
    assert m.generate(ids, max_new_tokens=4, strategy="autoregressive", tokens_per_pass=2).token_ids == hf_greedy(m, ids, 4)


def test_wide_medusa_blocks_start_as_the_lens():
    """head.intermediate: x + W2 SiLU(W1 x) with W2 zero-initialised, so the untrained head drafts as the lens."""
    m = make_tiny("llama")
    h = torch.randn(1, 5, m.backbone.hidden_size)
    m.set_head("lens", exit_layer=2)
    lens = m.head(h, m.backbone)
    m.set_head("medusa", exit_layer=2, num_blocks=2, intermediate=40)
    assert torch.allclose(m.head(h, m.backbone), lens, atol=1e-5)
    assert m.head.num_params() == 2 * (2 * 40 * m.backbone.hidden_size + 40)
    with pytest.raises(SelfSpecError, match=r"head.intermediate=0"):
        m.set_head("medusa", exit_layer=2, intermediate=0)


def test_tuned_tokens_per_pass():
    tuned = {"draft_len": 4, "tokens_per_pass": 2}
    cfg, used = with_tuned_settings(DecodeConfig(), tuned, set())
    assert cfg.tokens_per_pass == 2 and used == ["draft_len", "tokens_per_pass"]
    cfg, used = with_tuned_settings(DecodeConfig(tree="dynamic"), tuned, {"tree"})  # the user's tree: one per pass
    assert cfg.tokens_per_pass == 1 and used == ["draft_len"]


def test_eval_variant():
    from selfspec.evaluation.runner import method_decode_config, parse_method

    cfg = method_decode_config(parse_method("selfspec:tokens_per_pass=2"), DecodeConfig())
    assert cfg.tokens_per_pass == 2


def test_training_records_tokens_per_pass():
    from selfspec.training.run import tuned_settings

    assert "tokens_per_pass" not in tuned_settings(DecodeConfig())
    assert tuned_settings(DecodeConfig(tokens_per_pass=3))["tokens_per_pass"] == 3
