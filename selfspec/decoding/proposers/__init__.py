"""Proposers: one object per drafting strategy. The round loop (engine.py) asks a proposer for a round's proposal
(`propose`: a chain `Draft` or a `TreeDraft`, verify.py) and tells it what was committed (`observe`); it never asks
which strategy it runs.

  Autoregressive  no drafts (decode.strategy=autoregressive): every round verifies the last token alone
  HeadChain       the head's chain: up to K drafts, one pass through layers < E each (decode.draft_threshold:
                  stop at the first unsure one)
  AheadChain      several drafts per pass (decode.tokens_per_pass=m): a medusa head's extra heads propose the
                  tokens after the first from the same layer-E state
  LookupFirst     context lookup's chain when the history matches (no model pass), the head's chain otherwise
                  (decode.lookup_mode=first)
  LookupChecked   lookup's chain through the head in one pass, kept up to the head's first disagreement, the head's
                  drafts after it (decode.lookup_mode=checked)
  HeadTree        the head's tree (decode.tree=static|dynamic), with context-lookup branches under decode.lookup
  LookupTree      context lookup alone (decode.lookup without a head): its branches as a tree
How a head drafts (early exit, its own cache, low precision, reading the verified context) is the drafter's
business (drafters.py); every proposer works with every drafter.

`make_proposer` picks the strategy from the decode keys; `decode.proposer=NAME` picks a registered one by name
(`register_proposer`, decoding/registry.py; ARCHITECTURE.md "How to add a drafting strategy").
"""

from __future__ import annotations

import importlib
import pkgutil

from selfspec.decoding.proposers.base import Proposer
from selfspec.decoding.proposers.choice import make_proposer
from selfspec.decoding.registry import proposer_names, register_proposer, unregister_proposer

register_proposer("autoregressive")(Proposer)
for _m in pkgutil.iter_modules(__path__):  # every strategy module registers itself on import
    if _m.name not in ("base", "choice"):
        importlib.import_module(f"{__name__}.{_m.name}")

from selfspec.decoding.proposers.chains import AheadChain, HeadChain  # noqa: E402
from selfspec.decoding.proposers.lookups import LookupChecked, LookupFirst  # noqa: E402
from selfspec.decoding.proposers.trees import HeadTree, LookupTree  # noqa: E402

__all__ = ["Proposer", "make_proposer", "register_proposer", "unregister_proposer", "proposer_names", "HeadChain",
           "AheadChain", "LookupFirst", "LookupChecked", "HeadTree", "LookupTree"]
