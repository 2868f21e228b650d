"""python -m selfspec.cli.export_head SRC DEST [--dtype float16] [--readme FILE]: a saved head, its weights stored in a
smaller dtype (how the shipped heads under selfspec/heads/shipped/ are made small enough to commit).

The config (type, sizes, the base model's fingerprint, tuned decode settings) is copied unchanged, with
"weights_dtype" added; floating-point tensors are cast (int8: each matrix row with its own scale, vectors in float16;
saving.py: quantize_rows_int8), the draft vocabulary ids are kept. Loading casts the weights
back to the model's dtype (load_head). Nothing is unpickled: the head is read with safetensors and json only.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from selfspec.errors import SelfSpecError, check
from selfspec.heads.saving import CONFIG_FILE, WEIGHTS_FILE, quantize_rows_int8, read_head_config

DTYPES = ("float32", "float16", "bfloat16", "int8")


def export_head(src: str | Path, dest: str | Path, dtype: str = "float16", readme: str | Path | None = None) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    from selfspec.utils.io import atomic_dir

    check(dtype in DTYPES, f"--dtype={dtype!r}: allowed {', '.join(DTYPES)}")
    src, dest = Path(src), Path(dest)
    config = read_head_config(src)
    check(src.resolve() != dest.resolve(), f"DEST={str(dest)!r}: must differ from SRC")
    check(readme is None or Path(readme).is_file(), f"--readme={str(readme)!r}: file not found")
    try:
        tensors = load_file(str(src / WEIGHTS_FILE))
    except Exception as exc:  # safetensors raises several types on corrupt files
        raise SelfSpecError(f"SRC={str(src)!r}: corrupt {WEIGHTS_FILE} ({str(exc).splitlines()[0]})")
    check(config.get("weights_dtype") != "int8", f"SRC={str(src)!r}: already stored in int8; export the float head")
    if dtype == "int8":
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
