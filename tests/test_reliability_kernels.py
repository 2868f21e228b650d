"""Issue 58, third round: the C kernels under a long prompt and under changed weights.

- A context head's chain in one C call (decode.fused_chain) was handed every prompt row at its first round: its work
  buffer holds an attention score per row and key, O(prompt^2) (1.4 GB for 6,000 tokens of SmolLM2). The prompt's
  rows now go through the head as pass by pass feeds them, and the C call gets a decode step's rows.
- The fused q/k/v and gate/up matrices, the C layer structs (pointers into the weights), the LayerStacks kept on a
  cache and the low-precision draft copies were made once: a weight replaced later (a new Parameter for o_proj, a
  norm) was never read again by the C kernels, and selfspec's output stopped matching HF generate's.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from conftest import make_tiny, near_lens_context_head
from decoding.test_exactness import hf_greedy
from selfspec.decoding.config import DecodeConfig
from selfspec.model import cpu_kernels

needs_kernel = pytest.mark.skipif(cpu_kernels.load_kernel() is None, reason="needs selfspec's CPU kernels (a C compiler, AVX2)")
TEXT = "Once upon a time, in a land far away, there lived a fox who liked to read. "


def _rows_per_chain_call(monkeypatch) -> list[int]:
    """Spy on cpu_kernels.context_chain: the rows each call runs through layers < E or the head in one batch (what
    its work buffer's attention scores grow with, times the keys)."""
    rows: list[int] = []
    real = cpu_kernels.context_chain
    sig = inspect.signature(real)

    def spy(*a, **k):
        args = sig.bind(*a, **k).arguments
        p0 = args["p0"]
        rows.append(max(p0 + 1 - args["early"], p0 + 1 - args["seen"]))
        return real(*a, **k)

    monkeypatch.setattr(cpu_kernels, "context_chain", spy)
    return rows


@needs_kernel
@pytest.mark.parametrize("E, kw", [(2, {}), (0, dict(own_precision="int8")), (2, dict(draft_precision="int8"))])
def test_a_long_prompt_reaches_the_chain_kernel_in_a_few_rows(E, kw, monkeypatch):
    """A 300-token prompt: no C chain call runs more than a decode step's rows (MAX_ROWS), so its scratch is
    O(MAX_ROWS x keys), not O(prompt x keys); the output is HF generate's, and the drafts, acceptance and passes are
    the pass-by-pass chain's."""
    m = make_tiny("llama")
    near_lens_context_head(m, E, **kw)
    ids = m.encode(TEXT * 5)[:300]
    assert len(ids) == 300
    new = 12
    rows = _rows_per_chain_call(monkeypatch)
    fused = m.generate(ids, decode=DecodeConfig(draft_len=3, max_new_tokens=new))
    monkeypatch.undo()
    assert rows and max(rows) <= cpu_kernels.MAX_ROWS, rows
    stepwise = m.generate(ids, decode=DecodeConfig(draft_len=3, max_new_tokens=new, fused_chain=False))
    assert fused.token_ids == stepwise.token_ids == hf_greedy(m, ids, new)
    for key in ("accepted_per_position", "drafted_per_position", "draft_steps", "verify_steps"):
        assert fused.stats[key] == stepwise.stats[key], key
    assert fused.stats["drafted"] > 0


# ------------------------------------------------------------------------------------------------ changed weights
NEW = 16


def _replace(m, where: str, how: str) -> None:
    """Change one weight of layer 1 after the model was loaded (and fused): `how` = a new Parameter, new storage
    under the same Parameter (`.data =`), or an edit in place."""
    module_path, name = where.rsplit(".", 1)
    module = m.hf_model.model.layers[1].get_submodule(module_path)
    old = getattr(module, name)
    g = torch.Generator().manual_seed(7)
    scale = float(old.abs().mean()) or 2.0  # biases start at 0
    new = old.detach() * 1.5 + torch.randn(old.shape, generator=g) * scale
    if how == "parameter":
        setattr(module, name, torch.nn.Parameter(new))
    elif how == "data":
        old.data = new
    else:
        with torch.no_grad():
            old.copy_(new)


def _greedy_matches_hf(m, ids, **decode) -> None:
    from decoding.test_exactness import check_equal

    ref = hf_greedy(m, ids, NEW)
    got = m.generate(ids, decode=DecodeConfig(max_new_tokens=NEW, draft_len=3, **decode))
    check_equal(m, ids, got.token_ids, ref, [])
    assert got.stats["drafted"] > 0


@pytest.mark.parametrize("arch, where, how", [
    ("llama", "self_attn.o_proj.weight", "parameter"),
    ("llama", "self_attn.o_proj.weight", "data"),
    ("llama", "input_layernorm.weight", "parameter"),
    ("llama", "mlp.down_proj.weight", "parameter"),
    ("llama", "self_attn.q_proj.weight", "parameter"),
    ("qwen2", "self_attn.v_proj.bias", "parameter"),
    ("llama", "self_attn.q_proj.weight", "inplace"),
])
def test_a_weight_changed_after_a_decode_is_read_by_the_next(arch, where, how):
    """Decode once (the C structs, stacks and int8 copies exist), change one weight of layer 1, decode again: greedy
    output is HF generate's with the new weight, for a lens (a decode step's layers in one C call), its int8 draft,
    and a context head (its chain in one C call)."""
    from conftest import randomize_head

    m = make_tiny(arch)
    ids = m.encode("The quick brown fox")
    heads = [("lens", dict(exit_layer=2)), ("lens", dict(exit_layer=3, draft_precision="int8")),
             ("context", dict(exit_layer=2))]
    for kind, kw in heads:
        m.set_head(kind, **kw)
        if kind == "context":
            randomize_head(m.head, seed=1, std=0.05)
        _greedy_matches_hf(m, ids)
    _replace(m, where, how)
    for kind, kw in heads:
        m.set_head(kind, **kw)
        if kind == "context":
            randomize_head(m.head, seed=1, std=0.05)
        _greedy_matches_hf(m, ids)


@needs_kernel
def test_a_stack_kept_on_the_cache_follows_a_replaced_weight():
    """A decode step's layers run in one C call through a LayerStack kept on the generation's cache. A weight replaced
    between two steps of the same cache (a new Parameter for o_proj) must be read by the next step: the same result
    as HF's layer code reading the module's weights."""
    from selfspec.model.cache import KVCache

    m = make_tiny("llama", head="lens", exit_layer=2)
    bb = m.backbone
    ks = bb.kv_shape
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3))
    cache = KVCache(range(bb.num_layers), 1, ks.kv_heads, ks.head_dim, 32, bb.dtype, "cpu")
    with torch.inference_mode():
        bb.run_layers(bb.embed(ids[:, :10]), 0, bb.num_layers, cache, 0)
        bb.run_layers(bb.embed(ids[:, 10:11]), 0, bb.num_layers, cache, 10)
        assert len(cache.kernel_stacks) == 1
        _replace(m, "self_attn.o_proj.weight", "parameter")
        twin = KVCache(range(bb.num_layers), 1, ks.kv_heads, ks.head_dim, 32, bb.dtype, "cpu")
        twin.k.copy_(cache.k), twin.v.copy_(cache.v)
        got = bb.run_layers(bb.embed(ids[:, 11:12]), 0, bb.num_layers, cache, 11)
        lean, bb.lean = bb.lean, None
        try:
            want = bb.run_layers(bb.embed(ids[:, 11:12]), 0, bb.num_layers, twin, 11)  # HF's code, every layer
        finally:
            bb.lean = lean
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_int8_draft_copies_follow_weights_edited_in_place():
    """The fused q/k/v rows are the modules' own weights (views), so an edit in place reaches the float32 kernels
    by itself (the output stays HF generate's); the int8 draft copies are copies, made again once the weights they
    were made from changed: a q_proj and the LM head edited in place."""
    from selfspec.model.quant import KINDS, quantize

    m = make_tiny("llama")
    bb = m.backbone
    ids = m.encode("The quick brown fox")
    m.set_head("lens", exit_layer=3, draft_precision="int8")
    _greedy_matches_hf(m, ids)
    _replace(m, "self_attn.q_proj.weight", "inplace")
    with torch.no_grad():
        bb.lm_head.weight.mul_(1.5)
    _greedy_matches_hf(m, ids)
    quant = bb.quantized("int8")
    copies = quant.lean_layer(bb, 1)
    for name, w in bb.lean[1].matrices().items():
        fresh = quantize(w, KINDS["int8"]["mlp" if name in ("wgu", "wd") else "attn"], "int8")
        assert torch.equal(copies[name].q, fresh.q), name
    assert torch.equal(quant.lm_weight(bb, None).q, quantize(bb.lm_head.weight, KINDS["int8"]["lm"], "int8").q)


def test_decoding_keeps_the_fused_layers():
    """The checks find nothing to redo while the weights stay as they are: two decodes fuse nothing again."""
    m = make_tiny("llama")
    m.set_head("lens", exit_layer=2, draft_precision="int8")
    ids = m.encode("The quick brown fox")
    _greedy_matches_hf(m, ids)
    before = [layer.generation for layer in m.backbone.lean]
    _greedy_matches_hf(m, ids)
    assert [layer.generation for layer in m.backbone.lean] == before
