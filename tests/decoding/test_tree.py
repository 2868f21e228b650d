"""Draft trees (selfspec/decoding/tree.py): building, masks, greedy acceptance, and recursive rejection sampling
that keeps the target's distribution exactly (checked against the exact joint of the first tokens)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from selfspec.decoding.tree import (
    Tree,
    add_branches,
    ancestor_mask,
    chain_tree,
    dynamic_tree,
    greedy_accept_tree,
    sample_accept_tree,
    static_tree,
)
from selfspec.errors import SelfSpecError


class Table:
    """A fake model: a fixed random next-token distribution for every context (tuple of tokens)."""

    def __init__(self, vocab: int, seed: int, scale: float = 1.5, base: "Table | None" = None, noise: float = 0.0):
        self.vocab, self.seed, self.scale, self.base, self.noise = vocab, seed, scale, base, noise
        self._logits: dict[tuple[int, ...], torch.Tensor] = {}
        self._probs: dict[tuple[int, ...], torch.Tensor] = {}

    def logits(self, ctx: tuple[int, ...]) -> torch.Tensor:
        if ctx not in self._logits:
            g = torch.Generator().manual_seed(hash((self.seed,) + ctx) % (2**62))
            z = torch.randn(self.vocab, generator=g, dtype=torch.float64).float()
            # a draft: the target's logits plus noise, so that it agrees often but not always
            self._logits[ctx] = self.base.logits(ctx) + self.noise * z if self.base is not None else self.scale * z
        return self._logits[ctx]

    def probs(self, ctx) -> torch.Tensor:
        ctx = tuple(ctx)
        if ctx not in self._probs:
            self._probs[ctx] = self.logits(ctx).softmax(-1)
        return self._probs[ctx]


def drafter(draft: Table, root_ctx: tuple[int, ...]):
    """A draft_fn over a fake draft model that reads each row's context from the frontier's mask, as a cache would."""
    slots = [root_ctx[-1]]

    def fn(front):
        assert front.slot == len(slots) and front.tree_mask.shape == (len(front.nodes), front.slot + len(front.nodes))
        slots.extend(front.tokens.tolist())
        rows = []
        for r in range(len(front.nodes)):
            seen = [slots[s] for s in front.tree_mask[r].nonzero().flatten().tolist()]
            assert len(seen) == int(front.depth[r]) + 1  # the row sees its root-to-node path
            rows.append(draft.logits(root_ctx[:-1] + tuple(seen)))
        return torch.stack(rows)

    return fn


def node_ctx(tree: Tree, root_ctx: tuple[int, ...], i: int) -> tuple[int, ...]:
    return root_ctx + tuple(tree.tokens[tree.path(i)[1:]].tolist())


def random_tree(n: int, seed: int, vocab: int = 5) -> Tree:
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(max(0, i - 4), i, (1,), generator=g)) for i in range(1, n)]
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    order = sorted(range(n), key=lambda i: depth[i])
    new = {v: i for i, v in enumerate(order)}
    return Tree(
        tokens=torch.randint(0, vocab, (n,), generator=g)[order],
        parents=torch.tensor([new[parents[v]] if parents[v] >= 0 else -1 for v in order]),
        depth=torch.tensor([depth[v] for v in order]),
        source=["root"] + ["head"] * (n - 1),
        logprob=torch.zeros(n),
        sampled=torch.zeros(n, dtype=torch.bool),
    )


# ------------------------------------------------------------------ structure


def test_ancestor_mask_is_the_path_to_the_root():
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 4])
    m = ancestor_mask(parents)
    assert m[6].nonzero().flatten().tolist() == [0, 1, 4, 6]
    assert m[5].nonzero().flatten().tolist() == [0, 2, 5]
    assert m[0].nonzero().flatten().tolist() == [0]
    assert m.sum().item() == 1 + 2 + 2 + 3 + 3 + 3 + 4


@pytest.mark.parametrize("temperature,draw", [(0.0, "topk"), (1.0, "sample"), (0.7, "topk")])
def test_static_tree_has_the_shape_and_the_draft_s_children(temperature, draw):
    target = Table(12, seed=1)
    draft = Table(12, seed=2, base=target, noise=1.0)
    ctx = (3, 7)
    calls = []
    fn = drafter(draft, ctx)
    t = static_tree(7, draft.logits(ctx), [3, 2, 2, 1], lambda f: calls.append(len(f.nodes)) or fn(f),
                    temperature=temperature, draw=draw, generator=torch.Generator().manual_seed(0))
    assert len(t) == 1 + 3 + 6 + 12 + 12 and calls == [3, 6, 12]
    assert t.depth.tolist() == sorted(t.depth.tolist())
    assert all(t.parents[i] < i for i in range(1, len(t)))
    assert t.source == ["root"] + ["head"] * (len(t) - 1)
    assert (t.slot[t.depth < 4] >= 0).all() and (t.slot[t.depth == 4] == -1).all()
    drafted = (t.slot >= 0).nonzero().flatten()
    assert torch.equal(t.slot[drafted], drafted)  # a static tree's node i was drafted at slot i (reusable for verify)
    for u, kids in enumerate(t.children):
        if not kids:
            continue
        q = draft.probs(node_ctx(t, ctx, u)) if temperature == 0 else draft.logits(node_ctx(t, ctx, u)).div(temperature).softmax(-1)
        toks = t.tokens[kids]
        assert len(set(toks.tolist())) == len(kids)  # siblings distinct (top-k, or without replacement)
        torch.testing.assert_close(t.logprob[kids], t.logprob[u] + q[toks].log())
        if draw == "topk":
            assert toks.tolist() == q.topk(len(kids)).indices.tolist()
            assert not t.sampled[kids].any() and t.q is None
        else:
            assert t.sampled[kids].all()
            torch.testing.assert_close(t.q[u], q)


def test_dynamic_tree_follows_eagle2_rule():
    """Brute force of EAGLE-2's rule: expand the best topk per depth, keep the best N candidates overall."""
    V, topk, depth, nodes = 10, 3, 4, 12
    target = Table(V, seed=3)
    draft = Table(V, seed=4, base=target, noise=1.0)
    ctx = (5,)
    calls = []
    fn = drafter(draft, ctx)
    t = dynamic_tree(5, draft.logits(ctx), lambda f: calls.append(len(f.nodes)) or fn(f), depth=depth, topk=topk, nodes=nodes)

    # brute force over paths (tuples of draft tokens after the root) with their cumulative log-prob
    cands, frontier = {}, [()]
    for d in range(depth):
        new = {}
        for path in frontier:
            lq = draft.probs(ctx + path).log()
            for tok in lq.topk(topk).indices.tolist():
                new[path + (tok,)] = (cands.get(path, 0.0) if path else 0.0) + float(lq[tok])
        cands.update(new)
        frontier = sorted(new, key=lambda p: -new[p])[:topk]
    best = sorted(cands, key=lambda p: -cands[p])[: nodes - 1]

    got = {tuple(t.tokens[t.path(i)[1:]].tolist()) for i in range(1, len(t))}
    assert got == set(best) and len(t) == nodes
    assert calls == [topk] * (depth - 1)
    assert t.depth.tolist() == sorted(t.depth.tolist()) and not t.sampled.any()
    for i in range(1, len(t)):
        assert t.logprob[i] <= t.logprob[t.parents[i]] + 1e-6


def test_add_branches_merges_lookup_chains_as_fixed_children():
    root = chain_tree(9, [])
    t = add_branches(root, [[1, 2, 3]], source="head")
    t = add_branches(t, [[1, 2, 4], [5], [1, 6, 7]])
    paths = {tuple(t.tokens[t.path(i)].tolist()): t.source[i] for i in range(len(t))}
    assert paths == {(9,): "root", (9, 1): "head", (9, 1, 2): "head", (9, 1, 2, 3): "head", (9, 5): "lookup",
                     (9, 1, 2, 4): "lookup", (9, 1, 6): "lookup", (9, 1, 6, 7): "lookup"}
    assert t.depth.tolist() == sorted(t.depth.tolist())
    two = [i for i in range(len(t)) if tuple(t.tokens[t.path(i)].tolist()) == (9, 1, 2)][0]
    assert t.tokens[t.children[two]].tolist() == [3, 4]  # the existing sibling first, the lookup after
    assert not t.sampled.any()


def test_bad_tree_arguments_fail_with_one_line():
    logits = torch.zeros(8)
    with pytest.raises(SelfSpecError, match="tree_shape"):
        static_tree(0, logits, [2, 0], lambda f: None)
    with pytest.raises(SelfSpecError, match="tree_nodes"):
        dynamic_tree(0, logits, lambda f: None, depth=2, topk=2, nodes=1)
    with pytest.raises(SelfSpecError, match="draw"):
        static_tree(0, logits, [2], lambda f: None, draw="greedy")


# ------------------------------------------------------------------ greedy acceptance


@pytest.mark.parametrize("seed", range(6))
def test_greedy_accept_takes_the_deepest_matching_path(seed):
    V = 3  # a small vocabulary: many nodes match
    t = random_tree(30, seed, vocab=V)
    logits = torch.randn(len(t), V, generator=torch.Generator().manual_seed(100 + seed))
    arg = logits.argmax(-1)
    path, nxt = greedy_accept_tree(t, logits)

    def valid(i):
        return all(int(t.tokens[v]) == int(arg[t.parents[v]]) for v in t.path(i)[1:])

    deepest = max(int(t.depth[i]) for i in range(len(t)) if valid(i))
    first = min(i for i in range(len(t)) if valid(i) and int(t.depth[i]) == deepest)
    assert path == t.path(first) and int(nxt) == int(arg[first])


def test_greedy_accept_on_a_chain_matches_the_chain_rule():
    from selfspec.decoding.sampling import greedy_accept

    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        drafts = torch.randint(0, 3, (4,), generator=g)
        logits = torch.randn(5, 3, generator=g)
        a, nxt = greedy_accept(drafts, logits)
        path, nxt_t = greedy_accept_tree(chain_tree(1, drafts.tolist(), "head"), logits)
        assert len(path) - 1 == a and int(nxt) == int(nxt_t)


# ------------------------------------------------------------------ sampling: exact distribution


def emitted_distribution(build, accept, target: Table, ctx, m: int, n: int, seed: int = 0):
    """Empirical distribution of the first m tokens a decoder emits from `ctx` when each round builds a tree with
    build(ctx, gen) and accepts with accept(tree, P, gen) (P: the target's rows at every node); tokens past a
    round come from the target itself (the next rounds). Also returns how often every draft on a root-to-leaf
    path was accepted (the bonus token)."""
    gen = torch.Generator().manual_seed(seed)
    counts: dict[tuple[int, ...], int] = {}
    bonus = 0
    for _ in range(n):
        t = build(ctx, gen)
        toks, par, ctxs = t.tokens.tolist(), t.parents.tolist(), [ctx]
        for i in range(1, len(t)):
            ctxs.append(ctxs[par[i]] + (toks[i],))
        P = torch.stack([target.probs(c) for c in ctxs])
        path, nxt = accept(t, P, gen)
        bonus += not t.children[path[-1]]
        out = t.tokens[path[1:]].tolist() + [int(nxt)]
        while len(out) < m:
            out.append(int(torch.multinomial(target.probs(ctx + tuple(out)), 1, generator=gen)))
        key = tuple(out[:m])
        counts[key] = counts.get(key, 0) + 1
    return counts, bonus / n


def exact_distribution(target: Table, ctx, m: int) -> dict[tuple[int, ...], float]:
    out = {}
    for seq in itertools.product(range(target.vocab), repeat=m):
        pr = 1.0
        for i in range(m):
            pr *= float(target.probs(ctx + seq[:i])[seq[i]])
        out[seq] = pr
    return out


def total_variation(counts, exact, n) -> float:
    return 0.5 * sum(abs(counts.get(k, 0) / n - p) for k, p in exact.items())


def tv_threshold(cells: int, n: int) -> float:
    """E[TV] <= 0.5 sqrt(cells / n) (Cauchy-Schwarz over the cells); TV moves by at most 1/n per sample, so
    (McDiarmid) TV exceeds twice that bound with probability <= exp(-cells / 2)."""
    return math.sqrt(cells / n)


def check_exact(build, accept, target, ctx, m, n, seed=0):
    counts, bonus = emitted_distribution(build, accept, target, ctx, m, n, seed)
    exact = exact_distribution(target, ctx, m)
    return total_variation(counts, exact, n), tv_threshold(len(exact), n), bonus


def wrong_row_bonus(tree, P, gen):
    """A planted bug: the bonus token (after a fully accepted leaf) drawn from the leaf's parent's row."""
    P = P.clone()
    for i in range(1, len(tree)):
        if not tree.children[i]:
            P[i] = P[tree.parents[i]]
    return sample_accept_tree(tree, P, gen)


V = 4
TARGET = Table(V, seed=11)
DRAFT = Table(V, seed=12, base=TARGET, noise=2.5)  # agrees with the target often, not always
CTX = (2,)


def static_builder(shape, draft=DRAFT, draw="sample"):
    def build(ctx, gen):
        return static_tree(ctx[-1], draft.logits(ctx), shape, drafter(draft, ctx), temperature=1.0, draw=draw, generator=gen)

    return build


@pytest.mark.parametrize("siblings", [2, 3, 4])
def test_sampled_siblings_keep_the_target_distribution(siblings):
    """2-4 siblings drawn without replacement at the root, 2 below each: the first three emitted tokens follow
    the target's joint distribution exactly."""
    tv, thr, bonus = check_exact(static_builder([siblings, 2]), sample_accept_tree, TARGET, CTX, m=3, n=3000, seed=siblings)
    assert tv < thr, (tv, thr)
    assert bonus > 0.2  # the bonus token is exercised


@pytest.mark.parametrize("build", ["topk", "dynamic", "lookup"])
def test_fixed_children_keep_the_target_distribution(build):
    """Fixed proposals: top-k children, EAGLE-2's dynamic tree, and lookup chains merged beside sampled children."""
    if build == "topk":
        b = static_builder([3, 2], draw="topk")
    elif build == "dynamic":
        def b(ctx, gen):
            return dynamic_tree(ctx[-1], DRAFT.logits(ctx), drafter(DRAFT, ctx), depth=2, topk=3, nodes=7, temperature=1.0)
    else:
        def b(ctx, gen):
            t = static_tree(ctx[-1], DRAFT.logits(ctx), [2, 1], drafter(DRAFT, ctx), temperature=1.0, generator=gen)
            return add_branches(t, [[1, 3], [0, 0], [3]])  # some duplicate sampled tokens, some new
    tv, thr, _ = check_exact(b, sample_accept_tree, TARGET, CTX, m=3, n=3000, seed=7)
    assert tv < thr, (tv, thr)


def test_bonus_token_when_every_draft_is_accepted():
    """A draft equal to the target accepts every first child: each round ends with the bonus token, drawn from the
    leaf's row. The same check fails when the bonus is drawn from the wrong row (a planted bug)."""
    same = Table(V, seed=11)  # the target's own distributions as the draft
    build = static_builder([3, 2], draft=same)
    tv, thr, bonus = check_exact(build, sample_accept_tree, TARGET, CTX, m=3, n=2000, seed=1)
    assert bonus == 1.0
    assert tv < thr, (tv, thr)
    tv_bug, thr_bug, _ = check_exact(build, wrong_row_bonus, TARGET, CTX, m=3, n=2000, seed=1)
    assert tv_bug > thr_bug, (tv_bug, thr_bug)


def test_planted_bugs_fail_the_distribution_check():
    """With an imperfect draft too: the wrong-row bonus breaks the joint of the first three tokens, and sampled
    siblings tested as if drawn with replacement (proposal q[u] without removing earlier siblings' tokens)
    break the first token's distribution, while the correct rule passes the same check."""
    tv, thr, _ = check_exact(static_builder([3, 2]), wrong_row_bonus, TARGET, CTX, m=3, n=2000, seed=3)
    assert tv > thr, (tv, thr)
    poor = Table(V, seed=12, base=TARGET, noise=3.0)
    tv, thr, _ = check_exact(static_builder([3], draft=poor), sample_accept_tree, TARGET, CTX, m=1, n=3000, seed=2)
    assert tv < thr, (tv, thr)
    tv, thr, _ = check_exact(static_builder([3], draft=poor), accept_as_if_with_replacement, TARGET, CTX, m=1, n=3000, seed=2)
    assert tv > thr, (tv, thr)


def accept_as_if_with_replacement(tree, P, gen):
    """A planted bug: sample_accept_tree with a sampled child's proposal taken as q[u] itself, the rule for
    siblings drawn with replacement, while the tree drew them without."""
    tokens = tree.tokens.tolist()
    u, path = 0, [0]
    while True:
        r = P[u]
        acc = None
        for c in tree.children[u]:
            x, qc = tokens[c], tree.q[u]
            if float(torch.rand((), generator=gen)) * float(qc[x]) < float(r[x]):
                acc = c
                break
            res = (r - qc).clamp_min(0)
            if float(res.sum()) > 0:
                r = res / res.sum()
        if acc is None:
            return path, torch.multinomial(r, 1, generator=gen)[0]
        path.append(acc)
        u = acc


def test_chain_tree_sampling_matches_speculative_accept_on_a_chain():
    """One chain of fixed drafts: the tree rule's accepted length has the chain rule's distribution for
    deterministic drafts (accept x with probability p(x))."""
    g = torch.Generator().manual_seed(5)
    p = torch.rand(4, 6, generator=g).softmax(-1)
    t = chain_tree(0, [1, 2, 3], "head")
    lens = torch.zeros(4)
    n = 4000
    for _ in range(n):
        path, _ = sample_accept_tree(t, p, g)
        lens[len(path) - 1] += 1
    exact = torch.tensor([1 - p[0, 1], p[0, 1] * (1 - p[1, 2]), p[0, 1] * p[1, 2] * (1 - p[2, 3]), p[0, 1] * p[1, 2] * p[2, 3]])
    assert 0.5 * (lens / n - exact).abs().sum() < tv_threshold(4, n)
