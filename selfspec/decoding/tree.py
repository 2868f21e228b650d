"""Draft trees: build them (a static shape, or EAGLE-2's dynamic rule), mask them, accept from them. Pure tensor
functions; the caller runs the model (the `draft_fn` callbacks) and the verify pass.

A tree's node 0 is the root: the last committed token, not a draft. Its other nodes are drafts, each one
token after its parent, stored parents first and sorted by depth (one contiguous range per depth), siblings
in the order they were proposed. Verification writes node i at cache slot root_slot + i and runs the full
stack over all nodes in one pass (Backbone.run_layers with tree_mask=tree.mask, rotary position =
root position + depth); row i of the target's output is its distribution after node i's path.

Acceptance keeps the target's output exactly:
  greedy    the deepest node whose every token equals the target's argmax at its parent; then the target's
            argmax at that node.
  sampling  recursive rejection sampling over siblings (SpecInfer's multi-draft speculative sampling, in the
            without-replacement form of Recursive Speculative Decoding, Jeon et al. 2024). At node u, with
            r = p_u the target's distribution there, try u's children in order; child c with token x and
            proposal q_c is accepted with probability min(1, r(x) / q_c(x)); on rejection
            r <- normalize(max(r - q_c, 0)) and the next sibling is tried. An accepted child becomes u; when
            every child is rejected (or u has none: a fully accepted path's bonus token) the next token is
            drawn from r.
            The proposal q_c: for a `sampled` child, u's draft distribution q[u] with the tokens of all of c's
            earlier siblings removed, renormalized; for a fixed child (top-k picks, context lookups), the point
            mass on its token.
Why it is exact: by induction from the last sibling, given everything decided before child c (earlier
siblings' tokens, their rejections), the rest of the procedure returns a sample of the current r, *provided
that c's token is distributed as q_c given that history*. Then P(next = y) = min(r(y), q_c(y)) +
P(reject) * normalize(max(r - q_c, 0))(y) = r(y), the one-draft lemma of Leviathan et al. / Chen et al.
(the residual after c does not depend on c's token, only on q_c). The builders guarantee the proviso: sampled
children are drawn without replacement in their stored order (Gumbel top-k over q[u] with earlier siblings'
tokens masked), which is exactly "the i-th drawn from q minus the first i-1"; fixed children are functions
of the context alone. Whether a child exists may depend on the history (a lookup branch merged after the
head's samples), never on its own random token; trees pruned after sampling (EAGLE-2's rerank) therefore take
fixed top-k children.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import torch

from selfspec.decoding.sampling import process_logits
from selfspec.errors import check

SOURCES = ("root", "head", "lookup")


@dataclass
class Tree:
    """A draft tree (module docstring). Built by static_tree / dynamic_tree / add_branches / chain_tree; tensors on
    the CPU (move tokens and mask to the model's device for run_layers)."""

    tokens: torch.Tensor  # (N,) long; tokens[0] is the root (the last committed token)
    parents: torch.Tensor  # (N,) long; parents[0] = -1, parents[i] < i
    depth: torch.Tensor  # (N,) long; depth[0] = 0, non-decreasing
    source: list[str]  # per node: 'root' | 'head' | 'lookup'
    logprob: torch.Tensor  # (N,) float: cumulative draft log-probability of the node's path (root 0, lookups add 0)
    sampled: torch.Tensor  # (N,) bool: drawn at random from q[parent] (without replacement); False = a fixed proposal
    q: torch.Tensor | None = None  # (N, V) draft distribution after each node (rows of nodes never drafted from: 0);
    #                                only when some node is sampled
    slot: torch.Tensor | None = None  # (N,) long: the node's draft slot (root 0) if the draft ran over it, else -1

    def __post_init__(self):
        n = self.tokens.shape[0]
        check(n >= 1 and self.parents.shape == (n,) and self.depth.shape == (n,) and len(self.source) == n,
              "tree: tokens, parents, depth and source must have one entry per node (at least the root)")
        if self.slot is None:
            self.slot = torch.full((n,), -1, dtype=torch.long)
            self.slot[0] = 0

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @cached_property
    def children(self) -> list[list[int]]:
        """Each node's children, in proposal order."""
        kids: list[list[int]] = [[] for _ in range(len(self))]
        for i, p in enumerate(self._parent_list):
            if p >= 0:
                kids[p].append(i)
        return kids

    @cached_property
    def mask(self) -> torch.Tensor:
        """(N, N) bool ancestor mask, computed once: the tree_mask of a verify pass over all nodes."""
        return ancestor_mask(self.parents)

    def positions(self, root_pos: int) -> torch.Tensor:
        """(N,) rotary positions when the root sits at root_pos."""
        return root_pos + self.depth

    @cached_property
    def _parent_list(self) -> list[int]:
        return self.parents.tolist()

    def path(self, node: int) -> list[int]:
        """Node indices from the root to `node`."""
        par, out = self._parent_list, []
        while node >= 0:
            out.append(node)
            node = par[node]
        return out[::-1]


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """parents (N,) long, -1 at roots, parents[i] < i -> (N, N) bool, [i, j] = j is i or one of i's ancestors."""
    parents = torch.as_tensor(parents, dtype=torch.long).cpu()
    n = parents.shape[0]
    mask = torch.eye(n, dtype=torch.bool)
    cur = torch.arange(n)
    rows = torch.arange(n)
    while True:
        cur = torch.where(cur >= 0, parents[cur.clamp_min(0)], cur)  # one generation up; -1 stays -1
        live = cur >= 0
        if not live.any():
            return mask
        mask[rows[live], cur[live]] = True


# ---------------------------------------------------------------------------------------------------- building


@dataclass
class Frontier:
    """One draft call: the nodes whose next-token distributions the builder needs, all at one depth.

    The caller runs the early layers over `tokens` at cache slots root_slot + slot .. (consecutive) with
    `tree_mask` (F, S) over the draft slots root_slot .. root_slot + S - 1 (the root and every node drafted so
    far, slot order), e.g. run_layers(embed(tokens), 0, E, cache, pos0=root_slot + slot, tree_mask=tree_mask)
    (rotary positions default to root position + depth there), and returns (F, V') draft logits."""

    nodes: torch.Tensor  # (F,) node indices in the tree being built
    tokens: torch.Tensor  # (F,) long
    depth: torch.Tensor  # (F,) long
    tree_mask: torch.Tensor  # (F, S) bool
    slot: int  # first draft slot of these rows (= S - F)


DraftFn = Callable[[Frontier], torch.Tensor]


@dataclass
class _Builder:
    """A tree under construction (lists), with the draft-slot bookkeeping."""

    root: int
    vocab_size: int | None
    keep_q: bool
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)
    source: list[str] = field(default_factory=list)
    logprob: list[float] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    slot: list[int] = field(default_factory=list)
    q: dict[int, torch.Tensor] = field(default_factory=dict)
    drafted: list[int] = field(default_factory=list)  # node of each draft slot

    def __post_init__(self):
        self.add(self.root, -1, "root", 0.0, False)
        self.slot[0] = 0
        self.drafted.append(0)

    def add(self, token: int, parent: int, source: str, logprob: float, sampled: bool) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depth.append(self.depth[parent] + 1 if parent >= 0 else 0)
        self.source.append(source)
        self.logprob.append(logprob)
        self.sampled.append(sampled)
        self.slot.append(-1)
        return len(self.tokens) - 1

    def frontier(self, nodes: list[int]) -> Frontier:
        """Give `nodes` the next draft slots; their rows of the ancestor mask over all draft slots."""
        s0 = len(self.drafted)
        for v in nodes:
            self.slot[v] = len(self.drafted)
            self.drafted.append(v)
        mask = torch.zeros(len(nodes), len(self.drafted), dtype=torch.bool)
        for r, v in enumerate(nodes):
            while v >= 0:
                check(self.slot[v] >= 0, "tree: a frontier node's ancestor was never drafted")
                mask[r, self.slot[v]] = True
                v = self.parents[v]
        return Frontier(torch.tensor(nodes), torch.tensor([self.tokens[v] for v in nodes]),
                        torch.tensor([self.depth[v] for v in nodes]), mask, s0)

    def tree(self, keep: list[int] | None = None) -> Tree:
        """The finished tree (only the nodes in `keep`, a parent-closed set, when given), sorted by depth."""
        order = list(range(len(self.tokens))) if keep is None else sorted(set(keep) | {0})
        order.sort(key=lambda v: self.depth[v])  # stable: siblings stay in proposal order
        new = {v: i for i, v in enumerate(order)}
        q = None
        if self.keep_q and self.q:
            some = next(iter(self.q.values()))
            q = torch.zeros(len(order), some.shape[-1], dtype=some.dtype, device=some.device)
            for v, row in self.q.items():
                if v in new:
                    q[new[v]] = row
        return Tree(
            tokens=torch.tensor([self.tokens[v] for v in order]),
            parents=torch.tensor([new[self.parents[v]] if self.parents[v] >= 0 else -1 for v in order]),
            depth=torch.tensor([self.depth[v] for v in order]),
            source=[self.source[v] for v in order],
            logprob=torch.tensor([self.logprob[v] for v in order], dtype=torch.float32),
            sampled=torch.tensor([self.sampled[v] for v in order], dtype=torch.bool),
            q=q,
            slot=torch.tensor([self.slot[v] for v in order]),
        )


def _draft_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, vocab_ids, vocab_size):
    """(F, V') draft logits -> (F, V') probabilities (processed like the target's when sampling; plain softmax for
    greedy, where they only rank nodes) and, when sampling, the same on the full vocabulary (F, V) for acceptance."""
    if temperature == 0:
        return logits.float().softmax(-1), None
    q = process_logits(logits, temperature, top_k, top_p)
    if vocab_ids is None:
        return q, q
    full = torch.zeros(q.shape[0], vocab_size, dtype=q.dtype, device=q.device)
    return q, full.index_copy_(1, vocab_ids.to(q.device), q)


def _pick(q: torch.Tensor, k: int, sample: bool, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(F, V') probabilities -> (F, k) indices and their log-probs: the top k, or k draws without replacement in
    draw order (Gumbel top-k: the order of log q + Gumbel noise is sequential sampling without replacement).
    Entries of probability 0 come back with log-prob -inf (the caller drops them)."""
    logq = q.clamp_min(0).log()
    k = min(k, q.shape[-1])
    if not sample:
        top = logq.topk(k, dim=-1)
        return top.indices, top.values
    u = torch.rand(q.shape, generator=generator, device=q.device, dtype=torch.float32).clamp_(1e-20, 1.0)
    idx = (logq - (-u.log()).log()).topk(k, dim=-1).indices
    return idx, logq.gather(-1, idx)


def _check_common(temperature, draw, vocab_ids, vocab_size):
    check(temperature >= 0, f"tree: temperature={temperature}: must be >= 0 (0 = greedy)")
    check(draw in ("sample", "topk"), f"tree: draw={draw!r}: allowed sample, topk")
    check(vocab_ids is None or vocab_size is not None, "tree: vocab_ids needs vocab_size (the full vocabulary)")


def static_tree(
    root_token: int,
    root_logits: torch.Tensor,
    shape: list[int],
    draft_fn: DraftFn,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    draw: str = "sample",
    generator: torch.Generator | None = None,
    vocab_ids: torch.Tensor | None = None,
    vocab_size: int | None = None,
) -> Tree:
    """A tree of fixed branching per depth: shape [3, 2, 2, 1] gives the root 3 children, each of them 2, ...
    (1 + 3 + 6 + 12 + 12 nodes). root_logits (V',): the draft's logits after the root (the caller ran it).
    draft_fn is called once per depth but the last, over that depth's nodes.

    Greedy (temperature 0): each node's children are the draft's top-b tokens. Sampling: draw='sample' draws
    them without replacement from the processed draft distribution (kept in tree.q for acceptance);
    draw='topk' takes the top b as fixed proposals. vocab_ids (V',) maps a reduced draft vocabulary to token ids."""
    check(len(shape) >= 1 and all(isinstance(b, int) and b >= 1 for b in shape),
          f"decode.tree_shape={list(shape)}: must be a non-empty list of integers >= 1")
    _check_common(temperature, draw, vocab_ids, vocab_size)
    sample = temperature > 0 and draw == "sample"
    b = _Builder(int(root_token), vocab_size, keep_q=sample)
    nodes, logits = [0], root_logits.reshape(1, -1)
    for d, k in enumerate(shape):
        q, q_full = _draft_probs(logits, temperature, top_k, top_p, vocab_ids, vocab_size)
        idx, lq = _pick(q, k, sample, generator)
        tok = vocab_ids.to(idx.device)[idx] if vocab_ids is not None else idx
        children = []
        for r, u in enumerate(nodes):
            if sample:
                b.q[u] = q_full[r]
            for t, l in zip(tok[r].tolist(), lq[r].tolist()):
                if l > -math.inf:
                    children.append(b.add(t, u, "head", b.logprob[u] + l, sample))
        if d + 1 == len(shape) or not children:
            break
        nodes = children
        logits = draft_fn(b.frontier(nodes))
    return b.tree()


def dynamic_tree(
    root_token: int,
    root_logits: torch.Tensor,
    draft_fn: DraftFn,
    *,
    depth: int,
    topk: int,
    nodes: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    vocab_ids: torch.Tensor | None = None,
    vocab_size: int | None = None,
) -> Tree:
    """EAGLE-2's dynamic tree. Expand: the root's top-`topk` children form the first frontier; at each of the
    next depth-1 depths, draft_fn runs over the frontier, each frontier node proposes its top-`topk` tokens
    with value = the path's cumulative draft log-probability, and the best `topk` of those topk^2 candidates
    become the next frontier. Rerank: the tree keeps the root and the best `nodes - 1` of all candidates by
    value (a parent's value is never below its child's, so the kept set is a tree). Children are fixed
    proposals (top-k picks), also when sampling: the rerank prunes by token, which sampled children must not."""
    check(isinstance(depth, int) and depth >= 1, f"decode.tree_depth={depth}: must be an integer >= 1")
    check(isinstance(topk, int) and topk >= 1, f"decode.tree_topk={topk}: must be an integer >= 1")
    check(isinstance(nodes, int) and nodes >= 2, f"decode.tree_nodes={nodes}: must be an integer >= 2 (root + drafts)")
    _check_common(temperature, "topk", vocab_ids, vocab_size)
    b = _Builder(int(root_token), vocab_size, keep_q=False)
    frontier, logits = [0], root_logits.reshape(1, -1)
    for d in range(depth):
        q, _ = _draft_probs(logits, temperature, top_k, top_p, vocab_ids, vocab_size)
        idx, lq = _pick(q, topk, False, None)
        tok = vocab_ids.to(idx.device)[idx] if vocab_ids is not None else idx
        new = []
        for r, u in enumerate(frontier):
            for t, l in zip(tok[r].tolist(), lq[r].tolist()):
                if l > -math.inf:
                    new.append(b.add(t, u, "head", b.logprob[u] + l, False))
        if d + 1 == depth or not new:
            break
        best = sorted(new, key=lambda v: -b.logprob[v])[:topk]  # stable: earlier candidates win ties
        frontier = sorted(best)  # proposal order (parents' order, then each parent's top-k order)
        logits = draft_fn(b.frontier(frontier))
    cand = torch.tensor(b.logprob[1:])
    order = torch.sort(cand, descending=True, stable=True).indices[: nodes - 1] + 1  # ties: parents (earlier) first
    return b.tree(keep=order.tolist())


def add_branches(tree: Tree, chains: list[list[int]], source: str = "lookup") -> Tree:
    """Merge token chains continuing the root (context-lookup proposals) into the tree as fixed proposals: each
    chain follows existing nodes with the same tokens and adds the rest as new nodes, after the existing
    siblings. Returns a new tree, sorted by depth."""
    check(source in SOURCES[1:], f"tree: source={source!r}: allowed head, lookup")
    tokens, parents, depth = tree.tokens.tolist(), tree.parents.tolist(), tree.depth.tolist()
    src, logprob, sampled, slot = list(tree.source), tree.logprob.tolist(), tree.sampled.tolist(), tree.slot.tolist()
    kids = {}
    for i, p in enumerate(parents):
        kids.setdefault((p, tokens[i]), i)
    n0 = len(tokens)
    for chain in chains:
        u = 0
        for t in chain:
            t = int(t)
            v = kids.get((u, t))
            if v is None:
                v = len(tokens)
                tokens.append(t), parents.append(u), depth.append(depth[u] + 1), src.append(source)
                logprob.append(logprob[u]), sampled.append(False), slot.append(-1)
                kids[(u, t)] = v
            u = v
    if len(tokens) == n0:
        return tree
    order = sorted(range(len(tokens)), key=lambda v: depth[v])
    new = {v: i for i, v in enumerate(order)}
    q = None
    if tree.q is not None:
        q = torch.zeros(len(order), tree.q.shape[1], dtype=tree.q.dtype, device=tree.q.device)
        q[[new[v] for v in range(n0)]] = tree.q
    return Tree(
        tokens=torch.tensor([tokens[v] for v in order]),
        parents=torch.tensor([new[parents[v]] if parents[v] >= 0 else -1 for v in order]),
        depth=torch.tensor([depth[v] for v in order]),
        source=[src[v] for v in order],
        logprob=torch.tensor([logprob[v] for v in order], dtype=torch.float32),
        sampled=torch.tensor([sampled[v] for v in order], dtype=torch.bool),
        q=q,
        slot=torch.tensor([slot[v] for v in order]),
    )


def chain_tree(root_token: int, drafts: list[int], source: str = "lookup") -> Tree:
    """A chain as a tree: the root and one fixed draft per depth."""
    root = Tree(torch.tensor([int(root_token)]), torch.tensor([-1]), torch.tensor([0]), ["root"],
                torch.zeros(1), torch.zeros(1, dtype=torch.bool))
    return add_branches(root, [list(drafts)], source) if len(drafts) else root


# ---------------------------------------------------------------------------------------------------- accepting


def greedy_accept_tree(tree: Tree, target_logits: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """target_logits (N, V): the target after each node -> (accepted path as node indices from the root, the
    target's next token). The path is the deepest one whose every draft equals the target's argmax at its
    parent (the first such node on ties)."""
    t = target_logits.argmax(-1)  # (N,)
    dev = t.device
    par = tree.parents.to(dev)
    ok = tree.tokens.to(dev) == t[par.clamp_min(0)]
    ok[0] = True
    good = ~(tree.mask.to(dev) & ~ok[None, :]).any(-1)  # every node on the path matches
    best = int(torch.where(good, tree.depth.to(dev), -1).argmax())  # first of the deepest
    return tree.path(best), t[best]


def sample_accept_tree(tree: Tree, p: torch.Tensor, generator: torch.Generator | None = None) -> tuple[list[int], torch.Tensor]:
    """p (N, V): the target's processed distribution after each node -> (accepted path as node indices from the
    root, the next token): recursive rejection sampling over siblings (module docstring), exact for trees built
    by static_tree / dynamic_tree / add_branches."""
    tokens, sampled, kids = tree.tokens.tolist(), tree.sampled.tolist(), tree.children
    dev = p.device
    u, path = 0, [0]
    while True:
        r = p[u]
        accepted = None
        tried: list[int] = []  # tokens of u's earlier (rejected) children
        for c in kids[u]:
            x = tokens[c]
            if sampled[c]:
                qc = tree.q[u].to(dev).clone()
                if tried:
                    qc[tried] = 0
                total = float(qc.sum())
                check(total > 0 and float(qc[x]) > 0, "tree: a sampled child outside its proposal (build trees with static_tree)")
                qc = qc / total
            else:
                qc = torch.zeros_like(r)
                qc[x] = 1.0
            # accept iff v < r(x) / q(x)  <=>  v * q(x) < r(x)
            if float(torch.rand((), generator=generator, device=dev)) * float(qc[x]) < float(r[x]):
                accepted = c
                break
            residual = (r - qc).clamp_min(0)
            total = float(residual.sum())
            # total == 0 only when r == q_c, where rejection has probability 0; guard for rounding.
            if total > 0:
                r = residual / total
            tried.append(x)
        if accepted is None:
            return path, torch.multinomial(r, 1, generator=generator)[0]
        path.append(accepted)
        u = accepted
