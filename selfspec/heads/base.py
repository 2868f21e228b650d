"""Exit heads: small modules that turn layer E's hidden state into a draft distribution.

A head owns only its trained parameters. The target's final norm and LM head are shared (read through
the Backbone, never copied into the head's state), and the base model stays frozen and bit-identical.
What the engine, training and saving need from a head is a method or an attribute of `ExitHead`, so that none
of them asks which head class it holds.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import replace
import weakref

import torch
from torch import nn

from selfspec.errors import check
from selfspec.heads.config import HeadConfig
from selfspec.heads.files import save_head
from selfspec.model.quant import check_precision


def default_exit_layer(num_layers: int) -> int:
    """A fifth of the depth: cheap drafts; trained heads recover most of the acceptance (see BENCHMARKS.md)."""
    return max(1, min(num_layers - 1, num_layers // 5))


def check_exit_layer(exit_layer: int, num_layers: int, minimum: int = 1, entry: str | None = None) -> None:
    """E in [minimum, L]: E = L drafts through the whole stack (with head.draft_precision=int8|int4|int4_mlp, the quantized
    self-draft); minimum 0 would be the embeddings. entry: the `heads` entry of an analysis that named E (its
    message names the entry)."""
    what = (f"head.exit_layer={exit_layer}: must be an integer in [{minimum}, {num_layers}]" if entry is None else
            f"heads: {entry!r}: exit layer {exit_layer} out of range; allowed {minimum}..{num_layers}")
    check(isinstance(exit_layer, int) and minimum <= exit_layer <= num_layers, f"{what} for this {num_layers}-layer model")


def resolve_exit_layer(exit_layer: int | None, num_layers: int, minimum: int = 1) -> int:
    """The exit layer a head is built at: `exit_layer` (checked: check_exit_layer), or default_exit_layer when None."""
    E = exit_layer if exit_layer is not None else default_exit_layer(num_layers)
    check_exit_layer(E, num_layers, minimum)
    return E


class ExitHead(nn.Module):
    """Base class. Subclasses implement `transform` (hidden -> hidden before the shared norm + LM head).

    Shapes: h is (B, T, H) layer-E hidden states; logits are (B, T, V') with V' = V, or N with a
    reduced draft vocabulary (then `vocab_ids` (N,) maps draft indices back to token ids).
    """

    # False when the head changes layers < E (LoRA): drafting then keeps its own cache (decoding/drafters.py)
    reuses_early_layers = True
    # What training feeds it (training/loop.py): "positions" (cached layer-E states, one position at a time),
    # "sequence" (cached layer-E states of whole sequences: heads that attend), "ids" (token ids through layers < E)
    training_input = "positions"
    # True when the head changes the model itself (LoRA): a model carries at most one such head at a time
    one_per_model = False
    # True when the head reads the verified context's full-depth states (context.py): the engine hands it each
    # verify pass's final-layer states (`observe`) and lowers what it has seen to `refeed_from`
    reads_context = False
    # The depths whose states it reads (a context head: the final layer, or EAGLE-3's low/mid/high side by side):
    # the verify pass captures them (Backbone.run_capturing) and `observe` gets them concatenated, (B, T, D*H)
    context_depths: tuple[int, ...] = ()
    # The lowest exit layer this head type drafts from (0: the token embeddings; check_exit_layer)
    min_exit_layer = 1
    # True when head.exit_layer=null means the whole depth (a trained low-bit draft), not default_exit_layer
    full_depth_default = False
    # True when the draft is the model's own final norm + LM head on layer E, nothing else (the logit lens): a greedy
    # chain of them may run in one kernel call (Backbone.draft_chain)
    plain_readout = False

    def __init__(self, config: HeadConfig, exit_layer: int, backbone):
        super().__init__()
        self.config = config
        self.exit_layer = exit_layer
        self.register_buffer("vocab_ids", torch.empty(0, dtype=torch.long), persistent=True)
        self._draft_weight: torch.Tensor | None = None
        # Decode settings this head was tuned with (a saved head's "decode" block: draft_len, draft_threshold,
        # ...); the API, `selfspec.generate` and `selfspec.eval` use them unless the user sets those keys.
        self.decode_settings: dict = {}
        # A loaded head: how its saved base model compares with this one (model/identity.py: verdict, distance, ...)
        self.base_model_check: dict | None = None
        try:  # for save_pretrained; a weak reference, so a head never keeps a model alive
            self._backbone = weakref.ref(backbone)
        except TypeError:  # None, or a stand-in object in a test
            self._backbone = None

    @property
    def draft_precision(self) -> str:
        """The draft pass's weight precision: "full", "int8", "int4" or "int4_mlp" (head.draft_precision)."""
        return getattr(self.config, "draft_precision", None) or "full"

    @property
    def verify_reuse(self) -> int | None:
        """E when verification reuses the draft's layers < E (a head that leaves them untouched, drafting in full
        precision); None when it runs the whole stack (LoRA, or a low-precision draft: drafters.py)."""
        return self.exit_layer if self.reuses_early_layers and self.draft_precision == "full" else None

    def set_draft_precision(self, precision: str | None) -> "ExitHead":
        """Draft in `precision` from now on (None: keep the head's own, e.g. a saved head's); returns self."""
        if precision is not None:
            check_precision(precision)
            self.config = replace(self.config, draft_precision=precision)
        return self

    def with_draft_precision(self, precision: str) -> "ExitHead":
        """The same head (shared weights and draft vocabulary) drafting in another precision: an eval method
        variant (`selfspec:draft_precision=int8`) beside the head's own setting."""
        check_precision(precision)
        other = copy.copy(self)  # a shallow copy: the same parameter and buffer dicts
        other.config = replace(self.config, draft_precision=precision)
        return other

    def with_settings(self, **changes) -> "ExitHead":
        """The same head (shared weights, draft vocabulary and caches) with some config fields changed: an eval method
        variant (`selfspec:own_precision=int8`); a field this head type does not have is refused."""
        unknown = [k for k in changes if not hasattr(self.config, k)]
        check(not unknown, f"{', '.join(unknown)}: not a setting of a {self.config.type} head")
        other = copy.copy(self)
        other.config = replace(self.config, **changes)  # validated by the config's __post_init__
        return other

    @classmethod
    def exit_layer_for(cls, exit_layer: int | None, num_layers: int) -> int:
        """The exit layer a head of this type is built at: `exit_layer` (checked), else this type's default."""
        if exit_layer is None and cls.full_depth_default:
            exit_layer = num_layers
        return resolve_exit_layer(exit_layer, num_layers, cls.min_exit_layer)

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
            self._draft_weight = backbone.lm_rows(self.vocab_ids)
        return self._draft_weight

    # ---- set-up on the model, per-generation state, the drafting context
    def attach(self, backbone) -> None:
        """Called once the head sits on its device: heads that change the model (LoRA) do it here."""

    def new_state(self, backbone, max_len: int, batch: int = 1):
        """Per-generation state (the adapter's KV cache); None for stateless heads."""
        return None

    def drafting(self):
        """The context drafting runs layers < E in (LoRA: adapters on)."""
        return contextlib.nullcontext()

    def draft_copies(self, backbone):
        """The low-precision copies the draft pass reads (model/backbone.py: QuantStack), None in full precision: the
        model's own for head.draft_precision; a trained low-bit draft (heads/lowbit.py) has its own."""
        return backbone.quantized(self.draft_precision)

    def early_states(self, backbone, ids: torch.Tensor) -> torch.Tensor:
        """Training a head that changes layers < E (training_input "ids"): ids (B, T) -> the states it transforms."""
        with self.drafting():
            return backbone.run_layers(backbone.embed(ids), 0, self.exit_layer)

    # ---- the head proper
    def transform(self, h: torch.Tensor, backbone, state=None, pos0: int = 0) -> torch.Tensor:
        return h

    def forward(self, h: torch.Tensor, backbone, state=None, pos0: int = 0, last_only: bool = False) -> torch.Tensor:
        """(B, T, H) layer-E hidden -> (B, T, V') draft logits (or (B, 1, V') with last_only)."""
        x = self.transform(h, backbone, state, pos0)
        if last_only:
            x = x[:, -1:]
        return backbone.logits(backbone.norm(x), self.lm_weight(backbone))

    def next_token_logits(self, h: torch.Tensor, backbone, state=None, pos0: int = 0) -> torch.Tensor:
        """h (1, T, H): layer-E states at positions pos0 .. pos0+T-1 that the head has not seen yet -> (V',)
        draft logits for the token after the last. A stateless head needs only the last row."""
        return self(h[:, -1:], backbone)[0, -1]

    def extra_logits(self, h: torch.Tensor, backbone) -> list[torch.Tensor]:
        """Logits of extra heads that predict t+2, t+3, ... (Medusa); none by default."""
        return []

    @property
    def max_ahead(self) -> int:
        """Tokens one draft pass can propose: 1 + the extra heads (decode.tokens_per_pass at most this)."""
        return 1

    def ahead_logits(self, h: torch.Tensor, backbone, state=None, pos0: int = 0, ahead: int = 1) -> torch.Tensor:
        """`next_token_logits`, plus the extra heads' for the tokens after it: (ahead, V') logits for positions
        t+1 .. t+ahead, t = the last row of h, all from that one row (Medusa's parallel drafts)."""
        first = self.next_token_logits(h, backbone, state, pos0)
        if ahead == 1:
            return first[None]
        extra = self.extra_logits(h[:, -1:], backbone)[: ahead - 1]
        if len(extra) < ahead - 1:
            raise ValueError(f"{type(self).__name__} proposes at most {1 + len(extra)} tokens per pass, not {ahead}")
        return torch.stack([first, *(lg[0, -1] for lg in extra)])

    # ---- weights: what training changes, what a saved head holds
    def trainable_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The parameters training may change (LoRA: its matrices inside the frozen model)."""
        return dict(self.named_parameters())

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """What a saved head stores (the draft vocabulary included as `vocab_ids`)."""
        return dict(self.state_dict())

    def load_trainable(self, tensors: dict[str, torch.Tensor]) -> None:
        """The inverse of trainable_state_dict without `vocab_ids`; RuntimeError when the tensors do not fit."""
        self.load_state_dict({**tensors, "vocab_ids": self.vocab_ids}, strict=True)

    def load_matching(self, tensors: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
        """Copy the tensors whose names and shapes match this head's (another head's trainable_state_dict, e.g. one of
        another context source); the others keep their values. -> (names copied, this head's names left as they were)."""
        own = self.trainable_state_dict()
        own.pop("vocab_ids", None)
        copied = [k for k, v in tensors.items() if k in own and tuple(own[k].shape) == tuple(v.shape)]
        with torch.no_grad():
            for k in copied:
                own[k].copy_(tensors[k].to(own[k].dtype))
        return copied, [k for k in own if k not in copied]

    def num_params(self) -> int:
        return sum(p.numel() for p in self.trainable_parameters().values())

    def config_dict(self) -> dict:
        from dataclasses import asdict

        d = asdict(self.config)
        d.update(exit_layer=self.exit_layer, path=None)
        d.pop("allow_other_model", None)  # how this head was loaded, not what it is
        return d

    def save_pretrained(self, path, backbone=None, extra: dict | None = None):
        """Save like a peft adapter: DIR/head_config.json (type, sizes, the base model's fingerprint and
        `base_model_name_or_path`) + DIR/head.safetensors (heads/files.py: save_head). `backbone`: the model the
        head sits on; by default the one it was built or loaded on."""
        if backbone is None and self._backbone is not None:
            backbone = self._backbone()
        check(backbone is not None, "save_pretrained: the model this head was built on is gone; pass backbone=")
        return save_head(self, path, backbone, extra)


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


def check_draft_vocab(vocab_ids: torch.Tensor, vocab_size: int, where: str) -> None:
    """A draft vocabulary read from a file: distinct token ids in [0, vocab_size)."""
    check(vocab_ids.dim() == 1 and not vocab_ids.is_floating_point() and not vocab_ids.is_complex(),
          f"{where}: vocab_ids must be a 1-D integer tensor")
    if vocab_ids.numel():
        lo, hi = int(vocab_ids.min()), int(vocab_ids.max())
        check(lo >= 0 and hi < vocab_size, f"{where}: draft vocabulary ids must be in [0, {vocab_size}); found {lo if lo < 0 else hi}")
        check(vocab_ids.unique().numel() == vocab_ids.numel(), f"{where}: draft vocabulary ids must be distinct")
