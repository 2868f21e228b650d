"""Build, save and load heads through the registry (peft-like: a small JSON config + the trained weights).

A saved head is a directory: head_config.json (format, the config's fields, the parameter count, the base
model's fingerprint) and head.safetensors (the head's trainable tensors and `vocab_ids`). Loading rebuilds the
head from its registered type and refuses a head saved for another model. Heads saved before the per-type
configs (every type's fields in one flat JSON) load too: fields their type does not have are dropped.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

from selfspec.decoding.config import TUNED_KEYS as DECODE_SETTING_KEYS
from selfspec.errors import SelfSpecError
from selfspec.heads.base import ExitHead, check_draft_vocab, check_exit_layer, default_draft_vocab
from selfspec.heads.config import HeadConfig, as_head_config, head_config_from_dict, head_spec, head_types
from selfspec.model.backbone import fingerprints_match

CONFIG_FILE = "head_config.json"
WEIGHTS_FILE = "head.safetensors"
FORMAT = "selfspec-head/1"
# Heads this project trained and ships (one directory per model, a README with its command beside each);
# `head=default` / head.path=default picks the one saved for the loaded model (by fingerprint).
SHIPPED_DIR = Path(__file__).parent / "shipped"
DEFAULT_HEAD = "default"


def default_exit_layer(num_layers: int) -> int:
    """A fifth of the depth: cheap drafts; trained heads recover most of the acceptance (see BENCHMARKS.md)."""
    return max(1, min(num_layers - 1, num_layers // 5))


def build_head(cfg: HeadConfig, backbone, eos_ids: list[int] | None = None) -> ExitHead:
    """A fresh (untrained) head of cfg.type at cfg.exit_layer on this backbone (a LoRA is injected into it)."""
    cfg = as_head_config(cfg)
    E = cfg.exit_layer if cfg.exit_layer is not None else default_exit_layer(backbone.num_layers)
    check_exit_layer(E, backbone.num_layers)
    head = head_spec(cfg.type).head_class(replace(cfg, exit_layer=E), E, backbone)
    if cfg.draft_vocab:
        head.set_draft_vocab(default_draft_vocab(backbone.vocab_size, cfg.draft_vocab, eos_ids or []))
    head.to(device=backbone.device, dtype=backbone.dtype)
    head.attach(backbone)
    return head


def save_head(head: ExitHead, path: str | os.PathLike, backbone, extra: dict | None = None) -> Path:
    """Write DIR/head_config.json + DIR/head.safetensors atomically (a temp dir, then a rename)."""
    from safetensors.torch import save_file

    from selfspec.utils.io import atomic_dir

    path = Path(path)
    config = {"format": FORMAT, **head.config_dict(), "num_params": head.num_params(),
              "base_model": backbone.fingerprint(), **(extra or {})}
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in head.trainable_state_dict().items()}
    with atomic_dir(path) as tmp:
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        save_file(tensors, str(tmp / WEIGHTS_FILE))
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
        if not isinstance(data, dict) or data.get("type") not in head_types():
            raise ValueError("no valid 'type'")
    except ValueError as exc:
        raise SelfSpecError(f"head.path={str(path)!r}: corrupt {CONFIG_FILE} ({exc})")
    return data


def shipped_heads() -> dict[str, Path]:
    """The heads that ship with the package: {directory name: path}."""
    if not SHIPPED_DIR.is_dir():
        return {}
    return {d.name: d for d in sorted(SHIPPED_DIR.iterdir()) if (d / CONFIG_FILE).is_file() and (d / WEIGHTS_FILE).is_file()}


def shipped_head_for(backbone) -> Path | None:
    """The shipped head saved for this backbone's model (its fingerprint matches), or None."""
    mine = backbone.fingerprint()
    for path in shipped_heads().values():
        if fingerprints_match(read_head_config(path).get("base_model", {}), mine):
            return path
    return None


def resolve_default_head(cfg: HeadConfig, backbone) -> HeadConfig:
    """head.path=default -> the shipped head's directory for this model; when none ships for it, the untrained
    logit lens at cfg.exit_layer (one warning line). Any other config passes through unchanged."""
    cfg = as_head_config(cfg)
    if cfg.path != DEFAULT_HEAD:
        return cfg
    found = shipped_head_for(backbone)
    if found is not None:
        return replace(cfg, path=str(found))
    import logging

    logging.getLogger(__name__).warning(
        "head=default: no head ships for this model (shipped: %s); using the untrained logit lens (train one: "
        "python -m selfspec.train)", ", ".join(shipped_heads()) or "none")
    return HeadConfig(type="lens", exit_layer=cfg.exit_layer, draft_vocab=None)


def _saved_config(path: Path, data: dict) -> HeadConfig:
    try:
        return head_config_from_dict({k: v for k, v in data.items() if k != "path"}, strict=False)
    except SelfSpecError as exc:
        raise SelfSpecError(f"head.path={str(path)!r}: bad {CONFIG_FILE}: {exc}")


def load_head(path: str | os.PathLike, backbone) -> ExitHead:
    """Rebuild a saved head on this backbone; refuses a head saved for another model."""
    from safetensors.torch import load_file

    if str(path) == DEFAULT_HEAD:
        found = shipped_head_for(backbone)
        if found is None:
            raise SelfSpecError(f"head.path=default: no head ships for this model (shipped: {', '.join(shipped_heads()) or 'none'}); "
                                "give head=lens|medusa|... or head.path=DIR")
        path = found
    path = Path(path)
    data = read_head_config(path)
    mine = backbone.fingerprint()
    if not fingerprints_match(data.get("base_model", {}), mine):
        saved = data.get("base_model", {})
        raise SelfSpecError(
            f"head.path={str(path)!r}: saved for another model ({saved.get('model_type')}, {saved.get('num_layers')} layers, "
            f"hidden {saved.get('hidden_size')}); this one is {mine['model_type']}, {backbone.num_layers} layers, hidden {backbone.hidden_size}"
        )
    head = build_head(_saved_config(path, data), backbone)
    try:
        tensors = load_file(str(path / WEIGHTS_FILE))
    except Exception as exc:  # safetensors raises several types on corrupt files
        raise SelfSpecError(f"head.path={str(path)!r}: corrupt {WEIGHTS_FILE} ({str(exc).splitlines()[0]})")
    vocab = tensors.pop("vocab_ids", None)
    if vocab is not None:
        check_draft_vocab(vocab, backbone.vocab_size, f"head.path={str(path)!r}: {WEIGHTS_FILE}")
    head.set_draft_vocab(vocab if vocab is not None and vocab.numel() else None)
    try:
        head.load_trainable(tensors)
    except RuntimeError as exc:
        raise SelfSpecError(f"head.path={str(path)!r}: weights do not fit the config ({str(exc).splitlines()[0]})")
    head.to(device=backbone.device, dtype=backbone.dtype)
    head.vocab_ids = head.vocab_ids.long()
    head.decode_settings = saved_decode_settings(path, data)
    return head


# Decode settings a saved head may carry (those its validation ran with; training writes them): TUNED_KEYS.


def saved_decode_settings(path: Path, data: dict) -> dict:
    """The head's tuned decode settings from head_config.json's "decode" block ({} when absent), checked by
    DecodeConfig itself so a bad value is one line naming the file."""
    from selfspec.decoding.config import DecodeConfig

    block = data.get("decode") or {}
    if not isinstance(block, dict):
        raise SelfSpecError(f"head.path={str(path)!r}: bad {CONFIG_FILE}: 'decode' must be a mapping")
    known = set(DecodeConfig.__dataclass_fields__)
    settings = {k: v for k, v in block.items() if k in DECODE_SETTING_KEYS and k in known}
    try:
        DecodeConfig(**settings)
    except SelfSpecError as exc:
        raise SelfSpecError(f"head.path={str(path)!r}: bad {CONFIG_FILE} 'decode' block: {exc}")
    return settings
