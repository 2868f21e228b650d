"""Small tensor helpers shared by several packages."""

from __future__ import annotations

import torch

from selfspec.errors import SelfSpecError


def right_pad(rows: list[list[int]], pad_id: int) -> torch.Tensor:
    """Token id rows of different lengths as one (B, T) long tensor, padded on the right with pad_id."""
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
    return ids


# torch.load(weights_only=True) stops code from a crafted pickle only from torch 2.6 on (CVE-2025-32434: before it,
# a crafted file could still run code). pyproject requires torch>=2.6; this also refuses an older torch that was
# installed some other way (a system torch a venv sees), before any file is read.
SAFE_LOAD_TORCH = (2, 6)


def _torch_version(version: str) -> tuple[int, int]:
    import re

    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def safe_torch_load(path):
    """torch.load(path, map_location="cpu", weights_only=True): tensors and plain values only, never code.
    SelfSpecError (one line) on a torch older than 2.6, where weights_only=True can be bypassed."""
    if _torch_version(torch.__version__) < SAFE_LOAD_TORCH:
        raise SelfSpecError(f"torch {torch.__version__} cannot load files safely (CVE-2025-32434: weights_only=True is "
                            f"bypassable before 2.6); refusing to read {path}; install torch>=2.6")
    return torch.load(path, map_location="cpu", weights_only=True)
