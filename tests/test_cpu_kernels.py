"""selfspec's CPU kernels (selfspec/model/cpu_kernels.py): the small-row matmul, the whole decoder layer,
the backbone's own llama-family layer forward, and how the backbone gates them."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from selfspec.model import cpu_kernels as fl
from tests.conftest import make_tiny

HAS_KERNEL_PREREQS = fl._cpu_has_avx2_fma() and bool(shutil.which("cc") or shutil.which("gcc"))
needs_kernel = pytest.mark.skipif(not HAS_KERNEL_PREREQS, reason="the kernel needs an x86-64 CPU with AVX2/FMA and a C compiler")


@needs_kernel
def test_kernel_builds_and_loads_here():
    assert fl.load_kernel() is not None
    assert fl.gemm_isa() in ("avx2", "avx512")


@pytest.fixture(params=["avx2", "avx512"])
def isa(request):
    """Each instruction set of the matmul blocks in turn (AVX-512 only where the CPU has it); auto afterwards."""
    if not HAS_KERNEL_PREREQS:
        pytest.skip("the kernel needs an x86-64 CPU with AVX2/FMA and a C compiler")
    if fl.gemm_isa(request.param) != request.param:
        fl.gemm_isa("auto")
        pytest.skip(f"this CPU has no {request.param}")
    yield request.param
    fl.gemm_isa("auto")


@needs_kernel
def test_isa_choice():
    best = fl.gemm_isa("auto")
    assert fl.gemm_isa("avx2") == "avx2" and fl.gemm_isa() == "avx2"  # no argument: asks, changes nothing
    assert fl.gemm_isa("avx512") == best  # AVX-512 only where the CPU has it
    fl.gemm_isa("auto")
    with pytest.raises(ValueError, match="gemm_isa: 'sse': allowed auto, avx2, avx512"):
        fl.gemm_isa("sse")


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16])
@pytest.mark.parametrize("n,k", [(64, 64), (193, 577), (6, 1536), (1, 9), (9, 23)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_torch(rows, n, k, with_bias, isa):
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


READ_ORDERS = [(0, 1), (0, 2), (8, 1)]  # (stream_rows, prefetch_level): blocks into L1, blocks into L2, row by row


@pytest.fixture(params=READ_ORDERS, ids=["blocks-L1", "blocks-L2", "row-by-row"])
def read_order(request):
    """Each way the float matmul can read the weights in turn; the session's setting afterwards."""
    before = fl.gemm_stream_rows(), fl.gemm_prefetch_level()
    if before[0] is None:
        pytest.skip("the kernel needs an x86-64 CPU with AVX2/FMA and a C compiler")
    fl.gemm_stream_rows(request.param[0])
    fl.gemm_prefetch_level(request.param[1])
    yield request.param
    fl.gemm_stream_rows(before[0])
    fl.gemm_prefetch_level(before[1])


@needs_kernel
@pytest.mark.parametrize("n,k", [(64, 64), (193, 577), (6, 1536), (1, 9), (9, 23), (1024, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_every_read_order_gives_the_same_bits(n, k, with_bias, isa):
    """The read order (blocks prefetching into L1 or L2, or row by row) changes the order the weights are read in,
    never a sum: every row count up to two groups, bitwise, in both instruction sets."""
    g = torch.Generator().manual_seed(n + k)
    x, w = torch.randn(17, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    before = fl.gemm_stream_rows(), fl.gemm_prefetch_level()
    try:
        for rows in list(range(1, 10)) + [16, 17]:
            outs = []
            for stream, level in READ_ORDERS:
                fl.gemm_stream_rows(stream)
                fl.gemm_prefetch_level(level)
                outs.append(fl.linear(x[:rows], w, b))
            assert all(torch.equal(outs[0], o) for o in outs[1:]), rows
            torch.testing.assert_close(outs[0].double(), F.linear(x[:rows].double(), w.double(), None if b is None else b.double()),
                                       rtol=1e-5, atol=1e-4 * k**0.5)
    finally:
        fl.gemm_stream_rows(before[0])
        fl.gemm_prefetch_level(before[1])


@needs_kernel
def test_read_order_settings():
    before = fl.gemm_stream_rows(), fl.gemm_prefetch_level()
    assert 0 <= before[0] <= 8 and before[1] in (1, 2)
    try:
        assert fl.gemm_stream_rows(3) == 3 and fl.gemm_stream_rows() == 3  # no argument: asks, changes nothing
        assert fl.gemm_prefetch_level(2) == 2 and fl.gemm_prefetch_level() == 2
        for bad in (9, -1, "4", 2.0, True):
            with pytest.raises(ValueError, match=r"gemm_stream_rows: .*: allowed an integer from 0 to 8"):
                fl.gemm_stream_rows(bad)
        for bad in (0, 3, "2", 1.0, True):
            with pytest.raises(ValueError, match=r"gemm_prefetch_level: .*: allowed 1 \(L1\) or 2 \(L2\)"):
                fl.gemm_prefetch_level(bad)
        assert fl.gemm_stream_rows() == 3 and fl.gemm_prefetch_level() == 2
    finally:
        fl.gemm_stream_rows(before[0])
        fl.gemm_prefetch_level(before[1])


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
    monkeypatch.setenv("SELFSPEC_CPU_KERNELS", "0")
    assert fl.load_kernel() is None
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    assert torch.equal(fl.linear(x, w), F.linear(x, w))


@needs_kernel
def test_backbone_gates_the_kernel_to_its_own_calls():
    """Inside run_layers the decoder's matmuls use the kernel; outside (HF generate, HF forward on the same
    modules) they are plain F.linear, bit for bit."""
    model = make_tiny("llama", head="lens", exit_layer=2)
    assert model.backbone.cpu_kernels
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
            assert len(calls) == 4  # one llama layer without a cache: fused qkv, o, fused gate-up, down
        finally:
            fl.linear = fl_linear


def test_model_cpu_kernels_false_keeps_torch_and_the_same_tokens():
    from selfspec.api import SelfSpecModel
    from selfspec.model.loading import ModelConfig
    from tests.conftest import tiny_spec

    on = make_tiny("qwen2", head="lens", exit_layer=3)
    off = SelfSpecModel.from_pretrained(
        ModelConfig(name="tiny-qwen2", random_init=tiny_spec("qwen2"), cpu_kernels=False), head="lens", exit_layer=3
    )
    assert not off.backbone.cpu_kernels
    prompt = [3, 14, 15, 92, 65, 35]
    a = on.generate(prompt, max_new_tokens=24, draft_len=3)
    b = off.generate(prompt, max_new_tokens=24, draft_len=3)
    assert a.token_ids == b.token_ids


# ------------------------------------------------------------------ whole decoder layers


def _decode_chunks(bb, ids, chunks, cache_len=64):
    """Prefill then decode `chunks` (sizes) through every layer with a fresh cache; -> the chunks' outputs."""
    from selfspec.model.cache import KVCache

    ks = bb.kv_shape
    cache = KVCache(range(bb.num_layers), 1, ks.kv_heads, ks.head_dim, cache_len, bb.dtype, "cpu")
    outs, pos = [], 0
    with torch.inference_mode():
        for T in chunks:
            outs.append(bb.run_layers(bb.embed(ids[:, pos : pos + T]), 0, bb.num_layers, cache, pos))
            pos += T
    return outs


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_own_layers_match_hf_layers(arch, isa):
    """The backbone's llama-family layer forward (the C kernel for decode steps, its torch twin elsewhere) gives
    HF's layer outputs within float32 rounding (fused matmuls sum in their own order). Chunks of 1..9 rows after a prefill cross qwen2's and mistral's 12-token sliding window."""
    model = make_tiny(arch, head="lens", exit_layer=2)
    bb = model.backbone
    assert bb.lean is not None and all(layer.usable() for layer in bb.lean)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    chunks = [20, 1, 5, 1, 9, 4]
    kernel_outs = _decode_chunks(bb, ids, chunks)
    bb.cpu_kernels = False
    twin_outs = _decode_chunks(bb, ids, chunks)
    lean, bb.lean = bb.lean, None
    try:
        hf_outs = _decode_chunks(bb, ids, chunks)
    finally:
        bb.lean = lean
    for k, t, h in zip(kernel_outs, twin_outs, hf_outs):
        for got in (k, t):
            torch.testing.assert_close(got, h, rtol=1e-5, atol=1e-5 * float(h.abs().max()))


@needs_kernel
@pytest.mark.parametrize("precision", ["full", "int8"])
def test_a_verify_row_is_bitwise_the_decode_step_at_its_position(precision, isa, read_order):
    """Every row of a multi-row call is computed as a one-row call computes it: each matmul output is one dot
    product in a fixed order whatever the row count (float32 and int8 blocks alike), and a row's attention depends
    only on its own keys. So a verify's logits are exactly the decode steps' (9 rows: two row groups in AVX2)."""
    from selfspec.model.cache import KVCache

    model = make_tiny("llama", head="lens", exit_layer=2)
    bb = model.backbone
    quant = bb.quantized(precision)
    if quant is not None:
        quant.prepare(bb, bb.num_layers, None)
    ks = bb.kv_shape
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(4))
    outs = []
    with torch.inference_mode():
        for chunks in ([23, 9], [23] + [1] * 9):  # 23 keys: blocks of 8 and a remainder of 7, then 8..15 more
            cache = KVCache(range(bb.num_layers), 1, ks.kv_heads, ks.head_dim, 64, bb.dtype, "cpu")
            pos, rows = 0, []
            for T in chunks:
                rows.append(bb.run_layers(bb.embed(ids[:, pos : pos + T]), 0, bb.num_layers, cache, pos, quant=quant))
                pos += T
            outs.append(torch.cat(rows[1:], dim=1))
    assert torch.equal(outs[0], outs[1])


def test_fused_projections_leave_hf_weights_as_they_were():
    """Fusing q/k/v and gate/up re-points HF's modules at rows of one matrix: same numbers, no copies kept."""
    from selfspec.model.backbone import Backbone
    from selfspec.model.loading import ModelConfig, load_model
    from tests.conftest import tiny_spec

    hf, _ = load_model(ModelConfig(name="t", random_init=tiny_spec("qwen2")))
    before = {n: p.clone() for n, p in hf.named_parameters()}
    bb = Backbone(hf)
    after = dict(hf.named_parameters())
    assert before.keys() == after.keys()
    assert all(torch.equal(before[n], after[n]) for n in before)
    attn = hf.model.layers[0].self_attn
    assert attn.k_proj.weight.data_ptr() == bb.lean[0].wqkv.data_ptr() + attn.q_proj.weight.numel() * 4


def test_moved_weights_send_layers_back_to_hf_code():
    """After the model is cast (new storage), the fused copies are stale: the layers must run HF's code."""
    model = make_tiny("llama", head="lens", exit_layer=2)
    bb = model.backbone
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        model.hf_model.to(torch.float64)
        assert not any(layer.usable() for layer in bb.lean)
        out = bb.run_layers(bb.embed(ids), 0, bb.num_layers)
        ref = model.hf_model.model(ids).last_hidden_state
    torch.testing.assert_close(bb.norm(out), ref)


@needs_kernel
def test_a_module_replaced_after_the_stack_was_built_runs_hf_code():
    """Decode steps run every layer in one C call through a LayerStack kept on the cache. A module replaced later
    (as a LoRA injection does) must send the step back to per-layer code, never to the stack's stale C weights."""
    from selfspec.model.cache import KVCache

    model = make_tiny("llama", head="lens", exit_layer=2)
    bb = model.backbone
    ks = bb.kv_shape
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3))
    cache = KVCache(range(bb.num_layers), 1, ks.kv_heads, ks.head_dim, 32, bb.dtype, "cpu")
    calls = []
    real = fl.decoder_layers

    def spy(stack, *args):
        calls.append(stack.n)
        return real(stack, *args)

    with torch.inference_mode(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(fl, "decoder_layers", spy)
        bb.run_layers(bb.embed(ids[:, :10]), 0, bb.num_layers, cache, 0)
        bb.run_layers(bb.embed(ids[:, 10:11]), 0, bb.num_layers, cache, 10)
        assert calls == [bb.num_layers] * 2 and len(cache.kernel_stacks) == 1  # one call per pass, one stack
        attn = model.hf_model.model.layers[1].self_attn
        doubled = torch.nn.Linear(attn.o_proj.in_features, attn.o_proj.out_features, bias=False)
        doubled.weight = torch.nn.Parameter(attn.o_proj.weight.detach() * 2, requires_grad=False)
        attn.o_proj = doubled
        twin = KVCache(range(bb.num_layers), 1, ks.kv_heads, ks.head_dim, 32, bb.dtype, "cpu")
        twin.k.copy_(cache.k), twin.v.copy_(cache.v)
        got = bb.run_layers(bb.embed(ids[:, 11:12]), 0, bb.num_layers, cache, 11)
        assert calls == [bb.num_layers] * 2  # no stack call after the replacement
        lean, bb.lean = bb.lean, None
        try:
            want = bb.run_layers(bb.embed(ids[:, 11:12]), 0, bb.num_layers, twin, 11)  # HF's code, every layer
        finally:
            bb.lean = lean
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@needs_kernel
def test_decoder_layer_kernel_rejects_nothing_silently_on_overflow():
    """Writing past the cache's capacity is an error, as with HF's cache protocol."""
    from selfspec.model.cache import KVCache

    model = make_tiny("llama", head="lens", exit_layer=2)
    bb = model.backbone
    ks = bb.kv_shape
    cache = KVCache(range(bb.num_layers), 1, ks.kv_heads, ks.head_dim, 8, bb.dtype, "cpu")
    with torch.inference_mode(), pytest.raises(RuntimeError, match="KV cache overflow"):
        bb.run_layers(bb.embed(torch.ones(1, 3, dtype=torch.long)), 0, bb.num_layers, cache, pos0=6)


# ------------------------------------------------------------------------------------------------ low precision
_QUANT_SHAPES = [(64, 64), (193, 576), (6, 1536), (1, 96), (9, 23), (37, 33)]


@needs_kernel
# int4 only at widths its group of 32 divides (the others are an error: test_int4_width_must_divide_the_group)
@pytest.mark.parametrize("kind,n,k", [("int8", n, k) for n, k in _QUANT_SHAPES]
                         + [("int4", n, k) for n, k in _QUANT_SHAPES if k % 32 == 0])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 13, 16])
def test_quant_kernel_matches_the_dequantized_weights_in_float64(kind, rows, n, k, isa):
    from selfspec.model.quant import int8_reference, quantize

    g = torch.Generator().manual_seed(rows * 7919 + n * 31 + k)
    x = torch.randn(1, rows, k, generator=g)
    qw = quantize(torch.randn(n, k, generator=g), kind)
    b = torch.randn(n, generator=g)
    assert fl.applies(x, qw, b)
    got = fl.linear(x, qw, b)
    assert got.shape == (1, rows, n) and got.dtype == torch.float32
    exact = F.linear(x.double(), qw.dequantize(torch.float64), b.double())  # the dequantized weights, exact inputs
    if kind == "int8" or isa == "avx512":  # integer multiplies of inputs rounded to 14 bits per row (int4 too under
        # AVX-512, where BW is taken as given): the kernel's own math in float64, and close to the exact product
        torch.testing.assert_close(got.double(), int8_reference(x, qw, b), rtol=1e-5, atol=1e-4 * k**0.5)
        torch.testing.assert_close(got.double(), exact, rtol=1e-3, atol=2e-3 * k**0.5)
    else:
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-4 * k**0.5)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 4, 8, 11])
@pytest.mark.parametrize("n,k", [(7, 23), (9, 48), (13, 4117), (5, 4864), (3, 8200)])
def test_int8_kernel_gives_the_same_bits_under_both_isas(rows, n, k):
    """int8 multiplies in integers under AVX2 and AVX-512 alike (chunks of 4,096 inputs, a 16-wide remainder, the
    K % 16 tail), so both give the same bits: a model drafts the same tokens on either CPU. Widths cover a remainder
    of 16 after the 32-wide steps, more than one chunk (Qwen2.5-0.5B's MLP is 4,864 wide) and a partial last chunk."""
    from selfspec.model.quant import quantize

    if fl.gemm_isa("avx512") != "avx512":
        fl.gemm_isa("auto")
        pytest.skip("this CPU has no AVX-512: there is one int8 path only")
    try:
        g = torch.Generator().manual_seed(rows * 101 + n * 7 + k)
        x = torch.randn(1, rows, k, generator=g) * torch.rand(1, rows, 1, generator=g) * 4
        qw, b = quantize(torch.randn(n, k, generator=g), "int8"), torch.randn(n, generator=g)
        wide = fl.linear(x, qw, b)
        fl.gemm_isa("avx2")
        narrow = fl.linear(x, qw, b)
    finally:
        fl.gemm_isa("auto")
    assert torch.equal(wide, narrow)


def test_quantization_formats():
    """int8: symmetric per row, |error| <= half a step; int4: 4-bit codes in groups of 32 with a scale and a zero,
    every group's error within half its step; both round-trip through dequantize."""
    from selfspec.model.quant import INT4_GROUP, quantize

    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 96, generator=g) * torch.linspace(0.1, 3, 24)[:, None]
    q8 = quantize(w, "int8")
    assert q8.q.dtype == torch.int8 and int(q8.q.abs().max()) <= 127 and q8.nbytes == 24 * 96 + 24 * 4
    assert ((q8.dequantize() - w).abs() <= q8.scale[:, None] / 2 + 1e-6).all()
    q4 = quantize(w, "int4")
    assert q4.q.dtype == torch.uint8 and q4.q.shape == (24, 48) and q4.scale.shape == (24, 96 // INT4_GROUP)
    err = (q4.dequantize() - w).abs().view(24, -1, INT4_GROUP).amax(-1)
    span = w.view(24, -1, INT4_GROUP)
    assert (err <= (span.amax(-1) - span.amin(-1)) / 15 + 1e-5).all()  # within a step of the group's full range
    assert (q4.dequantize() - w).pow(2).mean() < (q8.dequantize() - w).pow(2).mean() * 400
    sub = q8.rows(torch.tensor([3, 0, 7]))
    torch.testing.assert_close(sub.dequantize(), q8.dequantize()[[3, 0, 7]])


def test_int4_width_must_divide_the_group():
    from selfspec.errors import SelfSpecError
    from selfspec.model.quant import quantize

    with pytest.raises(SelfSpecError, match=r"^head.draft_precision=int4: a weight of width 40 is not divisible by the int4 group of 32; use int8$"):
        quantize(torch.randn(8, 40), "int4")


@needs_kernel
@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_low_precision_c_layer_matches_the_torch_layer(precision, isa):
    """The C decoder layer with a layer's low-precision copy == the torch layer forward over the same copy
    (dequantized by torch), on llama / qwen2 / mistral with windows, 1-9 rows after a prefill (int8 within the
    kernel's 14-bit input rounding)."""
    from selfspec.model.cache import KVCache

    for arch in ("llama", "qwen2", "mistral"):
        m = make_tiny(arch)
        bb = m.backbone
        quant = bb.quantized(precision)
        ks = bb.kv_shape
        ids = torch.randint(0, 250, (1, 40), generator=torch.Generator().manual_seed(1))
        caches = [KVCache(range(bb.num_layers), 1, ks.kv_heads, ks.head_dim, 64, bb.dtype, "cpu") for _ in range(2)]
        with torch.no_grad():
            for c in caches:
                bb.run_layers(bb.embed(ids[:, :30]), 0, bb.num_layers, c, pos0=0)
            for rows in (1, 4, 9):
                h = bb.embed(ids[:, 30 : 30 + rows])
                got = bb.run_layers(h, 0, bb.num_layers, caches[0], pos0=30, quant=quant)  # C kernel
                bb.cpu_kernels = False
                try:
                    want = bb.run_layers(h, 0, bb.num_layers, caches[1], pos0=30, quant=quant)  # torch, dequantized
                finally:
                    bb.cpu_kernels = True
                scale = float(want.abs().max())  # the wide-init random model's residual stream reaches ~100
                # int8 (and int4 under AVX-512): the C kernel also rounds its inputs to 14 bits per row
                # (quant.int8_reference), torch does not
                tol = 3e-3 if precision == "int8" or isa == "avx512" else 3e-5
                torch.testing.assert_close(got, want, rtol=0, atol=tol * scale)


@needs_kernel
def test_the_self_test_checks_every_kernel(monkeypatch):
    """A library whose decoder layer or low-precision matmul is wrong fails the self-test, not just the matmul."""
    assert fl.load_kernel() is not None and fl.self_test() is None

    def noop(*args):
        return 0

    for name, what in (("_layer_kernel", "decoder layer (causal)"), ("_tree_layer_kernel", "decoder layer (tree)"),
                       ("_quant_kernel", "int8 matmul"), ("_layers_kernel", "decoder layers (two in one call)")):
        with monkeypatch.context() as mp:
            mp.setattr(fl, name, noop)
            assert what in (fl.self_test() or "")


@needs_kernel
def test_kernel_work_buffers_are_float32_whatever_the_default_dtype(monkeypatch):
    """The C code reads float32: its work buffers must be float32 even after torch.set_default_dtype(float16)
    (a float16 buffer would be half the bytes the kernel writes)."""
    dtypes = []
    real_empty = torch.empty

    def recording(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        dtypes.append(out.dtype)
        return out

    monkeypatch.setattr(fl.torch, "empty", recording)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        failed = fl.self_test()
    finally:
        torch.set_default_dtype(old)
    assert failed is None
    assert dtypes and all(d == torch.float32 for d in dtypes)
