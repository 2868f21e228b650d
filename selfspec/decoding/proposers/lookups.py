"""Context lookup's chains beside the head's: `LookupFirst` (lookup's chain when the history matches, the head's
otherwise) and `LookupChecked` (lookup's chain checked by the head in one pass)."""

from __future__ import annotations

import torch

from selfspec.decoding.config import DecodeConfig
from selfspec.decoding.drafters import Drafter
from selfspec.decoding.lookup import NgramIndex
from selfspec.decoding.proposers.base import Proposer, pick
from selfspec.decoding.proposers.chains import AheadChain, HeadChain
from selfspec.decoding.registry import register_proposer
from selfspec.decoding.state import DecodeState
from selfspec.decoding.verify import Draft


def history_index(cfg: DecodeConfig, state: DecodeState) -> NgramIndex:
    """Context lookup's n-gram index over the prompt (lookup.py)."""
    return NgramIndex(state.tokens[: state.n].tolist(), cfg.lookup_min_ngram, cfg.lookup_max_ngram)


def extend_index(index: NgramIndex, state: DecodeState, n0: int) -> None:
    """The round's committed tokens [n0, state.n) into the index."""
    if not state.done:
        index.extend(state.out[n0 - state.prompt_len :])


class _Lookup(Proposer):
    """Context lookup's n-gram index over prompt + committed tokens (lookup.py), and the head's chain proposer
    (`head`: HeadChain, or AheadChain under decode.tokens_per_pass) for the drafts lookup does not make."""

    needs_head = True
    tree_stats = True

    def __init__(self, cfg: DecodeConfig, drafter: Drafter):
        super().__init__(cfg, drafter)
        self.head = (AheadChain if cfg.tokens_per_pass > 1 else HeadChain)(cfg, drafter)
        self.index: NgramIndex | None = None

    @property
    def depth(self) -> int:
        return max(self.cfg.draft_len, self.cfg.lookup_len)  # lookup's chain or the head's


    def start(self, state: DecodeState) -> None:
        self.index = history_index(self.cfg, state)

    def observe(self, state: DecodeState, n0: int) -> None:
        extend_index(self.index, state, n0)

    def chain(self, state: DecodeState, room: int) -> list[int]:
        """Lookup's chain (at most `room` tokens; [] without a match): a match whose continuation runs into the end
        of the history (a repetition) gives way to an earlier one that has all `room` tokens."""
        return next(iter(self.index.propose_many(room, 1)), []) if room > 0 else []


@register_proposer("lookup_first")
class LookupFirst(_Lookup):
    """Lookup's chain when the history matches (no model pass; sampling: a one-hot q, so acceptance is min(1, p(d))
    and the residual is p without d), the head's chain otherwise. The drafter runs layers < E over lookup's tokens
    in `verify_input`, as over a last draft."""

    def propose(self, state: DecodeState) -> Draft:
        tokens = self.chain(state, min(self.cfg.lookup_len, state.room))
        if not tokens:
            return self.head.propose(state)
        n, ids = state.n, torch.tensor(tokens, dtype=torch.long, device=state.tokens.device)
        state.tokens[n : n + len(tokens)] = ids
        draft = Draft(tokens=tokens, lookup=len(tokens))
        if not self.cfg.greedy:
            one_hot = torch.zeros(len(tokens), self.drafter.bb.vocab_size, dtype=torch.float32, device=ids.device)
            draft.q = list(one_hot.scatter_(1, ids[:, None], 1.0))
        state.timer.lap(state.stats, "draft_s")
        return draft


@register_proposer("lookup_checked")
class LookupChecked(_Lookup):
    """Lookup's chain (at most K tokens) through the head in ONE pass; its tokens are kept up to the first one the
    head's argmax disagrees with, where the head's own draft (argmax, or sampled from its q) takes over, and the
    head drafts on from there. Sampling: a kept lookup token is a deterministic proposal (one-hot q), the head's
    token carries the head's q."""

    def propose(self, state: DecodeState) -> Draft:
        draft = Draft()
        self.head.extend(state, draft, self.checked(state, draft))
        state.timer.lap(state.stats, "draft_s")
        return draft

    def checked(self, state: DecodeState, draft: Draft) -> int:
        """Lookup's tokens kept by the head, then the head's token where they part -> drafts made."""
        cfg, n, drafter = self.cfg, state.n, self.drafter
        tokens = self.chain(state, min(cfg.lookup_len, cfg.draft_len, state.room))
        if not tokens:
            return 0
        state.tokens[n : n + len(tokens)] = torch.tensor(tokens, dtype=torch.long, device=state.tokens.device)
        rows = drafter.draft_rows_logits(state, n, len(tokens))  # (L, V'): the head after each lookup prefix
        state.stats.draft_steps += 1
        agree = [drafter.token_id(i) for i in rows.argmax(-1).tolist()]  # the round's one read-back
        for j, tok in enumerate(tokens):
            if agree[j] != tok:
                drafter.rollback(n + j)  # positions from n + j on held lookup's tokens: stale for the draft
                idx, q, _ = pick(rows[j], cfg, state.generator)
                self.head.append(state, draft, n + j, idx, q)
                return j + 1
            draft.tokens.append(tok)  # kept: a deterministic proposal
            draft.lookup += 1
            if not cfg.greedy:
                draft.q.append(torch.zeros(drafter.bb.vocab_size, dtype=torch.float32, device=rows.device)
                               .index_fill_(0, torch.tensor([tok], device=rows.device), 1.0))
        return len(tokens)
