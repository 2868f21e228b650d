"""Build and load heads through the registry (peft-like: a small JSON config + the trained weights).

A saved head is a directory: head_config.json (format, the config's fields, the parameter count, the base
model's fingerprint) and head.safetensors (the head's trainable tensors and `vocab_ids`), written by files.py
(save_head). Loading rebuilds the head from its registered type and refuses a head saved for another model. Heads
saved before the per-type configs (every type's fields in one flat JSON) load too: fields their type does not have
are dropped.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

from selfspec.decoding.config import TUNED_KEYS, DecodeConfig
from selfspec.errors import SelfSpecError
from selfspec.heads.base import ExitHead, check_draft_vocab, default_draft_vocab
from selfspec.heads.config import HeadConfig, as_head_config, check_head_sizes, head_config_from_dict, head_spec, head_types
from selfspec.heads.files import CONFIG_FILE, WEIGHTS_FILE, non_finite
from selfspec.model.identity import compare_fingerprints, compare_to_backbone, tensor_layout

# Heads this project trained and ships (one directory per model, a README with its command beside each);
# `head=default` / head.path=default picks the one saved for the loaded model or another source or quantization of it
# (shipped_head_for: their fingerprints compared, model/identity.py).
SHIPPED_DIR = Path(__file__).parent / "shipped"
DEFAULT_HEAD = "default"


def build_head(cfg: HeadConfig, backbone, eos_ids: list[int] | None = None, where: str = "head") -> ExitHead:
    """A fresh (untrained) head of cfg.type at cfg.exit_layer on this backbone (a LoRA is injected into it).
    Its sizes are checked against the model (HeadConfig.size_limits) before any module is built."""
    cfg = as_head_config(cfg)
    E = head_spec(cfg.type).head_class.exit_layer_for(cfg.exit_layer, backbone.num_layers)
    check_head_sizes(cfg, backbone, where)
    head = head_spec(cfg.type).head_class(replace(cfg, exit_layer=E), E, backbone)
    if cfg.draft_vocab:
        head.set_draft_vocab(default_draft_vocab(backbone.vocab_size, cfg.draft_vocab, eos_ids or []))
    head.to(device=backbone.device, dtype=backbone.dtype)
    head.attach(backbone)
    return head


def read_head_config(path: str | os.PathLike) -> dict:
    path = shipped_or_path(path)
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
    """The heads that ship with the package: {directory name: path}. A name without '+' is a model's default
    (`head=default`); `<model>+<kind>` (e.g. smollm2_135m+context) is another head for it, loaded by that name
    (`head.path=smollm2_135m+context`, from_pretrained(head="smollm2_135m+context"))."""
    if not SHIPPED_DIR.is_dir():
        return {}
    return {d.name: d for d in sorted(SHIPPED_DIR.iterdir()) if (d / CONFIG_FILE).is_file() and (d / WEIGHTS_FILE).is_file()}


def default_shipped_heads() -> dict[str, Path]:
    """The shipped heads head=default may pick: those named after a model alone (no '+')."""
    return {n: p for n, p in shipped_heads().items() if "+" not in n}


def shipped_or_path(path: str | os.PathLike) -> Path:
    """A shipped head's name -> its directory (unless a directory of that name exists here); any other path as it is."""
    p = Path(path)
    if not p.exists() and str(path) in (shipped := shipped_heads()):
        return shipped[str(path)]
    return p


def shipped_head_for(backbone) -> Path | None:
    """The default head shipped for this backbone's model, or None: the same weights, or the same model from another
    source or quantization (model/identity.py; the shipped heads were trained on GGUF Q4 files)."""
    mine, layout = backbone.fingerprint(), tensor_layout(backbone)
    for path in default_shipped_heads().values():
        if compare_fingerprints(read_head_config(path).get("base_model", {}), mine, layout).accepted:
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


def check_base_model(path: Path, data: dict, backbone, allow_other_model: bool = False) -> dict:
    """Compare the head's saved base model with this one (model/identity.py) -> the comparison as a dict. The same
    model in another source or quantization loads with one line that gives the measured weight distance; another
    model is refused unless allow_other_model (head.allow_other_model=true)."""
    import logging

    match = compare_to_backbone(data.get("base_model", {}), backbone)
    base = data.get("base_model_name_or_path")
    on = f" (saved on {base})" if base else ""
    if not match.accepted and not allow_other_model:
        raise SelfSpecError(f"head.path={str(path)!r}: saved for another model{on}: {match.describe()}; "
                            "head.allow_other_model=true (allow_other_model=True) loads it anyway")
    log = logging.getLogger(__name__)
    if not match.accepted:
        log.warning("head.path=%r: saved for another model%s (%s); loading it anyway (head.allow_other_model=true)",
                    str(path), on, match.describe())
    elif match.verdict == "quantized":
        log.warning("head.path=%r: base model%s loaded from another source or quantization (%s)", str(path), on, match.describe())
    return {**match.to_dict(), "allowed_other_model": not match.accepted}


def load_head(path: str | os.PathLike, backbone, allow_other_model: bool = False) -> ExitHead:
    """Rebuild a saved head on this backbone; refuses a head saved for another model (check_base_model) unless
    allow_other_model."""
    from safetensors.torch import load_file

    if str(path) == DEFAULT_HEAD:
        found = shipped_head_for(backbone)
        if found is None:
            raise SelfSpecError(f"head.path=default: no head ships for this model (shipped: {', '.join(shipped_heads()) or 'none'}); "
                                "give head=lens|medusa|... or head.path=DIR")
        path = found
    path = shipped_or_path(path)
    data = read_head_config(path)
    check = check_base_model(path, data, backbone, allow_other_model)
    where = f"head.path={str(path)!r}: {CONFIG_FILE}: head"
    settings = saved_decode_settings(path, data, backbone.max_positions)  # checked before anything is allocated
    head = build_head(_saved_config(path, data), backbone, where=where)
    int8 = data.get("weights_dtype") == "int8"
    _check_weight_shapes(path, head, backbone.vocab_size, int8)  # from the file's header, before its tensors are read
    try:
        tensors = load_file(str(path / WEIGHTS_FILE))
    except Exception as exc:  # safetensors raises several types on corrupt files
        raise SelfSpecError(f"head.path={str(path)!r}: corrupt {WEIGHTS_FILE} ({str(exc).splitlines()[0]})")
    if int8:
        tensors = dequantize_rows_int8(path, tensors)
    _check_finite(path, tensors, "holds NaN or inf")
    vocab = tensors.pop("vocab_ids", None)
    if vocab is not None:
        check_draft_vocab(vocab, backbone.vocab_size, f"head.path={str(path)!r}: {WEIGHTS_FILE}")
    head.set_draft_vocab(vocab if vocab is not None and vocab.numel() else None)
    try:
        head.load_trainable(tensors)
    except RuntimeError as exc:
        raise SelfSpecError(f"head.path={str(path)!r}: weights do not fit the config ({str(exc).splitlines()[0]})")
    head.to(device=backbone.device, dtype=backbone.dtype)
    # finite in the file but beyond the model's dtype (1e6 on a float16 model) is inf from here on
    _check_finite(path, head.trainable_state_dict(), f"overflows the model's dtype ({str(backbone.dtype).split('.')[-1]})")
    head.vocab_ids = head.vocab_ids.long()
    head.decode_settings = settings
    head.base_model_check = check
    return head


INT8_SCALE = ".int8_scale"  # weights_dtype int8: tensor NAME (int8) has per-row scales NAME.int8_scale (float32)


def quantize_rows_int8(tensors: dict) -> dict:
    """Matrices -> int8 with one symmetric scale per row (NAME, NAME.int8_scale); other floating tensors -> float16;
    the rest (vocab_ids) as they are. About a quarter of float32, and within 0.4% of each row's largest weight."""
    import torch

    out = {}
    for k, v in tensors.items():
        if v.is_floating_point() and v.dim() == 2:
            scale = v.float().abs().amax(1).clamp(min=1e-12) / 127
            out[k] = torch.round(v.float() / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
            out[k + INT8_SCALE] = scale.contiguous()
        else:
            out[k] = (v.half() if v.is_floating_point() else v).contiguous()
    return out


def dequantize_rows_int8(path: Path, tensors: dict) -> dict:
    """quantize_rows_int8's file -> floating tensors (each matrix with its scales; a missing or misshapen scale is one
    line naming the file)."""
    out = {}
    for k, v in tensors.items():
        if k.endswith(INT8_SCALE):
            continue
        scale = tensors.get(k + INT8_SCALE)
        if v.dtype.is_floating_point or v.dim() != 2:
            out[k] = v
            continue
        if scale is None or tuple(scale.shape) != (v.shape[0],) or not scale.is_floating_point():
            raise SelfSpecError(f"head.path={str(path)!r}: {WEIGHTS_FILE}: {k} is int8 without its {k + INT8_SCALE} "
                                f"of shape [{v.shape[0]}]")
        out[k] = v.float() * scale.float()[:, None]
    return out


def _check_finite(path: Path, tensors: dict, what: str) -> None:
    """One line naming the file and the first floating tensor that is not finite: such a head drafts garbage, and
    sampling fails deep inside torch.multinomial ("probability tensor contains either inf, nan")."""
    bad = non_finite(tensors)
    if bad:
        raise SelfSpecError(f"head.path={str(path)!r}: {WEIGHTS_FILE}: {bad[0]} {what}"
                            f"{f' (and {len(bad) - 1} more)' if len(bad) > 1 else ''}")


_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors' header names of the floating dtypes a scale may have


def _check_int8_scales(path: Path, declared: dict) -> None:
    """Every NAME.int8_scale in the header is the per-row scale of the int8 matrix NAME beside it: floating, of
    shape [rows]. Checked from the header like the weights, so a stray or oversized scale is refused unread."""
    where = f"head.path={str(path)!r}: {WEIGHTS_FILE}"
    for k, (shape, dtype) in sorted(declared.items()):
        if not k.endswith(INT8_SCALE):
            continue
        name = k[: -len(INT8_SCALE)]
        w_shape, w_dtype = declared.get(name, (None, None))
        if w_dtype != "I8" or len(w_shape) != 2:
            found = "missing" if w_shape is None else f"{w_dtype} {list(w_shape)}"
            raise SelfSpecError(f"{where}: {k} is not the scale of an int8 matrix ({name}: {found})")
        if dtype not in _FLOAT_DTYPES or shape != (w_shape[0],):
            raise SelfSpecError(f"{where}: {k} is {dtype} {list(shape)}; the scale of int8 {name} {list(w_shape)} must "
                                f"be float [{w_shape[0]}]")


def _check_weight_shapes(path: Path, head: ExitHead, vocab_size: int, int8: bool = False) -> None:
    """Every tensor that head.safetensors declares has the shape the head expects (vocab_ids: at most the model's
    vocabulary; in an int8 file (int8) each NAME.int8_scale fits its matrix), read from the file's header alone, so
    a file cannot make the load allocate more than the head."""
    from safetensors import safe_open

    expected = {k: tuple(v.shape) for k, v in head.trainable_state_dict().items() if k != "vocab_ids"}
    try:
        with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
            header = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    except Exception as exc:  # safetensors raises several types on corrupt files
        raise SelfSpecError(f"head.path={str(path)!r}: corrupt {WEIGHTS_FILE} ({(str(exc).splitlines() or [type(exc).__name__])[0]})")
    if int8:  # a scale is no weight of the head: it is checked against its matrix, then set aside
        _check_int8_scales(path, header)
        header = {k: v for k, v in header.items() if not k.endswith(INT8_SCALE)}
    declared = {k: shape for k, (shape, _) in header.items()}
    vocab = declared.pop("vocab_ids", None)
    if vocab is not None and (len(vocab) != 1 or vocab[0] > vocab_size):
        raise SelfSpecError(f"head.path={str(path)!r}: {WEIGHTS_FILE}: vocab_ids of shape {list(vocab)}; at most "
                            f"[{vocab_size}] (the model's vocabulary)")
    wrong = sorted(k for k in set(declared) | set(expected) if declared.get(k) != expected.get(k))
    if wrong:
        k = wrong[0]
        raise SelfSpecError(f"head.path={str(path)!r}: weights do not fit the config ({k}: "
                            f"{list(declared[k]) if k in declared else 'missing'} in {WEIGHTS_FILE}, "
                            f"{list(expected[k]) if k in expected else 'not a weight of this head'} expected)")


def saved_decode_settings(path: Path, data: dict, max_positions: int | None = None) -> dict:
    """The head's tuned decode settings from head_config.json's "decode" block ({} when absent): its TUNED_KEYS keys
    (those its validation ran with; training writes them: decoding/config.py tuned_settings), checked by
    DecodeConfig itself (and against a model's context, with max_positions) so a bad or oversized value is one
    line naming the file."""
    block = data.get("decode") or {}
    if not isinstance(block, dict):
        raise SelfSpecError(f"head.path={str(path)!r}: bad {CONFIG_FILE}: 'decode' must be a mapping")
    settings = {k: v for k, v in block.items() if k in TUNED_KEYS}
    try:
        tuned = DecodeConfig(**settings)
        if max_positions is not None:
            tuned.check_fits(max_positions, where="decode")
    except SelfSpecError as exc:
        raise SelfSpecError(f"head.path={str(path)!r}: bad {CONFIG_FILE} 'decode' block: {exc}")
    return settings
