"""One engine, every strategy: a round of decoding is propose -> verify -> accept -> commit -> observe.

  propose  the strategy's proposal for the next positions: a chain of drafts or a draft tree (proposers/: one
           object per strategy; the autoregressive baseline proposes nothing)
  verify   the rest of the stack over the proposal in ONE forward, scoring every proposed token (verify.py)
  accept   greedy: the longest proposal equal to the target's argmax, then the target's token; sampling: the
           min(1, p/q) test with residual or bonus sampling (sampling.py, tree.py)
  commit   keep the accepted tokens and the target's; every cache's valid length drops to the new n - 1: caches
           are written by position (cache.py), so the commit is the rollback
  observe  the proposer learns what was committed (context lookup's index)

How drafts are made (which layers, which precision, which cache, what verification reuses) is the drafter's
business (drafters.py); which drafts a round proposes is the proposer's. The engine returns token ids and
`DecodeStats`; it does no I/O. A greedy chain round reads the device back once (the commit); on CUDA the draft /
verify split comes from events that `finish` reads with one wait (state.Timer).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from selfspec.decoding.config import STRATEGIES, DecodeConfig
from selfspec.decoding.drafters import Drafter, NoDrafter, make_drafter
from selfspec.decoding.proposers import Proposer, make_proposer
from selfspec.decoding.state import DecodeResult, DecodeState, Observer, StopFn, Timer
from selfspec.decoding.stats import DecodeStats  # noqa: F401 (re-exported)
from selfspec.decoding.verify import Draft, TreeDraft
from selfspec.errors import SelfSpecError, check
from selfspec.model.cache import KVCache

__all__ = ["STRATEGIES", "DecodeConfig", "DecodeResult", "DecodeState", "DecodeStats", "Decoder", "Draft", "TreeDraft"]


class Decoder:
    """Decodes one sequence (batch 1) with a Backbone and an optional exit head.

    `drafter_factory(backbone, head, max_len) -> Drafter` makes each generation's drafter (default: the head's
    own way of drafting, drafters.make_drafter); `proposer_factory(cfg, drafter) -> Proposer` its strategy (default:
    the one the decode keys ask for, proposers.make_proposer)."""

    def __init__(self, backbone, head=None, drafter_factory: Callable[..., Drafter] = make_drafter,
                 proposer_factory: Callable[..., Proposer] = make_proposer):
        self.bb = backbone
        self.head = head
        self.drafter_factory = drafter_factory
        self.proposer_factory = proposer_factory

    @torch.inference_mode()
    def decode(self, prompt_ids, cfg: DecodeConfig, eos_ids: Sequence[int] = (), stop_fn: StopFn | None = None,
               observer: Observer | None = None) -> DecodeResult:
        """prompt_ids: 1-D ids. stop_fn(new_ids) -> number of tokens to keep if a stop string completed, else None.
        observer(token_ids, logits): called after each verify with the ids the target's logits follow (a chain: the
        ids through the last draft, and the (k+1, V) logits at the last k+1 positions; a tree: the ids through the
        root, and the (N, V) logits after each node in tree order); for tests and analysis, no I/O here."""
        state = self.start(prompt_ids, cfg, eos_ids)
        proposer = state.proposer
        while not state.done:
            n0 = state.n
            draft = proposer.propose(state)
            logits = draft.verify(self.bb, state)
            if observer is not None:
                observer(draft.history(state), logits)
            draft.commit(state, *draft.accept(state, logits), stop_fn)
            proposer.observe(state, n0)
        return self.finish(state)

    def generate(self, prompt_ids, cfg: DecodeConfig, eos_ids: Sequence[int] = (), stop_fn: StopFn | None = None,
                 observer: Observer | None = None) -> tuple[list[int], dict]:
        """`decode` with the stats as a dict: (new token ids, stats dict)."""
        result = self.decode(prompt_ids, cfg, eos_ids, stop_fn, observer)
        return result.token_ids, result.stats.to_dict()

    def start(self, prompt_ids, cfg: DecodeConfig, eos_ids: Sequence[int] = ()) -> DecodeState:
        """Check the request and allocate one generation's buffers; the clock starts here."""
        bb, spec = self.bb, cfg.strategy == "selfspec"
        check(not (spec and cfg.tree == "auto"),
              "decode.tree=auto: not resolved; calibration chooses the tree (python -m selfspec.eval decode.tree=auto, or "
              "selfspec.evaluation.calibration.calibrate_tree), then decode with its choice (decode.tree=chain|static|dynamic)")
        prompt = self._check_prompt(prompt_ids, cfg)
        cfg.check_fits(bb.max_positions)  # every size of the round against this model, before anything is allocated
        P, dev = prompt.numel(), bb.device
        max_len = P + cfg.max_new_tokens + cfg.round_slots() + 1  # the most a generation's buffers hold
        drafter = self.drafter_factory(bb, self.head, max_len) if spec else NoDrafter(bb)
        proposer = self.proposer_factory(cfg, drafter)
        eos_set = frozenset(int(e) for e in eos_ids)
        ks = bb.kv_shape
        state = DecodeState(
            cfg, torch.zeros(max_len, dtype=torch.long, device=dev), P, P,
            KVCache(range(bb.num_layers), 1, ks.kv_heads, ks.head_dim, max_len, bb.dtype, dev), drafter, proposer.depth,
            torch.tensor(sorted(eos_set), dtype=torch.long, device=dev), self._generator(cfg, dev), proposer.new_stats(P),
            eos_ids=eos_set, proposer=proposer)
        state.tokens[:P] = prompt
        proposer.start(state)
        state.timer = Timer(dev)
        return state

    def _check_prompt(self, prompt_ids, cfg: DecodeConfig) -> torch.Tensor:
        bb = self.bb
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=bb.device).reshape(-1)
        P = prompt.numel()
        check(P >= 1, "prompt: must not be empty")
        lo, hi = int(prompt.min()), int(prompt.max())
        check(lo >= 0 and hi < bb.vocab_size, f"prompt: token id {lo if lo < 0 else hi} is outside the vocabulary [0, {bb.vocab_size})")
        if P + cfg.max_new_tokens > bb.max_positions:
            raise SelfSpecError(
                f"decode.max_new_tokens={cfg.max_new_tokens}: prompt ({P} tokens) + max_new_tokens exceeds the model's context ({bb.max_positions})"
            )
        return prompt

    @staticmethod
    def _generator(cfg: DecodeConfig, dev) -> torch.Generator | None:
        """Sampling's generator: seeded by decode.seed, else a fresh seed for it alone (the caller's global
        generator is left alone)."""
        if cfg.greedy:
            return None
        generator = torch.Generator(device=dev)
        if cfg.seed is not None:
            generator.manual_seed(cfg.seed)
        else:
            generator.seed()
        return generator

    def finish(self, state: DecodeState) -> DecodeResult:
        new = list(state.out)
        state.timer.settle(state.stats)  # CUDA: the generation's one wait for the device's clock
        state.stats.new_tokens = len(new)
        state.stats.seconds = time.perf_counter() - state.timer.start
        return DecodeResult(new, state.stats)
