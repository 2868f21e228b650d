"""Drafting strategies by name: `register_proposer("name")` on a Proposer subclass makes `decode.proposer=name` draft
with it; `make_proposer` picks the strategy a DecodeConfig asks for."""

from __future__ import annotations

from selfspec.decoding.config import DecodeConfig
from selfspec.decoding.drafters import Drafter, NoDrafter
from selfspec.errors import check

_REGISTRY: dict[str, type] = {}


def register_proposer(name: str):
    """Class decorator: `decode.proposer=name` drafts with this Proposer subclass."""

    def add(cls):
        _REGISTRY[name] = cls
        cls.name = name
        return cls

    return add


def unregister_proposer(name: str) -> None:
    _REGISTRY.pop(name, None)


def proposer_names() -> list[str]:
    return sorted(_REGISTRY)


def make_proposer(cfg: DecodeConfig, drafter: Drafter) -> Proposer:
    """The strategy the decode keys ask for (decode.proposer=NAME: a registered one by name)."""
    name = cfg.proposer or _strategy_name(cfg, drafter)
    check(name in _REGISTRY, f"decode.proposer={name}: unknown; registered: {', '.join(proposer_names())}")
    return _REGISTRY[name](cfg, drafter)


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
