"""head=lowbit: a trained low-bit draft (heads/lowbit.py). Its delta moves weights between the points of the grid the
untrained draft uses, so: training's forward reads exactly what the kernels read; with no delta it is the untrained
draft; greedy == HF generate whatever the delta; it saves, loads and trains; bad settings are one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import make_tiny
from decoding.test_exactness import PROMPTS, check_equal, hf_greedy
from selfspec.decoding.config import DecodeConfig
from selfspec.errors import SelfSpecError
from selfspec.model.quant import fake_quantize, quantize, requantize

NEW = 24


def _perturb(head, seed: int = 0, std: float = 0.05) -> None:
    """Non-zero deltas (and a learned grid's multipliers and shifts, when the head has one)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in [*head.lora_b.values(), *head.grid_scale.values(), *head.grid_zero.values()]:
            p.copy_(torch.randn(p.shape, generator=g) * std)


@pytest.mark.parametrize("kind,precision", [("int8", "int8"), ("int4", "int4"), ("int4", "int4_a8"), ("int8", "int8_a8")])
def test_fake_quantize_is_the_requantized_weight_bit_for_bit(kind, precision):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 96, generator=g) * 0.05
    own = quantize(w, kind, precision)
    assert torch.equal(fake_quantize(w, own), own.dequantize())  # no delta: the untrained copy exactly
    assert torch.equal(requantize(w, own).codes(), own.codes())
    d = torch.randn(40, 96, generator=g) * 0.02
    moved = requantize(w + d, own)
    assert torch.equal(fake_quantize(w + d, own), moved.dequantize())
    assert torch.equal(moved.scale, own.scale) and not torch.equal(moved.codes(), own.codes())  # same grid, new codes
    # the straight-through gradient: identity inside the grid's range, zero where a code is clamped
    x = (w + d).clone().requires_grad_(True)
    fake_quantize(x, own).sum().backward()
    assert set(x.grad.unique().tolist()) <= {0.0, 1.0} and x.grad.mean() > 0.5
    # a learned grid: its scales (and zeros) stored, the same values in training (float16 ones for an _a8 int4 grid)
    scale = (own.scale * torch.exp(torch.randn(own.scale.shape, generator=g) * 0.1)).requires_grad_(True)
    zero = None if own.zero is None else (own.zero + own.scale * 0.3).requires_grad_(True)
    learned = requantize(w + d, own, scale, zero)
    assert torch.equal(fake_quantize(w + d, own, scale, zero), learned.dequantize())
    if precision == "int4_a8":
        assert torch.equal(learned.scale.half().float(), learned.scale) and not torch.equal(learned.scale, scale.detach())
    fake_quantize(w + d, own, scale, zero).pow(2).sum().backward()
    assert scale.grad.abs().sum() > 0 and (zero is None or zero.grad.abs().sum() > 0)


def test_without_a_delta_it_is_the_untrained_draft_and_its_copies_move_with_the_delta():
    m = make_tiny("llama", head="lowbit")
    bb, L = m.backbone, m.backbone.num_layers
    assert m.head.exit_layer == L and m.head.draft_precision == "int4_a8"  # null exit layer: the whole stack
    own, mine = bb.quantized("int4_a8"), m.head.draft_copies(bb)
    assert mine is not own
    for i in range(L):
        a, b = own.lean_layer(bb, i), mine.lean_layer(bb, i)
        assert all(torch.equal(a[k].codes(), b[k].codes()) for k in a)
    _perturb(m.head)
    moved = m.head.draft_copies(bb)
    assert moved is not mine  # made again after the weights changed
    layer = moved.lean_layer(bb, 0)["wgu"]
    want = requantize(bb.lean[0].matrices()["wgu"] + m.head.delta(0, "wgu").detach(), own.lean_layer(bb, 0)["wgu"])
    assert torch.equal(layer.codes(), want.codes()) and not torch.equal(layer.codes(), own.lean_layer(bb, 0)["wgu"].codes())


@pytest.mark.parametrize("precision,learn_grid", [("int4_a8", False), ("int8", False), ("int4_mlp", False),
                                                  ("int4_a8", True), ("int4_mlp", True)])
def test_training_reads_what_the_draft_reads(precision, learn_grid):
    """The states training computes (differentiable, fake-quantized) equal the draft's own low-bit pass."""
    m = make_tiny("llama")
    m.set_head("lowbit", draft_precision=precision, learn_grid=learn_grid)
    assert m.head.draft_precision == precision
    _perturb(m.head, std=0.1)
    bb = m.backbone
    ids = torch.tensor([m.encode(PROMPTS[0])])
    trained = m.head.early_states(bb, ids)
    assert trained.requires_grad
    with torch.no_grad():
        drafted = bb.run_layers(bb.embed(ids), 0, m.head.exit_layer, quant=m.head.draft_copies(bb))
        untrained = bb.run_layers(bb.embed(ids), 0, m.head.exit_layer, quant=bb.quantized(precision))
    assert torch.allclose(trained.detach(), drafted, rtol=1e-4, atol=1e-4)
    assert (untrained - drafted).abs().max() > 100 * (trained.detach() - drafted).abs().max()
    trained.pow(2).mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.head.lora_a.values())
    assert len(m.head.grid_scale) == (4 * m.head.exit_layer if learn_grid else 0)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in [*m.head.grid_scale.values(), *m.head.grid_zero.values()])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("precision", ["int4_a8", "int8", "int4_mlp", "int4_a8+grid"])
def test_trained_low_bit_drafts_are_lossless(arch, precision):
    precision, _, grid = precision.partition("+")
    m = make_tiny(arch)
    L = m.backbone.num_layers
    ids = m.encode(PROMPTS[1])
    ref = hf_greedy(m, ids, NEW)
    near_ties, taus = [], []
    for E in (L // 2, L):
        m.set_head("lowbit", exit_layer=E, draft_precision=precision, learn_grid=bool(grid))
        _perturb(m.head, seed=E, std=0.005)  # codes move, drafts are still accepted often
        bb = m.backbone
        own, mine = bb.quantized(precision).lean_layer(bb, 0), m.head.draft_copies(bb).lean_layer(bb, 0)
        assert any(not torch.equal(own[k].codes(), mine[k].codes()) for k in own)
        for K, extra in ((1, {}), (4, {}), (4, dict(lookup=True, lookup_mode="first")), (4, dict(tree="dynamic", tree_nodes=6))):
            got = m.generate(ids, decode=DecodeConfig(draft_len=K, max_new_tokens=NEW, **extra))
            assert got.stats["draft_precision"] == precision
            check_equal(m, ids, got.token_ids, ref, near_ties)
            taus.append(got.stats["tau"])
    assert len(near_ties) <= 1 and max(taus) > 1.5


@pytest.mark.parametrize("learn_grid", [False, True])
def test_it_saves_and_loads_with_its_precision(tmp_path: Path, learn_grid: bool):
    m = make_tiny("llama")
    m.set_head("lowbit", draft_precision="int8", lora_rank=4, learn_grid=learn_grid)
    _perturb(m.head)
    m.head.save_pretrained(tmp_path / "h")
    back = make_tiny("llama", head=str(tmp_path / "h"))
    assert back.head.config.type == "lowbit" and back.head.draft_precision == "int8" and back.head.config.lora_rank == 4
    bb, bb2 = m.backbone, back.backbone
    a, b = m.head.draft_copies(bb).lean_layer(bb, 1), back.head.draft_copies(bb2).lean_layer(bb2, 1)
    assert all(torch.equal(a[k].codes(), b[k].codes()) and torch.equal(a[k].scale, b[k].scale) for k in a)
    if learn_grid:  # a learned grid is for its own precision
        with pytest.raises(SelfSpecError, match=r"learned its grid for another precision \(int8\)"):
            back.head.with_draft_precision("int4_a8").draft_copies(bb2).lean_layer(bb2, 0)


def test_bad_settings_are_one_line():
    m = make_tiny("llama")
    with pytest.raises(SelfSpecError, match=r"head.draft_precision=full: a lowbit head drafts in low precision"):
        m.set_head("lowbit", draft_precision="full")
    with pytest.raises(SelfSpecError, match=r"head.lowbit_targets=\['q_proj'\]: a non-empty list of distinct names among wqkv"):
        m.set_head("lowbit", lowbit_targets=["q_proj"])
    with pytest.raises(SelfSpecError, match=r"head.type=lowbit: needs llama-family decoder layers"):
        make_tiny("gemma3_text", head="lowbit")


def test_training_names_a_trained_head_that_drafts_worse_than_the_untrained_one(tmp_path: Path, monkeypatch, caplog):
    """The closing validation warns when the trained head's tau is below the untrained lens's at the same exit layer
    and precision (what a lowbit draft trained on its model's own exact grid did: BENCHMARKS.md), and not otherwise."""
    import logging

    from selfspec.training import run as run_mod
    from selfspec.training import validation

    class Log:
        def log(self, *a, **k): ...

        def log_table(self, *a, **k): ...

    m = make_tiny("llama")
    m.set_head("lowbit", exit_layer=2, draft_precision="int8")
    lens = run_mod._untrained_lens(m.head, m.backbone)
    assert lens.draft_precision == "int8" and lens.exit_layer == 2  # the untrained draft of the same precision
    for trained_tau, warned in ((3.0, True), (5.0, False)):
        def fake(bb, heads, *a, **k):
            row = {"val/accept_rate": 0.5, "val/speedup": 1.0, "val/lossless": 1.0, "val/accept_rate_per_position": [0.5]}
            out = {name: {**row, "val/tau": trained_tau if name == "trained" else 4.0} for name in heads}
            return out | {"autoregressive": {**row, "val/tau": 1.0}}

        monkeypatch.setattr(validation, "validate", fake)
        hooks = run_mod.RunHooks(Log(), m, m.head, [m.encode("hi")], DecodeConfig(max_new_tokens=4), tmp_path, 1,
                                 lens, final_step=5)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="selfspec.train"):
            hooks.validate(5)
        assert ("drafts worse than the untrained lens" in caplog.text) == warned
