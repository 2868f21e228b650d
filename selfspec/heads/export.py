"""python -m selfspec.cli.export_head SRC DEST [--dtype float16] [--readme FILE] [--draft-vocab N [--keep-ids 0,2]]
[--average OTHER [--average-weight W]]: a saved head, its weights stored in a smaller dtype (how the shipped heads
under selfspec/heads/shipped/ are made small enough to commit).

The config (type, sizes, the base model's fingerprint, tuned decode settings) is copied unchanged, with
"weights_dtype" added; floating-point tensors are cast (int8: each matrix row with its own scale, vectors in float16;
saving.py: quantize_rows_int8), the draft vocabulary ids are kept. Loading casts the weights
back to the model's dtype (load_head). Nothing is unpickled: the head is read with safetensors and json only.

--draft-vocab N cuts a head's draft vocabulary to its N lowest token ids (byte-level BPE numbers tokens in merge
order, so low ids are the frequent ones: the rule default_draft_vocab uses), plus the ids in --keep-ids (the model's
EOS ids, when they are not among them): a smaller readout per draft, at the price of the tokens cut. The weights are
untouched, so an int8-stored head can be cut as it is (--dtype int8 again).

--average OTHER averages SRC's weights with another saved head's, W * SRC + (1 - W) * OTHER (checkpoint averaging:
a head fine-tuned from OTHER, averaged with it, keeps more of what OTHER learned from its data). OTHER must be the
same head: same type and sizes, the same draft vocabulary ids, saved for the same base model. Either may be stored
in int8 (its rows are dequantized first); the config is SRC's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from selfspec.errors import SelfSpecError, check
from selfspec.heads.saving import CONFIG_FILE, WEIGHTS_FILE, quantize_rows_int8, read_head_config

DTYPES = ("float32", "float16", "bfloat16", "int8")


def export_head(src: str | Path, dest: str | Path, dtype: str = "float16", readme: str | Path | None = None,
                draft_vocab: int | None = None, keep_ids: tuple[int, ...] = (), average: str | Path | None = None,
                average_weight: float = 0.5) -> Path:
    import torch
    from safetensors.torch import save_file

    from selfspec.utils.io import atomic_dir

    check(dtype in DTYPES, f"--dtype={dtype!r}: allowed {', '.join(DTYPES)}")
    src, dest = Path(src), Path(dest)
    config = read_head_config(src)
    check(src.resolve() != dest.resolve(), f"DEST={str(dest)!r}: must differ from SRC")
    check(readme is None or Path(readme).is_file(), f"--readme={str(readme)!r}: file not found")
    if average is not None:
        check(isinstance(average_weight, (int, float)) and not isinstance(average_weight, bool) and 0 < average_weight < 1,
              f"--average-weight={average_weight!r}: must be a number strictly between 0 and 1")
        check(Path(average).resolve() != src.resolve(), f"--average={str(average)!r}: must differ from SRC")
    tensors = _read_weights(src, "SRC")
    stored_int8 = config.get("weights_dtype") == "int8"
    if average is not None:
        tensors, stored_int8 = _average(src, tensors, config, Path(average), float(average_weight)), False
        config = {k: v for k, v in config.items() if k != "weights_dtype"}
    check(not stored_int8 or dtype == "int8" and draft_vocab,
          f"SRC={str(src)!r}: already stored in int8; export the float head (or cut its draft vocabulary: --dtype int8 --draft-vocab N)")
    if draft_vocab is not None:
        tensors, config = _cut_draft_vocab(tensors, config, draft_vocab, keep_ids)
    if stored_int8:
        cast = tensors
    elif dtype == "int8":
        cast = quantize_rows_int8(tensors)
    else:
        target = getattr(torch, dtype)
        cast = {k: (v.to(target) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
    with atomic_dir(dest) as tmp:
        (tmp / CONFIG_FILE).write_text(json.dumps({**config, "weights_dtype": dtype}, indent=2))
        save_file(cast, str(tmp / WEIGHTS_FILE))
        if readme is not None:
            shutil.copyfile(readme, tmp / "README.md")
    return dest


def _read_weights(path: Path, what: str) -> dict:
    from safetensors.torch import load_file

    try:
        return load_file(str(path / WEIGHTS_FILE))
    except Exception as exc:  # safetensors raises several types on corrupt files
        raise SelfSpecError(f"{what}={str(path)!r}: corrupt {WEIGHTS_FILE} ({str(exc).splitlines()[0]})")


def _average(src: Path, tensors: dict, config: dict, other: Path, w: float) -> dict:
    """w * SRC + (1 - w) * OTHER in float32, after checking that OTHER is the same head (see the module doc)."""
    import torch

    from selfspec.heads.saving import dequantize_rows_int8, shipped_or_path

    where = f"--average={str(other)!r}"
    try:
        other_config = read_head_config(other)
    except SelfSpecError as exc:  # it names head.path=; here the head came as --average
        raise SelfSpecError(f"{where}: {str(exc).split(': ', 1)[-1]}") from None
    other = shipped_or_path(other)
    for key in ("type", "exit_layer", "draft_vocab", "context_layers", "context_source", "fuse_depths", "mlp_ratio"):
        check(other_config.get(key) == config.get(key),
              f"{where}: {key}={other_config.get(key)!r} where SRC has {config.get(key)!r} (only the same head averages)")
    fingerprint = lambda c: (c.get("base_model") or {}).get("tensors")  # noqa: E731
    check(fingerprint(other_config) == fingerprint(config), f"{where}: saved for another base model than SRC")
    a = tensors if config.get("weights_dtype") != "int8" else dequantize_rows_int8(src, tensors)
    b = _read_weights(other, "--average")
    b = b if other_config.get("weights_dtype") != "int8" else dequantize_rows_int8(other, b)
    check(a.keys() == b.keys(), f"{where}: its tensors differ from SRC's ({', '.join(sorted(a.keys() ^ b.keys()))})")
    out = {}
    for k, x in a.items():
        y = b[k]
        check(x.shape == y.shape, f"{where}: {k} has shape {list(y.shape)} where SRC's is {list(x.shape)}")
        if x.is_floating_point():
            out[k] = (w * x.float() + (1 - w) * y.float()).contiguous()
        else:
            check(torch.equal(x, y), f"{where}: {k} differs from SRC's (the draft vocabulary must be the same)")
            out[k] = x
    return out


def _cut_draft_vocab(tensors: dict, config: dict, n: int, keep_ids) -> tuple[dict, dict]:
    """The head's draft vocabulary cut to its n lowest ids plus `keep_ids` (see the module doc)."""
    import torch

    vocab = tensors.get("vocab_ids")
    size = 0 if vocab is None else vocab.numel()
    check(size > 0, "--draft-vocab: this head scores the whole vocabulary (no draft vocabulary to cut)")
    check(isinstance(n, int) and not isinstance(n, bool) and 1 <= n < size,
          f"--draft-vocab={n!r}: must be an integer in [1, {size - 1}] (this head's draft vocabulary has {size} tokens)")
    vocab = vocab.long()
    keep = torch.tensor(sorted({int(k) for k in keep_ids}), dtype=torch.long)
    check(bool(torch.isin(keep, vocab).all()), f"--keep-ids={[int(k) for k in keep_ids]}: every id must be in the head's "
                                               "draft vocabulary")
    cut = torch.unique(torch.cat([vocab.sort().values[:n], keep]))
    return {**tensors, "vocab_ids": cut}, {**config, "draft_vocab": int(cut.numel()), "draft_vocab_cut_from": size}
