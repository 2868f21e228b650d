"""Exit heads: small modules that turn layer E's hidden state into a draft distribution.

A head owns only its trained parameters. The target's final norm and LM head are shared (read through
the Backbone, never copied into the head's state), and the base model stays frozen and bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from selfspec.errors import check

HEAD_TYPES = ("lens", "medusa", "adapter", "lora")


@dataclass
class HeadConfig:
    type: str = "lens"
    exit_layer: int | None = None  # None: the default for the model (a quarter of its depth)
    path: str | None = None  # a saved head directory; overrides type and sizes
    draft_vocab: int | None = None  # score only the N most frequent tokens when drafting
    # medusa
    num_blocks: int = 1  # ResBlocks per head
    num_heads: int = 1  # extra heads predict t+2, t+3, ... from the same hidden state (training + analysis)
    # adapter
    adapter_heads: int | None = None  # attention heads; None = the model's
    # lora
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])

    def __post_init__(self):
        if self.path is None:
            check(self.type in HEAD_TYPES, f"head.type={self.type!r}: allowed {', '.join(HEAD_TYPES)} (or head.path=DIR)")
        check(self.draft_vocab is None or self.draft_vocab >= 1, f"head.draft_vocab={self.draft_vocab}: must be >= 1 (or null for the full vocabulary)")
        check(self.num_blocks >= 0, f"head.num_blocks={self.num_blocks}: must be >= 0")
        check(self.num_heads >= 1, f"head.num_heads={self.num_heads}: must be >= 1")
        check(self.lora_rank >= 1, f"head.lora_rank={self.lora_rank}: must be >= 1")
        self.lora_targets = list(self.lora_targets)


def check_exit_layer(exit_layer: int, num_layers: int) -> None:
    check(
        isinstance(exit_layer, int) and 1 <= exit_layer <= num_layers - 1,
        f"head.exit_layer={exit_layer}: must be an integer in [1, {num_layers - 1}] for this {num_layers}-layer model",
    )


class ExitHead(nn.Module):
    """Base class. Subclasses implement `transform` (hidden -> hidden before the shared norm + LM head).

    Shapes: h is (B, T, H) layer-E hidden states; logits are (B, T, V') with V' = V, or N with a
    reduced draft vocabulary (then `vocab_ids` (N,) maps draft indices back to token ids).
    """

    kind = "base"
    reuses_early_layers = True  # False when the head changes layers < E (LoRA): drafting then keeps its own cache

    def __init__(self, cfg: HeadConfig, exit_layer: int, hidden_size: int):
        super().__init__()
        self.cfg = cfg
        self.exit_layer = exit_layer
        self.hidden_size = hidden_size
        self.register_buffer("vocab_ids", torch.empty(0, dtype=torch.long), persistent=True)
        self._draft_weight: torch.Tensor | None = None

    # ---- draft vocabulary
    def set_draft_vocab(self, vocab_ids: torch.Tensor | None) -> None:
        self.vocab_ids = torch.empty(0, dtype=torch.long) if vocab_ids is None else vocab_ids.long().cpu()
        self._draft_weight = None

    @property
    def has_draft_vocab(self) -> bool:
        return self.vocab_ids.numel() > 0

    def lm_weight(self, backbone) -> torch.Tensor | None:
        """The LM head rows the draft scores (None = all). The subset is copied once and kept contiguous,
        so a draft step reads N x H weights instead of V x H."""
        if not self.has_draft_vocab:
            return None
        if self._draft_weight is None or self._draft_weight.device != backbone.device:
            ids = self.vocab_ids.to(backbone.device)
            self._draft_weight = backbone.lm_head.weight.detach()[ids].contiguous()
        return self._draft_weight

    # ---- per-generation state (the adapter's KV cache; None for stateless heads)
    def new_state(self, backbone, max_len: int, batch: int = 1):
        return None

    # ---- the head proper
    def transform(self, h: torch.Tensor, backbone, state=None, pos0: int = 0) -> torch.Tensor:
        return h

    def forward(self, h: torch.Tensor, backbone, state=None, pos0: int = 0, last_only: bool = False) -> torch.Tensor:
        """(B, T, H) layer-E hidden -> (B, T, V') draft logits (or (B, 1, V') with last_only)."""
        x = self.transform(h, backbone, state, pos0)
        if last_only:
            x = x[:, -1:]
        return backbone.logits(backbone.norm(x), self.lm_weight(backbone))

    def extra_logits(self, h: torch.Tensor, backbone) -> list[torch.Tensor]:
        """Logits of extra heads that predict t+2, t+3, ... (Medusa); none by default."""
        return []

    # ---- bookkeeping
    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items()}

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def config_dict(self) -> dict:
        from dataclasses import asdict

        d = asdict(self.cfg)
        d.update(type=self.kind, exit_layer=self.exit_layer, path=None)
        return d


class LensHead(ExitHead):
    """The logit lens: final norm + LM head on layer E. No parameters: the untrained baseline."""

    kind = "lens"


def default_draft_vocab(vocab_size: int, n: int, always: list[int]) -> torch.Tensor:
    """Without token counts: the first n ids (byte-level BPE numbers its tokens in merge order, so low ids
    are the frequent ones) plus the ids in `always` (EOS). Training replaces this with measured counts."""
    n = min(n, vocab_size)
    ids = list(range(n))
    for t in always:
        if 0 <= t < vocab_size and t >= n:
            ids[-1 - always.index(t)] = t
    return torch.tensor(sorted(set(ids)), dtype=torch.long)


def draft_vocab_from_counts(counts: torch.Tensor, n: int, always: list[int]) -> torch.Tensor:
    """The n most frequent token ids by `counts` (V,), always including `always` (EOS)."""
    n = min(n, counts.numel())
    counts = counts.clone().float()
    for t in always:
        if 0 <= t < counts.numel():
            counts[t] = float("inf")
    return torch.topk(counts, n).indices.sort().values
