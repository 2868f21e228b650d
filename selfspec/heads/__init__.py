"""Exit heads and their save/load (peft-like: a small JSON config + the trained weights in safetensors)."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import fields
from pathlib import Path

import torch

from selfspec.errors import SelfSpecError
from selfspec.heads.adapter import AdapterHead
from selfspec.heads.base import HEAD_TYPES, ExitHead, HeadConfig, LensHead, check_exit_layer, default_draft_vocab, draft_vocab_from_counts
from selfspec.heads.lora import LoraHead
from selfspec.heads.medusa import MedusaHead
from selfspec.model.backbone import fingerprints_match

CONFIG_FILE = "head_config.json"
WEIGHTS_FILE = "head.safetensors"

__all__ = [
    "HEAD_TYPES", "ExitHead", "HeadConfig", "LensHead", "MedusaHead", "AdapterHead", "LoraHead",
    "build_head", "save_head", "load_head", "default_exit_layer", "draft_vocab_from_counts",
]


def default_exit_layer(num_layers: int) -> int:
    """A quarter of the depth: cheap drafts; trained heads recover most of the acceptance (see BENCHMARKS.md)."""
    return max(1, min(num_layers - 1, num_layers // 5))


def build_head(cfg: HeadConfig, backbone, eos_ids: list[int] | None = None) -> ExitHead:
    """A fresh (untrained) head of cfg.type at cfg.exit_layer on this backbone."""
    E = cfg.exit_layer if cfg.exit_layer is not None else default_exit_layer(backbone.num_layers)
    check_exit_layer(E, backbone.num_layers)
    H = backbone.hidden_size
    if cfg.type == "lens":
        head: ExitHead = LensHead(cfg, E, H)
    elif cfg.type == "medusa":
        head = MedusaHead(cfg, E, H)
    elif cfg.type == "adapter":
        head = AdapterHead(cfg, E, H, backbone.kv_shape.head_dim, backbone.config.num_attention_heads)
    elif cfg.type == "lora":
        head = LoraHead(cfg, E, H)
    else:  # HeadConfig validates; keep the message for direct callers
        raise SelfSpecError(f"head.type={cfg.type!r}: allowed {', '.join(HEAD_TYPES)}")
    head.exit_layer = E
    if cfg.draft_vocab:
        head.set_draft_vocab(default_draft_vocab(backbone.vocab_size, cfg.draft_vocab, eos_ids or []))
    head.to(device=backbone.device, dtype=backbone.dtype)
    if isinstance(head, LoraHead):
        head.attach(backbone.hf_model)
    return head


def save_head(head: ExitHead, path: str | os.PathLike, backbone, extra: dict | None = None) -> Path:
    """Write DIR/head_config.json + DIR/head.safetensors atomically (temp dir, then rename)."""
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = {"format": "selfspec-head/1", **head.config_dict(), "num_params": head.num_params(),
              "base_model": backbone.fingerprint(), **(extra or {})}
    (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in head.trainable_state_dict().items()}
    save_file(tensors, str(tmp / WEIGHTS_FILE))
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)
    return path


def read_head_config(path: str | os.PathLike) -> dict:
    path = Path(path)
    cfg_file = path / CONFIG_FILE
    if not path.is_dir():
        raise SelfSpecError(f"head.path={str(path)!r}: directory not found")
    if not cfg_file.is_file() or not (path / WEIGHTS_FILE).is_file():
        raise SelfSpecError(f"head.path={str(path)!r}: not a head directory (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        data = json.loads(cfg_file.read_text())
        if not isinstance(data, dict) or data.get("type") not in HEAD_TYPES:
            raise ValueError("no valid 'type'")
    except ValueError as exc:
        raise SelfSpecError(f"head.path={str(path)!r}: corrupt {CONFIG_FILE} ({exc})")
    return data


def load_head(path: str | os.PathLike, backbone) -> ExitHead:
    """Rebuild a saved head on this backbone; refuses a head saved for another model."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    data = read_head_config(path)
    if not fingerprints_match(data.get("base_model", {}), backbone.fingerprint()):
        saved = data.get("base_model", {})
        raise SelfSpecError(
            f"head.path={str(path)!r}: saved for another model ({saved.get('model_type')}, {saved.get('num_layers')} layers, "
            f"hidden {saved.get('hidden_size')}); this one is {backbone.config.model_type}, {backbone.num_layers} layers, hidden {backbone.hidden_size}"
        )
    names = {f.name for f in fields(HeadConfig)}
    cfg = HeadConfig(**{k: v for k, v in data.items() if k in names and k != "path"})
    head = build_head(cfg, backbone)
    try:
        tensors = load_file(str(path / WEIGHTS_FILE))
    except (SafetensorError, OSError, Exception) as exc:  # safetensors raises several types on corrupt files
        raise SelfSpecError(f"head.path={str(path)!r}: corrupt {WEIGHTS_FILE} ({str(exc).splitlines()[0]})")
    vocab = tensors.pop("vocab_ids", None)
    head.set_draft_vocab(vocab if vocab is not None and vocab.numel() else None)
    try:
        if isinstance(head, LoraHead):
            params = head.lora_parameters()
            got = {k.removeprefix("lora."): v for k, v in tensors.items()}
            if set(got) != set(params):
                raise RuntimeError(f"LoRA tensors do not match ({len(got)} saved, {len(params)} expected)")
            with torch.no_grad():
                for k, p in params.items():
                    p.copy_(got[k].to(p.dtype))
        else:
            head.load_state_dict({**tensors, "vocab_ids": head.vocab_ids}, strict=True)
    except RuntimeError as exc:
        raise SelfSpecError(f"head.path={str(path)!r}: weights do not fit the config ({str(exc).splitlines()[0]})")
    head.to(device=backbone.device, dtype=backbone.dtype)
    head.vocab_ids = head.vocab_ids.long()
    return head
