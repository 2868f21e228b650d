"""Tree attention in Backbone.run_layers (torch path, HF layers and the C decoder layer) and KV compaction: a node
of a draft tree gets the logits its root-to-node path gets as a plain causal sequence, and compacting an
accepted path leaves the caches as a chain decode of the same tokens writes them."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import make_tiny
from selfspec.decoding.tree import ancestor_mask
from selfspec.errors import SelfSpecError
from selfspec.model import cpu_kernels as ck
from selfspec.model.cache import KVCache, compact_rows

HAS_KERNEL_PREREQS = ck.load_kernel() is not None

ARCHS = ["llama", "qwen2", "mistral", "gemma3_text"]
P = 20  # cached prefix: with depths past 12, qwen2's / mistral's / gemma3's 12-token windows cut in


def random_parents(n: int, seed: int, fan: int = 5) -> list[int]:
    """A random tree in depth order (parents first, each depth contiguous); deep enough to cross the windows."""
    rng = random.Random(seed)
    parents, depth = [-1], [0]
    for i in range(1, n):
        p = rng.randrange(max(0, i - fan), i)
        parents.append(p)
        depth.append(depth[p] + 1)
    order = sorted(range(n), key=lambda i: depth[i])
    new = {v: i for i, v in enumerate(order)}
    return [new[parents[v]] if parents[v] >= 0 else -1 for v in order]


def new_cache(bb, max_len=128):
    ks = bb.kv_shape
    return KVCache(range(bb.num_layers), 1, ks.kv_heads, ks.head_dim, max_len, bb.dtype, "cpu")


def chain_logits(bb, ids: torch.Tensor) -> torch.Tensor:
    """Logits of the last token of ids run as a plain sequence: prefix P as one chunk, the rest as another."""
    cache = new_cache(bb)
    bb.run_layers(bb.embed(ids[None, :P]), 0, bb.num_layers, cache, 0)
    h = bb.run_layers(bb.embed(ids[None, P:]), 0, bb.num_layers, cache, P)
    return bb.logits(bb.norm(h[0, -1]))


def node_paths(parents: list[int]) -> list[list[int]]:
    paths = []
    for i in range(len(parents)):
        path, j = [], i
        while j >= 0:
            path.append(j)
            j = parents[j]
        paths.append(path[::-1])
    return paths


def assert_rows_match(bb, prefix, tokens, parents, logits):
    """Every node's logits against its path as a causal sequence."""
    for i, path in enumerate(node_paths(parents)):
        ref = chain_logits(bb, torch.cat([prefix, tokens[path]]))
        torch.testing.assert_close(logits[i], ref, rtol=1e-5, atol=2e-5 * float(ref.abs().max()))


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request):
    return make_tiny(request.param)


@pytest.mark.parametrize("kernels", [True, False], ids=["c_layer", "torch"])
@pytest.mark.parametrize("n", [9, 40])
def test_tree_rows_equal_their_paths(tiny, kernels, n):
    """One verify pass over a whole tree (9 nodes: the C layer when enabled; 40 nodes: past its row limits, torch)."""
    bb = tiny.backbone
    if kernels and not HAS_KERNEL_PREREQS:
        pytest.skip("no C kernels here")
    saved, bb.cpu_kernels = bb.cpu_kernels, kernels and bb.cpu_kernels
    try:
        g = torch.Generator().manual_seed(n)
        prefix = torch.randint(0, 256, (P,), generator=g)
        parents = random_parents(n, seed=n)
        tokens = torch.randint(0, 256, (n,), generator=g)
        mask = ancestor_mask(torch.tensor(parents))
        depth = mask.sum(-1) - 1
        assert n < 40 or int(depth.max()) >= 12  # a window cuts into the tree itself
        calls = []
        real = ck.decoder_layers

        def spy(stack, *args):
            calls.append((stack.n, args[-1] is not None))  # (layers in the call, tree rows)
            return real(stack, *args)

        with torch.inference_mode():
            cache = new_cache(bb)
            bb.run_layers(bb.embed(prefix[None]), 0, bb.num_layers, cache, 0)
            ck.decoder_layers = spy
            try:
                h = bb.run_layers(bb.embed(tokens[None]), 0, bb.num_layers, cache, P, positions=P + depth, tree_mask=mask)
            finally:
                ck.decoder_layers = real
            logits = bb.logits(bb.norm(h[0]))
            assert_rows_match(bb, prefix, tokens, parents, logits)
        lean = bb.lean is not None
        c_rows = n <= ck.TREE_MAX_ROWS  # above it the backbone picks torch (measured cheaper there)
        assert calls == ([(bb.num_layers, True)] if kernels and lean and c_rows else [])  # the C tree layers ran every layer, in one call
    finally:
        bb.cpu_kernels = saved


@pytest.mark.parametrize("kernels", [True, False], ids=["c_layer", "torch"])
def test_drafting_depth_by_depth_sees_earlier_calls(tiny, kernels):
    """Drafting writes one depth per call; later rows see their ancestors written by earlier calls (S > T), and
    the rotary positions default to root position + depth."""
    bb = tiny.backbone
    if kernels and not HAS_KERNEL_PREREQS:
        pytest.skip("no C kernels here")
    saved, bb.cpu_kernels = bb.cpu_kernels, kernels and bb.cpu_kernels
    try:
        n = 30
        g = torch.Generator().manual_seed(3)
        prefix = torch.randint(0, 256, (P,), generator=g)
        parents = random_parents(n, seed=3, fan=3)
        tokens = torch.randint(0, 256, (n,), generator=g)
        mask = ancestor_mask(torch.tensor(parents))
        depth = (mask.sum(-1) - 1).tolist()
        with torch.inference_mode():
            cache = new_cache(bb)
            bb.run_layers(bb.embed(prefix[None]), 0, bb.num_layers, cache, 0)
            outs = []
            for d in range(max(depth) + 1):
                lo, hi = depth.index(d), depth.index(d) + depth.count(d)
                outs.append(bb.run_layers(bb.embed(tokens[None, lo:hi]), 0, bb.num_layers, cache, P + lo, tree_mask=mask[lo:hi, :hi]))
            logits = bb.logits(bb.norm(torch.cat(outs, 1)[0]))
            assert_rows_match(bb, prefix, tokens, parents, logits)
    finally:
        bb.cpu_kernels = saved


def test_a_causal_tree_is_the_chain():
    """tree_mask = lower triangle with positions pos0.. is the causal chunk (same cache, same outputs)."""
    model = make_tiny("qwen2")
    bb = model.backbone
    ids = torch.randint(0, 256, (1, 36), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        a, b = new_cache(bb), new_cache(bb)
        for c in (a, b):
            bb.run_layers(bb.embed(ids[:, :P]), 0, bb.num_layers, c, 0)
        ha = bb.run_layers(bb.embed(ids[:, P:]), 0, bb.num_layers, a, P)
        hb = bb.run_layers(bb.embed(ids[:, P:]), 0, bb.num_layers, b, P, tree_mask=torch.ones(16, 16, dtype=torch.bool).tril())
    torch.testing.assert_close(ha, hb, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.k[:, :, :, :36], b.k[:, :, :, :36], rtol=1e-5, atol=1e-5)


def test_bad_tree_masks_fail_with_one_line():
    bb = make_tiny("llama").backbone
    h = bb.embed(torch.ones(1, 3, dtype=torch.long))
    with torch.inference_mode():
        with pytest.raises(SelfSpecError, match="tree_mask"):
            bb.run_layers(h, 0, 2, new_cache(bb), 5, tree_mask=torch.ones(2, 3, dtype=torch.bool))
        with pytest.raises(SelfSpecError, match="tree_mask"):
            bb.run_layers(h, 0, 2, new_cache(bb), 0, tree_mask=torch.ones(3, 4, dtype=torch.bool))  # S > pos0 + T
        with pytest.raises(SelfSpecError, match="positions"):
            bb.run_layers(h, 0, 2, new_cache(bb), 5, positions=torch.arange(2))


# ------------------------------------------------------------------ compaction


@pytest.mark.parametrize("kernels", [True, False], ids=["c_layer", "torch"])
def test_compaction_leaves_the_cache_of_a_chain_decode(tiny, kernels):
    """Verify a tree, take a root-to-leaf path as accepted, compact its K/V (and a hidden-state buffer): the
    caches over the accepted length equal those of a chain forward of the same tokens."""
    bb = tiny.backbone
    if kernels and not HAS_KERNEL_PREREQS:
        pytest.skip("no C kernels here")
    saved, bb.cpu_kernels = bb.cpu_kernels, kernels and bb.cpu_kernels
    try:
        n = 24
        g = torch.Generator().manual_seed(5)
        prefix = torch.randint(0, 256, (P,), generator=g)
        parents = random_parents(n, seed=5, fan=2)
        tokens = torch.randint(0, 256, (n,), generator=g)
        mask = ancestor_mask(torch.tensor(parents))
        leaf = int((mask.sum(-1)).argmax())  # the deepest node
        path = node_paths(parents)[leaf]  # root first: the root is the tree's node 0 at slot P
        assert len(path) >= 13
        with torch.inference_mode():
            cache = new_cache(bb)
            bb.run_layers(bb.embed(prefix[None]), 0, bb.num_layers, cache, 0)
            h = bb.run_layers(bb.embed(tokens[None]), 0, bb.num_layers, cache, P, tree_mask=mask)
            hbuf = torch.zeros(1, 128, bb.hidden_size)
            hbuf[:, P : P + n] = h
            cache.compact([P + i for i in path], P)
            compact_rows(hbuf, [P + i for i in path], P)

            ref = new_cache(bb)
            ids = torch.cat([prefix, tokens[path]])
            bb.run_layers(bb.embed(ids[None, :P]), 0, bb.num_layers, ref, 0)
            h_ref = bb.run_layers(bb.embed(ids[None, P:]), 0, bb.num_layers, ref, P)
        end = P + len(path)
        for got, want in ((cache.k, ref.k), (cache.v, ref.v)):
            torch.testing.assert_close(got[:, :, :, :end], want[:, :, :, :end], rtol=1e-5, atol=2e-5 * float(want.abs().max()))
        torch.testing.assert_close(hbuf[:, P:end], h_ref, rtol=1e-5, atol=2e-5 * float(h_ref.abs().max()))
    finally:
        bb.cpu_kernels = saved


def test_compaction_moves_overlapping_slots_and_skips_a_compact_path():
    cache = KVCache(range(2), 1, 1, 2, 10, torch.float32, "cpu")
    cache.k[..., 0] = torch.arange(10.0)
    cache.v[..., 0] = -torch.arange(10.0)
    cache.compact([3, 4, 6, 9], 2)  # overlapping: slot 3 -> 2, 4 -> 3, 6 -> 4, 9 -> 5
    assert cache.k[0, 0, 0, :, 0].tolist() == [0, 1, 3, 4, 6, 9, 6, 7, 8, 9]
    assert cache.v[1, 0, 0, :, 0].tolist() == [-x for x in [0, 1, 3, 4, 6, 9, 6, 7, 8, 9]]
    before = cache.k.clone()
    cache.compact([5, 6, 7], 5)
    cache.compact([], 3)
    assert torch.equal(cache.k, before)
    buf = torch.arange(10.0)[None, :, None].repeat(1, 1, 3)
    compact_rows(buf, torch.tensor([7, 8]), 1)
    assert buf[0, :, 0].tolist() == [0, 7, 8, 3, 4, 5, 6, 7, 8, 9]
    with pytest.raises(RuntimeError, match="overflow"):
        cache.compact([8, 9], 9)
