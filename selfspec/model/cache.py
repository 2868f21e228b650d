"""KV cache written by position (gpt-fast style): rejecting drafts costs nothing.

Each layer owns preallocated K/V buffers of shape (B, kv_heads, max_len, head_dim). A forward chunk at
positions pos0..pos0+T-1 writes its K/V there and attends over [0, pos0+T). Whatever lies beyond the
valid length is garbage that the next chunk overwrites, so a rollback is only `valid = n`.
HF attention modules call `update(key, value, layer_idx, ...)`; that is the whole protocol we implement.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        layers: range | list[int],
        batch: int,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.layers = list(layers)
        self.max_len = max_len
        slot = {l: i for i, l in enumerate(self.layers)}
        self._slot = slot
        shape = (len(self.layers), batch, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.write_pos = 0  # absolute position of the chunk now being written (set by Backbone.run_layers)
        self.kernel_stacks: dict = {}  # the backbone's C views of runs of these layers (Backbone._layer_stack)

    def check_room(self, end: int) -> None:
        if end > self.max_len:
            raise RuntimeError(f"KV cache overflow: position {end} > capacity {self.max_len}")

    def layer_buffers(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch-1 cache's (kv_heads, max_len, head_dim) K and V buffers of one layer, for kernels that write
        and read them by position themselves (cpu_kernels.decoder_layer)."""
        i = self._slot[layer_idx]
        return self.k[i, 0], self.v[i, 0]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write (B, H, T, D) K/V at write_pos.. and return the layer's K/V over [0, write_pos + T)."""
        i = self._slot[layer_idx]
        s = self.write_pos
        e = s + key.shape[2]
        self.check_room(e)
        self.k[i, :, :, s:e] = key
        self.v[i, :, :, s:e] = value
        return self.k[i, :, :, :e], self.v[i, :, :, :e]

    def compact(self, src, dst: int) -> None:
        """Move the K/V at slots src[0], src[1], ... to slots dst, dst+1, ... in every layer: a draft tree's
        accepted path, verified at scattered slots, put where a chain decode of the same tokens writes it.
        Sources may overlap the destination (the old values are read first); an already-compact path is free."""
        move = _moves(src, dst)
        if move is None:
            return
        idx, n = move
        self.check_room(dst + n)
        idx = idx.to(self.k.device)
        self.k[:, :, :, dst : dst + n] = self.k.index_select(3, idx)
        self.v[:, :, :, dst : dst + n] = self.v.index_select(3, idx)

    # HF code sometimes asks a cache for these; answer sensibly.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.write_pos

    @property
    def is_compileable(self) -> bool:
        return False


def _moves(src, dst: int) -> tuple[torch.Tensor, int] | None:
    """(source index tensor, count) of a compaction, or None when nothing moves."""
    src = torch.as_tensor(src, dtype=torch.long).reshape(-1).cpu()
    n = src.numel()
    if n == 0 or torch.equal(src, torch.arange(dst, dst + n)):
        return None
    return src, n


def compact_rows(buf: torch.Tensor, src, dst: int, dim: int = 1) -> None:
    """KVCache.compact for a buffer indexed by position along `dim` (the engine's layer-E hidden states, (1, max_len, H)):
    rows src[0], src[1], ... are copied to dst, dst+1, ..."""
    move = _moves(src, dst)
    if move is None:
        return
    idx, n = move
    if dst + n > buf.shape[dim]:
        raise RuntimeError(f"compact_rows: rows {dst}..{dst + n - 1} past the buffer's {buf.shape[dim]}")
    buf.narrow(dim, dst, n).copy_(buf.index_select(dim, idx.to(buf.device)))
