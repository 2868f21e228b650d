"""Draft trees: the head's (`HeadTree`, with context-lookup branches under decode.lookup) and context lookup's alone
(`LookupTree`)."""

from __future__ import annotations

from selfspec.decoding.config import DecodeConfig
from selfspec.decoding.drafters import Drafter, NoDrafter
from selfspec.decoding.proposers.base import Proposer
from selfspec.decoding.proposers.lookups import extend_index, history_index
from selfspec.decoding.registry import register_proposer
from selfspec.decoding.state import DecodeState
from selfspec.decoding.tree import add_branches, chain_tree, dynamic_tree, static_tree
from selfspec.decoding.verify import Draft, TreeDraft


@register_proposer("head_tree")
class HeadTree(Proposer):
    """The head's tree (decode.tree=static: tree_shape; dynamic: EAGLE-2's rule), plus context-lookup branches
    under decode.lookup (lookup_mode=branch); no deeper than max_new_tokens leaves room for."""

    needs_head = True
    tree_stats = True

    def __init__(self, cfg: DecodeConfig, drafter: Drafter):
        super().__init__(cfg, drafter)
        self.index = None

    @property
    def depth(self) -> int:
        return self.cfg.tree_depth(head=not isinstance(self.drafter, NoDrafter))


    def start(self, state: DecodeState) -> None:
        if self.cfg.lookup:  # lookup branches beside the head's drafts
            self.index = history_index(self.cfg, state)

    def observe(self, state: DecodeState, n0: int) -> None:
        if self.index is not None:
            extend_index(self.index, state, n0)

    def propose(self, state: DecodeState) -> Draft | TreeDraft:
        root, room = state.n - 1, state.room
        tree = self.head_tree(state, root, room) if room > 0 else None
        if self.index is not None and room > 0:
            branches = self.index.propose_many(min(self.cfg.lookup_len, room), self.cfg.lookup_branches)
            if branches:
                tree = add_branches(tree or chain_tree(int(state.tokens[root]), []), branches)
        state.timer.lap(state.stats, "draft_s")
        # nothing proposed (no room, no lookup match): the chain's round with k = 0
        return Draft() if tree is None else TreeDraft(tree, root)

    def head_tree(self, state: DecodeState, root: int, room: int):
        cfg, drafter, stats = self.cfg, self.drafter, state.stats
        root_logits = drafter.draft_logits(state, root + 1)  # (V',) after the root
        stats.draft_steps += 1

        def draft_fn(frontier):
            stats.draft_steps += 1
            return drafter.draft_tree_logits(state, root, frontier)

        common = dict(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, vocab_ids=drafter.vocab_ids,
                      vocab_size=drafter.bb.vocab_size)
        token = int(state.tokens[root])
        if cfg.tree == "dynamic":
            return dynamic_tree(token, root_logits, draft_fn, depth=min(cfg.draft_len, room), topk=cfg.tree_topk,
                                nodes=cfg.tree_nodes + 1, **common)
        shape = cfg.tree_shape if cfg.tree == "static" else [1] * cfg.draft_len
        return static_tree(token, root_logits, shape[:room], draft_fn, generator=state.generator, **common)


@register_proposer("lookup_tree")
class LookupTree(HeadTree):
    """Context lookup alone (no head): its branches (decode.lookup_branches) as a tree, in either lookup_mode."""

    needs_head = False

    def head_tree(self, state: DecodeState, root: int, room: int):
        return None
