"""The small-row CPU matmul kernel (selfspec/model/fast_linear.py) and how the backbone gates it."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from selfspec.model import fast_linear as fl
from tests.conftest import make_tiny

HAS_KERNEL_PREREQS = fl._cpu_has_avx2_fma() and bool(shutil.which("cc") or shutil.which("gcc"))
needs_kernel = pytest.mark.skipif(not HAS_KERNEL_PREREQS, reason="the kernel needs an x86-64 CPU with AVX2/FMA and a C compiler")


@needs_kernel
def test_kernel_builds_and_loads_here():
    assert fl.load_kernel() is not None


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 13, 16])
@pytest.mark.parametrize("n,k", [(64, 64), (193, 577), (6, 1536), (1, 9)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_torch(rows, n, k, with_bias):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(1, rows, k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    assert fl.applies(x, w, b)
    got = fl.linear(x, w, b)
    ref = F.linear(x.double(), w.double(), b.double() if b is not None else None)
    assert got.shape == (1, rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4 * k**0.5)


@needs_kernel
def test_kernel_takes_strided_rows():
    """Rows that are views into a wider buffer (a slice of hidden states) are read with their stride."""
    base = torch.randn(5, 2 * 96)
    x = base[:, :96]
    w = torch.randn(40, 96)
    torch.testing.assert_close(fl.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_falls_back_where_the_kernel_does_not_apply():
    w = torch.randn(8, 16, requires_grad=True)
    x = torch.randn(2, 16)
    assert not fl.applies(x, w)  # autograd: training must get gradients
    y = fl.linear(x, w)
    y.sum().backward()
    assert w.grad is not None
    with torch.no_grad():
        assert not fl.applies(torch.randn(fl.MAX_ROWS + 1, 16), w)  # prefill-sized: MKL
        assert not fl.applies(torch.randn(2, 16, dtype=torch.float64), w.double())
        assert not fl.applies(torch.randn(2, 16), w.t().contiguous().t())  # non-contiguous weight
        assert fl.applies(torch.randn(2, 16), w)
        assert torch.equal(fl.linear(torch.ones(17, 16), w), F.linear(torch.ones(17, 16), w))


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setattr(fl, "_kernel", None)
    monkeypatch.setenv("SELFSPEC_FAST_LINEAR", "0")
    assert fl.load_kernel() is None
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    assert torch.equal(fl.linear(x, w), F.linear(x, w))


@needs_kernel
def test_backbone_gates_the_kernel_to_its_own_calls():
    """Inside run_layers the decoder's nn.Linear modules use the kernel; outside (HF generate, HF forward on the
    same modules) they are plain F.linear, bit for bit."""
    model = make_tiny("llama", head="lens", exit_layer=2)
    assert model.backbone.fast_linear
    ids = torch.tensor([[1, 5, 9, 20]])
    proj = model.backbone.layers[0].mlp.down_proj
    x = torch.randn(1, 4, proj.in_features)
    with torch.no_grad():
        assert torch.equal(proj(x), F.linear(x, proj.weight, proj.bias))
        calls = []
        real = fl.linear

        def spy(*args):
            calls.append(args[0].shape)
            return real(*args)

        fl_linear, fl.linear = fl.linear, spy
        try:
            model.hf_model(ids)
            assert calls == []  # HF's own forward never reaches the kernel
            model.backbone.run_layers(model.backbone.embed(ids), 0, 1)
            assert len(calls) == 7  # q, k, v, o, gate, up, down of one llama layer
        finally:
            fl.linear = fl_linear


def test_model_fast_linear_false_keeps_torch_and_the_same_tokens():
    from selfspec.api import SelfSpecModel
    from selfspec.model.loading import ModelConfig
    from tests.conftest import tiny_spec

    on = make_tiny("qwen2", head="lens", exit_layer=3)
    off = SelfSpecModel.from_pretrained(
        ModelConfig(name="tiny-qwen2", random_init=tiny_spec("qwen2"), fast_linear=False), head="lens", exit_layer=3
    )
    assert not off.backbone.fast_linear
    prompt = [3, 14, 15, 92, 65, 35]
    a = on.generate(prompt, max_new_tokens=24, draft_len=3)
    b = off.generate(prompt, max_new_tokens=24, draft_len=3)
    assert a.token_ids == b.token_ids
