"""The tree building blocks put together as an engine would (draft the tree through layers < E with tree masks,
verify it in one pass with a tree mask, accept greedily, compact the cache): greedy output == HF generate on the
four tiny architectures, for static and dynamic trees and with context-lookup branches."""

from __future__ import annotations

import pytest
import torch

from conftest import ARCHS, make_tiny
from selfspec.decoding.lookup import NgramIndex
from selfspec.decoding.tree import add_branches, dynamic_tree, greedy_accept_tree, static_tree
from selfspec.model.cache import KVCache

NEW = 32
EOS = 257  # the tiny models' (conftest)
PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away,"]


def tree_generate(m, ids: list[int], kind: str, exit_layer: int = 2, lookup: bool = False,
                  seen: list[int] = ()) -> tuple[list[int], dict]:
    """A minimal tree decoder over the logit lens at `exit_layer`, with its own draft cache for layers < E.
    lookup: n-gram matches in `seen` + the tokens so far add up to 2 branches of 4 tokens."""
    bb = m.backbone
    L, E, ks = bb.num_layers, exit_layer, bb.kv_shape
    max_len = len(ids) + NEW + 64
    main = KVCache(range(L), 1, ks.kv_heads, ks.head_dim, max_len, bb.dtype, "cpu")
    draft = KVCache(range(E), 1, ks.kv_heads, ks.head_dim, max_len, bb.dtype, "cpu")
    toks = list(ids)
    index = NgramIndex(list(seen) + toks, min_ngram=1, max_ngram=3)
    lens = lambda h: bb.logits(bb.norm(h))  # noqa: E731  the logit lens at layer E
    stats = {"rounds": 0, "nodes": 0, "lookup_accepted": 0}
    with torch.inference_mode():
        bb.run_layers(bb.embed(torch.tensor([toks[:-1]])), 0, L, main, 0)  # prefill all but the root
        v_draft = 0
        while len(toks) - len(ids) < NEW:
            n = len(toks)
            root = n - 1  # slot and position of the root (the last committed token)
            h = bb.run_layers(bb.embed(torch.tensor([toks[v_draft:n]])), 0, E, draft, v_draft)  # catch up, chain
            v_draft = n

            def draft_fn(front):
                h = bb.run_layers(bb.embed(front.tokens[None]), 0, E, draft, root + front.slot, tree_mask=front.tree_mask)
                return lens(h[0])

            if kind == "static":
                tree = static_tree(toks[-1], lens(h[0, -1]), [3, 2, 2, 1], draft_fn)
            else:
                tree = dynamic_tree(toks[-1], lens(h[0, -1]), draft_fn, depth=4, topk=3, nodes=14)
            if lookup:
                tree = add_branches(tree, index.propose_many(4, branches=2))
            h = bb.run_layers(bb.embed(tree.tokens[None]), 0, L, main, root, tree_mask=tree.mask)
            path, nxt = greedy_accept_tree(tree, lens(h[0]))
            main.compact([root + i for i in path], root)  # the accepted path's K/V where a chain puts them
            new = tree.tokens[path[1:]].tolist() + [int(nxt)]
            toks += new
            index.extend(new)
            stats["rounds"] += 1
            stats["nodes"] += len(tree)
            stats["lookup_accepted"] += sum(tree.source[i] == "lookup" for i in path)
            if EOS in new:
                break
    out = toks[len(ids) : len(ids) + NEW]
    return (out[: out.index(EOS) + 1] if EOS in out else out), stats


def hf_greedy(m, ids):
    out = m.hf_model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, pad_token_id=258, eos_token_id=EOS)
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("kind,lookup", [("static", False), ("dynamic", False), ("dynamic", True)])
def test_tree_decode_matches_hf_generate(arch, kind, lookup):
    m = make_tiny(arch)
    for p in PROMPTS:
        ids = m.encode(p)
        got, stats = tree_generate(m, ids, kind, lookup=lookup)
        assert got == hf_greedy(m, ids)
        assert stats["rounds"] < NEW  # some drafts were accepted


def test_lookup_branches_are_accepted_when_the_context_holds_the_answer():
    """With the answer already in the lookup history (as when a model copies from its prompt), the lookup
    branches carry most tokens, and the output is still the target's."""
    m = make_tiny("qwen2")
    ids = m.encode(PROMPTS[1])
    ref = hf_greedy(m, ids)
    got, stats = tree_generate(m, ids, "dynamic", lookup=True, seen=ids + ref + [0])
    assert got == ref
    assert stats["lookup_accepted"] >= NEW // 2 and stats["rounds"] <= NEW // 3
