"""Draft trees and context lookup in the engine (decode.tree / decode.lookup): greedy output == HF generate on the
four tiny architectures with every head type, the caches a tree round leaves == a chain decode's, tree drafting with
a stateful head == chain drafting along each node's path, exact sampling (siblings and the bonus token), stats,
config errors."""

from __future__ import annotations

import contextlib

import pytest
import torch

from conftest import ARCHS, make_tiny, randomize_head
from decoding.test_exactness import PROMPTS, check_equal, hf_greedy
from selfspec.decoding.config import DecodeConfig
from selfspec.decoding.drafters import make_drafter
from selfspec.decoding.engine import Decoder
from selfspec.errors import SelfSpecError
from selfspec.model.cache import KVCache

NEW = 32
HEADS = ["lens", "medusa", "adapter", "layer", "lora"]
# One decode per (head, arch) pair, rotating so that each arch sees each kind of round.
TREES = [
    dict(tree="static", tree_shape=[3, 2, 2, 1]),
    dict(tree="dynamic", tree_nodes=12, tree_topk=3),
    dict(tree="dynamic", tree_nodes=8, tree_topk=2, lookup=True, lookup_branches=2),
    dict(tree="chain", draft_len=3, lookup=True, lookup_len=4),
    dict(tree="static", tree_shape=[2, 1, 1], lookup=True),
]


def tree_cfg(**kw) -> DecodeConfig:
    return DecodeConfig(max_new_tokens=NEW, **kw)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_tree_and_lookup_match_hf_generate(arch):
    m = make_tiny(arch)
    L = m.backbone.num_layers
    refs = {p: hf_greedy(m, m.encode(p)) for p in PROMPTS}
    near_ties, runs, taus = [], 0, []
    for i, head in enumerate(HEADS):
        E = (1, L // 2, L - 1)[i % 3]
        vocab = 200 if i % 2 else None  # a reduced draft vocabulary: tree tokens are mapped back to ids
        if head == "lora":
            m = make_tiny(arch)  # a LoRA is injected into the model: a fresh model for it
        m.set_head(head, exit_layer=E, draft_vocab=vocab)
        randomize_head(m.head, seed=E, std=0.05 if head == "lora" else 0.2)
        for j in range(2):
            kw = TREES[(i + j + list(ARCHS).index(arch)) % len(TREES)]
            p = PROMPTS[(i + j) % 2]
            ids = m.encode(p)
            got = m.generate(ids, decode=tree_cfg(**kw))
            assert got.stats["new_tokens"] == len(got.token_ids) <= NEW
            check_equal(m, ids, got.token_ids, refs[p], near_ties)
            assert got.stats["tree"] == kw["tree"] and got.stats["nodes_per_step"] > 1
            taus.append(got.stats["tau"])
            runs += 1
    assert len(near_ties) <= 1, near_ties
    assert max(taus) > 1.0  # drafts were accepted somewhere
    m.set_head(None)  # context lookup alone (no head): a chain of lookup drafts
    for p in PROMPTS:
        got = m.generate(m.encode(p), max_new_tokens=NEW, lookup=True)
        check_equal(m, m.encode(p), got.token_ids, refs[p], near_ties)
        assert got.stats["exit_layer"] is None and got.stats["drafted_head"] == 0


def test_lookup_drafts_carry_a_repetition():
    """Where the target repeats itself (this tiny gemma3 falls into a loop of one token), lookup drafts without a
    head carry most tokens; beside a head's tree, the lookup branch is the one accepted. The output stays the target's."""
    m = make_tiny("gemma3_text")
    ids = m.encode(PROMPTS[0])
    ids += hf_greedy(m, ids, 84)
    ref = hf_greedy(m, ids)
    assert ref == ref[:1] * NEW  # the premise: a loop
    got = m.generate(ids, max_new_tokens=NEW, lookup=True, lookup_len=6)
    assert got.token_ids == ref
    s = got.stats
    assert s["accepted_lookup"] >= NEW // 2 and s["verify_steps"] <= NEW // 3 and s["draft_steps"] == 0
    m.set_head("medusa", exit_layer=2)
    randomize_head(m.head, seed=0)
    both = m.generate(ids, max_new_tokens=NEW, tree="dynamic", tree_nodes=6, lookup=True, lookup_len=6)
    assert both.token_ids == ref and both.stats["accepted_lookup"] >= NEW // 2


# ------------------------------------------------------------------------------------------------ caches
def chain_cache(bb, tokens: torch.Tensor, layers: range, context=None) -> KVCache:
    ks = bb.kv_shape
    cache = KVCache(layers, 1, ks.kv_heads, ks.head_dim, tokens.numel() + 1, bb.dtype, "cpu")
    with torch.inference_mode(), context or contextlib.nullcontext():
        bb.run_layers(bb.embed(tokens[None]), 0, len(layers), cache, 0)
    return cache


def assert_same_slots(a: torch.Tensor, b: torch.Tensor, n: int):
    """K/V (or hidden states) over the first n positions, to float32 noise of the chunking."""
    x, y = a[..., :n, :], b[..., :n, :]
    torch.testing.assert_close(x, y, rtol=0, atol=1e-4 * float(y.abs().max()))


@pytest.mark.parametrize("arch,head", [("llama", "adapter"), ("gemma3_text", "layer"), ("qwen2", "lora")])
def test_tree_rounds_leave_the_caches_of_a_chain_decode(arch, head):
    """After every tree round (dynamic tree + lookup, and a sampled static tree), the target's cache, the layer-E
    states, the head's KV and the LoRA's own cache hold exactly what a chain over the committed tokens writes."""
    m = make_tiny(arch, head=head, exit_layer=3)
    randomize_head(m.head, seed=1, std=0.05 if head == "lora" else 0.2)
    bb, dec = m.backbone, m.decoder
    ids = m.encode(PROMPTS[1])
    for cfg in (tree_cfg(tree="dynamic", tree_nodes=10, lookup=True, lookup_branches=2),
                tree_cfg(tree="static", tree_shape=[3, 2, 1], temperature=1.0, seed=3)):
        st = dec.start(ids, cfg, [257])
        rounds = 0
        while not st.done:
            with torch.inference_mode():  # the public steps, as Decoder.decode runs them
                n0 = st.n
                draft = st.proposer.propose(st)
                draft.commit(st, *draft.accept(st, draft.verify(bb, st)))
                st.proposer.observe(st, n0)
            rounds += 1
            v, d = st.verified, st.drafter
            assert v == st.n - 1
            ref = chain_cache(bb, st.tokens[:v], range(bb.num_layers))
            assert_same_slots(st.cache.k, ref.k, v)
            assert_same_slots(st.cache.v, ref.v, v)
            with torch.inference_mode(), m.head.drafting():
                h_e = bb.run_layers(bb.embed(st.tokens[None, : st.n]), 0, d.exit_layer)  # layer-E states, causal
            if hasattr(d, "hidden"):
                assert d.early == v
                assert_same_slots(d.hidden, h_e, d.early)
            if d.head_state is not None:
                state = m.head.new_state(bb, st.n)
                with torch.inference_mode():
                    m.head.next_token_logits(h_e[:, : d.head_seen], bb, state, pos0=0)
                assert_same_slots(d.head_state.k, state.k, d.head_seen)
            if hasattr(d, "cache"):  # LoRA: its own cache of the adapted layers < E
                own = chain_cache(bb, st.tokens[: d.head_seen], range(d.exit_layer), m.head.drafting())
                assert_same_slots(d.cache.k, own.k, d.head_seen)
        assert rounds < NEW and dec.finish(st).stats.accepted > 0


class RecordingDrafter:
    """Wraps a head's drafter: records each tree frontier's draft logits with the tokens each row sees (the prefix
    before the root, then its path) and the root's position."""

    def __init__(self, inner, log: list):
        self.inner, self.log, self.slots = inner, log, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft_tree_logits(self, state, root, frontier):
        if frontier.slot == 1:
            self.slots = [int(state.tokens[root])]
        self.slots += frontier.tokens.tolist()
        logits = self.inner.draft_tree_logits(state, root, frontier)
        prefix = state.tokens[:root].tolist()
        for r in range(len(frontier.nodes)):
            path = [self.slots[s] for s in frontier.tree_mask[r].nonzero().flatten().tolist()]
            self.log.append((prefix + path, logits[r].clone(), root))
        return logits


@pytest.mark.parametrize("arch,head", [("llama", "adapter"), ("mistral", "layer"), ("gemma3_text", "medusa"), ("llama", "lora")])
def test_tree_drafts_equal_chain_drafts_along_each_path(arch, head):
    """A frontier row's draft logits are the head's over its own path, as a chain would draft them: the head's own
    attention (adapter, layer) takes the tree's mask and rotary positions, LoRA's adapted layers < E too."""
    m = make_tiny(arch, head=head, exit_layer=2)
    randomize_head(m.head, seed=4, std=0.05 if head == "lora" else 0.2)
    bb, log = m.backbone, []
    dec = Decoder(bb, m.head, drafter_factory=lambda b, h, n: RecordingDrafter(make_drafter(b, h, n), log))
    dec.decode(m.encode(PROMPTS[0]), tree_cfg(tree="dynamic", tree_nodes=10, tree_topk=3))
    assert len(log) > 20
    for tokens, logits, _ in log[::3]:
        with torch.inference_mode(), m.head.drafting():
            h = bb.run_layers(bb.embed(torch.tensor([tokens])), 0, 2)
            ref = m.head(h, bb)[0, -1]  # the head over the whole sequence, causal
        torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------------ sampling
def test_tree_sampling_keeps_the_target_distribution():
    """Sampled static trees (3 siblings drawn without replacement, vocab-mapped) and fixed top-3 children with a
    lookup branch: the first three tokens follow the target's exact distribution (TV threshold from the sample size)."""
    from test_sampling import T, TOP_K, exact_marginals, marginal_failures, support_violations

    m = make_tiny("llama")
    m.set_head("medusa", exit_layer=2, draft_vocab=200)
    randomize_head(m.head, seed=3, std=0.03)
    ids = m.encode("Sampling test")
    marginals = exact_marginals(m, ids, 3)
    for kw in (dict(tree="static", tree_shape=[3, 2]), dict(tree="dynamic", tree_topk=3, tree_nodes=6, draft_len=2, lookup=True)):
        outs, drafted, accepted = [], 0, 0
        for seed in range(400):
            r = m.generate(ids, decode=DecodeConfig(temperature=T, top_k=TOP_K, seed=seed, max_new_tokens=3, **kw))
            outs.append(r.token_ids)
            drafted, accepted = drafted + r.stats["drafted"], accepted + r.stats["accepted"]
        assert 0 < accepted < drafted / 3, kw  # siblings were tried, drafts both accepted and rejected
        assert not support_violations(m, ids, outs), kw
        assert not marginal_failures(outs, marginals), kw


def _bonus_from_parent_row(tree, p, generator=None):
    """A planted bug: the bonus token after a fully accepted path drawn from the leaf's parent's row."""
    from selfspec.decoding.tree import sample_accept_tree

    leaves = [i for i, kids in enumerate(tree.children) if not kids and i > 0]
    wrong = p.clone()
    wrong[leaves] = p[tree.parents[leaves]]
    return sample_accept_tree(tree, wrong, generator)


def test_tree_bonus_token_comes_from_the_leaf_row(monkeypatch):
    """q == p (layers >= 2 add nothing; the lens at E=2 drafts the target exactly): every sampled draft is accepted,
    so the third token is the bonus drawn after the leaf. It follows the target's distribution there; a bonus drawn
    from the parent's row fails the same checks."""
    from test_sampling import exact_draft_model, exact_marginals, marginal_failures, support_violations

    import selfspec.decoding.verify as verify

    m = exact_draft_model()
    ids = m.encode("Bonus test")
    marginals = exact_marginals(m, ids, 3)

    def run(n):
        outs = []
        for seed in range(n):
            r = m.generate(ids, decode=DecodeConfig(tree="static", tree_shape=[2, 1], temperature=1.0, top_k=6, seed=seed,
                                                    max_new_tokens=3))
            assert r.stats["accepted"] == 2 and r.stats["verify_steps"] == 1
            outs.append(r.token_ids)
        return outs

    outs = run(400)
    assert not support_violations(m, ids, outs) and not marginal_failures(outs, marginals)
    monkeypatch.setattr(verify, "sample_accept_tree", _bonus_from_parent_row)
    bad = run(150)
    assert support_violations(m, ids, bad) or marginal_failures(bad, marginals), "a bonus from the wrong row went unnoticed"


# ------------------------------------------------------------------------------------------------ stats, config, API
def test_tree_stats(tiny_llama):
    m = tiny_llama
    m.set_head("medusa", exit_layer=2)
    r = m.decoder.decode(m.encode("Stats"), tree_cfg(tree="static", tree_shape=[2, 2, 1], lookup=True, lookup_len=8, lookup_min_ngram=1))
    s, d = r.stats, r.stats.to_dict()
    from selfspec.decoding.stats import TREE_KEYS

    assert list(d)[-len(TREE_KEYS):] == list(TREE_KEYS) and d["tree"] == "static" and d["lookup"] is True
    assert d["draft_len"] == 8  # the deepest draft: the lookup branch (lookup_len 8) beside a 3-deep tree
    assert d["nodes_per_step"] == s.drafted / s.verify_steps >= 2 + 4 + 4
    assert d["accepted_depth"] == s.accepted / s.verify_steps
    assert d["drafted_head"] + d["drafted_lookup"] == s.drafted and d["accepted_head"] + d["accepted_lookup"] == s.accepted
    # per depth: rounds whose tree / accepted path reached it (only a last round without room drafts nothing)
    assert s.drafted_per_position[0] >= s.verify_steps - 1 and sum(s.accepted_per_position) == s.accepted
    assert all(a <= dr for a, dr in zip(s.accepted_per_position, s.drafted_per_position))
    # a draft step per head pass: the root, then the frontiers at depths 1 and 2 (fewer near max_new_tokens)
    assert 3 * (s.verify_steps - 3) <= s.draft_steps <= 3 * s.verify_steps
    assert type(s).from_dict(d) == s
    pooled = type(s).merge([s, d])
    assert pooled.tree == "static" and pooled.drafted_lookup == 2 * s.drafted_lookup
    assert pooled.to_dict()["nodes_per_step"] == pytest.approx(d["nodes_per_step"])


def test_tree_config_errors(tiny_llama):
    for kw, message in [
        (dict(tree="beam"), r"decode.tree='beam': allowed chain, static, dynamic"),
        (dict(tree_nodes=0), r"decode.tree_nodes=0: must be an integer >= 1"),
        (dict(tree_topk=1.5), r"decode.tree_topk=1.5: must be an integer >= 1"),
        (dict(tree_shape=[]), r"decode.tree_shape=\[\]: must be a non-empty list of integers >= 1"),
        (dict(tree_shape=[2, 0]), r"decode.tree_shape=\[2, 0\]"),
        (dict(tree_shape=[8] * 4), r"decode.tree_shape=\[8, 8, 8, 8\]: 4680 draft nodes; at most 1024"),
        (dict(lookup="yes"), r"decode.lookup='yes': must be true or false"),
        (dict(lookup_len=0), r"decode.lookup_len=0: must be an integer >= 1"),
        (dict(lookup_min_ngram=3, lookup_max_ngram=2), r"decode.lookup_max_ngram=2: must be an integer >= lookup_min_ngram \(3\)"),
        (dict(tree="static", draft_threshold=0.3), r"decode.draft_threshold=0.3: not supported with decode.tree=static"),
    ]:
        with pytest.raises(SelfSpecError, match=message):
            DecodeConfig(**kw)
    m = tiny_llama
    m.set_head(None)
    with pytest.raises(SelfSpecError, match="needs a head .* or decode.lookup=true"):
        m.generate("hi", max_new_tokens=4)
    with pytest.raises(SelfSpecError, match="decode.tree=dynamic: drafts a tree with an exit head"):
        m.generate("hi", max_new_tokens=4, tree="dynamic", lookup=True)
    with pytest.raises(SelfSpecError, match="inside decode=DecodeConfig"):
        m.generate("hi", decode=DecodeConfig(), tree="static")


def test_tree_decode_config_from_hydra():
    from hydra import compose, initialize_config_dir

    from selfspec.cli.config import decode_config
    from selfspec.utils.paths import conf_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = decode_config(compose("generate", overrides=["decode.tree=static", "decode.tree_shape=[3,2,2,1]", "decode.lookup=true"]).decode)
        assert cfg.tree == "static" and cfg.tree_shape == [3, 2, 2, 1] and cfg.lookup and cfg.uses_tree
        plain = decode_config(compose("generate").decode)
        assert plain == DecodeConfig() and not plain.uses_tree  # the yaml's defaults are DecodeConfig's
