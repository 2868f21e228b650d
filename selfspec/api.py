"""The Python entry point: `SelfSpecModel.from_pretrained(...)` and `.generate(...)`, with HF's conventions where they
apply: `streamer=` (TextStreamer, TextIteratorStreamer), `seed=None` drawing from torch's global generator,
`generation_config=` (a transformers GenerationConfig), and a list of prompts giving a list of results.

The prompt rule (`SelfSpecModel.prompt_chat`, the CLI's too): a string goes through the tokenizer's chat template as
one user message when the tokenizer has one, unless chat=False (then it is raw text to continue); a list of
{"role", "content"} messages always goes through the template; token ids are used as they are.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from selfspec.decoding.config import DECODE_KEYS, DecodeConfig, with_tuned_settings
from selfspec.decoding.engine import Decoder
from selfspec.errors import SelfSpecError, check, is_int
from selfspec.heads import ExitHead, HeadConfig, build_head, head_types, load_head, make_head_config, read_head_config
from selfspec.heads.auto import AUTO_HEAD, auto_head_config
from selfspec.heads.saving import DEFAULT_HEAD, resolve_default_head, shipped_heads, shipped_or_path
from selfspec.model.backbone import Backbone
from selfspec.model.loading import ModelConfig, load_model
from selfspec.model.tokens import chat_template_ids, eos_token_ids, generation_defaults
from selfspec.utils.paths import conf_dir


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only (a final EOS included, as HF generate returns it)
    text: str
    stats: dict = field(default_factory=dict)
    decode: DecodeConfig | None = None  # the settings it was decoded with
    tuned_from_head: list[str] = field(default_factory=list)  # keys of `decode` taken from the head's saved settings
    auto: dict | None = None  # head="auto": what was chosen and why (heads/auto.py: AutoChoice.as_dict())


def model_config_from_name(name: str, **overrides) -> ModelConfig:
    """A config name from conf/model/ (e.g. 'smollm2_135m', 'tiny'), a local directory or a hub id."""
    yaml = conf_dir() / "model" / f"{name}.yaml"
    if yaml.is_file() and not os.path.isdir(name):
        from omegaconf import OmegaConf

        node = OmegaConf.load(yaml)
        data = OmegaConf.to_container(node.get("model", node), resolve=True)
        data.update({k: v for k, v in overrides.items() if v is not None})
        return ModelConfig(**data)
    return ModelConfig(name=os.path.basename(str(name).rstrip("/")), name_or_path=name, **{k: v for k, v in overrides.items() if v is not None})


DEFAULT_MODEL = "smollm2_135m"


def _base_model_of(head) -> tuple[str, str | None, float | None]:
    """from_pretrained(model=None): (name_or_path, gguf_file, off_grid) of the model a saved head directory records,
    else the embedded default model."""
    path = head.path if isinstance(head, HeadConfig) else head
    if isinstance(path, (str, os.PathLike)) and str(path) not in (DEFAULT_HEAD, *head_types()) and shipped_or_path(path).is_dir():
        data = read_head_config(path)
        if data.get("base_model_name_or_path"):
            return str(data["base_model_name_or_path"]), data.get("base_model_gguf_file"), data.get("base_model_off_grid")
    return DEFAULT_MODEL, None, None


class SelfSpecModel:
    """A target model plus one exit head. `.hf_model`, `.tokenizer`, `.exit_layer`, `.head`, `.backbone`,
    `.decoder` (the engine over both: `decoder.decode(ids, DecodeConfig(...))`)."""

    def __init__(self, hf_model, tokenizer, head: ExitHead | None, model_config: ModelConfig | None = None):
        self.hf_model = hf_model
        self.tokenizer = tokenizer
        self.backbone = Backbone(hf_model, cpu_kernels=model_config.cpu_kernels if model_config is not None else True)
        self.head = head
        self.model_config = model_config
        self.decoder = Decoder(self.backbone, head)
        self.auto_choice, self._auto_decode = None, {}  # head="auto": the choice and the decode settings it adds

    @property
    def exit_layer(self) -> int | None:
        return self.head.exit_layer if self.head is not None else None

    @classmethod
    def from_pretrained(
        cls,
        model: str | ModelConfig | None = None,
        head: str | HeadConfig | None = "default",
        exit_layer: int | None = None,
        dtype: str | None = None,
        device: str | None = None,
        allow_other_model: bool = False,
        draft_precision: str | None = None,
        off_grid: float | None = None,
        **head_options,
    ) -> "SelfSpecModel":
        """model: a config name from conf/model/, a directory, a hub id or a ModelConfig; None: the model a saved head
        records (`base_model_name_or_path`, as peft's AutoPeftModel) when `head` is a head directory, else the
        embedded smollm2_135m.
        head: "default" (the head that ships for this model, selfspec/heads/shipped/; the untrained logit lens with a
        warning when none does), "auto" (the shipped setting predicted fastest on this machine, heads/auto.py: its
        step costs measured at first use and cached; `auto_choice` and each result's `auto` say what and why), a head type ('lens' | 'medusa' | 'adapter' | 'lora' | 'layer' | a registered one) with
        its options as keyword arguments (num_blocks=2, ...), a saved head directory (`head.save_pretrained(DIR)`), a
        HeadConfig, or None. A saved head loads on the model it was saved on, in any dtype, source or quantization
        (the measured weight distance is logged and kept in `head.base_model_check`); on another model only with
        allow_other_model=True (model/identity.py).
        draft_precision: "full" | "int8" | "int4" | "int4_mlp" (head.draft_precision): the draft pass reads copies of
        the model's own layers < E and LM head in that precision (int4_mlp: the MLP in int4, the rest in int8) (None: a saved head's own setting, else full).
        off_grid: model.off_grid, the model's weights nudged off the 4-bit grid of its GGUF file (a native-like testbed;
        model/loading.py: nudge_off_grid); None: 0, or what a saved head's model had."""
        gguf = None
        if model is None:
            model, gguf, saved_off_grid = _base_model_of(head)
            off_grid = saved_off_grid if off_grid is None else off_grid
        mcfg = model if isinstance(model, ModelConfig) else model_config_from_name(model, dtype=dtype, device=device, gguf_file=gguf,
                                                                                   off_grid=off_grid)
        hf_model, tok = load_model(mcfg)
        self = cls(hf_model, tok, None, mcfg)
        self.set_head(head, exit_layer=exit_layer, allow_other_model=allow_other_model, draft_precision=draft_precision,
                      **head_options)
        return self

    def set_head(self, head: str | HeadConfig | ExitHead | None, exit_layer: int | None = None,
                 allow_other_model: bool = False, draft_precision: str | None = None, **head_options) -> None:
        self.auto_choice, self._auto_decode = None, {}
        if head == AUTO_HEAD or (isinstance(head, HeadConfig) and head.path == AUTO_HEAD):
            # the shipped setting predicted fastest here; None: context lookup alone (its decode settings below)
            hcfg = head if isinstance(head, HeadConfig) else HeadConfig(path=AUTO_HEAD, exit_layer=exit_layer)
            head, self._auto_decode, self.auto_choice = auto_head_config(self.backbone, hcfg)
        if head == DEFAULT_HEAD:
            head = HeadConfig(path=DEFAULT_HEAD, exit_layer=exit_layer)
        if isinstance(head, HeadConfig):
            head = resolve_default_head(head, self.backbone)
        if head is None or isinstance(head, ExitHead):
            h = head
        elif isinstance(head, HeadConfig):
            allow = allow_other_model or head.allow_other_model
            h = load_head(head.path, self.backbone, allow_other_model=allow) if head.path else build_head(head, self.backbone, self.eos_ids)
        elif head in head_types():
            own = {"draft_precision": draft_precision} if draft_precision is not None else {}  # built for it (lowbit)
            h = build_head(make_head_config(head, exit_layer=exit_layer, **own, **head_options), self.backbone, self.eos_ids)
        elif shipped_or_path(head).exists():
            h = load_head(head, self.backbone, allow_other_model=allow_other_model)
        else:
            raise SelfSpecError(f"head={head!r}: allowed default, auto, {', '.join(head_types())}, a shipped head ({', '.join(shipped_heads())}) or a saved head directory (not found)")
        if h is not None:
            h.set_draft_precision(draft_precision if draft_precision is not None
                                  else head.draft_precision if isinstance(head, HeadConfig) else None)
        self.head = h
        self.decoder = Decoder(self.backbone, h)

    # ------------------------------------------------------------------ prompts
    @property
    def eos_ids(self) -> list[int]:
        return eos_token_ids(self.hf_model, self.tokenizer)

    def encode(self, prompt, chat: bool | None = None) -> list[int]:
        """One prompt -> ids: a string is tokenized as raw text, or goes through the chat template as one user message
        with chat=True (when the tokenizer has one); a list of {"role", "content"} messages goes through the chat
        template; ids (a list of int, a 1-D tensor or numpy integer array, or a one-row 2-D one) pass through.
        (`generate` and the CLI decide chat first: `prompt_chat`.)"""
        if isinstance(prompt, (torch.Tensor, np.ndarray)):
            ids = _array_ids(prompt)
        elif isinstance(prompt, str):
            check(prompt.strip() != "", "prompt: must not be empty")
            if chat and self.tokenizer.chat_template:
                return self.encode([{"role": "user", "content": prompt}])
            ids = self.tokenizer(prompt)["input_ids"]
        elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            _check_messages(prompt)
            ids = chat_template_ids(self.tokenizer, prompt)
        elif isinstance(prompt, (list, tuple)) and all(is_int(t) for t in prompt):
            ids = list(prompt)
        else:
            raise SelfSpecError("prompt: give a string, a list of chat messages ({'role', 'content'}) or token ids")
        check(len(ids) > 0, "prompt: must not be empty")
        return list(ids)

    def prompt_chat(self, chat: bool | None = None) -> bool:
        """The prompt rule `generate` and `python -m selfspec.generate` share: a string prompt goes through the chat
        template (as one user message) when the tokenizer has one, unless chat=False; chat=True without a template
        is an error."""
        template = bool(self.tokenizer.chat_template)
        check(chat is not True or template, "chat=True: this tokenizer has no chat template")
        return template if chat is None else bool(chat)

    def _stop_fn(self, stops: list[str]):
        if not stops:
            return None
        tok = self.tokenizer

        def stop_fn(new_ids: list[int]) -> int | None:
            text = tok.decode(new_ids, skip_special_tokens=False)
            if not any(s in text for s in stops):
                return None
            # the shortest prefix of tokens whose text contains a stop string
            for n in range(1, len(new_ids) + 1):
                t = tok.decode(new_ids[:n], skip_special_tokens=False)
                if any(s in t for s in stops):
                    return n
            return None

        return stop_fn

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        prompt,
        max_new_tokens: int | None = None,
        *,
        seed: int | None = None,
        chat: bool | None = None,
        decode: DecodeConfig | None = None,
        streamer=None,
        generation_config=None,
        **decode_keys,
    ) -> GenerationResult | list[GenerationResult]:
        """Every other keyword argument is a DecodeConfig key (decoding/config.py: DECODE_KEYS; None = unset, a saved
        head's tuned settings or DecodeConfig's default), or `decode=` gives them all at once: draft_len,
        draft_threshold (0 turns a head's dynamic K off), strategy="selfspec" | "autoregressive", stop, tree="chain" |
        "static" | "dynamic" | "auto" (the head's tuned tree; an error when it carries none), tree_nodes, tree_topk,
        tree_shape=[3, 2, 2, 1], lookup=True (needs no head: context-lookup drafts alone), lookup_mode="branch" |
        "first" | "checked" (with a head: lookup branches in a tree, lookup's chain when it matches and the head's
        otherwise, or lookup's chain checked by the head in one pass and continued by it), lookup_len,
        lookup_branches, lookup_min_ngram, lookup_max_ngram; tokens_per_pass=m (m drafts per pass through layers < E
        from a medusa head's extra heads).

        As HF's `generate`:
        - prompt: a string, a list of messages or ids (`prompt_chat`: the chat-template rule), or a list of
          prompts (strings, message lists or id lists) -> a list of results, decoded one after another;
        - max_new_tokens (default 128), temperature (0 = greedy, the default), top_k (0 = off), top_p: explicit
          values win over `generation_config=` (a transformers GenerationConfig: max_new_tokens, do_sample,
          temperature, top_k, top_p, stop_strings and eos_token_id are used, HF's defaults for unset ones when
          sampling: temperature 1, top_k 50; other non-default settings such as num_beams are refused);
        - seed=None (sampling): a seed drawn from torch's global generator, so torch.manual_seed(s) before the call
          reproduces it and two calls differ; an explicit seed leaves the global generator alone. The seed used is
          `result.decode.seed`;
        - streamer: put(prompt ids as a (1, T) tensor) first, then each round's committed tokens, end() when done
          (transformers' TextStreamer, TextIteratorStreamer); with a list of prompts, each prompt in turn."""
        batch = _prompt_list(prompt)
        if batch is not None:
            return [self.generate(p, max_new_tokens, seed=seed, chat=chat, decode=decode, streamer=streamer,
                                  generation_config=generation_config, **decode_keys) for p in batch]
        given = _given_decode_keys(dict(decode_keys, max_new_tokens=max_new_tokens))
        if decode is not None:  # a whole config: every key is the caller's
            _check_nothing_beside(decode, given, generation_config)
            cfg, tuned, eos_ids = decode, [], self.eos_ids
            if decode.seed is None and not decode.greedy:
                cfg = replace(decode, seed=_draw_seed())
        else:
            cfg, tuned, eos_ids = self._decode_config(given, seed, generation_config)
        ids = self.encode(prompt, chat=self.prompt_chat(chat))
        result = self._decode(ids, cfg, eos_ids, streamer)
        text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        return GenerationResult(token_ids=result.token_ids, text=text, stats=result.stats.to_dict(), decode=cfg,
                                tuned_from_head=tuned,
                                auto=self.auto_choice.as_dict() if self.auto_choice is not None else None)

    def _decode_config(self, given: dict, seed: int | None, generation_config) -> tuple[DecodeConfig, list[str], list[int]]:
        """The config of a generate call without decode=: the caller's keys, over generation_config's, over
        GENERATE_DEFAULTS; then a trained head's tuned settings (draft_len, draft_threshold, ...) in the keys the caller
        left unset. -> (config, the keys taken from the head, the eos ids)."""
        from_config, eos_from_config = generation_config_keys(generation_config)
        keys = {**GENERATE_DEFAULTS, **from_config, **given}  # explicit arguments win, as in HF
        tuned_settings = {**(self.head.decode_settings if self.head is not None else {}), **self._auto_decode}
        # tree="auto" is the head's tuned tree when it carries one (else the engine refuses it: calibration resolves
        # auto, selfspec.evaluation.calibration.calibrate_tree).
        if (given.get("tree") == "auto" and keys.get("strategy", DecodeConfig.strategy) == "selfspec"
                and tuned_settings.get("tree", "auto") != "auto"):
            del given["tree"], keys["tree"]
        if seed is None and keys["temperature"] != 0:  # HF's way: a draw from the caller's global generator
            seed = _draw_seed()
        cfg, tuned = with_tuned_settings(DecodeConfig(seed=seed, **keys), tuned_settings, given)
        return cfg, tuned, eos_from_config if eos_from_config is not None else self.eos_ids

    def _decode(self, ids: list[int], cfg: DecodeConfig, eos_ids: list[int], streamer):
        """One decode, with cfg.stop's stop strings, streamed to `streamer` when given."""
        stop_fn = self._stop_fn(cfg.stop)
        if streamer is not None:
            streamer.put(torch.tensor([ids]))
            stop_fn = _StreamingStop(stop_fn, streamer)
        result = self.decoder.decode(ids, cfg, eos_ids, stop_fn)
        if streamer is not None:
            stop_fn.flush(result.token_ids)
            streamer.end()
        return result


def _given_decode_keys(kwargs: dict) -> dict:
    """generate's decode keys that the caller set (not None); a keyword that is no decode key is refused as Python
    refuses an unknown keyword argument."""
    unknown = [k for k in kwargs if k not in DECODE_KEYS]
    if unknown:
        raise TypeError(f"SelfSpecModel.generate() got an unexpected keyword argument {unknown[0]!r}")
    return {k: v for k, v in kwargs.items() if v is not None}


def _check_nothing_beside(decode: DecodeConfig, given: dict, generation_config) -> None:
    """Beside decode=: a key that repeats decode's own value is harmless; one that differs would be ignored, so it
    is refused."""
    beside = [k for k, v in given.items() if getattr(decode, k) != v]
    beside += ["generation_config"] if generation_config is not None else []
    check(not beside, f"generate: give {', '.join(beside)} inside decode=DecodeConfig(...), not beside it")


def _draw_seed() -> int:
    """A sampling seed drawn from torch's global generator, never a reseed of it (as HF does)."""
    return int(torch.randint(2**63 - 1, ()))


GENERATE_DEFAULTS = dict(max_new_tokens=128, temperature=0.0, top_k=0, top_p=1.0)
# GenerationConfig fields generate() reads, and those that do not change what is generated (ids, output format)
_GC_USED = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "stop_strings", "eos_token_id")
_GC_IGNORED = ("transformers_version", "_from_model_config", "bos_token_id", "pad_token_id", "decoder_start_token_id",
               "max_length", "use_cache", "return_dict_in_generate", "output_scores", "output_logits",
               "output_attentions", "output_hidden_states", "cache_implementation")


def generation_config_keys(gc) -> tuple[dict, list[int] | None]:
    """A transformers GenerationConfig (or None) -> (our keys: max_new_tokens, temperature, top_k, top_p, stop; its
    eos_token_id as a list, or None). do_sample unset or False is greedy; sampling takes HF's defaults for what it
    leaves unset (temperature 1.0, top_k 50, top_p 1.0). A setting we cannot honour (num_beams=4,
    repetition_penalty=1.2, ...) is refused, not ignored."""
    if gc is None:
        return {}, None
    check(hasattr(gc, "to_diff_dict"), f"generation_config: a transformers GenerationConfig, not {type(gc).__name__}")
    hf_defaults = generation_defaults()  # what HF applies when unset
    unsupported = sorted(k for k, v in gc.to_diff_dict().items()
                         if k not in _GC_USED and k not in _GC_IGNORED and v is not None and not (k in hf_defaults and hf_defaults[k] == v))
    check(not unsupported, f"generation_config: {', '.join(f'{k}={getattr(gc, k, None)!r}' for k in unsupported)} not "
                           f"supported (selfspec reads {', '.join(_GC_USED)})")
    out: dict = {}
    if gc.max_new_tokens is not None:
        out["max_new_tokens"] = gc.max_new_tokens
    if gc.do_sample:
        out.update(temperature=1.0 if gc.temperature is None else gc.temperature, top_k=50 if gc.top_k is None else gc.top_k,
                   top_p=1.0 if gc.top_p is None else gc.top_p)
    else:
        out["temperature"] = 0.0
    if getattr(gc, "stop_strings", None):
        out["stop"] = gc.stop_strings
    eos = gc.eos_token_id
    return out, ([eos] if isinstance(eos, int) else list(eos)) if eos is not None else None


def _array_ids(prompt: torch.Tensor | np.ndarray) -> list[int]:
    """A tensor or numpy array of token ids (1-D, or 2-D with one row) -> the ids as Python ints. Floats, bools and
    the like are refused: casting them would turn a wrong input (probabilities, a mask) into plausible ids."""
    if isinstance(prompt, torch.Tensor):
        kind, integer = "tensor", not prompt.is_floating_point() and not prompt.is_complex() and prompt.dtype != torch.bool
    else:
        kind, integer = "numpy array", prompt.dtype.kind in "iu"  # signed / unsigned integers only
    check(integer, f"prompt: a {kind} of token ids must have an integer dtype, not {prompt.dtype}")
    shape = tuple(prompt.shape)
    check(len(shape) <= 1 or math.prod(shape[:-1]) == 1,
          f"prompt: a {kind} of shape {shape} holds several prompts; give a list of prompts")
    return [int(t) for t in prompt.reshape(-1).tolist()]


def _check_messages(messages) -> None:
    """Chat messages: each a mapping with a non-empty string 'role' and non-empty 'content' (a template would
    otherwise fail inside jinja, or render a message without its speaker)."""
    for i, m in enumerate(messages):
        for key in ("role", "content"):
            check(key in m, f"messages[{i}]: missing {key!r} (each message is {{'role': ..., 'content': ...}})")
        check(isinstance(m["role"], str) and m["role"].strip() != "",
              f"messages[{i}]: 'role' must be a non-empty string, not {m['role']!r}")
        check(bool(m["content"]), f"messages[{i}]: 'content' must not be empty")


def _prompt_list(prompt) -> list | None:
    """Several prompts (a list of strings, of message lists or of id lists, or of 1-D tensors or numpy arrays) ->
    that list; one prompt -> None."""
    if not isinstance(prompt, (list, tuple)) or not prompt:
        return None
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, (torch.Tensor, np.ndarray)) for p in prompt):
        return list(prompt)
    if all(isinstance(p, (list, tuple)) for p in prompt):
        return list(prompt)
    return None


class _StreamingStop:
    """The engine's stop check, wrapped so that each round's committed tokens go to the streamer: the engine calls it
    after every commit with all new ids so far (decoding/engine.py: _advance), and a stop string cuts only the
    round it completes in, so tokens already streamed stay."""

    def __init__(self, stop_fn, streamer):
        self.stop_fn, self.streamer, self.sent = stop_fn, streamer, 0

    def __call__(self, new_ids: list[int]) -> int | None:
        cut = self.stop_fn(new_ids) if self.stop_fn is not None else None
        self.flush(new_ids[:cut] if cut is not None else new_ids)
        return cut

    def flush(self, ids: list[int]) -> None:
        if len(ids) > self.sent:
            self.streamer.put(torch.tensor(ids[self.sent:]))
            self.sent = len(ids)
