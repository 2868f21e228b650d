"""Run several decoding methods over a prompt set, interleaved prompt by prompt, and record what each produced.

Methods (same weights, dtype, prompts and max_new_tokens; greedy unless decode.temperature > 0, see below):
  hf_generate       HF `generate(do_sample=False)`: the reference
  hf_early_exit     HF `generate(assistant_early_exit=E)`: HF's own self-speculation (no KV sharing)
  hf_prompt_lookup  HF `generate(prompt_lookup_num_tokens=N)`
  autoregressive    our engine without drafts (decode strategy `autoregressive`)
  selfspec          our engine with the exit head (decode strategy `selfspec`; decode.tree / decode.lookup
                    as configured)
  lookup            our engine with context-lookup drafts alone, as a chain (decode.lookup=true, no head)
  selfspec+lookup   selfspec with context-lookup branches beside the head's drafts (decode.lookup=true); with
                    lookup_mode=first, lookup's chain when the context matches and the head's otherwise

Variants time several decode settings of a drafting method side by side in one run: `selfspec:draft_len=2`,
`selfspec:tree=static:tree_shape=[2,2,1,1]`, `selfspec+lookup:tree=dynamic`, `selfspec:draft_precision=int8`, and
of heads: `selfspec:head=DIR` drafts with another saved head (a directory, a shipped head's name or default)
(keys VARIANT_KEYS and the head's HEAD_VARIANT_KEYS, values YAML;
parse_method); the record's method is the string as given. Dynamic K (decode.draft_threshold) is a chain feature: a
method whose rounds verify a tree or lookup branches runs without it unless its variant sets it (lookup_mode=first
keeps it: its rounds are chains).

Sampled runs (decode.temperature > 0) take only our engine's methods; each prompt's turn gets one seed, the same for
every method (prompt_seed). Their outputs are not compared token for token (report.py says "not checked"): sampling's
exactness is what the distribution tests check (report.SAMPLING_TESTS).

The HF methods are selfspec/model/hf_baselines.py; the interleaving (every method on a prompt before the next
prompt, rotating order, an untimed warm-up call each) is selfspec/utils/timing.py, shared with training's
validation. Every call is timed with perf_counter around the whole call (HF's input preparation and our cache
allocation included), synchronised on CUDA.

Multi-turn items (MT-bench) feed each method's OWN answer back as the assistant message before the next user
turn, as Spec-Bench does; a record holds the concatenated new ids of all turns and the summed stats.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

import torch
import yaml

from selfspec.decoding.config import LOOKUP_KEYS, VARIANT_KEYS, DecodeConfig, rounds_are_trees
from selfspec.decoding.engine import Decoder
from selfspec.decoding.stats import pool_stats
from selfspec.errors import SelfSpecError, check
from selfspec.evaluation.config import HFOptions
from selfspec.heads.context import OWN_PRECISIONS
from selfspec.heads.saving import CONFIG_FILE, DEFAULT_HEAD, shipped_heads
from selfspec.model.hf_baselines import HFGenerate, early_exit_kwargs, prompt_lookup_kwargs
from selfspec.model.quant import check_precision
from selfspec.utils.machine import ThreadPolicy
from selfspec.utils.timing import peak_memory_mb, reset_peak_memory, run_interleaved, timed

log = logging.getLogger(__name__)

METHODS = ("hf_generate", "hf_early_exit", "hf_prompt_lookup", "autoregressive", "selfspec", "lookup", "selfspec+lookup")
HF_METHODS = METHODS[:3]
# Our engine's methods -> the decode settings each runs over decode.*. The method names are what results and tables
# show; the method `selfspec` is the decode strategy of the same name, with the exit head.
ENGINE_STRATEGIES = {"autoregressive": "autoregressive", "selfspec": "selfspec", "lookup": "selfspec",
                     "selfspec+lookup": "selfspec"}
ENGINE_OVERRIDES = {"lookup": dict(lookup=True, tree="chain"), "selfspec+lookup": dict(lookup=True)}
HEAD_METHODS = ("selfspec", "selfspec+lookup")  # the methods that draft with the exit head
# Method variants, `selfspec:tree=dynamic:tree_nodes=8`: the decode settings that may differ between the methods of
# one run (decoding/config.py: VARIANT_KEYS), and which of them each drafting method takes (`lookup` has no head and
# fixes a chain: LOOKUP_KEYS; the lookup methods fix lookup=true).
# Head settings a variant of a head method may change: `selfspec:draft_precision=int8` drafts with the same head's
# weights through int8 copies of the model's layers (ExitHead.with_draft_precision); `selfspec:head=DIR` drafts with
# another saved head (a directory, a shipped head's name, or default), so that heads compare in one interleaved run;
# `selfspec:own_precision=int8` drafts with a context head's own matrices in int8 (heads/context.py).
# A method's own head decodes with the run's decode.* and the variant's settings: its saved decode block is not read.
HEAD_VARIANT_KEYS = ("draft_precision", "own_precision", "head")
VARIANT_METHODS = {"selfspec": VARIANT_KEYS + HEAD_VARIANT_KEYS, "lookup": LOOKUP_KEYS,
                   "selfspec+lookup": tuple(k for k in VARIANT_KEYS if k not in ENGINE_OVERRIDES["selfspec+lookup"])
                   + HEAD_VARIANT_KEYS}


# ------------------------------------------------------------------------------------------------ methods
class Method:
    """A named way to continue token ids: `generate(ids, max_new_tokens) -> (new ids, stats)`.

    Stats always carry new_tokens, verify_steps (full-depth forward passes), drafted, accepted and the
    per-position lists, so every method goes through `report.summarize_methods` the same way. A `sampled` method
    also takes `seed=`: run_conversation gives every method the same seed for a prompt's turn (prompt_seed)."""

    sampled = False  # decodes at temperature > 0 (then generate takes seed=)
    seed: int | None = None  # the run's seed, from which prompt_seed derives each call's

    def __init__(self, name: str, head_params: int | None = None):
        self.name = name
        self.head_params = head_params

    def generate(self, ids: list[int], max_new_tokens: int) -> tuple[list[int], dict]:  # pragma: no cover
        raise NotImplementedError


class EngineMethod(Method):
    """Our engine with the decode settings `cfg` (method_decode_config); `base` is the method it is a variant of."""

    def __init__(self, name: str, backbone, head, cfg: DecodeConfig, eos_ids: list[int], base: str | None = None):
        super().__init__(name, head_params=head.num_params() if head is not None else None)
        self.decoder = Decoder(backbone, head)
        self.cfg = cfg
        self.eos_ids = eos_ids
        self.base = base or name
        self.sampled = not cfg.greedy
        self.seed = cfg.seed

    def generate(self, ids, max_new_tokens, seed: int | None = None):
        new, stats = self.decoder.generate(ids, self.cfg.for_call(max_new_tokens, seed), self.eos_ids)
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


@dataclass(frozen=True)
class MethodSpec:
    """One entry of `methods`: `name` as given (what records and tables show), its base method (METHODS) and the
    decode settings of a variant (`selfspec:draft_len=2` -> base selfspec, {"draft_len": 2})."""

    name: str
    base: str
    settings: dict = field(default_factory=dict)


_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _variant_value(raw: str, name: str, key: str):
    try:
        value = yaml.safe_load(raw.strip())
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SelfSpecError(f"methods: {name!r}: {key}={raw.strip()!r} is not a YAML value ({first})") from None
    if isinstance(value, str) and _EXPONENT.fullmatch(value):  # YAML 1.1 reads 1e-3 as a string
        value = float(value)
    return value


def parse_method(name) -> MethodSpec:
    """`selfspec`, or a variant `selfspec:tree=static:tree_shape=[2,2,1,1]`: a drafting method (VARIANT_METHODS)
    with `:key=value` decode settings, values read as YAML (int, float, true/false, null, [..])."""
    check(isinstance(name, str) and name.strip() != "",
          f"methods: {name!r}: a method name ({', '.join(METHODS)}), or a variant such as 'selfspec:draft_len=2'")
    base, *parts = name.split(":")
    base = base.strip()
    check(base in METHODS, f"methods: unknown {name!r}; allowed {', '.join(METHODS)}, and variants of "
                           f"{', '.join(VARIANT_METHODS)} such as 'selfspec:draft_len=2'")
    if not parts:
        return MethodSpec(name, base)
    check(base in VARIANT_METHODS,
          f"methods: {name!r}: {base} takes no settings; variants (name:key=value) are for {', '.join(VARIANT_METHODS)}"
          + ("; HF's methods take hf.*" if base in HF_METHODS else ""))
    allowed = VARIANT_METHODS[base]
    settings: dict = {}
    for part in parts:
        key, sep, raw = part.partition("=")
        key = key.strip()
        check(sep == "=" and key != "", f"methods: {name!r}: {part!r} is not key=value (e.g. 'selfspec:draft_len=2')")
        fixed = ENGINE_OVERRIDES.get(base, {})
        check(key not in fixed, f"methods: {name!r}: {base} fixes {key}={str(fixed.get(key)).lower()}; "
                                f"it takes {', '.join(allowed)}")
        check(key in allowed, f"methods: {name!r}: unknown setting {key!r}; {base} takes {', '.join(allowed)}")
        check(key not in settings, f"methods: {name!r}: {key} is given twice")
        settings[key] = _variant_value(raw, name, key)
    if "draft_precision" in settings:
        check_precision(settings["draft_precision"], f"methods: {name!r}: draft_precision")
    if "own_precision" in settings:
        check(settings["own_precision"] in OWN_PRECISIONS,
              f"methods: {name!r}: own_precision={settings['own_precision']!r}: allowed {', '.join(OWN_PRECISIONS)}")
    if "head" in settings:
        check_method_head(settings["head"], name)
    check(settings.get("tree") != "auto", f"methods: {name!r}: tree=auto is calibrated once per run, for decode.* "
                                          "(decode.tree=auto); a variant takes tree=chain, static or dynamic")
    return MethodSpec(name, base, settings)


def check_method_head(ref, name: str) -> None:
    """A variant's `head=`: a saved head directory, a shipped head's name or `default` (before the model loads)."""
    from pathlib import Path

    shipped = shipped_heads()
    text = isinstance(ref, str) and ref.strip() != ""
    check(text and (ref == DEFAULT_HEAD or ref in shipped or (Path(ref).expanduser() / CONFIG_FILE).is_file()),
          f"methods: {name!r}: head={ref!r}: give a saved head directory (one with {CONFIG_FILE}; no ':' in the path), "
          f"a shipped head ({', '.join(shipped) or 'none ship'}) or {DEFAULT_HEAD}")


def method_head_refs(names: Sequence[str]) -> list[str]:
    """The heads the entries of `methods` name with `head=` (in order, each once); they load beside the run's head."""
    refs = [parse_method(n).settings.get("head") for n in names]
    return list(dict.fromkeys(r for r in refs if r is not None))


def needs_run_head(names: Sequence[str]) -> bool:
    """Whether a method drafts with the run's head (head=... / head.path): a head method without its own `head=`."""
    return any(s.base in HEAD_METHODS and "head" not in s.settings for s in map(parse_method, names))


def method_bases(names: Sequence[str]) -> list[str]:
    """The base method (METHODS) of each entry of `methods`, e.g. to ask whether a run needs a head."""
    return [parse_method(n).base for n in names]


def method_decode_config(spec: MethodSpec, decode: DecodeConfig) -> DecodeConfig | None:
    """The decode settings an engine method runs with (None for HF's methods): decode.*, then the method's own
    (strategy, ENGINE_OVERRIDES), then the variant's. Dynamic K is a chain feature: a method whose rounds verify a
    tree or lookup branches (DecodeConfig.uses_tree) runs without decode.draft_threshold or draft_continue unless the
    variant sets them."""
    if spec.base in HF_METHODS:
        return None
    decode_settings = {k: v for k, v in spec.settings.items() if k not in HEAD_VARIANT_KEYS}
    changes = dict(strategy=ENGINE_STRATEGIES[spec.base], **ENGINE_OVERRIDES.get(spec.base, {}), **decode_settings)
    if rounds_are_trees(decode, changes):  # dynamic K is a chain feature: off unless the variant sets it
        changes = {"draft_threshold": None, "draft_continue": None, **changes}
    try:
        return replace(decode, **changes)
    except SelfSpecError as exc:
        raise SelfSpecError(f"methods: {spec.name!r}: {exc}") from None


def _resolve(names: Sequence[str], decode: DecodeConfig, duplicates: bool = True) -> list[tuple[MethodSpec, DecodeConfig | None]]:
    check(not isinstance(names, str) and len(names) > 0, "methods: give at least one method")
    specs = [parse_method(n) for n in names]
    check(len(set(names)) == len(names), f"methods={list(names)}: each method at most once")
    hf = [s.name for s in specs if s.base in HF_METHODS]
    check(decode.greedy or not hf,
          f"decode.temperature={decode.temperature}: methods {', '.join(hf)}: HF's methods decode greedily here (HF's "
          "generate gets no sampling settings); a sampled evaluation runs only our engine's methods (autoregressive, "
          "selfspec, lookup, selfspec+lookup and their variants)")
    check(not decode.stop, "decode.stop: stop strings are not supported in evaluation (HF's generate would need "
                           "the same stopping rule); leave it empty")
    out = [(s, method_decode_config(s, decode)) for s in specs]
    seen: dict[str, str] = {}
    for spec, cfg in out:
        if cfg is None or not duplicates:
            continue
        head_settings = {k: v for k, v in spec.settings.items() if k in HEAD_VARIANT_KEYS}
        key = json.dumps([spec.base in HEAD_METHODS, asdict(cfg), head_settings], sort_keys=True, default=str)
        check(key not in seen, f"methods: {seen.get(key)!r} and {spec.name!r} decode with the same settings here "
                               "(after decode.* and the head's tuned settings); give each once")
        seen[key] = spec.name
    return out


def check_methods(names: Sequence[str], decode: DecodeConfig, duplicates: bool = True) -> list[MethodSpec]:
    """What can be checked before the model is loaded: names and variants (parse_method), each engine method's
    decode settings (method_decode_config), no two entries that decode alike (duplicates=False: not yet, when a
    saved head's tuned settings will still change decode.*; build_methods checks it then), and no HF method in a
    sampled run."""
    return [spec for spec, _ in _resolve(names, decode, duplicates)]


def build_methods(
    names: Sequence[str],
    model,
    decode: DecodeConfig,
    head=None,
    hf_options: HFOptions | None = None,
    method_heads: dict | None = None,
) -> list[Method]:
    """Method objects for `names` (METHODS or variants, see parse_method) in the given order. `head` is used by
    selfspec (and gives hf_early_exit E); method_heads maps each `head=` of a variant (method_head_refs) to its loaded
    head. A sampled run (decode.temperature > 0) with decode.seed=null draws one seed for the run, shared by every
    method."""
    if not decode.greedy and decode.seed is None:
        decode = replace(decode, seed=secrets.randbits(31))
        log.info("sampled evaluation: decode.seed=null, this run's seed is %d", decode.seed)
    hf = hf_options or HFOptions()
    out: list[Method] = []
    for spec, cfg in _resolve(names, decode):
        name, base = spec.name, spec.base
        if base == "hf_generate":
            out.append(HFMethod(name, model, {}))
        elif base == "hf_early_exit":
            check(head is not None, "methods: hf_early_exit needs an exit layer (head=... head.exit_layer=E)")
            out.append(HFMethod(name, model, early_exit_kwargs(head.exit_layer, hf.num_assistant_tokens)))
        elif base == "hf_prompt_lookup":
            out.append(HFMethod(name, model, prompt_lookup_kwargs(hf.prompt_lookup_num_tokens, hf.max_matching_ngram_size)))
        else:
            method_head = None
            if base in HEAD_METHODS:
                method_head = _method_head(spec, head, method_heads or {})
            out.append(EngineMethod(name, model.backbone, method_head, cfg, model.eos_ids, base=base))
    return out


def _method_head(spec: MethodSpec, head, method_heads: dict):
    """The head a head method drafts with: its variant's `head=` (loaded into method_heads) or the run's head, in the
    variant's draft_precision and own_precision when it sets them."""
    ref = spec.settings.get("head")
    if ref is not None:
        check(ref in method_heads, f"methods: {spec.name!r}: head={ref!r} was not loaded (build_methods' method_heads)")
        head = method_heads[ref]
    check(head is not None, f"methods: {spec.name} needs a head (head=lens|medusa|adapter|lora|layer or head.path=DIR, "
                            "or a variant's head=DIR)")
    precision = spec.settings.get("draft_precision")
    head = head if precision is None else head.with_draft_precision(precision)
    own = spec.settings.get("own_precision")
    if own is not None:
        check(hasattr(head.config, "own_precision"),
              f"methods: {spec.name!r}: own_precision is a context head's setting; this method drafts with a "
              f"{head.config.type} head")
        head = head.with_settings(own_precision=own)
    return head


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
def prompt_seed(seed: int | None, prompt_id, turn: int) -> int:
    """The sampling seed of one prompt's turn in a sampled run: the same for every method (so they draw from the
    same stream), different across prompts; derived from the run's decode.seed."""
    digest = hashlib.blake2b(f"{seed}/{prompt_id}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def merge_turn_stats(per_turn: list[dict]) -> dict:
    """One conversation's stats: counts and seconds summed over turns, rates recomputed from the sums (pool_stats)."""
    return {**pool_stats(per_turn), "turns": len(per_turn)}


def run_conversation(method: Method, item, renderer: Renderer, max_new_tokens: int, device: torch.device,
                     save_prompts: bool = False) -> dict:
    """All turns of one prompt item with one method; -> a results.jsonl record."""
    answers: list[str] = []
    ids_all: list[int] = []
    per_turn: list[dict] = []
    prompts: list[str] = []
    prompt_lens: list[int] = []
    seeds: list[int] = []
    tok = renderer.tokenizer
    reset_peak_memory(device)
    for turn in range(len(item.turns)):
        ids, text = renderer.render(item.turns, answers)
        kwargs = {"seed": prompt_seed(method.seed, item.id, turn)} if method.sampled else {}
        seeds += kwargs.values()
        (new, stats), seconds = timed(lambda: method.generate(ids, max_new_tokens, **kwargs), device)
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
        "turn_verify_steps": [s.get("verify_steps", 0) for s in per_turn], "turn_seconds": [s["seconds"] for s in per_turn],
        "prompt_lens": prompt_lens, "stats": stats, "head_params": method.head_params,
        # sampled: not compared token for token with the reference (report.summarize_methods)
        "sampled": method.sampled,
    }
    if method.sampled:
        record["seeds"] = seeds
    if getattr(item, "source_category", None):  # the file's own category under a task name (Spec-Bench's mt_bench)
        record["source_category"] = item.source_category
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
    threads: ThreadPolicy | None = None,
) -> list[dict]:
    """Every method on every item, interleaved (timing.run_interleaved); -> records in run order.
    warmup: one untimed call of up to 16 tokens per method on the first item. on_record(record, i, n) after each.
    threads: adapted before each item (every method of an item runs with the same count); each record notes it."""
    check(len(items) > 0, "prompts: no prompts selected")
    by_name = {m.name: m for m in methods}
    chosen: dict = {}

    def run_one(m: Method, item) -> dict:
        rec = run_conversation(m, item, renderer, max_new_tokens, device, save_prompts)
        if chosen:
            rec["threads"] = dict(chosen)
        return rec

    def adapt(_i: int) -> None:
        chosen.update(threads.adapt().as_dict())

    runs = {m.name: (lambda item, m=m: run_one(m, item)) for m in methods}
    warm = None
    if warmup:
        first_ids = renderer.render(items[0].turns, [])[0]

        def warm(name: str) -> None:
            by_name[name].generate(first_ids, min(16, max_new_tokens))

    per_item = run_interleaved(
        runs, items, warmup=warm,
        on_result=(lambda name, i, rec: on_record(rec, i, len(items))) if on_record is not None else None,
        before_item=adapt if threads is not None and device.type == "cpu" else None,
    )
    return [rec for results in per_item for rec in results.values()]

