"""head.draft_precision=int8|int4: the draft pass reads low-precision copies of the model's own layers and LM head;
verification stays in full precision. Greedy == HF generate on the four tiny architectures at E in {1, L/2, L}, K in
{1, 4}, with trees and lookup first; the exact sampling distribution; what the draft shares with the target's cache
(verified K/V are always the target's own); the copies' bytes in stats; one-line errors."""

from __future__ import annotations

import pytest
import torch

from conftest import ARCHS, make_tiny, randomize_head
from decoding.test_exactness import PROMPTS, check_equal, hf_greedy
from selfspec.decoding.config import DecodeConfig
from selfspec.decoding.drafters import LowPrecisionDrafter
from selfspec.decoding.engine import Decoder
from selfspec.errors import SelfSpecError

NEW = 24


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("precision", ["int8", "int4", "int8_a8", "int4_mlp_a8"])
def test_low_precision_drafts_match_hf_generate(arch, precision):
    m = make_tiny(arch)
    L = m.backbone.num_layers
    ids = m.encode(PROMPTS[0])
    ref = hf_greedy(m, ids, NEW)
    near_ties, taus = [], []
    for E in (1, L // 2, L):
        for head_type in ("lens", "medusa"):
            m.set_head(head_type, exit_layer=E, draft_precision=precision)
            if head_type != "lens":
                randomize_head(m.head, seed=E, std=0.2)
            for K in (1, 4):
                settings = [dict(), dict(tree="dynamic", tree_nodes=6), dict(lookup=True, lookup_mode="first"),
                            dict(draft_threshold=0.3)]
                for extra in settings[K % 2 :: 2] if head_type == "medusa" else settings:  # medusa: half, alternating
                    got = m.generate(ids, decode=DecodeConfig(draft_len=K, max_new_tokens=NEW, **extra))
                    assert got.stats["draft_precision"] == precision
                    check_equal(m, ids, got.token_ids, ref, near_ties)
                    taus.append(got.stats["tau"])
    assert len(near_ties) <= 2
    assert max(taus) > 1.5  # the drafts are accepted often: the check above is not only about the target's tokens


@pytest.mark.parametrize("arch", list(ARCHS))
def test_int4_a8_rescores_its_readout_and_stays_lossless(arch):
    """draft_precision=int4_a8: every matrix in int4, the activations in int8 per group, the LM head's shortlist
    rescored from the float32 rows (quant.RESCORE): greedy == HF generate through the C chain, lookup first, a tree
    and layers < L; the LM head copy keeps the model's own float32 rows."""
    m = make_tiny(arch)
    bb, L = m.backbone, m.backbone.num_layers
    ids = m.encode(PROMPTS[0])
    ref = hf_greedy(m, ids, NEW)
    near_ties = []
    for E in (L // 2, L):
        m.set_head("lens", exit_layer=E, draft_precision="int4_a8")
        for K, extra in ((1, {}), (4, {}), (4, dict(lookup=True, lookup_mode="first")), (4, dict(tree="dynamic", tree_nodes=6))):
            got = m.generate(ids, decode=DecodeConfig(draft_len=K, max_new_tokens=NEW, **extra))
            assert got.stats["draft_precision"] == "int4_a8"
            check_equal(m, ids, got.token_ids, ref, near_ties)
    assert len(near_ties) <= 2
    (lm,) = [q for _, q in bb.quantized("int4_a8")._lm.values()]
    assert lm.kind == "int4" and lm.act8 and torch.equal(lm.exact, bb.lm_head.weight.float())


@pytest.mark.parametrize("arch", list(ARCHS))
def test_int4_mlp_keeps_each_part_in_its_format_and_stays_lossless(arch):
    """draft_precision=int4_mlp: the MLP's matrices in int4, attention's and the LM head in int8 (quant.KINDS), on
    the C layers and on layers run by HF's code alike; greedy == HF generate through the whole stack and at L/2,
    chain, lookup first and a tree; the bytes in stats are those copies'."""
    m = make_tiny(arch)
    bb, L = m.backbone, m.backbone.num_layers
    ids = m.encode(PROMPTS[1])
    ref = hf_greedy(m, ids, NEW)
    near_ties = []
    for E in (L // 2, L):
        m.set_head("lens", exit_layer=E, draft_precision="int4_mlp")
        for K, extra in ((1, {}), (4, {}), (4, dict(lookup=True, lookup_mode="first")), (4, dict(tree="dynamic", tree_nodes=6))):
            got = m.generate(ids, decode=DecodeConfig(draft_len=K, max_new_tokens=NEW, **extra))
            assert got.stats["draft_precision"] == "int4_mlp"
            check_equal(m, ids, got.token_ids, ref, near_ties)
    assert len(near_ties) <= 2
    stack = bb.quantized("int4_mlp")
    names = {id(mod): name for i in range(L) for name, mod in bb.layers[i].named_modules()}
    parts = [("mlp" if k in ("wgu", "wd") else "attn", w) for d in stack._lean.values() for k, w in d.items()]
    parts += [("mlp" if ".mlp." in f".{names[key]}." else "attn", w) for d in stack._modules.values() for key, w in d.items()]
    assert parts and {p for p, _ in parts} == {"mlp", "attn"}
    assert all(w.kind == ("int4" if p == "mlp" else "int8") for p, w in parts)
    assert [q.kind for _, q in stack._lm.values()] == ["int8"]
    assert got.stats["draft_bytes"] == sum(w.nbytes for _, w in parts) + sum(q.nbytes for _, q in stack._lm.values())


@pytest.mark.parametrize("head_type", ["adapter", "layer", "lora"])
def test_heads_with_their_own_state_or_layers_draft_in_low_precision(head_type):
    """A head with per-generation state (adapter, layer) or its own early layers (LoRA: the base weights in int8,
    the adapters in full precision) stays lossless."""
    m = make_tiny("llama")
    ids = m.encode(PROMPTS[1])
    ref = hf_greedy(m, ids, NEW)
    m.set_head(head_type, exit_layer=3, draft_precision="int8")
    randomize_head(m.head, seed=1, std=0.05 if head_type == "lora" else 0.2)
    near_ties = []
    for extra in (dict(), dict(tree="dynamic", tree_nodes=6)):
        got = m.generate(ids, decode=DecodeConfig(draft_len=4, max_new_tokens=NEW, **extra))
        check_equal(m, ids, got.token_ids, ref, near_ties)
    assert got.stats["draft_bytes"] > 0


def test_the_quantized_self_draft_agrees_with_the_target():
    """E = L with int8: the whole model with its own final norm and LM head, in int8. Even on a random tiny model
    (wide init, so every rounding matters) it agrees with the float model far more than an early exit does."""
    m = make_tiny("llama")
    L = m.backbone.num_layers
    ids = m.encode(PROMPTS[1])
    cfg = DecodeConfig(draft_len=4, max_new_tokens=NEW)
    m.set_head("lens", exit_layer=L, draft_precision="int8")
    full_depth = m.generate(ids, decode=cfg).stats
    m.set_head("lens", exit_layer=L // 2)
    early = m.generate(ids, decode=cfg).stats
    assert full_depth["accept_rate"] > 0.6 and full_depth["accept_rate"] > early["accept_rate"] + 0.2, (full_depth, early)


def _final_state(m, ids, cfg, monkeypatch):
    captured = {}
    real = Decoder.finish

    def finish(self, state):
        captured["state"] = state
        return real(self, state)

    monkeypatch.setattr(Decoder, "finish", finish)
    out = m.generate(ids, decode=cfg)
    monkeypatch.setattr(Decoder, "finish", real)
    return out, captured["state"]


@pytest.mark.parametrize("tree", ["chain", "dynamic"])
def test_verified_positions_hold_the_targets_own_kv(tree, monkeypatch):
    """What the design shares: the draft attends over the target's cache and writes its own K/V only at and after
    state.verified (scratch rows verification overwrites). After a decode, every verified position holds exactly the
    K/V of a full-precision autoregressive decode of the same tokens, in every layer."""
    m = make_tiny("qwen2")
    ids = m.encode(PROMPTS[0])
    m.set_head("lens", exit_layer=m.backbone.num_layers, draft_precision="int8")
    spec, s_state = _final_state(m, ids, DecodeConfig(draft_len=4, max_new_tokens=NEW, tree=tree), monkeypatch)
    assert isinstance(s_state.drafter, LowPrecisionDrafter) and spec.stats["accepted"] > 0
    ar, a_state = _final_state(m, ids, DecodeConfig(strategy="autoregressive", max_new_tokens=NEW), monkeypatch)
    assert spec.token_ids == ar.token_ids
    v = min(s_state.verified, a_state.verified)
    assert v >= len(ids) + NEW // 2
    # float rounding between tree and chain attention is ~1e-5; int8 K/V would differ by ~1e-2
    torch.testing.assert_close(s_state.cache.k[..., :v, :], a_state.cache.k[..., :v, :], rtol=0, atol=1e-4)
    torch.testing.assert_close(s_state.cache.v[..., :v, :], a_state.cache.v[..., :v, :], rtol=0, atol=1e-4)


def test_a_draft_never_overwrites_a_verified_position(monkeypatch):
    """Every low-precision pass starts at or after state.verified (planting the opposite is caught by the K/V check
    above; here the rule itself is watched)."""
    from selfspec.model.backbone import Backbone

    m = make_tiny("llama")
    m.set_head("lens", exit_layer=4, draft_precision="int8")
    starts = []
    real = Backbone.run_layers
    state_ref = {}

    def watch(self, h, start, end, cache=None, pos0=0, **kw):
        if kw.get("quant") is not None and cache is not None:
            starts.append((pos0, state_ref["state"].verified))
        return real(self, h, start, end, cache, pos0, **kw)

    real_start = Decoder.start

    def start(self, *a, **kw):
        state_ref["state"] = real_start(self, *a, **kw)
        return state_ref["state"]

    monkeypatch.setattr(Backbone, "run_layers", watch)
    monkeypatch.setattr(Decoder, "start", start)
    m.generate(m.encode(PROMPTS[1]), decode=DecodeConfig(draft_len=3, max_new_tokens=NEW))
    assert starts and all(pos0 >= verified for pos0, verified in starts)


def test_low_precision_drafts_keep_the_target_distribution():
    """Sampling: each draft is drawn from the quantized draft's distribution and scored with it (q); the first three
    sampled tokens follow the target's exact distribution, drafts accepted and rejected."""
    from test_sampling import T, TOP_K, exact_marginals, marginal_failures, support_violations

    m = make_tiny("llama")
    m.set_head("lens", exit_layer=m.backbone.num_layers, draft_precision="int4")
    ids = m.encode("Sampling test")
    outs, drafted, accepted = [], 0, 0
    for seed in range(1200):
        r = m.generate(ids, decode=DecodeConfig(temperature=T, top_k=TOP_K, seed=seed, max_new_tokens=3, draft_len=2))
        outs.append(r.token_ids)
        drafted, accepted = drafted + r.stats["drafted"], accepted + r.stats["accepted"]
    assert 0 < accepted < drafted
    assert not support_violations(m, ids, outs) and not marginal_failures(outs, exact_marginals(m, ids, 3))


def test_draft_bytes_in_stats():
    """int8 copies of layers < E and the LM head: a quarter of their float32 bytes plus one scale per row."""
    m = make_tiny("llama")
    bb = m.backbone
    m.set_head("lens", exit_layer=2, draft_precision="int8")
    stats = m.generate(m.encode(PROMPTS[0]), decode=DecodeConfig(draft_len=2, max_new_tokens=4)).stats
    lean = [bb.lean[i].matrices() for i in range(2)]
    weights = [w for d in lean for w in d.values()] + [bb.lm_head.weight]
    want = sum(w.numel() + 4 * w.shape[0] for w in weights)
    assert stats["draft_bytes"] == want
    m.set_head("lens", exit_layer=2)
    assert m.generate(m.encode(PROMPTS[0]), decode=DecodeConfig(draft_len=2, max_new_tokens=4)).stats["draft_bytes"] == 0


def test_precision_errors_are_one_line():
    m = make_tiny("llama")
    with pytest.raises(SelfSpecError, match=r"^head.draft_precision='int3': allowed full, int8, int4, int4_mlp, int8_a8, int4_a8, int4_mlp_a8$"):
        m.set_head("lens", exit_layer=2, draft_precision="int3")
    odd = make_tiny("llama", hidden_size=48, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
    odd.set_head("lens", exit_layer=2, draft_precision="int4")
    with pytest.raises(SelfSpecError) as exc:
        odd.generate(odd.encode(PROMPTS[0]), decode=DecodeConfig(draft_len=2, max_new_tokens=4))
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith("head.draft_precision=int4: a weight of width 48 is not divisible")
    odd.set_head("lens", exit_layer=2, draft_precision="int4_mlp")  # the MLP in int4 names its own setting
    with pytest.raises(SelfSpecError, match=r"^head.draft_precision=int4_mlp: a weight of width (48|96) is not divisible"):
        odd.generate(odd.encode(PROMPTS[0]), decode=DecodeConfig(draft_len=2, max_new_tokens=4))
    odd.set_head("lens", exit_layer=2, draft_precision="int8")  # int8 has no group: fine
    assert odd.generate(odd.encode(PROMPTS[0]), decode=DecodeConfig(draft_len=2, max_new_tokens=4)).token_ids


def test_saved_heads_keep_their_precision_and_a_user_setting_wins(tmp_path):
    from selfspec.heads import load_head, save_head

    m = make_tiny("llama")
    m.set_head("medusa", exit_layer=3, draft_precision="int8")
    save_head(m.head, tmp_path / "h", m.backbone)
    assert load_head(tmp_path / "h", m.backbone).draft_precision == "int8"
    assert load_head(tmp_path / "h", m.backbone).set_draft_precision("int4").draft_precision == "int4"
    assert load_head(tmp_path / "h", m.backbone).set_draft_precision(None).draft_precision == "int8"
    m.set_head(str(tmp_path / "h"), draft_precision="int4")  # the API's key on a saved head
    assert m.head.draft_precision == "int4"
    m.set_head(str(tmp_path / "h"))
    assert m.head.draft_precision == "int8"
    twin = m.head.with_draft_precision("full")  # an eval variant: same weights, another precision
    assert twin.draft_precision == "full" and m.head.draft_precision == "int8"
    assert next(iter(twin.parameters())) is next(iter(m.head.parameters()))


def test_a_model_off_the_cpu_loads_no_c_kernel(monkeypatch):
    """On another device (meta stands in for CUDA here) nothing is compiled, loaded or patched: low-precision drafts
    there are dequantize-then-matmul (QuantWeight.dequantize)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from conftest import tiny_spec
    from selfspec.model import backbone as bbmod

    def refuse():
        raise AssertionError("the C kernels were asked for on a non-CPU model")

    monkeypatch.setattr(bbmod.cpu_kernels_mod, "load_kernel", refuse)
    spec = {k: v for k, v in tiny_spec("llama").items() if k != "model_type"}
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(LlamaConfig(**spec))
    bb = bbmod.Backbone(hf, cpu_kernels=True)
    assert bb.cpu_kernels is False
    assert all("forward" not in mod.__dict__ for mod in hf.modules() if isinstance(mod, torch.nn.Linear))
