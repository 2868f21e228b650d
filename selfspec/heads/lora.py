"""A LoRA on the early layers [0, E), active on the draft path only.

Drafting runs layers < E with the LoRA on (and its own KV cache, since those K/V differ from the target's);
verification runs the base weights with the LoRA off, which is exactly the base layer's output. "On" holds for the
drafting thread only, so concurrent calls on one model never see another call's adapter.
The draft then exits through the shared final norm + LM head (the lens on the adapted early stack).
The LoRA itself lives in the model (selfspec/model/lora.py); the head holds no parameters of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from selfspec.errors import check
from selfspec.heads.base import ExitHead
from selfspec.heads.config import HeadConfig, check_int_field, check_number_field, register_head
from selfspec.model import lora as lora_mod

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraHeadConfig(HeadConfig):
    type: str = "lora"
    lora_rank: int = 8
    lora_alpha: float = 16.0
    # linear layers to adapt, by name; a single string is one name (["q_proj"]), not a pattern
    lora_targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))

    def __post_init__(self):
        super().__post_init__()
        check_int_field("head", "lora_rank", self.lora_rank, 1)
        check_number_field("head", "lora_alpha", self.lora_alpha, 0)
        targets = [self.lora_targets] if isinstance(self.lora_targets, str) else self.lora_targets
        check(isinstance(targets, (list, tuple)) and len(targets) > 0 and all(isinstance(t, str) and t for t in targets),
              f"head.lora_targets={self.lora_targets!r}: must be a non-empty list of layer names (e.g. [q_proj, v_proj])")
        self.lora_targets = list(targets)

    def size_limits(self, backbone):
        H = backbone.hidden_size
        return super().size_limits(backbone) | {"lora_rank": (1, H, f"its hidden size {H}")}


@register_head("lora", LoraHeadConfig)
class LoraHead(ExitHead):
    reuses_early_layers = False
    training_input = "ids"
    one_per_model = True

    def __init__(self, config: LoraHeadConfig, exit_layer: int, backbone):
        super().__init__(config, exit_layer, backbone)
        self._lora_modules: list = []
        self._hf_model = None  # set by attach(); not a submodule (the base model is not ours to save)

    def attach(self, backbone) -> None:
        """Inject the LoRA into layers < E of the backbone's model (once), adapters off."""
        if self._hf_model is backbone.hf_model:
            return
        c = self.config
        self._lora_modules = lora_mod.inject_lora(backbone.hf_model, c.lora_rank, c.lora_alpha, c.lora_targets, self.exit_layer)
        self._hf_model = backbone.hf_model

    def drafting(self):
        """The LoRA on for this thread's forward passes only: another thread's verify pass or HF generate on the
        same model, at the same time, computes the base layers (model/lora.py)."""
        return lora_mod.lora_drafting()

    def trainable_parameters(self) -> dict[str, torch.nn.Parameter]:
        return lora_mod.lora_parameters(self._hf_model) if self._hf_model is not None else {}

    def trainable_state_dict(self):
        sd = {f"lora.{n}": p.detach() for n, p in self.trainable_parameters().items()}
        sd["vocab_ids"] = self.vocab_ids
        return sd

    def load_trainable(self, tensors: dict[str, torch.Tensor]) -> None:
        params = self.trainable_parameters()
        got = {k.removeprefix("lora."): v for k, v in tensors.items()}
        if set(got) != set(params):
            raise RuntimeError(f"LoRA tensors do not match ({len(got)} saved, {len(params)} expected)")
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(got[k].to(p.dtype))
