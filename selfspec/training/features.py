"""Layer-E hidden states of every training position, computed once per (dataset, E) and cached.

With them, training a head that leaves layers < E untouched (medusa, adapter) costs only the head and the
(shared, frozen) LM head: the backbone never runs during training. The LoRA head changes layers < E, so it
recomputes them from token ids with the LoRA on and needs no hidden-state cache.

The file carries a checksum (dataset.atomic_torch_save); a damaged or stale one is recomputed with one
warning line.
"""

from __future__ import annotations

import logging

import torch
from tqdm.auto import tqdm

from selfspec.errors import SelfSpecError
from selfspec.training.dataset import Sequences, atomic_torch_save, cache_lock, load_checked
from selfspec.utils.tensors import right_pad

log = logging.getLogger(__name__)

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@torch.inference_mode()
def compute_hidden(backbone, data: Sequences, exit_layer: int, dtype: torch.dtype, batch_size: int = 8,
                   progress: bool = True) -> torch.Tensor:
    """(S, H) layer-E hidden states, row i for tokens[i] (after layers [0, E), as the draft sees them)."""
    out = torch.empty(data.tokens.numel(), backbone.hidden_size, dtype=dtype)
    lengths = (data.seq_offsets[1:] - data.seq_offsets[:-1]).tolist()
    order = sorted(range(data.num_sequences), key=lambda b: lengths[b])  # similar lengths: less padding
    bar = tqdm(total=data.num_sequences, desc=f"features E={exit_layer}", unit="seq", disable=not progress)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        ids = right_pad([data.sequence(b).tolist() for b in idx], 0).to(backbone.device)  # (B, T)
        # Right padding needs no mask: with causal attention no real position sees a later pad.
        h = backbone.run_layers(backbone.embed(ids), 0, exit_layer)  # (B, T, H)
        for r, b in enumerate(idx):
            rows = h[r, : lengths[b]].float()
            cast = rows.to(dtype)
            if not torch.isfinite(cast).all():
                raise SelfSpecError(f"data.feature_dtype={str(dtype).removeprefix('torch.')}: layer-{exit_layer} hidden states overflow it; use data.feature_dtype=bfloat16 or float32")
            out[data.seq_offsets[b] : data.seq_offsets[b + 1]] = cast.cpu()
        bar.update(len(idx))
    bar.close()
    return out


def hidden_path(directory, exit_layer: int, dtype_name: str):
    return directory / f"hidden-E{exit_layer}-{dtype_name}.pt"


def load_or_compute_hidden(backbone, data: Sequences, directory, exit_layer: int, dtype_name: str,
                           progress: bool = True) -> tuple[torch.Tensor, bool]:
    """Cached (S, H) hidden states for this dataset directory and exit layer. -> (hidden, was cached)."""
    path = hidden_path(directory, exit_layer, dtype_name)
    want = (data.tokens.numel(), backbone.hidden_size)
    with cache_lock(directory):
        if path.is_file():
            h = load_checked(path, "hidden-state")
            if isinstance(h, torch.Tensor) and tuple(h.shape) == want and h.dtype == DTYPES[dtype_name]:
                return h, True
            if h is not None:
                log.warning("hidden-state cache %s does not fit this dataset (%s, expected %s); rebuilding it",
                            path, tuple(getattr(h, "shape", ())), want)
        h = compute_hidden(backbone, data, exit_layer, DTYPES[dtype_name], progress=progress)
        atomic_torch_save(h, path)
    return h, False
