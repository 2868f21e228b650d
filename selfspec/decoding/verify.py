"""Verification: what a round proposed, checked by the full stack in ONE pass, accepted, and committed.

A proposal is a `Draft` (a chain: d[0..k) for positions n .. n+k-1) or a `TreeDraft` (a tree rooted at the last
committed token, tree.py). Either one does the same three steps on the generation's `DecodeState`:

  verify  the rest of the stack over the proposal in one forward -> the target's logits after each proposed token
          (chain: rows n-1 .. n-1+k; tree: every node, tree mask, rotary position = root + depth)
  accept  greedy: the longest proposal that equals the target's argmax, then the target's own token;
          sampling: min(1, p/q) with residual or bonus sampling (chain, sampling.py), recursive rejection sampling
          over siblings (tree, tree.py)
  commit  keep the accepted tokens and the target's token; every cache's valid length drops to the new n - 1
          (caches are written by position, so this is the rollback); a tree moves its accepted path's K/V (and
          the drafter's per-slot state) to where a chain decode writes them first

and hands the drafter the full-depth states the verify pass computed (`Drafter.observe_verified`: heads that read
the verified context keep them; positions that are rolled back are dropped by `Drafter.rollback`).

A greedy chain round reads the device back once (`Draft.commit`: the accepted count, the target's token and the
drafts in one small tensor); EOS, stop strings and lookup work on that host copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from selfspec.decoding.sampling import greedy_accept, process_logits, speculative_accept
from selfspec.decoding.state import DecodeState, StopFn
from selfspec.decoding.tree import Tree, chain_tree, greedy_accept_tree, sample_accept_tree


@dataclass
class Draft:
    """A chain: tokens d[0..k) for positions n .. n+k-1 (greedy head drafts: 0-d tensors on the device, never read
    back one by one; sampled and lookup drafts: ints), and (sampling) the (V,) distributions they were drawn from."""

    tokens: list = field(default_factory=list)
    q: list[torch.Tensor] = field(default_factory=list)
    lookup: int = 0  # the first this many tokens are context lookup's (counted apart in the stats)

    def history(self, state: DecodeState) -> list[int]:
        """The ids through the last draft (what an observer's logits follow)."""
        return state.tokens[: state.n + len(self.tokens)].tolist()

    def verify(self, bb, state: DecodeState) -> torch.Tensor:
        """The full stack over positions n-1 .. n-1+k in one pass -> the target's (k+1, V) logits there."""
        k, v = len(self.tokens), state.verified
        end = state.n + k
        h, start = state.drafter.verify_input(state, end)
        h, seen = state.drafter.verify_stack(h, start, state.cache, pos0=v)
        state.verified = end
        state.drafter.observe_verified(state, seen, v)
        return bb.logits(bb.norm(h[0, -(k + 1) :]))  # (k+1, V)

    def accept(self, state: DecodeState, logits: torch.Tensor) -> tuple:
        """-> (accepted drafts a, the target's next token); greedy: both on the device (read back in `commit`)."""
        cfg, k = state.cfg, len(self.tokens)
        d = state.tokens[state.n : state.n + k]
        if cfg.greedy:
            return greedy_accept(d, logits)
        p = process_logits(logits, cfg.temperature, cfg.top_k, cfg.top_p)
        return speculative_accept(d, torch.stack(self.q) if k else p[:0], p, state.generator)

    def commit(self, state: DecodeState, accepted, nxt, stop_fn: StopFn | None = None) -> None:
        """Keep a accepted drafts and the target's token; roll back the rest; stop at EOS / length / stop string.
        The round's one device -> host transfer: (a, the target's token, the drafts) in one small tensor."""
        n, k, dev = state.n, len(self.tokens), state.tokens.device
        row = torch.cat([torch.as_tensor(accepted, device=dev).reshape(1), torch.as_tensor(nxt, device=dev).reshape(1),
                         state.tokens[n : n + k]]).tolist()
        a, nxt_id, drafts = row[0], row[1], row[2:]
        state.stats.record_round(k, a)
        state.stats.drafted_lookup += self.lookup
        state.stats.accepted_lookup += min(a, self.lookup)
        state.tokens[n + a] = nxt_id
        advance(state, a, drafts[:a] + [nxt_id], stop_fn)


@dataclass
class TreeDraft:
    """A tree round's proposal: the tree (node 0 = x[n-1] at slot `root`; None = nothing proposed, verified as the
    tree of the root alone) and, once verified, each node's verify row (`rows`, node i at slot root + rows[i]) and
    the rows' order (`order`, None = tree order)."""

    tree: Tree | None
    root: int
    order: torch.Tensor | None = None
    rows: torch.Tensor | None = None

    def history(self, state: DecodeState) -> list[int]:
        """The ids through the root (the observer's logits follow each node, in tree order)."""
        return state.tokens[: state.n].tolist()

    def verify(self, bb, state: DecodeState) -> torch.Tensor:
        """The full stack over every node in one pass (tree mask, rotary position = root + depth) -> the target's
        (N, V) logits after each node, in tree order."""
        if self.tree is None:
            self.tree = chain_tree(int(state.tokens[self.root]), [])
        tree, root, drafter = self.tree, self.root, state.drafter
        if state.verified < root:  # the prompt (first round): through the full stack as a chain first
            h, start = drafter.verify_input(state, root)
            v = state.verified
            _, seen = drafter.verify_stack(h, start, state.cache, pos0=v)
            state.verified = root
            drafter.observe_verified(state, seen, v)
        order = self.order = drafter.tree_order(tree)
        mask, depth = (tree.mask, tree.depth) if order is None else (tree.mask[order][:, order], tree.depth[order])
        h, start = drafter.tree_verify_input(state, tree, root, order, mask)
        h, seen = drafter.verify_stack(h, start, state.cache, pos0=root, positions=root + depth, tree_mask=mask)
        drafter.observe_verified(state, seen, root)  # by slot; commit moves the accepted path's rows into place
        logits = bb.logits(bb.norm(h[0]))  # (N, V): row r is node order[r]'s
        if order is None:
            self.rows = torch.arange(len(tree))
            return logits
        self.rows = torch.empty_like(order)
        self.rows[order] = torch.arange(len(tree))
        return logits[self.rows.to(logits.device)]

    def accept(self, state: DecodeState, logits: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """-> (the accepted path as node indices from the root, the target's next token)."""
        cfg = state.cfg
        if cfg.greedy:
            return greedy_accept_tree(self.tree, logits)
        p = process_logits(logits, cfg.temperature, cfg.top_k, cfg.top_p)
        return sample_accept_tree(self.tree, p, state.generator)

    def commit(self, state: DecodeState, path: list[int], nxt, stop_fn: StopFn | None = None) -> None:
        """The accepted path's K/V (and the drafter's) to positions root, root+1, ...; then as a chain's commit."""
        tree, root, n, a = self.tree, self.root, state.n, len(path) - 1
        state.cache.compact([root + r for r in self.rows[path].tolist()], root)
        state.drafter.commit_tree(state, tree, path, root, self.rows)
        state.verified = root + a + 1
        if a:
            state.tokens[n : n + a] = tree.tokens[path[1:]].to(state.tokens.device)
        state.stats.record_tree_round(int(tree.depth[-1]), len(tree) - 1, tree.source.count("lookup"), a,
                                      sum(tree.source[i] == "lookup" for i in path))
        state.tokens[n + a] = nxt
        advance(state, a, state.tokens[n : n + a + 1].tolist(), stop_fn)


def advance(state: DecodeState, accepted: int, committed: list[int], stop_fn: StopFn | None) -> None:
    """Tokens [n, n+a] hold the accepted drafts and the target's token (`committed`, on the host): roll back every
    position past the new last token, stop at EOS / length / stop string."""
    n, P = state.n, state.prompt_len
    new_n = n + accepted + 1
    # positions >= new_n - 1 are stale or pending (the new last token has not been through the full stack)
    keep = new_n - 1
    state.verified = min(state.verified, keep)
    state.drafter.rollback(keep)
    hit = next((i for i, t in enumerate(committed) if t in state.eos_ids), None)
    if hit is not None:
        new_n = n + hit + 1  # keep the EOS, drop anything after it
        committed = committed[: hit + 1]
        state.done = True
    state.n = new_n
    state.out.extend(committed)
    if state.new_tokens >= state.cfg.max_new_tokens:
        state.done = True
    if stop_fn is not None:
        cut = stop_fn(list(state.out))
        if cut is not None:
            state.n = P + cut
            del state.out[cut:]
            state.done = True
    state.timer.lap(state.stats, "verify_s")
