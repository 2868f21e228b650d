"""The Python entry point: `SelfSpecModel.from_pretrained(...)` and `.generate(...)`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from selfspec.decoding.engine import DecodeConfig, Decoder
from selfspec.errors import SelfSpecError, check
from selfspec.heads import HEAD_TYPES, ExitHead, HeadConfig, build_head, load_head
from selfspec.model.backbone import Backbone
from selfspec.model.loading import ModelConfig, load_model


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only (a final EOS included, as HF generate returns it)
    text: str
    stats: dict = field(default_factory=dict)


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
    """A target model plus one exit head. `.hf_model`, `.tokenizer`, `.exit_layer`, `.head`, `.backbone`."""

    def __init__(self, hf_model, tokenizer, head: ExitHead | None, model_config: ModelConfig | None = None):
        self.hf_model = hf_model
        self.tokenizer = tokenizer
        self.backbone = Backbone(hf_model, cpu_kernels=model_config.cpu_kernels if model_config is not None else True)
        self.head = head
        self.model_config = model_config
        self._decoder = Decoder(self.backbone, head)

    @property
    def exit_layer(self) -> int | None:
        return self.head.exit_layer if self.head is not None else None

    @classmethod
    def from_pretrained(
        cls,
        model: str | ModelConfig = "smollm2_135m",
        head: str | HeadConfig | None = "lens",
        exit_layer: int | None = None,
        dtype: str | None = None,
        device: str | None = None,
        **head_options,
    ) -> "SelfSpecModel":
        """model: a config name from conf/model/, a directory, a hub id or a ModelConfig.
        head: 'lens' | 'medusa' | 'adapter' | 'lora' | a saved head directory | a HeadConfig | None."""
        mcfg = model if isinstance(model, ModelConfig) else model_config_from_name(model, dtype=dtype, device=device)
        hf_model, tok = load_model(mcfg)
        self = cls(hf_model, tok, None, mcfg)
        self.set_head(head, exit_layer=exit_layer, **head_options)
        return self

    def set_head(self, head: str | HeadConfig | ExitHead | None, exit_layer: int | None = None, **head_options) -> None:
        if head is None or isinstance(head, ExitHead):
            h = head
        elif isinstance(head, HeadConfig):
            h = load_head(head.path, self.backbone) if head.path else build_head(head, self.backbone, self.eos_ids)
        elif head in HEAD_TYPES:
            h = build_head(HeadConfig(type=head, exit_layer=exit_layer, **head_options), self.backbone, self.eos_ids)
        elif Path(head).exists():
            h = load_head(head, self.backbone)
        else:
            raise SelfSpecError(f"head={head!r}: allowed {', '.join(HEAD_TYPES)} or a saved head directory (not found)")
        self.head = h
        self._decoder = Decoder(self.backbone, h)

    # ------------------------------------------------------------------ prompts
    @property
    def eos_ids(self) -> list[int]:
        ids = set()
        for src in (getattr(self.hf_model.generation_config, "eos_token_id", None), self.tokenizer.eos_token_id):
            if isinstance(src, int):
                ids.add(src)
            elif src:
                ids.update(src)
        return sorted(ids)

    def encode(self, prompt, chat: bool | None = None) -> list[int]:
        """str -> ids (raw text, or the chat template when chat=True); list of messages -> chat template;
        ids (list of int / 1-D tensor) pass through."""
        if isinstance(prompt, torch.Tensor):
            ids = prompt.reshape(-1).tolist()
        elif isinstance(prompt, str):
            check(prompt.strip() != "", "prompt: must not be empty")
            if chat and self.tokenizer.chat_template:
                return self.encode([{"role": "user", "content": prompt}])
            ids = self.tokenizer(prompt)["input_ids"]
        elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            check(all(m.get("content") for m in prompt), "messages: every message needs non-empty 'content'")
            out = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
            ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
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
        draft_len: int = 4,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = 0,
        strategy: str = "self_speculative",
        draft_threshold: float | None = None,
        stop: list[str] | None = None,
        chat: bool | None = None,
        decode: DecodeConfig | None = None,
    ) -> GenerationResult:
        cfg = decode or DecodeConfig(
            strategy=strategy, draft_len=draft_len, draft_threshold=draft_threshold, temperature=temperature,
            top_k=top_k, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed, stop=list(stop or []),
        )
        ids = self.encode(prompt, chat=chat)
        new, stats = self._decoder.generate(ids, cfg, self.eos_ids, self._stop_fn(cfg.stop))
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        return GenerationResult(token_ids=new, text=text, stats=stats)


def decode_config_from(d: dict) -> DecodeConfig:
    names = {f.name for f in fields(DecodeConfig)}
    return DecodeConfig(**{k: v for k, v in d.items() if k in names})
