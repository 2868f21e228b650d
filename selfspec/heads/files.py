"""A saved head's files: DIR/head_config.json (format, the config's fields, the parameter count, the base model's
fingerprint and `base_model_name_or_path`) and DIR/head.safetensors (the head's trainable tensors and `vocab_ids`),
and how they are written (`save_head`).

Below base.py, so that `ExitHead.save_pretrained` writes them; saving.py reads them back (load_head)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from selfspec.errors import SelfSpecError
from selfspec.utils.io import atomic_dir

CONFIG_FILE = "head_config.json"
WEIGHTS_FILE = "head.safetensors"
FORMAT = "selfspec-head/1"


def save_head(head: nn.Module, path: str | os.PathLike, backbone, extra: dict | None = None) -> Path:
    """Write DIR/head_config.json + DIR/head.safetensors of an ExitHead atomically (a temp dir, then a rename)."""
    from safetensors.torch import save_file

    path = Path(path)
    config = {"format": FORMAT, **head.config_dict(), "num_params": head.num_params(),
              **base_model_source(backbone), "base_model": backbone.fingerprint(), **(extra or {})}
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in head.trainable_state_dict().items()}
    bad = non_finite(tensors)
    if bad:  # a head that would crash sampling (or draft garbage) is never written
        raise SelfSpecError(f"save_head({str(path)!r}): the head's weights hold NaN or inf ({', '.join(bad[:3])}"
                            f"{', ...' if len(bad) > 3 else ''}); not saved")
    with atomic_dir(path) as tmp:
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        save_file(tensors, str(tmp / WEIGHTS_FILE))
    return path


def base_model_source(backbone) -> dict:
    """peft's `base_model_name_or_path` (what SelfSpecModel.from_pretrained takes to load the model again: a conf/model
    name, a hub id or a directory; model/loading.py: model_source), and the GGUF file inside it when there is one."""
    src = getattr(backbone.hf_model, "selfspec_source", None) or {}
    name = src.get("name_or_path") or getattr(backbone.hf_model, "name_or_path", None) or None
    out = {"base_model_name_or_path": name}
    if src.get("gguf_file"):
        out["base_model_gguf_file"] = src["gguf_file"]
    if src.get("off_grid"):  # trained on a model.off_grid testbed: loading it again needs the same nudge
        out["base_model_off_grid"] = src["off_grid"]
    return out


def non_finite(tensors: dict) -> list[str]:
    """The names of the floating tensors holding NaN or inf, sorted."""
    return sorted(k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all()))
