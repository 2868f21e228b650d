"""decode.fused_chain: a logit lens's draft chain in one kernel call per round (Backbone.draft_chain). Greedy, it drafts
what the pass-by-pass chain drafts (same drafts, same acceptance, same tokens as HF generate), in full precision and
int8 / int4, with a draft vocabulary, at E < L and E = L; sampled (temperature, top-p), the tokens it emits follow
the target's exact distribution; where the kernel cannot run (gemma3's per-type rotary, another head type, top-k,
dynamic K) the engine drafts pass by pass; the kernel itself against decoder_layers + a float64 readout."""

from __future__ import annotations

import pytest
import torch

from conftest import ARCHS, make_tiny, randomize_head
from test_sampling import exact_marginals, tv, tv_threshold
from decoding.test_exactness import PROMPTS, check_equal, hf_greedy
from selfspec.decoding.config import DecodeConfig
from selfspec.decoding.sampling import process_logits
from selfspec.errors import SelfSpecError
from selfspec.evaluation.costs import StepTimer
from selfspec.model import cpu_kernels
from selfspec.model.cache import KVCache

NEW = 24


def _counting(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = cpu_kernels.draft_chain

    def counted(*args, **kwargs):
        calls.append(args[10])  # count
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_kernels, "draft_chain", counted)
    return calls


@pytest.mark.skipif(cpu_kernels.load_kernel() is None, reason="needs selfspec's CPU kernels (a C compiler, AVX2)")
@pytest.mark.parametrize("arch", list(ARCHS))
def test_the_fused_chain_drafts_what_the_pass_by_pass_chain_drafts(arch, monkeypatch):
    m = make_tiny(arch)
    L = m.backbone.num_layers
    ids = m.encode(PROMPTS[0])
    ref = hf_greedy(m, ids, NEW)
    near_ties, fused_tau = [], []
    for E, precision, vocab in ((2, "full", None), (L // 2, "int8", 200), (L, "int8", None), (L, "int4", None)):
        m.set_head("lens", exit_layer=E, draft_precision=precision, draft_vocab=vocab)
        for extra in (dict(), dict(lookup=True, lookup_mode="first")):
            calls = _counting(monkeypatch)
            fused = m.generate(ids, decode=DecodeConfig(draft_len=4, max_new_tokens=NEW, **extra))
            stepwise = m.generate(ids, decode=DecodeConfig(draft_len=4, max_new_tokens=NEW, fused_chain=False, **extra))
            monkeypatch.undo()
            check_equal(m, ids, fused.token_ids, ref, near_ties)
            assert fused.token_ids == stepwise.token_ids
            # the same drafts: the same acceptance at every position, and as many draft passes
            for key in ("accepted_per_position", "drafted_per_position", "draft_steps"):
                assert fused.stats[key] == stepwise.stats[key], (E, precision, key)
            if arch == "gemma3_text":  # rotary angles per layer type: no table the kernel can read; pass by pass
                assert calls == []
            else:
                assert sum(calls) > 0 and sum(calls) <= fused.stats["draft_steps"]
                fused_tau.append(fused.stats["tau"])
    assert len(near_ties) <= 2
    assert arch == "gemma3_text" or max(fused_tau) > 1.5  # drafts that are accepted: the comparison has content


def test_other_heads_top_k_and_dynamic_k_draft_pass_by_pass(monkeypatch):
    """The chain is the lens's alone (a head with weights of its own transforms the state first), not under top-k
    sampling (the kernel cuts top-p only), and not under dynamic K (the stop rule reads each draft's confidence)."""
    m = make_tiny("llama")
    ids = m.encode(PROMPTS[1])
    m.set_head("medusa", exit_layer=3)
    randomize_head(m.head, seed=2)
    calls = _counting(monkeypatch)
    m.generate(ids, decode=DecodeConfig(draft_len=4, max_new_tokens=12))
    m.set_head("lens", exit_layer=3)
    m.generate(ids, decode=DecodeConfig(draft_len=4, max_new_tokens=12, temperature=0.7, top_k=20, seed=1))
    m.generate(ids, decode=DecodeConfig(draft_len=4, max_new_tokens=12, draft_threshold=0.2))
    assert calls == []
    if cpu_kernels.load_kernel() is not None:
        m.generate(ids, decode=DecodeConfig(draft_len=4, max_new_tokens=12))
        assert calls  # and the greedy lens does take it


TEMP, TOP_P = 1.0, 0.5  # a nucleus of ~5 tokens per step on the tiny model: the exact marginals are enumerable


@pytest.mark.skipif(cpu_kernels.load_kernel() is None, reason="needs selfspec's CPU kernels (a C compiler, AVX2)")
def test_the_sampled_chain_keeps_the_targets_distribution(monkeypatch):
    """Sampling with the int8 self-draft (the lens at E=L: q close to p, not equal) drafted by the chain kernel
    (tempered softmax, top-p nucleus, draws from uniforms): the first three tokens follow the target's exact
    distribution, accepts and rejections both ran, and no emitted token lies outside the target's nucleus. With q
    close to p most drafts are accepted, so a draw that does not follow q shows in the output."""
    m = make_tiny("llama")
    m.set_head("lens", exit_layer=m.backbone.num_layers, draft_precision="int8")
    ids = m.encode("Sampling test")
    calls = _counting(monkeypatch)
    outs, drafted, accepted = [], 0, 0
    for seed in range(1500):
        r = m.generate(ids, decode=DecodeConfig(draft_len=3, temperature=TEMP, top_p=TOP_P, seed=seed, max_new_tokens=4))
        outs.append(r.token_ids)
        drafted, accepted = drafted + r.stats["drafted"], accepted + r.stats["accepted"]
    assert len(calls) >= 1500 and 0 < accepted < drafted
    for j, p in enumerate(exact_marginals(m, ids, 3, TEMP, 0, TOP_P)):
        tokens = torch.tensor([o[j] for o in outs])
        hist = torch.bincount(tokens, minlength=p.numel()).float() / tokens.numel()
        assert float(p[tokens].min()) > 0, f"token {j + 1} outside the target's nucleus"
        assert tv(hist, p) <= tv_threshold(p, tokens.numel()), f"token {j + 1}: TV {tv(hist, p):.4f}"


def test_fused_chain_must_be_a_bool():
    with pytest.raises(SelfSpecError, match=r"^decode.fused_chain='yes': must be true or false$"):
        DecodeConfig(fused_chain="yes")


@pytest.mark.skipif(cpu_kernels.load_kernel() is None, reason="needs selfspec's CPU kernels (a C compiler, AVX2)")
def test_the_cost_of_a_fused_draft_is_the_chains_share():
    """c of a lens comes from a timed chain (what the engine runs); heads that draft pass by pass keep one pass."""
    m = make_tiny("llama")
    m.set_head("lens", exit_layer=6, draft_precision="int8")
    timer = StepTimer(m.backbone, context=40, max_draft_len=4, repeats=2, warmup=1)
    assert timer.chain_step(m.head, 6) is not None
    c = timer.draft_cost(m.head, 6)
    assert 0 < c < 3
    g = make_tiny("gemma3_text")
    g.set_head("lens", exit_layer=6)
    assert StepTimer(g.backbone, context=40, max_draft_len=4, repeats=1, warmup=0).chain_step(g.head, 6) is None


def _chain_inputs(seed: int, vocab: int = 320):
    m = make_tiny("qwen2")  # a sliding window on its first layers
    bb = m.backbone
    g = torch.Generator().manual_seed(seed)
    tokens = torch.zeros(64, dtype=torch.int64)
    tokens[:30] = torch.randint(0, vocab, (30,), generator=g)
    return m, bb, tokens


@pytest.mark.skipif(cpu_kernels.load_kernel() is None, reason="needs selfspec's CPU kernels (a C compiler, AVX2)")
@pytest.mark.parametrize("precision,vocab", [("full", None), ("int8", 100), ("int4", None)])
def test_the_chain_kernel_is_run_layers_and_the_readout(precision, vocab):
    """Backbone.draft_chain against run_layers + norm + logits + argmax, one position at a time: the same K/V in the
    cache, the same layer-E states, and each draft the argmax of the float64 readout of those states."""
    m, bb, tokens = _chain_inputs(3)
    E, pos0, count = 4, 20, 6
    quant = bb.quantized(precision)
    ks = bb.kv_shape
    caches = [KVCache(range(bb.num_layers), 1, ks.kv_heads, ks.head_dim, 64, bb.dtype, "cpu") for _ in range(2)]
    ids = torch.arange(0, 320, 320 // vocab)[:vocab] if vocab else None
    lm_rows = bb.lm_rows(ids) if vocab else None
    with torch.inference_mode():
        for cache in caches:  # the same committed prefix in both
            bb.run_layers(bb.embed(tokens[None, :pos0]), 0, E, cache, pos0=0)
        hidden = torch.empty(count, bb.hidden_size)
        assert bb.draft_chain(caches[0], E, tokens, pos0, count, quant, lm_rows, ids, hidden)
        lm = (quant.lm_weight(bb, lm_rows).dequantize() if quant is not None else
              (lm_rows if vocab else bb.lm_head.weight)).double()
        for s in range(count):
            h = bb.run_layers(bb.embed(tokens[None, pos0 + s : pos0 + s + 1]), 0, E, caches[1], pos0=pos0 + s, quant=quant)
            torch.testing.assert_close(hidden[s], h[0, 0], rtol=1e-4, atol=1e-4)
            x = h[0, 0].double()
            logits = bb.final_norm.weight.double() * x * torch.rsqrt(x.pow(2).mean() + bb.final_norm.variance_epsilon) @ lm.T
            top = logits.topk(2)
            want = int(top.indices[0]) if ids is None else int(ids[top.indices[0]])
            assert int(tokens[pos0 + s + 1]) == want or float(top.values[0] - top.values[1]) < 1e-3
        end = pos0 + count
        torch.testing.assert_close(caches[0].k[:E, :, :, :end], caches[1].k[:E, :, :, :end], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(cpu_kernels.load_kernel() is None, reason="needs selfspec's CPU kernels (a C compiler, AVX2)")
def test_the_chain_kernel_refuses_bad_buffers():
    m, bb, tokens = _chain_inputs(4)
    cache = KVCache(range(bb.num_layers), 1, bb.kv_shape.kv_heads, bb.kv_shape.head_dim, 64, bb.dtype, "cpu")
    stack = bb._layer_stack(cache, 0, 2, None)
    D = bb.kv_shape.head_dim
    rope = [(torch.zeros(4, D), torch.zeros(4, D))]
    emb, norm, lm = bb.embed_tokens.weight, bb.final_norm.weight, bb.lm_head.weight
    with torch.inference_mode():
        with pytest.raises(ValueError, match="tokens must be a contiguous int64 CPU vector of at least 25 ids"):
            cpu_kernels.draft_chain(stack, rope, emb, norm, 1e-6, lm, None, None, tokens[:10], 20, 4)
        with pytest.raises(ValueError, match="tokens must be"):
            cpu_kernels.draft_chain(stack, rope, emb, norm, 1e-6, lm, None, None, tokens.int(), 20, 4)
        with pytest.raises(ValueError, match="rotary rows for 6 positions"):
            cpu_kernels.draft_chain(stack, rope, emb, norm, 1e-6, lm, None, None, tokens, 20, 6)
        with pytest.raises(ValueError, match="vocab_ids must be"):
            cpu_kernels.draft_chain(stack, rope, emb, norm, 1e-6, lm, None, torch.arange(5), tokens, 20, 4)
        with pytest.raises(ValueError, match="slots are out of range"):
            cpu_kernels.draft_chain(stack, rope, emb, norm, 1e-6, lm, None, None, torch.zeros(200, dtype=torch.int64), 62, 4)
        with pytest.raises(ValueError, match="contiguous float32"):
            cpu_kernels.draft_chain(stack, rope, emb.double(), norm, 1e-6, lm, None, None, tokens, 20, 4)


@pytest.mark.skipif(cpu_kernels.load_kernel() is None, reason="needs selfspec's CPU kernels (a C compiler, AVX2)")
@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_the_sampled_chain_kernel_writes_the_processed_distribution(top_p):
    """Each sampled draft's q row is process_logits of the same readout (tempered softmax, top-p nucleus), and the
    draft is a token q gives mass to; the same uniforms draw the same drafts."""
    m, bb, tokens = _chain_inputs(5)
    E, pos0, count = 6, 20, 5
    ks = bb.kv_shape
    cache = KVCache(range(bb.num_layers), 1, ks.kv_heads, ks.head_dim, 64, bb.dtype, "cpu")
    uniforms = torch.rand(count, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        bb.run_layers(bb.embed(tokens[None, :pos0]), 0, E, cache, pos0=0)
        hidden, q = torch.empty(count, bb.hidden_size), torch.empty(count, bb.vocab_size)
        assert bb.draft_chain(cache, E, tokens, pos0, count, hidden_out=hidden, sampled=(0.8, top_p, uniforms, q))
        first = tokens[pos0 + 1 : pos0 + 1 + count].clone()
        logits = bb.logits(bb.norm(hidden))
        torch.testing.assert_close(q, process_logits(logits, 0.8, 0, top_p), rtol=1e-4, atol=1e-5)
        assert bool((q.gather(1, first[:, None]) > 0).all())
        assert bb.draft_chain(cache, E, tokens, pos0, count, sampled=(0.8, top_p, uniforms, torch.empty_like(q)))
        assert torch.equal(tokens[pos0 + 1 : pos0 + 1 + count], first)
        with pytest.raises(ValueError, match="sampling needs temperature > 0"):
            bb.draft_chain(cache, E, tokens, pos0, count, sampled=(0.0, top_p, uniforms, q))
