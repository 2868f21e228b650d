"""Run several decoding methods over a prompt set, interleaved prompt by prompt, and record what each produced.

Methods (all greedy, same weights, dtype, prompts and max_new_tokens):
  hf_generate       HF `generate(do_sample=False)`: the reference
  hf_early_exit     HF `generate(assistant_early_exit=E)`: HF's own self-speculation (no KV sharing)
  hf_prompt_lookup  HF `generate(prompt_lookup_num_tokens=N)`
  autoregressive    our engine without drafts (decode strategy `autoregressive`)
  selfspec          our engine with the exit head (decode strategy `self_speculative`; decode.tree / decode.lookup
                    as configured)
  lookup            our engine with context-lookup drafts alone, as a chain (decode.lookup=true, no head)
  selfspec+lookup   selfspec with context-lookup branches beside the head's drafts (decode.lookup=true)

The HF methods are selfspec/model/hf_baselines.py; the interleaving (every method on a prompt before the next
prompt, rotating order, an untimed warm-up call each) is selfspec/timing.py, shared with training's
validation. Every call is timed with perf_counter around the whole call (HF's input preparation and our cache
allocation included), synchronised on CUDA.

Multi-turn items (MT-bench) feed each method's OWN answer back as the assistant message before the next user
turn, as Spec-Bench does; a record holds the concatenated new ids of all turns and the summed stats.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from selfspec.decoding.engine import DecodeConfig, Decoder
from selfspec.errors import SelfSpecError, check
from selfspec.evaluation.config import HFOptions
from selfspec.model.hf_baselines import HFGenerate, early_exit_kwargs, prompt_lookup_kwargs
from selfspec.timing import peak_memory_mb, pool_stats, reset_peak_memory, run_interleaved, timed

log = logging.getLogger(__name__)

METHODS = ("hf_generate", "hf_early_exit", "hf_prompt_lookup", "autoregressive", "selfspec", "lookup", "selfspec+lookup")
HF_METHODS = METHODS[:3]
# Our engine's methods -> the decode settings each runs over decode.*. The method names are what results and tables
# show; `selfspec` is the strategy `self_speculative` with the exit head.
ENGINE_STRATEGIES = {"autoregressive": "autoregressive", "selfspec": "self_speculative", "lookup": "self_speculative",
                     "selfspec+lookup": "self_speculative"}
ENGINE_OVERRIDES = {"lookup": dict(lookup=True, tree="chain"), "selfspec+lookup": dict(lookup=True)}
HEAD_METHODS = ("selfspec", "selfspec+lookup")  # the methods that draft with the exit head


# ------------------------------------------------------------------------------------------------ methods
class Method:
    """A named way to continue token ids: `generate(ids, max_new_tokens) -> (new ids, stats)`.

    Stats always carry new_tokens, verify_steps (full-depth forward passes), drafted, accepted and the
    per-position lists, so every method goes through `report.summarize_methods` the same way."""

    def __init__(self, name: str, head_params: int | None = None):
        self.name = name
        self.head_params = head_params

    def generate(self, ids: list[int], max_new_tokens: int) -> tuple[list[int], dict]:  # pragma: no cover
        raise NotImplementedError


class EngineMethod(Method):
    def __init__(self, name: str, backbone, head, cfg: DecodeConfig, eos_ids: list[int]):
        super().__init__(name, head_params=head.num_params() if head is not None else None)
        self.decoder = Decoder(backbone, head)
        self.cfg = cfg
        self.eos_ids = eos_ids

    def generate(self, ids, max_new_tokens):
        cfg = self.cfg if max_new_tokens == self.cfg.max_new_tokens else replace(self.cfg, max_new_tokens=max_new_tokens)
        new, stats = self.decoder.generate(ids, cfg, self.eos_ids)
        stats = dict(stats, engine_seconds=stats["seconds"])
        return new, stats


class HFMethod(Method):
    """One of HF's own decoding paths (model/hf_baselines.py) under an evaluation method name."""

    def __init__(self, name: str, model, generate_kwargs: dict):
        super().__init__(name, head_params=0 if name == "hf_early_exit" else None)
        self.hf = HFGenerate(model.hf_model, model.tokenizer, model.eos_ids, generate_kwargs)

    def generate(self, ids, max_new_tokens):
        new, stats = self.hf.generate(ids, max_new_tokens)
        return new, {"strategy": self.name, **stats}


def check_methods(names: Sequence[str], decode: DecodeConfig) -> None:
    """What can be checked before the model is loaded."""
    unknown = [n for n in names if n not in METHODS]
    check(not unknown, f"methods: unknown {unknown}; allowed {', '.join(METHODS)}")
    check(len(set(names)) == len(names), f"methods={list(names)}: each method at most once")
    check(len(names) > 0, "methods: give at least one method")
    check(decode.greedy, f"decode.temperature={decode.temperature}: evaluation is greedy (lossless is checked "
                         "token for token against HF's greedy generate); use temperature 0")
    check(not decode.stop, "decode.stop: stop strings are not supported in evaluation (HF's generate would need "
                           "the same stopping rule); leave it empty")
    for name in names:
        if name in ENGINE_OVERRIDES:  # e.g. decode.draft_threshold, which lookup's tree rounds do not take
            try:
                replace(decode, **ENGINE_OVERRIDES[name])
            except SelfSpecError as exc:
                raise SelfSpecError(f"methods: {name}: {exc}") from None


def build_methods(
    names: Sequence[str],
    model,
    decode: DecodeConfig,
    head=None,
    hf_options: HFOptions | None = None,
) -> list[Method]:
    """Method objects for `names` in the given order. `head` is used by selfspec (and gives hf_early_exit E)."""
    check_methods(names, decode)
    hf = hf_options or HFOptions()
    out: list[Method] = []
    for name in names:
        if name == "hf_generate":
            out.append(HFMethod(name, model, {}))
        elif name == "hf_early_exit":
            check(head is not None, "methods: hf_early_exit needs an exit layer (head=... head.exit_layer=E)")
            out.append(HFMethod(name, model, early_exit_kwargs(head.exit_layer, hf.num_assistant_tokens)))
        elif name == "hf_prompt_lookup":
            out.append(HFMethod(name, model, prompt_lookup_kwargs(hf.prompt_lookup_num_tokens, hf.max_matching_ngram_size)))
        else:
            if name in HEAD_METHODS:
                check(head is not None, f"methods: {name} needs a head (head=lens|medusa|adapter|lora|layer or head.path=DIR)")
            cfg = replace(decode, strategy=ENGINE_STRATEGIES[name], **ENGINE_OVERRIDES.get(name, {}))
            out.append(EngineMethod(name, model.backbone, head if name in HEAD_METHODS else None, cfg, model.eos_ids))
    return out


# ------------------------------------------------------------------------------------------------ prompts
@dataclass
class Renderer:
    """Turns a conversation (user turns + the method's own answers so far) into prompt ids."""

    tokenizer: object
    chat: bool

    def render(self, turns: Sequence[str], answers: Sequence[str]) -> tuple[list[int], str]:
        """Prompt for user turn len(answers), after the earlier turns and answers. -> (ids, rendered text)."""
        tok = self.tokenizer
        if self.chat:
            messages = []
            for i, turn in enumerate(turns[: len(answers) + 1]):
                messages.append({"role": "user", "content": turn})
                if i < len(answers):
                    messages.append({"role": "assistant", "content": answers[i]})
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            # The template already holds any BOS; tokenizing it must not add a second one.
            return list(tok(text, add_special_tokens=False)["input_ids"]), text
        parts = [p for i, t in enumerate(turns[: len(answers) + 1]) for p in ((t, answers[i]) if i < len(answers) else (t,))]
        text = "\n\n".join(parts)
        return list(tok(text)["input_ids"]), text


# ------------------------------------------------------------------------------------------------ running
def merge_turn_stats(per_turn: list[dict]) -> dict:
    """One conversation's stats: counts and seconds summed over turns, rates recomputed from the sums."""
    return {**pool_stats(per_turn), "turns": len(per_turn)}


def run_conversation(method: Method, item, renderer: Renderer, max_new_tokens: int, device: torch.device,
                     save_prompts: bool = False) -> dict:
    """All turns of one prompt item with one method; -> a results.jsonl record."""
    answers: list[str] = []
    ids_all: list[int] = []
    per_turn: list[dict] = []
    prompts: list[str] = []
    prompt_lens: list[int] = []
    tok = renderer.tokenizer
    reset_peak_memory(device)
    for _ in range(len(item.turns)):
        ids, text = renderer.render(item.turns, answers)
        (new, stats), seconds = timed(lambda: method.generate(ids, max_new_tokens), device)
        stats["seconds"] = seconds  # the same clock around every method's whole call
        answers.append(tok.decode(new, skip_special_tokens=True))
        ids_all += new
        per_turn.append(stats)
        prompt_lens.append(len(ids))
        if save_prompts:
            prompts.append(text)
    stats = merge_turn_stats(per_turn)
    stats["peak_memory_mb"] = peak_memory_mb(device)
    record = {
        "method": method.name, "prompt_id": item.id, "category": item.category, "token_ids": ids_all,
        "text": "\n\n".join(answers), "turn_texts": answers, "turn_new_tokens": [s["new_tokens"] for s in per_turn],
        "prompt_lens": prompt_lens, "stats": stats, "head_params": method.head_params,
    }
    if save_prompts:
        record["prompts"] = prompts
    return record


def run_eval(
    methods: Sequence[Method],
    items: Sequence,
    renderer: Renderer,
    max_new_tokens: int,
    device: torch.device,
    warmup: bool = True,
    save_prompts: bool = False,
    on_record: Callable[[dict, int, int], None] | None = None,
) -> list[dict]:
    """Every method on every item, interleaved (timing.run_interleaved); -> records in run order.
    warmup: one untimed call of up to 16 tokens per method on the first item. on_record(record, i, n) after each."""
    check(len(items) > 0, "prompts: no prompts selected")
    by_name = {m.name: m for m in methods}
    runs = {m.name: (lambda item, m=m: run_conversation(m, item, renderer, max_new_tokens, device, save_prompts))
            for m in methods}
    warm = None
    if warmup:
        first_ids = renderer.render(items[0].turns, [])[0]

        def warm(name: str) -> None:
            by_name[name].generate(first_ids, min(16, max_new_tokens))

    per_item = run_interleaved(
        runs, items, warmup=warm,
        on_result=(lambda name, i, rec: on_record(rec, i, len(items))) if on_record is not None else None,
    )
    return [rec for results in per_item for rec in results.values()]


# ------------------------------------------------------------------------------------ auto.enabled: calibrated E and K
@dataclass
class Calibration:
    exit_layer: int
    draft_len: int
    predicted_speedup: float
    table: dict = field(default_factory=dict)  # E -> {"alpha", "draft_cost", "verify_cost": {K}, "predicted": {K}}


def calibrate(model, heads: dict[int, object], prompt_ids: list[list[int]], draft_lens: Sequence[int],
              max_new_tokens: int, context: int | None = None, repeats: int = 5) -> Calibration:
    """Pick (E, K) by predicted speedup: alpha from a short run at the largest K on a few prompts, costs c and
    v(K) from step timings at the prompts' context length (costs.StepTimer), then argmax over E x K of
    `report.predicted_speedup(alpha, K, c, v(K))`."""
    from selfspec.evaluation.costs import StepTimer
    from selfspec.evaluation.report import alpha_from_accept_rate_per_position, predicted_speedup

    check(len(prompt_ids) > 0, "auto.enabled=true: no calibration prompts")
    ks = sorted({int(k) for k in draft_lens})
    check(ks and ks[0] >= 1, f"auto.draft_lens={list(draft_lens)}: integers >= 1")
    k_max = ks[-1]
    bb = model.backbone
    ctx = context or max(1, int(sum(len(p) for p in prompt_ids) / len(prompt_ids)))
    ctx = min(ctx, bb.max_positions - k_max - 2)
    timer = StepTimer(bb, ctx, k_max, repeats)
    table: dict = {}
    best: tuple[float, int, int] = (-math.inf, 0, 0)
    for E, head in heads.items():
        decoder = Decoder(bb, head)
        cfg = DecodeConfig(draft_len=k_max, max_new_tokens=max_new_tokens)
        pooled = pool_stats([decoder.generate(ids, cfg, model.eos_ids)[1] for ids in prompt_ids])
        rates = pooled["accept_rate_per_position"]
        alpha = alpha_from_accept_rate_per_position(rates) if any(r is not None for r in rates) else 0.0
        c = timer.ratio(timer.draft_step(head, E))
        v = {k: timer.ratio(timer.verify_step(k, E if head.reuses_early_layers else None)) for k in ks}
        pred = {k: predicted_speedup(alpha, k, c, v[k]) for k in ks}
        table[E] = {"alpha": alpha, "accept_rate_per_position": rates, "draft_cost": c, "verify_cost": v,
                    "predicted": pred}
        for k, s in pred.items():
            if s > best[0]:
                best = (s, E, k)
    return Calibration(exit_layer=best[1], draft_len=best[2], predicted_speedup=best[0], table=table)
