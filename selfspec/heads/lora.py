"""A peft LoRA on the early layers [0, E), active on the draft path only.

Drafting runs layers < E with the LoRA on (and its own KV cache, since those K/V differ from the target's);
verification runs the base weights with the LoRA off, which peft computes as exactly the base layer's output.
The draft then exits through the shared final norm + LM head (the lens on the adapted early stack).
"""

from __future__ import annotations

import contextlib

import torch

from selfspec.heads.base import ExitHead, HeadConfig


class LoraHead(ExitHead):
    kind = "lora"
    reuses_early_layers = False

    def __init__(self, cfg: HeadConfig, exit_layer: int, hidden_size: int):
        super().__init__(cfg, exit_layer, hidden_size)
        self._lora_modules: list = []
        self._hf_model = None  # set by attach(); not a submodule (the base model is not ours to save)

    def attach(self, hf_model) -> None:
        """Inject LoRA modules into layers < E of hf_model (once), adapters off by default."""
        from peft import LoraConfig, inject_adapter_in_model
        from peft.tuners.lora import LoraLayer

        if self._hf_model is hf_model:
            return
        if any(isinstance(m, LoraLayer) for m in hf_model.modules()):
            from selfspec.errors import SelfSpecError

            raise SelfSpecError("head=lora: this model already carries a LoRA; load a fresh model for another LoRA head")
        config = LoraConfig(
            r=self.cfg.lora_rank,
            lora_alpha=self.cfg.lora_alpha,
            target_modules=self.cfg.lora_targets,
            layers_to_transform=list(range(self.exit_layer)),
            layers_pattern="layers",
            lora_dropout=0.0,
        )
        inject_adapter_in_model(config, hf_model)
        self._hf_model = hf_model
        self._lora_modules = [m for m in hf_model.modules() if isinstance(m, LoraLayer)]
        self._set(False)

    def _set(self, on: bool) -> None:
        # peft's enable_adapters() also flips requires_grad; the flag alone is what forward() reads.
        for m in self._lora_modules:
            m._disable_adapters = not on

    @contextlib.contextmanager
    def drafting(self):
        self._set(True)
        try:
            yield
        finally:
            self._set(False)

    def lora_parameters(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in self._hf_model.named_parameters() if "lora_" in n} if self._hf_model else {}

    def trainable_state_dict(self):
        sd = {f"lora.{n}": p.detach() for n, p in self.lora_parameters().items()}
        sd["vocab_ids"] = self.vocab_ids
        return sd

    def num_params(self) -> int:
        return sum(p.numel() for p in self.lora_parameters().values())
