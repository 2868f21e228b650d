"""The head's chains: `HeadChain` (one draft per pass through layers < E) and `AheadChain` (several per pass)."""

from __future__ import annotations

import torch

from selfspec.decoding.config import DecodeConfig
from selfspec.decoding.drafters import Drafter
from selfspec.decoding.proposers.base import Proposer, pick, token_of
from selfspec.decoding.registry import register_proposer
from selfspec.decoding.state import DecodeState
from selfspec.decoding.verify import Draft
from selfspec.errors import check


@register_proposer("head_chain")
class HeadChain(Proposer):
    """Up to K of the head's drafts, each from one pass through layers < E."""

    needs_head = True
    fused = True  # a round may draft the whole chain in one kernel call (decode.fused_chain, a logit lens)

    @property
    def depth(self) -> int:
        return self.cfg.draft_len

    def propose(self, state: DecodeState) -> Draft:
        draft = Draft()
        self.extend(state, draft, 0)
        state.timer.lap(state.stats, "draft_s")
        return draft

    def rows(self, state: DecodeState, i: int, k: int) -> torch.Tensor:
        """The draft logits for position n+i, as (1, V'): one pass through layers < E."""
        state.stats.draft_steps += 1
        return self.drafter.draft_logits(state, state.n + i)[None]

    def extend(self, state: DecodeState, draft: Draft, start: int, limit: int | None = None) -> None:
        """The head's drafts for positions n+start, n+start+1, ... up to `limit` (default K; fewer near max_new_tokens,
        under draft_threshold, or once the drafts' joint confidence falls below draft_continue), appended to `draft`.
        Whether to draft on is decided from the drafts' own probabilities only, so sampling stays exact."""
        cfg, n = self.cfg, state.n
        k, rows, first = min(cfg.draft_len if limit is None else limit, state.room), None, start
        if k > start and self.fused_chain(state, draft, start, k):
            return
        joint = 1.0
        for i in range(start, k):
            if rows is None or i - first >= rows.shape[0]:
                rows, first = self.rows(state, i, k), i
            idx, q, conf = pick(rows[i - first], cfg, state.generator)
            if cfg.draft_threshold and conf < cfg.draft_threshold:
                break
            self.append(state, draft, n + i, idx, q)
            joint *= conf
            if cfg.draft_continue and joint < cfg.draft_continue:
                break

    def fused_chain(self, state: DecodeState, draft: Draft, start: int, k: int) -> bool:
        """Drafts start..k-1 of the round in one kernel call where the drafter has one (decode.fused_chain; greedy or
        sampled without top-k: a context head's chain with the dynamic-K rules, a logit lens's without them) -> True;
        False: nothing was drafted."""
        cfg, n, drafter = self.cfg, state.n, self.drafter
        if not (self.fused and cfg.fused_chain and (cfg.greedy or not cfg.top_k)):
            return False
        q = None if cfg.greedy else torch.empty(k - start, drafter.draft_vocab_size, device=state.tokens.device)
        made = drafter.draft_chain_dynamic(state, n + start, k - start, cfg.draft_threshold or 0.0,
                                           cfg.draft_continue or 0.0, q)
        if made is None:
            if cfg.draft_threshold or cfg.draft_continue or not drafter.draft_chain(state, n + start, k - start, q):
                return False
            made = (k - start, k - start)
        drafts, steps = made
        state.stats.draft_steps += steps
        draft.tokens.extend(state.tokens[n + start : n + start + drafts].clone().unbind())  # 0-d tensors: nothing read back
        if q is not None:
            draft.q.extend(drafter.full_distribution(row) for row in q[:drafts])
        return True

    def append(self, state: DecodeState, draft: Draft, pos: int, idx, q) -> None:
        tok = token_of(self.drafter, idx)
        if q is not None:
            draft.q.append(self.drafter.full_distribution(q))
        state.tokens[pos] = tok
        draft.tokens.append(tok)


@register_proposer("ahead_chain")
class AheadChain(HeadChain):
    """decode.tokens_per_pass=m: one pass through layers < E proposes the next m drafts (the head's extra heads);
    under sampling each draft's q is the distribution of the head that proposed it."""

    fused = False

    def __init__(self, cfg: DecodeConfig, drafter: Drafter):
        super().__init__(cfg, drafter)
        m = cfg.tokens_per_pass
        check(m <= drafter.max_ahead,
              f"decode.tokens_per_pass={m}: this head proposes at most {drafter.max_ahead} "
              f"token{'s' if drafter.max_ahead > 1 else ''} per pass (a medusa head with head.num_heads >= "
              f"{m} proposes that many)")

    def rows(self, state: DecodeState, i: int, k: int) -> torch.Tensor:
        state.stats.draft_steps += 1
        return self.drafter.draft_ahead_logits(state, state.n + i, min(self.cfg.tokens_per_pass, k - i))
