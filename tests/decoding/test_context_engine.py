"""head=context in the engine: verification hands the drafter the full-depth states of the positions it verified
(`Drafter.observe_verified`), rolled back with the rejected drafts. Greedy == HF generate on the four tiny
architectures (E = 0 and E = 2, K in {1, 4}, lookup first, checked lookup, int8 drafts, the head's own matrices
in int8, joint-confidence K); the exact sampling distribution; and what the head holds after a decode: the target's own final-layer
states for every verified position, and cache rows equal to a fresh pass over the same sequence with those states.
A round's chain runs in one C call (Backbone.context_chain): greedy, it drafts what the pass-by-pass chain drafts;
sampled (top-p), the output keeps the target's exact distribution."""

from __future__ import annotations

import pytest
import torch

from conftest import ARCHS, make_tiny, near_lens_context_head, randomize_head
from decoding.test_exactness import PROMPTS, check_equal, hf_greedy
from selfspec.decoding.config import DecodeConfig
from selfspec.model import cpu_kernels

NEW = 24


def _context_model(arch: str, E: int, seed: int = 1, std: float = 0.05, **kw):
    m = make_tiny(arch)
    m.set_head("context", exit_layer=E, **kw)
    randomize_head(m.head, seed=seed, std=std)
    return m


def _round(st, bb):
    """One engine round by hand (propose, verify, accept, commit, observe). -> (n before it, the proposal)."""
    with torch.inference_mode():
        n0 = st.n
        draft = st.proposer.propose(st)
        draft.commit(st, *draft.accept(st, draft.verify(bb, st)))
        st.proposer.observe(st, n0)
    return n0, draft


def _sampled_runs(m, **decode) -> tuple[int, int]:
    """400 sampled decodes of 3 tokens, one per seed: no token outside the target's top-k and every position's
    marginal equal to the target's exact distribution. -> (drafted, accepted) over them."""
    from test_sampling import T, TOP_K, exact_marginals, marginal_failures, support_violations

    ids = m.encode("Sampling test")
    marginals = exact_marginals(m, ids, 3)
    outs, drafted, accepted = [], 0, 0
    for seed in range(400):
        r = m.generate(ids, decode=DecodeConfig(temperature=T, top_k=TOP_K, seed=seed, max_new_tokens=3, **decode))
        outs.append(r.token_ids)
        drafted, accepted = drafted + r.stats["drafted"], accepted + r.stats["accepted"]
    assert not support_violations(m, ids, outs) and not marginal_failures(outs, marginals)
    return drafted, accepted


@pytest.mark.parametrize("arch", list(ARCHS))
def test_context_head_matches_hf_generate(arch):
    m0 = make_tiny(arch)
    ids = m0.encode(PROMPTS[0])
    ref = hf_greedy(m0, ids, NEW)
    near_ties = []
    first, checked = dict(lookup=True, lookup_mode="first"), dict(lookup=True, lookup_mode="checked")
    for E, runs in ((0, [(1, {}), (4, first)]), (2, [(4, {}), (1, checked), (4, checked)])):
        m = _context_model(arch, E)
        for K, extra in runs:
            got = m.generate(ids, decode=DecodeConfig(draft_len=K, max_new_tokens=NEW, **extra))
            check_equal(m, ids, got.token_ids, ref, near_ties)
            assert got.stats["drafted"] > 0
    m = _context_model(arch, 2, draft_precision="int8")
    got = m.generate(ids, decode=DecodeConfig(draft_len=4, max_new_tokens=NEW))
    check_equal(m, ids, got.token_ids, ref, near_ties)
    assert got.stats["draft_precision"] == "int8"
    m = _context_model(arch, 2, own_precision="int8")  # the head's own matrices in int8
    got = m.generate(ids, decode=DecodeConfig(draft_len=2, max_new_tokens=NEW))
    check_equal(m, ids, got.token_ids, ref, near_ties)
    assert got.stats["drafted"] > 0
    # joint-confidence K (the shipped context head's setting): rounds of one draft and of several
    got = m.generate(ids, decode=DecodeConfig(draft_len=3, draft_continue=0.05, max_new_tokens=NEW))
    check_equal(m, ids, got.token_ids, ref, near_ties)
    assert got.stats["verify_steps"] <= got.stats["draft_steps"] < 3 * got.stats["verify_steps"]
    assert len(near_ties) <= 1


def _final_states(m, ids: list[int]) -> torch.Tensor:
    """The full stack's output (before the final norm) over `ids` in one pass: (T, H)."""
    from selfspec.model.cache import KVCache

    bb = m.backbone
    ks = bb.kv_shape
    cache = KVCache(range(bb.num_layers), 1, ks.kv_heads, ks.head_dim, len(ids), bb.dtype, bb.device)
    with torch.inference_mode():
        return bb.run_layers(bb.embed(torch.tensor([ids], device=bb.device)), 0, bb.num_layers, cache, pos0=0)[0]


@pytest.mark.parametrize("E", [0, 2])
def test_the_head_holds_the_verified_states(E):
    """After every round: the head's features below real_upto are the target's own final-layer states (no rejected
    draft's, no prediction), real_upto reaches n-1, and the head's cache rows [0, exact_upto) equal a fresh head's
    over the committed tokens fed those states."""
    m = _context_model("llama", E, seed=4)
    bb, dec = m.backbone, m.decoder
    ids = m.encode(PROMPTS[1])
    st = dec.start(ids, DecodeConfig(draft_len=4, max_new_tokens=NEW), [257])
    rounds, rejected = 0, 0
    while not st.done:
        with torch.inference_mode():
            n0 = st.n
            draft = st.proposer.propose(st)
            k = len(draft.tokens)
            draft.commit(st, *draft.accept(st, draft.verify(bb, st)))
            st.proposer.observe(st, n0)
        rounds += 1
        rejected += st.n - n0 - 1 < k
        hs = st.drafter.head_state
        seq = st.tokens[: st.n].tolist()
        ref = _final_states(m, seq)
        assert hs.real_upto == st.verified == st.n - 1
        torch.testing.assert_close(hs.feats[0, : hs.real_upto], ref[: hs.real_upto], atol=1e-3, rtol=1e-3)
    assert rounds > 3 and rejected > 0  # rollbacks happened
    # one more draft re-feeds the rows fed predicted features; then the cache's exact rows equal a fresh pass
    with torch.inference_mode():
        st.done = False
        st.drafter.draft_logits(st, st.n)
        hs = st.drafter.head_state
        fresh = m.head.new_state(bb, st.tokens.numel())
        m.head.observe(fresh, _final_states(m, st.tokens[: st.n - 1].tolist())[None], 0)
        h = st.drafter.hidden[:, : st.n]
        m.head.transform(h, bb, fresh, pos0=0)
    upto = hs.exact_upto
    assert upto >= st.n - 1
    torch.testing.assert_close(hs.cache.k[0][..., :upto, :], fresh.cache.k[0][..., :upto, :], atol=1e-3, rtol=1e-3)


def test_context_head_sampling_keeps_the_target_distribution():
    m = _context_model("llama", 3, seed=3, std=0.01)  # near the lens at E = 3: drafts accepted and rejected
    drafted, accepted = _sampled_runs(m, draft_len=2)
    assert 0 < accepted < drafted
    drafted, accepted = _sampled_runs(m, draft_len=3, draft_continue=0.3)  # how far to draft: the draft's own probs
    assert 0 < accepted < drafted


TREES = [dict(tree="static", tree_shape=[3, 2, 1]), dict(tree="dynamic", tree_nodes=10, tree_topk=3),
         dict(tree="dynamic", tree_nodes=8, tree_topk=2, lookup=True, lookup_branches=2)]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_context_head_trees_match_hf_generate(arch):
    """Static and dynamic draft trees (with lookup branches beside them, and int8 early layers): the target's
    greedy tokens, with more than one node drafted per step."""
    m0 = make_tiny(arch)
    ids = m0.encode(PROMPTS[0])
    ref = hf_greedy(m0, ids, NEW)
    near_ties = []
    for i, kw in enumerate(TREES):
        m = _context_model(arch, 2, draft_precision="int8" if i == 2 else None)
        got = m.generate(ids, decode=DecodeConfig(max_new_tokens=NEW, **kw))
        check_equal(m, ids, got.token_ids, ref, near_ties)
        assert got.stats["tree"] == kw["tree"] and got.stats["nodes_per_step"] > 1
    assert len(near_ties) <= 1


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tree_drafts_equal_chain_drafts_along_each_path(arch):
    """A frontier row's draft logits are what a chain over its path drafts: the positions before the root read the
    target's verified final-layer states, the root its verified predecessor's, every later node its parent's
    prediction; the head's attention takes the tree's mask and rotary positions."""
    from decoding.test_tree_engine import RecordingDrafter
    from selfspec.decoding.drafters import make_drafter
    from selfspec.decoding.engine import Decoder

    m = _context_model(arch, 2, seed=4, std=0.2)
    bb, log = m.backbone, []
    dec = Decoder(bb, m.head, drafter_factory=lambda b, h, n: RecordingDrafter(make_drafter(b, h, n), log))
    dec.decode(m.encode(PROMPTS[0]), DecodeConfig(max_new_tokens=NEW, tree="dynamic", tree_nodes=10, tree_topk=3))
    depths = {len(tokens) - root for tokens, _, root in log}  # the path's length, root included
    assert len(log) > 20 and {2, 3} <= depths
    for tokens, logits, root in log[::3]:
        prefix = tokens[:root]
        with torch.inference_mode():
            state = m.head.new_state(bb, len(tokens))
            m.head.observe(state, _final_states(m, prefix)[None], 0)
            h = bb.run_layers(bb.embed(torch.tensor([tokens])), 0, 2)
            ref = m.head(h, bb, state, pos0=0)[0, -1]
        torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def test_tree_rounds_leave_the_verified_states():
    """After every tree round: the head's features below real_upto are the target's own final-layer states of the
    committed tokens (the accepted path's, moved from their verify slots), and real_upto reaches n-1."""
    m = make_tiny("llama")
    m.set_head("context", exit_layer=5)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # near its initialisation, the logit lens at E = 5: paths accepted and rejected
        for p in m.head.trainable_parameters().values():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)
    bb, dec = m.backbone, m.decoder
    ids = m.encode(PROMPTS[1])
    for cfg in (DecodeConfig(max_new_tokens=NEW, **TREES[2]), DecodeConfig(max_new_tokens=NEW, temperature=0.5, top_k=4, seed=3, **TREES[0])):
        st = dec.start(ids, cfg, [257])
        rounds = accepted = 0
        rejected = False
        while not st.done:
            n0, draft = _round(st, bb)
            rounds, accepted = rounds + 1, accepted + st.n - n0 - 1
            tree = getattr(draft, "tree", None)
            rejected = rejected or tree is not None and st.n - n0 - 1 < int(tree.depth.max())
            hs = st.drafter.head_state
            assert hs.real_upto == st.verified == st.n - 1
            ref = _final_states(m, st.tokens[: st.n].tolist())
            torch.testing.assert_close(hs.feats[0, : hs.real_upto], ref[: hs.real_upto], atol=1e-3, rtol=1e-3)
        assert rounds > 3 and accepted > 0 and rejected


def test_context_head_tree_sampling_keeps_the_target_distribution():
    m = _context_model("llama", 3, seed=3, std=0.01)
    drafted, accepted = _sampled_runs(m, tree="static", tree_shape=[3, 2])
    assert 0 < accepted < drafted / 3


# ------------------------------------------------------------------------------------------------ fused depths
def _fused_model(arch: str, E: int = 2, seed: int = 1, std: float = 0.05, **kw):
    """A context head reading the states after E, L/2 and L layers fused (EAGLE-3), every weight random: the
    shallower states matter to its drafts."""
    return _context_model(arch, E, seed=seed, std=std, context_source="fused", **kw)


def _depth_states(m, ids: list[int]) -> torch.Tensor:
    """The states at the head's context depths over `ids`, side by side, in one pass: (T, k*H)."""
    from selfspec.model.cache import KVCache

    bb = m.backbone
    ks = bb.kv_shape
    cache = KVCache(range(bb.num_layers), 1, ks.kv_heads, ks.head_dim, len(ids), bb.dtype, bb.device)
    with torch.inference_mode():
        f, states = bb.run_capturing(bb.embed(torch.tensor([ids], device=bb.device)), 0, bb.num_layers,
                                     m.head.context_depths[:-1], cache, pos0=0)
    return torch.cat([*states, f], dim=-1)[0]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_fused_context_head_matches_hf_generate(arch):
    """context_source=fused: chains (K=1, 4), lookup first, trees with lookup branches, int8 early layers: the
    target's greedy tokens."""
    m0 = make_tiny(arch)
    ids = m0.encode(PROMPTS[0])
    ref = hf_greedy(m0, ids, NEW)
    near_ties = []
    runs = [(2, None, dict(draft_len=1)), (2, None, dict(draft_len=4)), (0, None, dict(draft_len=4, lookup=True, lookup_mode="first")),
            (2, None, TREES[1]), (2, "int8", TREES[2]), (2, "int8", dict(draft_len=3))]
    for E, precision, kw in runs:
        m = _fused_model(arch, E, draft_precision=precision)
        assert len(m.head.context_depths) == 3
        got = m.generate(ids, decode=DecodeConfig(max_new_tokens=NEW, **kw))
        check_equal(m, ids, got.token_ids, ref, near_ties)
        assert got.stats["drafted"] > 0
    assert len(near_ties) <= 1


@pytest.mark.parametrize("tree", [False, True])
def test_a_fused_head_holds_the_fused_verified_states(tree):
    """After every round (chains, or trees whose accepted path moves from its verify slots): the head's features
    below real_upto are its fusion of the target's own states at its depths for the committed tokens."""
    m = _fused_model("llama", E=2, seed=4, std=0.05)
    bb, dec = m.backbone, m.decoder
    ids = m.encode(PROMPTS[1])
    cfg = DecodeConfig(max_new_tokens=NEW, **(TREES[2] if tree else dict(draft_len=3)))
    st = dec.start(ids, cfg, [257])
    rounds = 0
    while not st.done:
        _round(st, bb)
        hs = st.drafter.head_state
        assert hs.real_upto == st.verified == st.n - 1
        with torch.inference_mode():
            want = m.head.context_feature(_depth_states(m, st.tokens[: st.n].tolist())[None])[0]
        torch.testing.assert_close(hs.feats[0, : hs.real_upto], want[: hs.real_upto], atol=1e-3, rtol=1e-3)
        rounds += 1
    assert rounds > 3


def test_fused_context_head_sampling_keeps_the_target_distribution():
    m = make_tiny("llama")
    m.set_head("context", exit_layer=3, context_source="fused")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # near its initialisation (the lens at E = 3): drafts accepted and rejected
        for p in m.head.trainable_parameters().values():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)
    assert m.head.fuse.weight[:, :128].abs().min() > 0  # the shallower states count
    drafted, accepted = _sampled_runs(m, draft_len=2)
    assert 0 < accepted < drafted
    drafted, accepted = _sampled_runs(m, draft_len=3, draft_continue=0.3)  # how far to draft: the draft's own probs
    assert 0 < accepted < drafted


def _counting_context_calls(monkeypatch) -> list[tuple[int, int]]:
    calls: list[tuple[int, int]] = []
    real = cpu_kernels.context_chain
    monkeypatch.setattr(cpu_kernels, "context_chain", lambda *a, **k: calls.append(real(*a, **k)) or calls[-1])
    return calls


@pytest.mark.skipif(cpu_kernels.load_kernel() is None, reason="needs selfspec's CPU kernels (a C compiler, AVX2)")
@pytest.mark.parametrize("arch", list(ARCHS))
def test_the_chain_in_one_call_drafts_what_the_pass_by_pass_chain_drafts(arch, monkeypatch):
    """Greedy rounds run layers < E, the head and the readout of every draft in one C call (Backbone.context_chain),
    the dynamic-K rules included: the same drafts, acceptance and draft passes as pass by pass, at E = 0..2, one or two
    head layers, its own matrices in int8, int8 drafts, a draft vocabulary. gemma3's per-type rotary: pass by pass."""
    m = make_tiny(arch)
    ids, L = m.encode(PROMPTS[0]), m.backbone.num_layers
    accepted = 0
    for E, kw in ((L - 1, {}), (2, {}), (0, {}), (L - 1, dict(own_precision="int8")), (L - 1, dict(draft_precision="int8")),
                  (1, dict(context_layers=2, draft_vocab=200))):
        near_lens_context_head(m, E, seed=E, **kw)
        for decode in (dict(draft_len=4), dict(draft_len=3, draft_continue=0.05), dict(draft_len=3, draft_threshold=0.02)):
            calls = _counting_context_calls(monkeypatch)
            fused = m.generate(ids, decode=DecodeConfig(max_new_tokens=NEW, **decode))
            monkeypatch.undo()
            stepwise = m.generate(ids, decode=DecodeConfig(max_new_tokens=NEW, fused_chain=False, **decode))
            assert fused.token_ids == stepwise.token_ids, (E, kw, decode)
            for key in ("accepted_per_position", "drafted_per_position", "draft_steps", "verify_steps"):
                assert fused.stats[key] == stepwise.stats[key], (E, kw, decode, key)
            if arch == "gemma3_text":
                assert calls == []
            else:  # every round drafted in one call: its drafts and passes are the round's
                assert 0 < len(calls) <= fused.stats["verify_steps"]
                assert sum(d for d, _ in calls) == fused.stats["drafted"]
                assert sum(p for _, p in calls) == fused.stats["draft_steps"]
            accepted += sum(fused.stats["accepted_per_position"][1:])
    assert accepted > 0  # rounds that accepted two drafts or more (the head's rows fed again with verified features)


@pytest.mark.skipif(cpu_kernels.load_kernel() is None, reason="needs selfspec's CPU kernels (a C compiler, AVX2)")
def test_the_sampled_chain_in_one_call_keeps_the_targets_distribution(monkeypatch):
    """Sampled (temperature 1, top-p 0.5, joint-confidence K), every round drafted in one C call: the first three
    tokens follow the target's exact distribution, drafts are accepted and rejected, and no emitted token lies outside
    the target's nucleus. With a nucleus of one token (top-p near 0) the sampled chain drafts the greedy chain's
    tokens: the same output and the same acceptance per position."""
    from test_sampling import exact_marginals, tv, tv_threshold

    temp, top_p = 1.0, 0.5
    m = make_tiny("llama")
    L = m.backbone.num_layers
    near_lens_context_head(m, L - 1, seed=5)
    ids = m.encode("Sampling test")
    calls = _counting_context_calls(monkeypatch)
    outs, drafted, accepted = [], 0, 0
    for seed in range(1500):
        r = m.generate(ids, decode=DecodeConfig(draft_len=3, draft_continue=0.2, temperature=temp, top_p=top_p,
                                                seed=seed, max_new_tokens=4))
        outs.append(r.token_ids)
        drafted, accepted = drafted + r.stats["drafted"], accepted + r.stats["accepted"]
    assert len(calls) >= 1500 and sum(d for d, _ in calls) == drafted and 0 < accepted < drafted
    for j, p in enumerate(exact_marginals(m, ids, 3, temp, 0, top_p)):
        tokens = torch.tensor([o[j] for o in outs])
        hist = torch.bincount(tokens, minlength=p.numel()).float() / tokens.numel()
        assert float(p[tokens].min()) > 0, f"token {j + 1} outside the target's nucleus"
        assert tv(hist, p) <= tv_threshold(p, tokens.numel()), f"token {j + 1}: TV {tv(hist, p):.4f}"
    calls.clear()
    ids = m.encode(PROMPTS[0])
    one = m.generate(ids, decode=DecodeConfig(draft_len=3, temperature=temp, top_p=1e-9, seed=0, max_new_tokens=NEW))
    assert calls  # sampled, in one call
    greedy = m.generate(ids, decode=DecodeConfig(draft_len=3, max_new_tokens=NEW))
    assert one.token_ids == greedy.token_ids
    assert one.stats["accepted_per_position"] == greedy.stats["accepted_per_position"]
    assert sum(greedy.stats["accepted_per_position"][1:]) > 0


@pytest.mark.skipif(cpu_kernels.load_kernel() is None, reason="needs selfspec's CPU kernels (a C compiler, AVX2)")
def test_the_chain_kernel_refuses_positions_it_cannot_draft_from():
    """cpu_kernels.context_chain checks what the C code would read out of bounds: a head row whose previous feature
    is not verified yet, a first row past the early rows, too few rotary rows or token slots."""
    H, V = 8, 11
    f32 = dict(dtype=torch.float32)
    head = cpu_kernels.ContextChainHead(torch.ones(H), torch.ones(H), 1e-6, torch.zeros(H, 2 * H), [object()],
                                        [torch.zeros(1, 32, 8)], [torch.zeros(1, 32, 8)], torch.zeros(32, H), 3)
    args = dict(stack=None, base=2, embed=torch.zeros(V, H), head=head, norm_weight=torch.ones(H), eps=1e-6,
                lm=torch.zeros(V, H), lm_bias=None, vocab_ids=None, tokens=torch.zeros(32, dtype=torch.int64),
                hidden=torch.zeros(32, H), early=3, seen=2, p0=3, count=2)
    rope = (torch.zeros(4, 8, **f32), torch.zeros(4, 8, **f32))
    for bad in (dict(p0=4, early=4), dict(early=5), dict(count=3), dict(tokens=torch.zeros(5, dtype=torch.int64)),
                dict(tokens=torch.zeros(32, dtype=torch.int32)), dict(hidden=torch.zeros(32, H, dtype=torch.float64))):
        with pytest.raises(ValueError, match=r"^context_chain: "):
            cpu_kernels.context_chain(rope=rope, **{**args, **bad})
