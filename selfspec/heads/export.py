"""python -m selfspec.cli.export_head SRC DEST [--dtype float16] [--readme FILE] [--draft-vocab N [--keep-ids 0,2]]
[--average OTHER [--average-weight W]]: a saved head, its weights stored in a smaller dtype (how the shipped heads
under selfspec/heads/shipped/ are made small enough to commit).

The config (type, sizes, the base model's fingerprint, tuned decode settings) is copied unchanged, with
"weights_dtype" added; floating-point tensors are cast (int8: each matrix row with its own scale, vectors in float16;
saving.py: quantize_rows_int8), the draft vocabulary ids are kept. Loading casts the weights
back to the model's dtype (load_head). Nothing is unpickled: the head is read with safetensors and json only.
SRC (and OTHER) may be a shipped head's name (smollm2_135m+context), as head= takes it. A head with NaN or inf
weights, or one whose weights do not fit the dtype they would be stored in (|w| > 65504 in float16), is refused
with one line naming the tensor, and nothing is written.

--draft-vocab N cuts a head's draft vocabulary to its N lowest token ids (byte-level BPE numbers tokens in merge
order, so low ids are the frequent ones: the rule default_draft_vocab uses), plus the ids in --keep-ids (the model's
EOS ids, when they are not among them): a smaller readout per draft, at the price of the tokens cut. The weights are
untouched, so an int8-stored head can be cut as it is (--dtype int8 again).

--average OTHER averages SRC's weights with another saved head's, W * SRC + (1 - W) * OTHER (checkpoint averaging:
a head fine-tuned from OTHER, averaged with it, keeps more of what OTHER learned from its data). OTHER must be the
same head: same type and sizes, the same draft vocabulary ids, saved for the same base model (its saved weight samples
compared, model/identity.py: compare_saved; the same model in another quantization counts). Either may be stored
in int8 (its rows are dequantized first); the config is SRC's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from selfspec.errors import SelfSpecError, check
from selfspec.heads.saving import (CONFIG_FILE, WEIGHTS_FILE, dequantize_rows_int8, non_finite, quantize_rows_int8,
                                   read_head_config, shipped_or_path)
from selfspec.model.identity import compare_saved
from selfspec.utils.io import atomic_dir

DTYPES = ("float32", "float16", "bfloat16", "int8")


def export_head(src: str | Path, dest: str | Path, dtype: str = "float16", readme: str | Path | None = None,
                draft_vocab: int | None = None, keep_ids: tuple[int, ...] = (), average: str | Path | None = None,
                average_weight: float = 0.5) -> Path:
    import torch
    from safetensors.torch import save_file

    check(dtype in DTYPES, f"--dtype={dtype!r}: allowed {', '.join(DTYPES)}")
    # a shipped head's name (smollm2_135m+context) is its directory, as head= and --average take it
    src, dest = shipped_or_path(src), Path(dest)
    config = read_head_config(src)
    check(src.resolve() != dest.resolve(), f"DEST={str(dest)!r}: must differ from SRC")
    check(readme is None or Path(readme).is_file(), f"--readme={str(readme)!r}: file not found")
    if average is not None:
        check(isinstance(average_weight, (int, float)) and not isinstance(average_weight, bool) and 0 < average_weight < 1,
              f"--average-weight={average_weight!r}: must be a number strictly between 0 and 1")
        check(shipped_or_path(average).resolve() != src.resolve(), f"--average={str(average)!r}: must differ from SRC")
    tensors = _read_weights(src, "SRC")
    _check_finite(tensors, f"SRC={str(src)!r}")
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
        _check_range(tensors, dtype, torch.float16, lambda v: v.dim() != 2)  # quantize_rows_int8 keeps vectors in float16
        cast = quantize_rows_int8(tensors)
    else:
        target = getattr(torch, dtype)
        _check_range(tensors, dtype, target)
        cast = {k: (v.to(target) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
    with atomic_dir(dest) as tmp:
        (tmp / CONFIG_FILE).write_text(json.dumps({**config, "weights_dtype": dtype}, indent=2))
        save_file(cast, str(tmp / WEIGHTS_FILE))
        if readme is not None:
            shutil.copyfile(readme, tmp / "README.md")
    return dest


def _check_finite(tensors: dict, where: str) -> None:
    """A head with NaN or inf weights is refused, not copied: loading refuses it anyway (saving.py: load_head)."""
    bad = non_finite(tensors)
    if bad:
        raise SelfSpecError(f"{where}: {WEIGHTS_FILE}: {bad[0]} holds NaN or inf"
                            f"{f' (and {len(bad) - 1} more)' if len(bad) > 1 else ''}; not exported")


def _check_range(tensors: dict, dtype: str, target, applies=lambda v: True) -> None:
    """Every floating tensor (that `applies`) fits `target`'s range: a cast past it is inf (1e6 in float16), a head
    that drafts garbage and breaks sampling. One line naming the largest offender; nothing is written."""
    import torch

    limit = torch.finfo(target).max
    worst = {k: float(v.detach().abs().max()) for k, v in tensors.items()
             if v.is_floating_point() and v.numel() and applies(v)}
    over = sorted((k for k, m in worst.items() if m > limit), key=lambda k: -worst[k])
    if over:
        k = over[0]
        raise SelfSpecError(f"--dtype={dtype}: {k} has max |value| {worst[k]:.6g}, beyond {str(target).split('.')[-1]}'s "
                            f"range ({limit:.6g}){f' (and {len(over) - 1} more tensors)' if len(over) > 1 else ''}; "
                            "not exported (--dtype float32 keeps it)")


def _read_weights(path: Path, what: str) -> dict:
    from safetensors.torch import load_file

    try:
        return load_file(str(path / WEIGHTS_FILE))
    except Exception as exc:  # safetensors raises several types on corrupt files
        raise SelfSpecError(f"{what}={str(path)!r}: corrupt {WEIGHTS_FILE} ({str(exc).splitlines()[0]})")


def _average(src: Path, tensors: dict, config: dict, other: Path, w: float) -> dict:
    """w * SRC + (1 - w) * OTHER in float32, after checking that OTHER is the same head (see the module doc)."""
    import torch

    where = f"--average={str(other)!r}"
    try:
        other_config = read_head_config(other)
    except SelfSpecError as exc:  # it names head.path=; here the head came as --average
        raise SelfSpecError(f"{where}: {str(exc).split(': ', 1)[-1]}") from None
    other = shipped_or_path(other)
    for key in ("type", "exit_layer", "draft_vocab", "context_layers", "context_source", "fuse_depths", "mlp_ratio"):
        check(other_config.get(key) == config.get(key),
              f"{where}: {key}={other_config.get(key)!r} where SRC has {config.get(key)!r} (only the same head averages)")
    # the weights themselves, not only the tensor names and shapes: two models of one architecture share those
    match = compare_saved(config.get("base_model") or {}, other_config.get("base_model") or {})
    check(match.accepted, f"{where}: saved for another base model than SRC ({match.describe()}); "
                          "only heads of the same model average")
    a = tensors if config.get("weights_dtype") != "int8" else dequantize_rows_int8(src, tensors)
    b = _read_weights(other, "--average")
    _check_finite(b, where)
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
