"""Layer-E hidden states of every training position, computed once per (dataset, E) and cached.

With them, training a head that leaves layers < E untouched (medusa, adapter) costs only the head and the
(shared, frozen) LM head: the backbone never runs during training. The LoRA head changes layers < E, so it
recomputes them from token ids with the LoRA on and needs no hidden-state cache.

The file carries a checksum (sequences.atomic_torch_save); a damaged or stale one is recomputed with one
warning line.

Under torchrun with W ranks, rank r computes, caches and loads only its part: the states of the sequences b with
b % W == r (the ones it trains on, distributed.py), in `hidden-E<E>-<dtype>-part<r>of<W>.pt`, as a HiddenPart
indexed like the whole tensor.
"""

from __future__ import annotations

import logging

import torch
from tqdm.auto import tqdm

from selfspec.errors import SelfSpecError
from selfspec.training.dataset import cache_lock, load_checked
from selfspec.training.sequences import Sequences, atomic_torch_save, hidden_path
from selfspec.training.teacher import pooled_hidden
from selfspec.utils.io import file_lock
from selfspec.utils.tensors import right_pad

log = logging.getLogger(__name__)

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class HiddenPart:
    """Layer-E states of some of a dataset's sequences (a data-parallel rank's part), indexed like the whole (S, H)
    tensor: by token positions (a tensor of them, or a slice within one of its sequences)."""

    def __init__(self, states: torch.Tensor, where: torch.Tensor):
        self.states = states  # (S_part, H): the part's sequences, one after another
        self.where = where  # (S,) token position -> row of `states`, -1 outside the part

    @property
    def dtype(self) -> torch.dtype:
        return self.states.dtype

    @property
    def shape(self) -> tuple[int, int]:
        """As the whole (S, W) tensor's: every token of the dataset, W states per token."""
        return (self.where.numel(), self.states.shape[-1])

    def __getitem__(self, index) -> torch.Tensor:
        if isinstance(index, slice):
            index = torch.arange(int(index.start), int(index.stop))
        rows = self.where[index]
        if bool((rows < 0).any()):
            raise IndexError("HiddenPart: a position outside this rank's sequences")
        return self.states[rows]


def side_by_side(states: list) -> "torch.Tensor | HiddenPart":
    """Cached states of several depths ((S, H) tensors, or one rank's HiddenParts of the same sequences) -> one
    (S, k*H) of them side by side (a context head's fused depths), one copy; a single one as it is."""
    if len(states) == 1:
        return states[0]
    if isinstance(states[0], HiddenPart):
        return HiddenPart(torch.cat([s.states for s in states], dim=-1), states[0].where)
    return torch.cat(states, dim=-1)


def part_sequences(data: Sequences, rank: int, world: int) -> list[int]:
    """The sequences of part `rank` of `world`: b with b % world == rank."""
    return list(range(rank, data.num_sequences, world))


def part_index(data: Sequences, sequences: list[int]) -> torch.Tensor:
    """(S,) token position -> its row in the part's states (the sequences one after another), -1 elsewhere."""
    where = torch.full((data.tokens.numel(),), -1, dtype=torch.long)
    row = 0
    for b in sequences:
        s, e = int(data.seq_offsets[b]), int(data.seq_offsets[b + 1])
        where[s:e] = torch.arange(row, row + e - s)
        row += e - s
    return where


@torch.inference_mode()
def compute_hidden(backbone, data: Sequences, exit_layer: int, dtype: torch.dtype, batch_size: int = 8,
                   progress: bool = True, sequences: list[int] | None = None) -> torch.Tensor:
    """(S, H) layer-E hidden states, row i for tokens[i] (after layers [0, E), as the draft sees them); with
    `sequences`, only theirs, one sequence after another ((S_part, H), see part_index)."""
    seqs = list(range(data.num_sequences)) if sequences is None else list(sequences)
    lengths = (data.seq_offsets[1:] - data.seq_offsets[:-1]).tolist()
    starts, total = {}, 0
    for b in seqs:  # the whole dataset: starts[b] = seq_offsets[b]
        starts[b], total = total, total + lengths[b]
    out = torch.empty(total, backbone.hidden_size, dtype=dtype)
    order = sorted(seqs, key=lambda b: lengths[b])  # similar lengths: less padding
    bar = tqdm(total=len(seqs), desc=f"features E={exit_layer}", unit="seq", disable=not progress)
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
            out[starts[b] : starts[b] + lengths[b]] = cast.cpu()
        bar.update(len(idx))
    bar.close()
    return out




def load_or_compute_hidden(backbone, data: Sequences, directory, exit_layer: int, dtype_name: str,
                           progress: bool = True, part: tuple[int, int] | None = None) -> tuple[torch.Tensor | HiddenPart, bool]:
    """Cached (S, H) hidden states for this dataset directory and exit layer; with part = (rank, world), world > 1,
    only that part's (a HiddenPart), computed and cached by that rank alone. -> (hidden, was cached)."""
    if part is not None and part[1] > 1:
        return _load_or_compute_part(backbone, data, directory, exit_layer, dtype_name, progress, part)
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
        # data=sharegpt: from its resumable extraction shards
        h = pooled_hidden(backbone, data, directory, exit_layer, dtype_name, progress)
        if h is None:
            h = compute_hidden(backbone, data, exit_layer, DTYPES[dtype_name], progress=progress)
        atomic_torch_save(h, path)
    return h, False


def _load_or_compute_part(backbone, data: Sequences, directory, exit_layer: int, dtype_name: str, progress: bool,
                          part: tuple[int, int]) -> tuple[HiddenPart, bool]:
    seqs = part_sequences(data, *part)
    where = part_index(data, seqs)
    path = hidden_path(directory, exit_layer, dtype_name, part)
    want = (int((where >= 0).sum()), backbone.hidden_size)
    with file_lock(directory / f".{path.name}.lock"):  # its own lock: the ranks compute their parts at once
        if path.is_file():
            h = load_checked(path, "hidden-state")
            if isinstance(h, torch.Tensor) and tuple(h.shape) == want and h.dtype == DTYPES[dtype_name]:
                return HiddenPart(h, where), True
            if h is not None:
                log.warning("hidden-state cache %s does not fit this dataset (%s, expected %s); rebuilding it",
                            path, tuple(getattr(h, "shape", ())), want)
        whole = hidden_path(directory, exit_layer, dtype_name)
        h = load_checked(whole, "hidden-state") if whole.is_file() else None  # the whole file (data=sharegpt writes it)
        if isinstance(h, torch.Tensor) and tuple(h.shape) == (data.tokens.numel(), backbone.hidden_size) and h.dtype == DTYPES[dtype_name]:
            h = h[torch.cat([torch.arange(int(data.seq_offsets[b]), int(data.seq_offsets[b + 1])) for b in seqs]
                            or [torch.zeros(0, dtype=torch.long)])]
        else:
            h = compute_hidden(backbone, data, exit_layer, DTYPES[dtype_name], progress=progress, sequences=seqs)
        atomic_torch_save(h, path)
    return HiddenPart(h, where), False
