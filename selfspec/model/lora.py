"""LoRA on the base model's early layers, through peft (the one place that knows peft's modules).

`inject_lora` adds LoRA matrices to layers [0, E) of the HF model. Their contribution is gated per thread:
it applies only inside `lora_drafting()` *in the thread that entered it*. Everywhere else (another thread's
verify pass or HF `generate` on the same model, at the same moment) each adapted linear computes exactly
its base layer's output, so the target stays bit-identical. There is no model-wide switch that one thread
could leave on for another.
"""

from __future__ import annotations

import contextlib
import threading
import types

import torch

from selfspec.errors import SelfSpecError

_LOCAL = threading.local()  # .depth: how many lora_drafting() blocks this thread is inside


def lora_active() -> bool:
    """True inside `lora_drafting()` in the calling thread (and only there)."""
    return getattr(_LOCAL, "depth", 0) > 0


@contextlib.contextmanager
def lora_drafting():
    """The block in which the calling thread's forward passes run with the LoRA on (nestable)."""
    _LOCAL.depth = getattr(_LOCAL, "depth", 0) + 1
    try:
        yield
    finally:
        _LOCAL.depth -= 1


def _gated_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A peft LoRA layer's forward: peft's own (base + LoRA) in a drafting thread, the base layer elsewhere."""
    if lora_active():
        return type(self).forward(self, x, *args, **kwargs)
    return self.base_layer(x, *args, **kwargs)


def has_lora(hf_model) -> bool:
    from peft.tuners.lora import LoraLayer

    return any(isinstance(m, LoraLayer) for m in hf_model.modules())


def _linear_names(hf_model, num_layers: int) -> list[str]:
    """The full names of the nn.Linear modules inside decoder layers [0, num_layers)."""
    import re

    names = []
    for name, module in hf_model.named_modules():
        m = re.search(r"(^|\.)layers\.(\d+)\.", name)
        if m and int(m.group(2)) < num_layers and isinstance(module, torch.nn.Linear):
            names.append(name)
    return names


def inject_lora(hf_model, rank: int, alpha: float, targets: list[str], num_layers: int) -> list[torch.nn.Module]:
    """LoRA (rank, alpha) on the `targets` linears of decoder layers [0, num_layers), gated (see the module
    docstring). -> the LoRA modules. A target that names no linear layer there is one error line."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    if has_lora(hf_model):
        raise SelfSpecError("head=lora: this model already carries a LoRA; load a fresh model for another LoRA head")
    linears = _linear_names(hf_model, num_layers)
    # peft matches a target name as a suffix of a module's name: q_proj, self_attn.q_proj
    unknown = [t for t in targets if not any(n == t or n.endswith("." + t) for n in linears)]
    if unknown:
        raise SelfSpecError(f"head.lora_targets={list(targets)!r}: {', '.join(map(repr, unknown))} "
                            f"{'names' if len(unknown) == 1 else 'name'} no linear layer in this model's decoder layers "
                            f"[0, {num_layers}); allowed: {', '.join(sorted({n.rsplit('.', 1)[-1] for n in linears}))}")
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets),
        layers_to_transform=list(range(num_layers)),
        layers_pattern="layers",
        lora_dropout=0.0,
    )
    try:
        inject_adapter_in_model(config, hf_model)
    except (ValueError, TypeError, KeyError) as exc:  # peft's own refusal, as one line rather than a traceback
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise SelfSpecError(f"head.lora_targets={list(targets)!r}: peft cannot adapt them ({first})") from None
    modules = [m for m in hf_model.modules() if isinstance(m, LoraLayer)]
    for m in modules:
        m._disable_adapters = False  # peft's switch stays on; the per-thread gate decides (see _gated_forward)
        m.forward = types.MethodType(_gated_forward, m)
    return modules


def lora_parameters(hf_model) -> dict[str, torch.nn.Parameter]:
    """The injected LoRA matrices by name (empty without a LoRA)."""
    return {n: p for n, p in hf_model.named_parameters() if "lora_" in n}
