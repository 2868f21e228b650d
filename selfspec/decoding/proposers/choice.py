"""Which strategy drafts: `make_proposer` picks the one a DecodeConfig asks for (decode.proposer=NAME: a registered
one by name, decoding/registry.py; else the one the decode keys imply)."""

from __future__ import annotations

from selfspec.decoding.config import DecodeConfig
from selfspec.decoding.drafters import Drafter, NoDrafter
from selfspec.decoding.proposers.base import Proposer
from selfspec.decoding.registry import proposer_names, registered_proposer
from selfspec.errors import check


def make_proposer(cfg: DecodeConfig, drafter: Drafter) -> Proposer:
    """The strategy the decode keys ask for (decode.proposer=NAME: a registered one by name)."""
    name = cfg.proposer or _strategy_name(cfg, drafter)
    cls = registered_proposer(name)
    check(cls is not None, f"decode.proposer={name}: unknown; registered: {', '.join(proposer_names())}")
    return cls(cfg, drafter)


def _strategy_name(cfg: DecodeConfig, drafter: Drafter) -> str:
    if cfg.strategy != "selfspec":
        return "autoregressive"
    if isinstance(drafter, NoDrafter):
        check(cfg.lookup, "decode.strategy=selfspec needs a head (head=lens|medusa|adapter|lora|layer|DIR) "
                          "or decode.lookup=true (context-lookup drafts alone)")
        check(cfg.tree == "chain", f"decode.tree={cfg.tree}: drafts a tree with an exit head; without one use decode.tree=chain")
        return "lookup_tree"
    if cfg.uses_tree:
        return "head_tree"
    if cfg.lookup_first:
        return f"lookup_{cfg.lookup_mode}"
    return "ahead_chain" if cfg.tokens_per_pass > 1 else "head_chain"
