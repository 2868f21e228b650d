"""Timing the engine's own steps at a fixed context, relative to one autoregressive step: the draft and verify costs
(c and v) that every speedup prediction needs (evaluation's calibration and step-cost tables, analysis, head=auto's
choice among the shipped drafts, heads/auto.py). Each cost is the median over repeats of a step's time divided by
the time of an autoregressive step taken right before it, so that drift in the machine's speed cancels."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import replace

import torch

from selfspec.decoding.config import DecodeConfig
from selfspec.decoding.engine import Decoder
from selfspec.decoding.verify import Draft, TreeDraft
from selfspec.errors import check
from selfspec.utils.timing import timed


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    return timed(fn, device)[1]


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 20, warmup: int = 3) -> float:
    """Median wall time of fn() (synchronized on CUDA, so queued kernels are counted)."""
    check(repeats >= 1, f"costs.repeats={repeats}: must be >= 1")
    for _ in range(warmup):
        fn()
    return statistics.median(_timed(fn, device) for _ in range(repeats))


def median_ratio(fn: Callable[[], object], ref: Callable[[], object], device: torch.device, repeats: int = 20,
                 warmup: int = 3) -> float:
    """Median of time(fn) / time(ref), the two timed back to back in each repeat: drift in the machine's speed
    (other load, clocks) then cancels in each ratio instead of landing on whichever was timed during a slow spell."""
    check(repeats >= 1, f"costs.repeats={repeats}: must be >= 1")
    for _ in range(warmup):
        ref()
        fn()
    return statistics.median(_timed(fn, device) / _timed(ref, device) for _ in range(repeats))


class StepTimer:
    """Times single steps of the engine itself (decoding/engine.py: a chain's `verify.Draft.verify`, the drafter's `draft_logits`)
    at a fixed context length: each step is set up on a `DecodeState` whose first `context` positions count as
    already fed (`Drafter.assume_seen`), so a call does exactly one step's work, and is reset before the next."""

    def __init__(self, backbone, context: int = 200, max_draft_len: int = 8, repeats: int = 20, warmup: int = 3,
                 seed: int = 0):
        bb = self.bb = backbone
        check(context >= 1, f"costs.context={context}: must be >= 1")
        check(context + max_draft_len + 1 <= bb.max_positions,
              f"costs.context={context}: context + draft length exceeds the model's {bb.max_positions} positions")
        self.context = context
        self.max_draft_len = max_draft_len
        self.repeats = repeats
        self.warmup = warmup
        self.device = bb.device
        g = torch.Generator().manual_seed(seed)
        # Token ids only pick embedding rows; any ids cost the same. Keep clear of special tokens.
        self.ids = torch.randint(0, min(bb.vocab_size, 256), (context + max_draft_len + 1,), generator=g).tolist()

    def _state(self, head=None, draft_len: int = 1, cfg=None):
        """A generation with positions [0, context] committed, the last one not yet through the full stack (decoded
        with `cfg`, by default a chain of draft_len)."""
        decoder = Decoder(self.bb, head)
        cfg = cfg or DecodeConfig(strategy="selfspec" if head is not None else "autoregressive",
                                  draft_len=max(1, draft_len), max_new_tokens=self.max_draft_len + 1)
        state = decoder.start(self.ids[: self.context + 1], cfg)
        state.tokens[: len(self.ids)] = torch.tensor(self.ids, device=self.device)
        return decoder, state

    @torch.inference_mode()
    def seconds(self, step: Callable[[], object]) -> float:
        return median_seconds(step, self.device, self.repeats, self.warmup)

    @torch.inference_mode()
    def ratio(self, step: Callable[[], object]) -> float:
        """step's cost in autoregressive steps."""
        return median_ratio(step, self.ar_step(), self.device, self.repeats, self.warmup)

    def ar_step(self) -> Callable[[], int]:
        """A chain's verify with no drafts: layers [0, L) over 1 token + norm + LM head."""
        return self.verify_step(0)

    def draft_step(self, head, exit_layer: int, ahead: int = 1) -> Callable[[], int]:
        """One draft pass through the head's own drafter at exit layer E (`exit_layer` may be below a LoRA
        head's: running layers [0, E) with its adapters on costs what a LoRA on exactly those layers costs);
        ahead = m > 1: the pass proposes m tokens (decode.tokens_per_pass, the head's extra heads)."""
        bb, ctx, E = self.bb, self.context, exit_layer
        check(1 <= E <= bb.num_layers, f"exit layer {E}: must be in [1, {bb.num_layers}] for this model")
        decoder, state = self._state(head)
        drafter = state.drafter
        drafter.exit_layer = E  # time the drafter's own code at this depth

        def step():
            drafter.assume_seen(ctx)
            if ahead > 1:
                return drafter.draft_ahead_logits(state, ctx + 1, ahead).argmax(-1).tolist()
            return int(drafter.draft_logits(state, ctx + 1).argmax())  # int(): the engine syncs per draft too

        return step

    def draft_cost(self, head, exit_layer: int, ahead: int = 1) -> float:
        """c: one draft's cost in autoregressive steps. Where the engine drafts a greedy chain in one kernel call (a
        logit lens or a context head, decode.fused_chain), a chain of max_draft_len drafts is timed and c is its share
        per draft (a context head's chain also runs its last draft's layers < E, which verification then reads: c
        holds them, and the verify cost counts them again, about 2/L of a step per round for E = 2); otherwise one pass
        (draft_step)."""
        chain = self.chain_step(head, exit_layer) if ahead == 1 else None
        if chain is not None:
            return self.ratio(chain) / self.max_draft_len
        return self.ratio(self.draft_step(head, exit_layer, ahead))

    def chain_step(self, head, exit_layer: int) -> Callable[[], bool] | None:
        """max_draft_len greedy drafts in one call of the drafter's draft_chain (or draft_chain_dynamic, no stop rule),
        or None where it drafts pass by pass."""
        check(1 <= exit_layer <= self.bb.num_layers, f"exit layer {exit_layer}: must be in [1, {self.bb.num_layers}] for this model")
        decoder, state = self._state(head)
        drafter, ctx, m = state.drafter, self.context, self.max_draft_len
        drafter.exit_layer = exit_layer

        def step():
            drafter.assume_seen(ctx)
            return drafter.draft_chain(state, ctx + 1, m) or drafter.draft_chain_dynamic(state, ctx + 1, m, 0.0, 0.0) is not None

        with torch.inference_mode():
            return step if step() else None

    def verify_step(self, draft_len: int, head=None) -> Callable[[], list[int]]:
        """A chain's verify (`verify.Draft.verify`) over K+1 tokens through `head`'s drafter (None: the full stack);
        a head whose drafter leaves layers < E untouched (LayerSkip's reuse) runs layers < E over the last draft
        token only, as after a real draft."""
        ctx, K = self.context, draft_len
        decoder, state = self._state(head, K)
        draft = Draft(tokens=self.ids[ctx + 1 : ctx + 1 + K])
        seen = ctx + K if head is not None else ctx  # the drafted positions have been through layers < E

        def step():
            state.verified = ctx
            state.drafter.assume_seen(seen)
            return draft.verify(decoder.bb, state).argmax(-1).tolist()

        return step

    def tree_steps(self, head, cfg) -> tuple[Callable[[], object], Callable[[], list[int]], int, int]:
        """One tree round of `cfg` (decode.tree=static|dynamic, or decode.lookup) through the engine's own tree rounds (proposers/trees.py, verify.py),
        as two steps: the draft (the proposer's `propose`: the head's pass after the root, then one pass over each
        depth's frontier, the tree built between) and the verify (`verify.TreeDraft.verify` over every node of the tree the first
        draft built; the drafter's reuse of layers < E included). Context lookup rarely matches the timer's random
        ids, so its branches are not in the timed tree.
        -> (draft step, verify step, draft passes of that round, its verify rows)."""
        check(head is not None and cfg.uses_tree, "StepTimer.tree_steps: needs a head and a tree config")
        ctx = self.context
        depth = cfg.tree_depth(head=True)
        cfg = replace(cfg, strategy="selfspec", draft_threshold=None, draft_continue=None, stop=[],
                      max_new_tokens=max(depth, self.max_draft_len) + 1)
        check(ctx + cfg.max_new_tokens <= self.bb.max_positions,
              f"costs.context={ctx}: context + a {depth}-deep tree exceeds the model's {self.bb.max_positions} positions")
        decoder, state = self._state(head, cfg=cfg)

        def draft():
            state.drafter.assume_seen(ctx)
            return state.proposer.propose(state)

        with torch.inference_mode():
            before = state.stats.draft_steps
            tree = draft().tree
        check(tree is not None, "StepTimer.tree_steps: the round proposed no tree")
        passes = state.stats.draft_steps - before

        def verify():
            state.verified = ctx  # the root (position ctx) is the last committed token
            return TreeDraft(tree, ctx).verify(decoder.bb, state).argmax(-1).tolist()

        return draft, verify, passes, len(tree)
