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

    # HF code sometimes asks a cache for these; answer sensibly.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.write_pos

    @property
    def is_compileable(self) -> bool:
        return False
