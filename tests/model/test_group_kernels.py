"""The _a8 precisions' matmul (kernels/group_gemm.c): activations rounded to int8 per group of 32, weights in int8 or
int4 laid out in blocks of 16 rows. Every path this CPU runs (AVX512-VNNI, AVX-VNNI or its EVEX twin, AVX2, plain C)
against quant.group_reference in float64, bit-equal to each other, and the layout against the codes it packs."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from selfspec.model import cpu_kernels
from selfspec.model.quant import ACT_GROUP, PACK_ROWS, group_reference, quantize, round_groups

pytestmark = pytest.mark.skipif(not cpu_kernels.load_kernel(), reason="no C kernels on this machine")

PATHS = cpu_kernels.group_gemm_paths()  # plain C everywhere; AVX2, AVX-VNNI (or its EVEX twin), AVX512-VNNI here
SHAPES = {"int8": [(7, 23), (16, 32), (193, 577), (33, 1536), (5, 4117)],  # odd widths: K padded to the group
          "int4": [(7, 64), (16, 32), (193, 576), (33, 1536), (17, 4864)]}


@pytest.fixture(params=PATHS)
def path(request):
    was = cpu_kernels.group_gemm_path()
    cpu_kernels.group_gemm_path(request.param)
    yield request.param
    cpu_kernels.group_gemm_path(was)


def _weight(kind, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(n, k, generator=g) / k**0.5, kind, kind + "_a8"), g


@pytest.mark.parametrize("kind,n,k", [(kind, n, k) for kind, shapes in SHAPES.items() for n, k in shapes])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 13, 16])
def test_group_kernel_matches_the_float64_reference(kind, n, k, rows, path):
    qw, g = _weight(kind, n, k, seed=n * k + rows)
    x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 3
    x[0, : min(k, ACT_GROUP)] = 0  # an all-zero group (scale 1)
    b = torch.randn(n, generator=g) if rows % 2 else None
    got = cpu_kernels.linear(x, qw, b)
    assert got.shape == (rows, n)
    torch.testing.assert_close(got.double(), group_reference(x, qw, b), rtol=1e-5, atol=2e-5 * k**0.5)


@pytest.mark.parametrize("kind,n,k", [("int8", 193, 577), ("int8", 40, 1536), ("int4", 193, 576), ("int4", 24, 4864)])
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 8, 11, 16])
def test_every_path_gives_the_same_bits(kind, n, k, rows):
    if len(PATHS) < 2:
        pytest.skip("this CPU runs only the plain C path")
    qw, g = _weight(kind, n, k, seed=rows)
    x, b = torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    outs = []
    was = cpu_kernels.group_gemm_path()
    try:
        for p in PATHS:
            cpu_kernels.group_gemm_path(p)
            outs.append(cpu_kernels.linear(x, qw, b))
    finally:
        cpu_kernels.group_gemm_path(was)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("kind,n,k", [("int8", 37, 70), ("int4", 37, 96)])
def test_the_layout_holds_every_code_where_the_kernel_reads_it(kind, n, k):
    qw, _ = _weight(kind, n, k, seed=1)
    codes = qw.codes().to(torch.int64)
    p = qw.packed()
    nb, G = -(-n // PACK_ROWS), -(-k // ACT_GROUP)
    for r, kk in [(0, 0), (n - 1, k - 1), (17, 5), (36, 33), (3, k // 2)]:
        b, rr, g, kin = r // PACK_ROWS, r % PACK_ROWS, kk // ACT_GROUP, kk % ACT_GROUP
        if kind == "int8":
            assert int(p[b, g, kin // 4, rr, kin % 4]) - 128 == codes[r, kk]
        else:
            v, h, j = kin // 8, (kin % 8) // 4, kin % 4
            byte = int(p[b, g, (v * PACK_ROWS + rr) * 4 + j])
            assert (byte >> 4 if h else byte & 15) == codes[r, kk]
            halves = p[b, g, 256:].contiguous().view(torch.float16).float()
            assert halves[rr] == qw.scale[r, g] and halves[PACK_ROWS + rr] == qw.zero[r, g]
    assert p.shape == ((nb, G, 8, PACK_ROWS, 4) if kind == "int8" else (nb, G, 320))
    assert qw.nbytes == p.numel() + (4 * n if kind == "int8" else 0)
    if kind == "int8":  # padding rows and inputs hold the code of weight 0
        assert (p.view(nb * G * 8, PACK_ROWS, 4)[:, n % PACK_ROWS :].view(nb, G, 8, -1, 4)[-1] == 128).all()


def test_int4_a8_scales_and_zeros_are_float16_values():
    w = torch.randn(8, 64) * 0.02
    qa, qw = quantize(w, "int4", "int4_a8"), quantize(w, "int4", "int4")
    for t in (qa.scale, qa.zero):
        assert torch.equal(t, t.half().float())
    assert not torch.equal(qw.scale, qw.scale.half().float())  # the weight-only int4 keeps float32
    err_a8, err = ((qa.dequantize() - w).pow(2).mean() for qa in (qa, qw))
    assert err_a8 < err * 1.05  # rounding the scales costs next to nothing


def test_paths_are_named_and_checked():
    with pytest.raises(ValueError, match="allowed c, avx512vnni, avx2, avxvnni"):
        cpu_kernels.group_gemm_path("sse")
    assert "c" in PATHS and cpu_kernels.group_gemm_path() in PATHS


def test_rounding_is_per_group_and_the_torch_path_is_the_same_math():
    x = torch.tensor([[1.0, -0.5] + [0.0] * 30 + [100.0, 0.3]])
    r = round_groups(x)
    assert r[0, 0] == 1.0 and abs(float(r[0, 1]) + 0.5) < 1 / 127  # the first group's scale is 1/127
    assert r[0, 33] == 0.0  # 0.3 is below half a step of the second group (100/127)
    qw, g = _weight("int4", 9, 64, seed=2)
    xs = torch.randn(3, 64, generator=g)
    with torch.enable_grad():  # inputs that need a gradient go through torch, not the kernel
        slow = cpu_kernels.linear(xs.clone().requires_grad_(), qw)
    torch.testing.assert_close(slow.detach().double(), group_reference(xs, qw), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cpu_kernels.linear(xs, qw), slow.detach(), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(F.linear(xs, qw.dequantize()), slow.detach(), rtol=0, atol=1e-7)  # it did round


@pytest.mark.parametrize("rows", [1, 3, 9])
def test_an_int4_readout_rescores_its_shortlist_in_float32(rows, path):
    """int4_a8's LM head: each row's RESCORE largest int4 logits are recomputed from the float32 rows; the rest
    stay as int4 computed them."""
    from selfspec.model.quant import RESCORE, quantize_readout

    g = torch.Generator().manual_seed(rows)
    n, k = 301, 96
    w, x, b = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    qw = quantize_readout(w, "int4_a8")
    assert qw.exact is not None and quantize_readout(w, "int8_a8").exact is None  # an int8 readout needs none
    plain = cpu_kernels.linear(x, dataclasses.replace(qw, exact=None, _packed=qw.packed()), b)
    got = cpu_kernels.linear(x, qw, b)
    exact = x.double() @ w.double().T + b.double()
    for r in range(rows):
        changed = (got[r] != plain[r]).nonzero().flatten()
        top = sorted(range(n), key=lambda i: (-float(plain[r, i]), i))[:RESCORE]
        assert set(changed.tolist()) <= set(top) and len(changed) >= RESCORE - 2
        torch.testing.assert_close(got[r, top].double(), exact[r, top], rtol=1e-5, atol=1e-4)
    assert (got.argmax(-1) == exact.argmax(-1)).all()  # float32 ranks the candidates
    with torch.enable_grad():  # the torch path rescores the same way
        slow = cpu_kernels.linear(x.clone().requires_grad_(), qw, b).detach()
    assert (slow.argmax(-1) == got.argmax(-1)).all()
    torch.testing.assert_close(slow, got, rtol=1e-4, atol=1e-3)


def test_the_shortlist_gives_the_same_bits_on_every_path():
    if len(PATHS) < 2:
        pytest.skip("this CPU runs only the plain C path")
    from selfspec.model.quant import quantize_readout

    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(1000, 160, generator=g), torch.randn(4, 160, generator=g)
    qw = quantize_readout(w, "int4_a8")
    outs = []
    was = cpu_kernels.group_gemm_path()
    try:
        for p in PATHS:
            cpu_kernels.group_gemm_path(p)
            outs.append(cpu_kernels.linear(x, qw))
    finally:
        cpu_kernels.group_gemm_path(was)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
