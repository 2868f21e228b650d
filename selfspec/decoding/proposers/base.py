"""The Proposer interface and the autoregressive baseline (it proposes nothing); the draft-picking helpers every
strategy shares."""

from __future__ import annotations

import torch

from selfspec.decoding.config import DecodeConfig
from selfspec.decoding.drafters import Drafter, NoDrafter
from selfspec.decoding.sampling import process_logits, sample
from selfspec.decoding.state import DecodeState
from selfspec.decoding.stats import DecodeStats
from selfspec.decoding.verify import Draft, TreeDraft
from selfspec.errors import SelfSpecError

class Proposer:
    """The base: a strategy that drafts nothing (every round verifies the last committed token alone)."""

    name = "autoregressive"
    needs_head = False  # refuse to run without an exit head
    tree_stats = False  # the stats carry the tree / lookup fields (stats.TREE_KEYS)

    def __init__(self, cfg: DecodeConfig, drafter: Drafter):
        self.cfg = cfg
        self.drafter = drafter
        if self.needs_head and isinstance(drafter, NoDrafter):
            raise SelfSpecError(f"decode.proposer={self.name}: drafts with an exit head (head=lens|medusa|adapter|lora|layer|DIR)")

    @property
    def depth(self) -> int:
        """The deepest draft a round proposes (the stats' draft_len; 0: autoregressive)."""
        return 0


    def new_stats(self, prompt_len: int) -> DecodeStats:
        """A generation's stats, sized for this strategy's deepest draft."""
        d, cfg, depth = self.drafter, self.cfg, self.depth
        stats = DecodeStats(strategy=cfg.strategy, exit_layer=d.exit_layer, draft_len=depth, prompt_tokens=prompt_len,
                            drafted_per_position=[0] * depth, accepted_per_position=[0] * depth,
                            draft_precision=d.draft_precision, draft_bytes=d.draft_bytes)
        if self.tree_stats:
            stats.tree, stats.lookup = cfg.tree, cfg.lookup
        return stats

    def start(self, state: DecodeState) -> None:
        """Once per generation, after the state is allocated (the prompt is in state.tokens)."""

    def propose(self, state: DecodeState) -> Draft | TreeDraft:
        return Draft()

    def observe(self, state: DecodeState, n0: int) -> None:
        """After a round's commit: tokens [n0, state.n) are new."""




def pick(logits: torch.Tensor, cfg: DecodeConfig, generator) -> tuple:
    """(V',) draft logits -> (draft index, its distribution q (sampling only), the draft's confidence).

    Greedy: the index is a (1,) tensor on the device and, without decode.draft_threshold or draft_continue, nothing is
    read back (the round's one host sync is in `Draft.commit`); dynamic K reads the confidence back, the one thing its
    stop rule needs."""
    if cfg.greedy:
        idx = logits.argmax().view(1)
        conf = float(logits.float().softmax(-1).index_select(0, idx)) if cfg.draft_threshold or cfg.draft_continue else 1.0
        return idx, None, conf
    q = process_logits(logits, cfg.temperature, cfg.top_k, cfg.top_p)
    return int(sample(q, generator)), q, float(q.max())


def token_of(drafter: Drafter, idx):
    """A draft index -> its token id: an int, or for a (1,) device index a 0-d device tensor (index_select, never a
    0-d tensor index, which torch reads back to the host)."""
    if not isinstance(idx, torch.Tensor):
        return drafter.token_id(idx)
    vocab = drafter.vocab_ids
    return (vocab.index_select(0, idx) if vocab is not None else idx)[0]
