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

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from selfspec.decoding.costs import StepTimer as _StepTimer
from selfspec.decoding.costs import _timed, median_ratio, median_seconds  # noqa: F401  (re-exported: tree_costs, eval/)
from selfspec.errors import check
from selfspec.heads import HeadConfig, build_head, head_types as registered
from selfspec.utils.markdown import LEFT, RIGHT, table


class StepTimer(_StepTimer):
    """The engine's step timer (decoding/costs.py) with verify costs by exit layer: `reuse_exit_layer=E` times the
    verify of a logit lens at E, whose drafter leaves layers < E untouched (what lens / medusa / adapter heads pay)."""

    def verify_step(self, draft_len: int, reuse_exit_layer: int | None = None, head=None) -> Callable[[], list[int]]:
        if reuse_exit_layer is not None:
            head = build_head(HeadConfig(type="lens", exit_layer=reuse_exit_layer), self.bb)
        return super().verify_step(draft_len, head)


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
