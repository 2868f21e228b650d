"""The Python entry point: `SelfSpecModel.from_pretrained(...)` and `.generate(...)`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from selfspec.decoding.config import DecodeConfig, with_tuned_settings
from selfspec.decoding.engine import Decoder
from selfspec.errors import SelfSpecError, check, is_int
from selfspec.heads import ExitHead, HeadConfig, build_head, head_types, load_head, make_head_config
from selfspec.heads.saving import DEFAULT_HEAD, resolve_default_head
from selfspec.model.backbone import Backbone
from selfspec.model.loading import ModelConfig, load_model
from selfspec.model.tokens import chat_template_ids, eos_token_ids


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only (a final EOS included, as HF generate returns it)
    text: str
    stats: dict = field(default_factory=dict)
    decode: DecodeConfig | None = None  # the settings it was decoded with
    tuned_from_head: list[str] = field(default_factory=list)  # keys of `decode` taken from the head's saved settings


def model_config_from_name(name: str, **overrides) -> ModelConfig:
    """A config name from conf/model/ (e.g. 'smollm2_135m', 'tiny'), a local directory or a hub id."""
    from selfspec.paths import conf_dir

    yaml = conf_dir() / "model" / f"{name}.yaml"
    if yaml.is_file() and not os.path.isdir(name):
        from omegaconf import OmegaConf

        node = OmegaConf.load(yaml)
        data = OmegaConf.to_container(node.get("model", node), resolve=True)
        data.update({k: v for k, v in overrides.items() if v is not None})
        return ModelConfig(**data)
    return ModelConfig(name=os.path.basename(str(name).rstrip("/")), name_or_path=name, **{k: v for k, v in overrides.items() if v is not None})


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

    @property
    def exit_layer(self) -> int | None:
        return self.head.exit_layer if self.head is not None else None

    @classmethod
    def from_pretrained(
        cls,
        model: str | ModelConfig = "smollm2_135m",
        head: str | HeadConfig | None = "default",
        exit_layer: int | None = None,
        dtype: str | None = None,
        device: str | None = None,
        **head_options,
    ) -> "SelfSpecModel":
        """model: a config name from conf/model/, a directory, a hub id or a ModelConfig.
        head: "default" (the head that ships for this model, selfspec/heads/shipped/; the untrained logit lens with a
        warning when none does), a head type ('lens' | 'medusa' | 'adapter' | 'lora' | 'layer' | a registered one) with
        its options as keyword arguments (num_blocks=2, ...), a saved head directory, a HeadConfig, or None."""
        mcfg = model if isinstance(model, ModelConfig) else model_config_from_name(model, dtype=dtype, device=device)
        hf_model, tok = load_model(mcfg)
        self = cls(hf_model, tok, None, mcfg)
        self.set_head(head, exit_layer=exit_layer, **head_options)
        return self

    def set_head(self, head: str | HeadConfig | ExitHead | None, exit_layer: int | None = None, **head_options) -> None:
        if head == DEFAULT_HEAD:
            head = HeadConfig(path=DEFAULT_HEAD, exit_layer=exit_layer)
        if isinstance(head, HeadConfig):
            head = resolve_default_head(head, self.backbone)
        if head is None or isinstance(head, ExitHead):
            h = head
        elif isinstance(head, HeadConfig):
            h = load_head(head.path, self.backbone) if head.path else build_head(head, self.backbone, self.eos_ids)
        elif head in head_types():
            h = build_head(make_head_config(head, exit_layer=exit_layer, **head_options), self.backbone, self.eos_ids)
        elif Path(head).exists():
            h = load_head(head, self.backbone)
        else:
            raise SelfSpecError(f"head={head!r}: allowed default, {', '.join(head_types())} or a saved head directory (not found)")
        self.head = h
        self.decoder = Decoder(self.backbone, h)

    # ------------------------------------------------------------------ prompts
    @property
    def eos_ids(self) -> list[int]:
        return eos_token_ids(self.hf_model, self.tokenizer)

    def encode(self, prompt, chat: bool | None = None) -> list[int]:
        """str -> ids (raw text, or the chat template when chat=True); list of messages -> chat template;
        ids (list of int / 1-D tensor) pass through."""
        if isinstance(prompt, torch.Tensor):
            check(not prompt.is_floating_point() and not prompt.is_complex() and prompt.dtype != torch.bool,
                  f"prompt: a tensor of token ids must have an integer dtype, not {prompt.dtype}")
            ids = prompt.reshape(-1).tolist()
        elif isinstance(prompt, str):
            check(prompt.strip() != "", "prompt: must not be empty")
            if chat and self.tokenizer.chat_template:
                return self.encode([{"role": "user", "content": prompt}])
            ids = self.tokenizer(prompt)["input_ids"]
        elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            check(all(m.get("content") for m in prompt), "messages: every message needs non-empty 'content'")
            ids = chat_template_ids(self.tokenizer, prompt)
        elif isinstance(prompt, (list, tuple)) and all(is_int(t) for t in prompt):
            ids = list(prompt)
        else:
            raise SelfSpecError("prompt: give a string, a list of chat messages ({'role', 'content'}) or token ids")
        check(len(ids) > 0, "prompt: must not be empty")
        return list(ids)

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
        max_new_tokens: int = 128,
        draft_len: int | None = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = 0,
        strategy: str = "selfspec",
        draft_threshold: float | None = None,
        stop: str | list[str] | None = None,
        chat: bool | None = None,
        decode: DecodeConfig | None = None,
        tree: str | None = None,
        tree_nodes: int | None = None,
        tree_topk: int | None = None,
        tree_shape: list[int] | None = None,
        lookup: bool | None = None,
        lookup_mode: str | None = None,
        lookup_len: int | None = None,
        lookup_branches: int | None = None,
        lookup_min_ngram: int | None = None,
        lookup_max_ngram: int | None = None,
        tokens_per_pass: int | None = None,
    ) -> GenerationResult:
        """The keyword arguments are DecodeConfig's keys (`decode=` gives them all at once instead); the draft-tree
        and context-lookup ones default (None) to DecodeConfig's: tree="chain" | "static" | "dynamic" | "auto" (the
        head's tuned tree; an error when it carries none),
        tree_nodes, tree_topk, tree_shape=[3, 2, 2, 1], lookup=True (needs no head: context-lookup drafts alone),
        lookup_mode="branch" | "first" (with a head: lookup branches in a tree, or lookup's chain when it matches and
        the head's otherwise), lookup_len, lookup_branches, lookup_min_ngram, lookup_max_ngram; tokens_per_pass=m
        (m drafts per pass through layers < E from a medusa head's extra heads)."""
        options = dict(tree=tree, tree_nodes=tree_nodes, tree_topk=tree_topk, tree_shape=tree_shape, lookup=lookup,
                       lookup_mode=lookup_mode, lookup_len=lookup_len, lookup_branches=lookup_branches, lookup_min_ngram=lookup_min_ngram,
                       lookup_max_ngram=lookup_max_ngram, tokens_per_pass=tokens_per_pass)
        options.update(draft_len=draft_len, draft_threshold=draft_threshold)
        options = {k: v for k, v in options.items() if v is not None}
        check(decode is None or not options, f"generate: give {', '.join(options)} inside decode=DecodeConfig(...), not beside it")
        if decode is not None:  # a whole config: every key is the caller's
            cfg, tuned = decode, []
        else:
            # A trained head's tuned settings (draft_len, draft_threshold, ...) fill what the caller left unset;
            # draft_threshold=0 turns dynamic K off explicitly. tree="auto" is the head's tuned tree when it carries one
            # (else the engine refuses it: calibration resolves auto, selfspec.evaluation.calibration.calibrate_tree).
            tuned_tree = self.head.decode_settings.get("tree", "auto") if self.head is not None else "auto"
            if options.get("tree") == "auto" and strategy == "selfspec" and tuned_tree != "auto":
                del options["tree"]
            cfg = DecodeConfig(strategy=strategy, temperature=temperature, top_k=top_k, top_p=top_p,
                               max_new_tokens=max_new_tokens, seed=seed, stop=stop, **options)
            cfg, tuned = with_tuned_settings(cfg, self.head.decode_settings if self.head is not None else {}, options)
        ids = self.encode(prompt, chat=chat)
        result = self.decoder.decode(ids, cfg, self.eos_ids, self._stop_fn(cfg.stop))
        text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        return GenerationResult(token_ids=result.token_ids, text=text, stats=result.stats.to_dict(), decode=cfg,
                                tuned_from_head=tuned)
