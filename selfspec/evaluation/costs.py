"""Step costs relative to one autoregressive step: what `report.predicted_speedup` needs as c and v.

    python -m selfspec.cli.costs model=smollm2_135m costs.repeats=20       # config: conf/costs.yaml
    python -m selfspec.cli.costs model=tiny 'model.random_init={model_type: llama, hidden_size: 4096, ...}' \
        model.dtype=bfloat16 model.device=cuda          # a random-init Llama-3-8B-like config on a GPU

Times, at a context of `costs.context` tokens, each as the median over `costs.repeats` of its time divided by
the time of an autoregressive step taken right before it (paired, so that drift in the machine's speed cancels):
  ar        one full autoregressive step: layers [0, L) over 1 token + norm + LM head + argmax
  draft     one draft step at exit layer E with each head type: layers [0, E) over 1 token + the head + argmax
            (LoRA: with its adapters on, as the engine drafts); a logit lens's greedy chain, which the engine drafts
            in one kernel call on the CPU, as its time over the chain's length
  verify    one verify step over K+1 tokens through the whole stack (what a LoRA head pays)
  verify_reuse[E]  the same with LayerSkip's reuse: layers [0, E) over the last draft token only, layers [E, L)
            over K+1 tokens (what lens / medusa / adapter heads pay)
`ar_step_s` is reported in seconds (median), the rest as ratios to it. Costs do not depend on the weights, so untrained heads and random-init
models measure the same thing as trained ones; the cache holds zeros, which costs the same as real K/V.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from selfspec.errors import check
from selfspec.utils.markdown import LEFT, RIGHT, table
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
        from selfspec.decoding.config import DecodeConfig
        from selfspec.decoding.engine import Decoder

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

    def verify_step(self, draft_len: int, reuse_exit_layer: int | None = None) -> Callable[[], list[int]]:
        """A chain's verify (`verify.Draft.verify`) over K+1 tokens; with reuse_exit_layer=E (the drafter of a head that leaves layers < E
        untouched), layers < E run over the last draft token only, as after a real draft."""
        from selfspec.decoding.verify import Draft
        from selfspec.heads import HeadConfig, build_head

        ctx, K = self.context, draft_len
        head = None
        if reuse_exit_layer is not None:
            head = build_head(HeadConfig(type="lens", exit_layer=reuse_exit_layer), self.bb)
        decoder, state = self._state(head, K)
        draft = Draft(tokens=self.ids[ctx + 1 : ctx + 1 + K])
        seen = ctx + K if head is not None else ctx  # the drafted positions have been through layers < E

        def step():
            state.verified = ctx
            state.drafter.assume_seen(seen)
            return draft.verify(decoder.bb, state).argmax(-1).tolist()

        return step


    def tree_steps(self, head, cfg) -> tuple[Callable[[], object], Callable[[], list[int]], int, int]:
        """One tree round of `cfg` (decode.tree=static|dynamic, or decode.lookup) through the engine's own tree steps,
        as two steps: the draft (the proposer's `propose`: the head's pass after the root, then one pass over each
        depth's frontier, the tree built between) and the verify (`verify.TreeDraft.verify` over every node of the tree the first
        draft built; the drafter's reuse of layers < E included). Context lookup rarely matches the timer's random
        ids, so its branches are not in the timed tree.
        -> (draft step, verify step, draft passes of that round, its verify rows)."""
        from dataclasses import replace

        from selfspec.decoding.verify import TreeDraft

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


def measure_costs(
    backbone,
    heads: dict[str, object],
    exit_layers: list[int],
    draft_lens: list[int],
    context: int = 200,
    repeats: int = 20,
    warmup: int = 3,
) -> dict:
    """Cost ratios for every head in `heads` (name -> ExitHead) at every E in `exit_layers`, and verify ratios for
    every K in `draft_lens` (full stack, and with reuse at each E). Returns plain JSON-able dicts:
    {"ar_step_s", "draft": {name: {E: c}}, "verify": {K: v}, "verify_reuse": {E: {K: v}}, ...}."""
    L = backbone.num_layers
    bad = [e for e in exit_layers if not 1 <= e <= L]
    check(not bad, f"costs.exit_layers: {bad} out of range [1, {L}] for this {L}-layer model")
    check(all(isinstance(k, int) and k >= 1 for k in draft_lens), f"costs.draft_lens={draft_lens}: integers >= 1")
    timer = StepTimer(backbone, context, max(draft_lens), repeats, warmup)
    ar = timer.seconds(timer.ar_step())
    out = {
        "context": context, "repeats": repeats, "num_layers": L,
        "device": str(backbone.device), "dtype": str(backbone.dtype).removeprefix("torch."),
        "ar_step_s": ar, "draft": {}, "verify": {}, "verify_reuse": {},
    }
    for name, head in heads.items():
        usable = [e for e in exit_layers if head.reuses_early_layers or e <= head.exit_layer]
        out["draft"][name] = {e: timer.draft_cost(head, e) for e in usable}
    for k in draft_lens:
        out["verify"][k] = timer.ratio(timer.verify_step(k))
    for e in exit_layers:
        out["verify_reuse"][e] = {k: timer.ratio(timer.verify_step(k, reuse_exit_layer=e)) for k in draft_lens}
    return out


def costs_markdown(costs: dict, title: str = "Step costs") -> str:
    """Two tables: draft cost c by head x E, verify cost v by K (full stack and with reuse at each E)."""
    es = sorted({e for per in costs["draft"].values() for e in per} | set(costs["verify_reuse"]))
    ks = sorted(costs["verify"])
    lines = [
        f"# {title}", "",
        f"Relative to one autoregressive step ({costs['ar_step_s'] * 1e3:.2f} ms) at a {costs['context']}-token "
        f"context, {costs['num_layers']} layers, {costs['device']} / {costs['dtype']}, median of {costs['repeats']}.", "",
        "## Draft step c (layers < E + head)", "",
    ]
    lines += table(["head"] + [f"E={e}" for e in es],
                   [[name] + [f"{per[e]:.3f}" if e in per else "-" for e in es] for name, per in costs["draft"].items()],
                   align=[LEFT] + [RIGHT] * len(es))
    reuse_es = sorted(costs["verify_reuse"])
    lines += ["", "## Verify step v over K+1 tokens", ""]
    lines += table(["K", "full stack"] + [f"reuse E={e}" for e in reuse_es],
                   [[k, f"{costs['verify'][k]:.3f}"] + [f"{costs['verify_reuse'][e][k]:.3f}" for e in reuse_es] for k in ks],
                   align=[RIGHT] * (2 + len(reuse_es)))
    return "\n".join(lines) + "\n"


def build_cost_heads(model, head_types: list[str], exit_layers: list[int], draft_vocab: int | None = None) -> dict[str, object]:
    """One untrained head per type. Head modules do not grow with E, so one instance times every E; the LoRA
    head is attached at the deepest E (a model carries one LoRA) and timed at shallower E with layers [0, E)."""
    from selfspec.heads import HeadConfig, build_head
    from selfspec.heads import head_types as registered

    unknown = [t for t in head_types if t not in registered()]
    check(not unknown, f"costs.head_types: unknown {unknown}; allowed {', '.join(registered())}")
    e_max = max(exit_layers)
    # LoRA last: it injects modules into the model, which the other heads must not see.
    order = sorted(head_types, key=lambda t: t == "lora")
    return {t: build_head(HeadConfig(type=t, exit_layer=e_max, draft_vocab=draft_vocab), model.backbone, model.eos_ids)
            for t in order}


@dataclass
class CostsConfig:
    """The `costs` node of conf/costs.yaml."""

    exit_layers: list[int] = field(default_factory=lambda: [4, 8, 12])
    head_types: list[str] = field(default_factory=lambda: ["lens", "medusa", "adapter", "lora"])
    draft_lens: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    context: int = 200  # tokens in the cache when a step is timed
    repeats: int = 20  # median over this many paired timings
    draft_vocab: int | None = None  # draft heads score only the N most frequent tokens

    def __post_init__(self):
        def ints(values, key: str) -> list[int]:
            ok = isinstance(values, (list, tuple)) and len(values) > 0 and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values)
            check(ok, f"costs.{key}={values!r}: must be a non-empty list of integers >= 1")
            return [int(v) for v in values]

        self.exit_layers = ints(self.exit_layers, "exit_layers")
        self.draft_lens = ints(self.draft_lens, "draft_lens")
        if isinstance(self.head_types, str):
            self.head_types = [self.head_types]
        self.head_types = [str(t) for t in self.head_types]
        check(isinstance(self.context, int) and self.context >= 1, f"costs.context={self.context!r}: must be an integer >= 1")
        check(isinstance(self.repeats, int) and self.repeats >= 1, f"costs.repeats={self.repeats!r}: must be an integer >= 1")
        check(self.draft_vocab is None or (isinstance(self.draft_vocab, int) and self.draft_vocab >= 1),
              f"costs.draft_vocab={self.draft_vocab!r}: must be an integer >= 1, or null for the full vocabulary")
