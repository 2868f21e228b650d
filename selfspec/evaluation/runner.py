"""Run several decoding methods over a prompt set, interleaved prompt by prompt, and record what each produced.

Methods (all greedy, same weights, dtype, prompts and max_new_tokens):
  hf_generate       HF `generate(do_sample=False)`: the reference
  hf_early_exit     HF `generate(assistant_early_exit=E)`: HF's own self-speculation (no KV sharing)
  hf_prompt_lookup  HF `generate(prompt_lookup_num_tokens=N)`
  autoregressive    our engine without drafts
  selfspec          our engine with the exit head

For each prompt every method runs before the next prompt starts, so slow drift (thermal throttling, other
load on the machine) hits all methods alike; the order of the methods rotates from prompt to prompt so that
none is always first after a model switch. Every call is timed with perf_counter around the whole call (HF's
input preparation and our cache allocation included), synchronised on CUDA.

Multi-turn items (MT-bench) feed each method's OWN answer back as the assistant message before the next user
turn, as Spec-Bench does; a record holds the concatenated new ids of all turns and the summed stats.
"""

from __future__ import annotations

import logging
import math
import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from selfspec.decoding.engine import DecodeConfig, Decoder
from selfspec.errors import check

log = logging.getLogger(__name__)

METHODS = ("hf_generate", "hf_early_exit", "hf_prompt_lookup", "autoregressive", "selfspec")
HF_METHODS = METHODS[:3]

# Counts summed over the turns of a conversation; everything else in a record's stats is derived from them.
_SUM_KEYS = ("new_tokens", "verify_steps", "drafted", "draft_steps", "accepted", "seconds", "draft_s", "verify_s", "engine_seconds",
             "prompt_tokens")
_LIST_KEYS = ("drafted_per_position", "accepted_per_position")


# ------------------------------------------------------------------------------------------------ measurement
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> float:
    """CUDA: peak allocated since the last reset (per call). CPU: the process's max RSS so far, which is
    process-wide and monotonic, so on CPU it is the same for every method of one run."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


# ------------------------------------------------------------------------------------------------ methods
class Method:
    """A named way to continue token ids: `generate(ids, max_new_tokens) -> (new ids, stats)`.

    Stats always carry new_tokens, verify_steps (full-depth forward passes), drafted, accepted and the
    per-position lists, so every method goes through `report.summarize_methods` the same way."""

    def __init__(self, name: str, head_params: int | None = None, exit_layer: int | None = None,
                 draft_len: int | None = None):
        self.name = name
        self.head_params = head_params
        self.exit_layer = exit_layer
        self.draft_len = draft_len

    def generate(self, ids: list[int], max_new_tokens: int) -> tuple[list[int], dict]:  # pragma: no cover
        raise NotImplementedError


class EngineMethod(Method):
    def __init__(self, name: str, backbone, head, cfg: DecodeConfig, eos_ids: list[int]):
        super().__init__(name, head_params=head.num_params() if head is not None else None,
                         exit_layer=head.exit_layer if head is not None else None,
                         draft_len=cfg.draft_len if head is not None else None)
        self.decoder = Decoder(backbone, head)
        self.cfg = cfg
        self.eos_ids = eos_ids

    def generate(self, ids, max_new_tokens):
        cfg = self.cfg if max_new_tokens == self.cfg.max_new_tokens else replace(self.cfg, max_new_tokens=max_new_tokens)
        new, stats = self.decoder.generate(ids, cfg, self.eos_ids)
        stats = dict(stats, engine_seconds=stats["seconds"])
        return new, stats


class _TargetCalls:
    """Forward pre-hook on the HF model that records (first position, number of tokens) of each full-depth call.

    HF's early-exit assistant is the model itself with `config.num_hidden_layers` lowered to E while it
    drafts; those calls are drafts and are skipped. What remains are the target's forward passes: prefill,
    then one per generated token (plain generate) or one per verify round (assisted generation)."""

    def __init__(self, hf_model):
        self.model = hf_model
        self.depth = hf_model.config.num_hidden_layers
        self.calls: list[tuple[int, int]] = []

    def __enter__(self):
        self.calls = []
        self._handle = self.model.register_forward_pre_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self._handle.remove()

    def _hook(self, module, args, kwargs):
        if self.model.config.num_hidden_layers < self.depth:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        pos = kwargs.get("position_ids")
        if pos is not None:
            start = int(pos[0, 0])
        else:  # the uncached part starts where the cache ends
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            start = cache.get_seq_length() if cache is not None else 0
        self.calls.append((start, int(ids.shape[1])))


def hf_round_stats(calls: list[tuple[int, int]], prompt_len: int, new_tokens: int) -> dict:
    """Drafted / accepted counts per round, recovered from the target's calls.

    A round starts at the last committed token, which the target has not yet seen (position start); its input
    holds that token and the k drafts, so with c committed tokens k = start + n - c. The next round starts at
    the new last committed token: c' = start' + 1, and the round accepted a = c' - c - 1 drafts."""
    drafted_pp: list[int] = []
    accepted_pp: list[int] = []
    committed = prompt_len
    for i, (start, n) in enumerate(calls):
        k = max(0, start + n - committed)
        nxt = calls[i + 1][0] + 1 if i + 1 < len(calls) else prompt_len + new_tokens
        a = max(0, min(k, nxt - committed - 1))
        for j in range(k):
            if j == len(drafted_pp):
                drafted_pp.append(0)
                accepted_pp.append(0)
            drafted_pp[j] += 1
            accepted_pp[j] += int(j < a)
        committed = nxt
    return {"verify_steps": len(calls), "drafted": sum(drafted_pp), "accepted": sum(accepted_pp),
            "drafted_per_position": drafted_pp, "accepted_per_position": accepted_pp}


class HFMethod(Method):
    def __init__(self, name: str, model, kwargs: dict, exit_layer: int | None = None):
        super().__init__(name, head_params=0 if name == "hf_early_exit" else None, exit_layer=exit_layer,
                         draft_len=kwargs.get("num_assistant_tokens") or kwargs.get("prompt_lookup_num_tokens"))
        self.hf_model = model.hf_model
        self.kwargs = kwargs
        self.eos_ids = model.eos_ids
        tok = model.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else self.eos_ids[0]

    @torch.inference_mode()
    def generate(self, ids, max_new_tokens):
        dev = self.hf_model.device
        x = torch.tensor([ids], dtype=torch.long, device=dev)
        with _TargetCalls(self.hf_model) as calls:
            t = time.perf_counter()
            # EOS ids and pad given explicitly: HF then stops exactly where our engine stops (EOS included).
            out = self.hf_model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                eos_token_id=self.eos_ids, pad_token_id=self.pad_id, **self.kwargs,
            )
            _sync(dev)
            seconds = time.perf_counter() - t
        new = out[0, len(ids):].tolist()
        # Batch 1 never pads, but a stray pad after EOS would break the token-for-token comparison.
        for i, tok in enumerate(new):
            if tok in self.eos_ids:
                new = new[: i + 1]
                break
        stats = {"strategy": self.name, "new_tokens": len(new), "seconds": seconds, "prompt_tokens": len(ids),
                 **hf_round_stats(calls.calls, len(ids), len(new))}
        return new, stats


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


def build_methods(
    names: Sequence[str],
    model,
    decode: DecodeConfig,
    head=None,
    hf_options: dict | None = None,
) -> list[Method]:
    """Method objects for `names` in the given order. `head` is used by selfspec (and gives hf_early_exit E)."""
    check_methods(names, decode)
    hf = hf_options or {}
    out: list[Method] = []
    for name in names:
        if name == "hf_generate":
            out.append(HFMethod(name, model, {}))
        elif name == "hf_early_exit":
            check(head is not None, "methods: hf_early_exit needs an exit layer (head=... head.exit_layer=E)")
            kw = {"assistant_early_exit": head.exit_layer}
            if hf.get("num_assistant_tokens"):
                kw["num_assistant_tokens"] = int(hf["num_assistant_tokens"])
            out.append(HFMethod(name, model, kw, exit_layer=head.exit_layer))
        elif name == "hf_prompt_lookup":
            kw = {"prompt_lookup_num_tokens": int(hf.get("prompt_lookup_num_tokens") or 10)}
            if hf.get("max_matching_ngram_size"):
                kw["max_matching_ngram_size"] = int(hf["max_matching_ngram_size"])
            out.append(HFMethod(name, model, kw))
        elif name == "autoregressive":
            out.append(EngineMethod(name, model.backbone, None, replace(decode, strategy="autoregressive"), model.eos_ids))
        else:
            check(head is not None, "methods: selfspec needs a head (head=lens|medusa|adapter|lora or head.path=DIR)")
            out.append(EngineMethod(name, model.backbone, head, replace(decode, strategy="self_speculative"), model.eos_ids))
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
    out: dict = {k: v for k, v in per_turn[0].items() if k not in _SUM_KEYS and k not in _LIST_KEYS}
    for k in _SUM_KEYS:
        vals = [s[k] for s in per_turn if s.get(k) is not None]
        if vals:
            out[k] = sum(vals)
    for k in _LIST_KEYS:
        acc: list[int] = []
        for s in per_turn:
            for i, v in enumerate(s.get(k) or []):
                if i == len(acc):
                    acc.append(0)
                acc[i] += v
        out[k] = acc
    out["accepted_per_position"] += [0] * (len(out["drafted_per_position"]) - len(out["accepted_per_position"]))
    n, steps, drafted = out["new_tokens"], out["verify_steps"], out["drafted"]
    out["tau"] = n / steps if steps else 0.0
    out["accept_rate"] = out["accepted"] / drafted if drafted else None
    out["accept_rate_per_position"] = [a / d if d else None for a, d in
                                       zip(out["accepted_per_position"], out["drafted_per_position"])]
    out["tokens_per_s"] = n / out["seconds"] if out["seconds"] > 0 else 0.0
    out["turns"] = len(per_turn)
    return out


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
    for t in range(len(item.turns)):
        ids, text = renderer.render(item.turns, answers)
        _sync(device)
        t0 = time.perf_counter()
        new, stats = method.generate(ids, max_new_tokens)
        _sync(device)
        stats["seconds"] = time.perf_counter() - t0  # the same clock around every method's whole call
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


def warm_up(methods: Sequence[Method], item, renderer: Renderer, max_new_tokens: int = 16) -> None:
    """One untimed short call per method: first-call costs (allocator growth, lazy init, kernel selection)
    would otherwise land on whichever method happens to run first."""
    ids, _ = renderer.render(item.turns, [])
    for m in methods:
        m.generate(ids, max_new_tokens)


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
    """Every method on every item, interleaved; -> records in run order. on_record(record, i, n) after each."""
    check(len(items) > 0, "data: no prompts selected")
    if warmup:
        warm_up(methods, items[0], renderer, min(16, max_new_tokens))
    records = []
    for i, item in enumerate(items):
        k = i % len(methods)
        for m in list(methods[k:]) + list(methods[:k]):  # rotate: no method is always first
            rec = run_conversation(m, item, renderer, max_new_tokens, device, save_prompts)
            records.append(rec)
            if on_record is not None:
                on_record(rec, i, len(items))
    return records


# ------------------------------------------------------------------------------------------------ draft_len=auto
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

    check(len(prompt_ids) > 0, "decode.draft_len=auto: no calibration prompts")
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
        drafted = [0] * k_max
        accepted = [0] * k_max
        for ids in prompt_ids:
            _, st = decoder.generate(ids, cfg, model.eos_ids)
            for i, (d, a) in enumerate(zip(st["drafted_per_position"], st["accepted_per_position"])):
                drafted[i] += d
                accepted[i] += a
        rates = [a / d if d else None for a, d in zip(accepted, drafted)]
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
