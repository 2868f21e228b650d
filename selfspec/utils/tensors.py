"""Small tensor helpers shared by several packages."""

from __future__ import annotations

import torch


def right_pad(rows: list[list[int]], pad_id: int) -> torch.Tensor:
    """Token id rows of different lengths as one (B, T) long tensor, padded on the right with pad_id."""
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
    return ids
