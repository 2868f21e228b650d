"""LoRA on the base model's early layers, through peft (the one place that knows peft's modules).

`inject_lora` adds LoRA matrices to layers [0, E) of the HF model, switched off; `set_lora_enabled` switches
them. With them off, peft computes exactly the base layer's output, so the target stays bit-identical.
"""

from __future__ import annotations

import torch

from selfspec.errors import SelfSpecError


def has_lora(hf_model) -> bool:
    from peft.tuners.lora import LoraLayer

    return any(isinstance(m, LoraLayer) for m in hf_model.modules())


def inject_lora(hf_model, rank: int, alpha: float, targets: list[str], num_layers: int) -> list[torch.nn.Module]:
    """LoRA (rank, alpha) on the `targets` linears of decoder layers [0, num_layers), off. -> the LoRA modules."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    if has_lora(hf_model):
        raise SelfSpecError("head=lora: this model already carries a LoRA; load a fresh model for another LoRA head")
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets),
        layers_to_transform=list(range(num_layers)),
        layers_pattern="layers",
        lora_dropout=0.0,
    )
    inject_adapter_in_model(config, hf_model)
    modules = [m for m in hf_model.modules() if isinstance(m, LoraLayer)]
    set_lora_enabled(modules, False)
    return modules


def set_lora_enabled(modules: list[torch.nn.Module], on: bool) -> None:
    # peft's enable_adapters() also flips requires_grad; the flag alone is what forward() reads.
    for m in modules:
        m._disable_adapters = not on


def lora_parameters(hf_model) -> dict[str, torch.nn.Parameter]:
    """The injected LoRA matrices by name (empty without a LoRA)."""
    return {n: p for n, p in hf_model.named_parameters() if "lora_" in n}
