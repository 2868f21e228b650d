"""What one decode call does: `DecodeConfig`, validated when it is built (`decode.*` in conf/decode/)."""

from __future__ import annotations

import copy
import math
from dataclasses import MISSING, dataclass, field, fields, replace

from selfspec.decoding.registry import proposer_names
from selfspec.errors import check, is_int, is_number

STRATEGIES = ("autoregressive", "selfspec")
TREES = ("chain", "static", "dynamic", "auto")  # auto: chosen by calibration (evaluation/calibration.py), not decodable
# branch: lookup's proposals as tree branches beside the head's; first: chain rounds, lookup's chain when it matches,
# else the head's; checked: chain rounds, lookup's chain checked by the head in one pass, kept up to the first token
# the head disagrees with, the head's drafts from there on (a pass through layers < E for several lookup tokens)
LOOKUP_MODES = ("branch", "first", "checked")
CHAIN_LOOKUP_MODES = ("first", "checked")
MAX_TREE_NODES = 1024  # draft nodes one round may verify (a static shape multiplies up fast)
# Upper limits on every size a decode round allocates for, checked when the config is built (a user's value, a
# head file's "decode" block), before any buffer exists; `check_fits` ties them to a model's context as well.
MAX_DRAFT_LEN = 256  # draft_len, lookup_len: tokens drafted in a row (far past where acceptance has run out)
MAX_NGRAM = 64  # lookup_min_ngram / lookup_max_ngram
MAX_TOKENS_PER_PASS = 64
# Below this, logits / temperature overflows float32 for ordinary logit ranges (|logit| ~ 30 / 1e-38), and far
# above it the distribution is already one-hot in float32: a smaller positive temperature is a mistake for 0.
MIN_TEMPERATURE = 1e-4
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes at most 64 bits; a larger int is its raw overflow error


def _at_most(name: str, value: int, hi: int) -> None:
    check(value <= hi, f"decode.{name}={value}: must be in [1, {hi}]")


def setting(default=MISSING, *, factory=MISSING, tuned: bool | str = False, variant: bool = False,
            lookup: bool = False, chain: bool = False):
    """A DecodeConfig field, with what the rest of selfspec does with it in its metadata (read by DECODE_KEYS and the
    key sets below, and by `tuned_settings`, so each key is written out once, here):
      tuned    a saved head's "decode" block may carry it (TUNED_KEYS): True = training records it always; the name
               of another key = training records it while that key is off its default (the tree keys with a tree)
      variant  an evaluation method variant may set it (`selfspec:draft_len=2`; VARIANT_KEYS)
      lookup   it shapes context lookup's proposals: the `lookup` method's variants (LOOKUP_KEYS)
      chain    chain rounds only: a head's tuned value is left out where the other settings make tree rounds"""
    meta = {k: v for k, v in dict(tuned=tuned, variant=variant, lookup=lookup, chain=chain).items() if v}
    return field(default=default, default_factory=factory, metadata=meta)


@dataclass
class DecodeConfig:
    strategy: str = "selfspec"
    draft_len: int = setting(4, tuned=True, variant=True)
    # dynamic K: stop drafting when the draft's top-1 prob < this
    draft_threshold: float | None = setting(None, tuned=True, variant=True, chain=True)
    # joint-confidence K (EAGLE-2's rule on a chain): the first draft is always made; the next one only while the
    # product of the drafts' top-1 probs so far is >= this (a low-confidence round costs one draft pass, a confident
    # one goes on up to draft_len)
    draft_continue: float | None = setting(None, tuned="draft_continue", variant=True, chain=True)
    temperature: float = 0.0  # 0 = greedy; else >= MIN_TEMPERATURE
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    max_new_tokens: int = 128
    seed: int | None = 0  # sampling only; None = a fresh random seed
    stop: list[str] = field(default_factory=list)  # stop strings; a single string is one stop string
    # Draft trees (decoding/tree.py): chain = one draft per position (the plain loop); static = tree_shape's
    # branching per depth; dynamic = EAGLE-2's rule, draft_len deep, tree_topk children per expanded node, the
    # best tree_nodes drafts kept (by cumulative draft log-probability); auto = one of them, chosen by calibration
    # before decoding (python -m selfspec.eval decode.tree=auto; the engine refuses an unresolved auto).
    tree: str = setting("chain", tuned="tree", variant=True)
    # dynamic: draft nodes verified per round (the root, the last committed token, aside)
    tree_nodes: int = setting(16, tuned="tree", variant=True)
    # dynamic: children per expanded node, and nodes expanded per depth
    tree_topk: int = setting(4, tuned="tree", variant=True)
    # static: children per node at each depth
    tree_shape: list[int] = setting(factory=lambda: [2, 2, 1, 1], tuned="tree", variant=True)
    # Context lookup (decoding/lookup.py): continuations of the last n-gram's earlier occurrences in the prompt and
    # output; a chain without a head, extra tree branches beside the head's drafts with one.
    lookup: bool = setting(False, tuned="lookup", variant=True)
    # With a head: branch = lookup proposals are extra tree branches beside the head's drafts (a tree round);
    # first = a round drafts from lookup when the context has a match, from the head otherwise (chain rounds,
    # dynamic K allowed). Without a head both are the lookup chain.
    lookup_mode: str = setting("branch", tuned="lookup", variant=True)
    # tokens per proposal (3 with 2-gram matches: 1.16x our AR path on this CPU, BENCHMARKS.md; 8: 0.85x)
    lookup_len: int = setting(3, tuned="lookup", variant=True, lookup=True)
    lookup_branches: int = setting(1, variant=True, lookup=True)  # proposals per round
    # n-grams matched, longest first; a shipped head may carry its measured values (lookup first with the int8
    # self-draft: 3 beats 2, BENCHMARKS.md)
    lookup_min_ngram: int = setting(2, tuned="lookup", variant=True, lookup=True)
    lookup_max_ngram: int = setting(3, tuned="lookup", variant=True, lookup=True)
    # Drafts per pass through layers < E (chain rounds): 1 = each draft from its own pass; m > 1 = the head's
    # first m heads (a medusa head with num_heads >= m) propose m tokens from one pass.
    tokens_per_pass: int = setting(1, tuned="tokens_per_pass", variant=True, chain=True)
    # A drafting strategy by name (decoding/registry.py: register_proposer); None = the one the keys above ask for
    proposer: str | None = setting(None, variant=True)
    # A logit lens's chain runs as one kernel call per round where the CPU kernels apply (Backbone.draft_chain; greedy,
    # or sampled without top-k): the same drafts without the Python between steps; false = one pass per draft
    fused_chain: bool = setting(True, variant=True)

    def __post_init__(self):
        check(self.strategy != "self_speculative", "decode.strategy='self_speculative' is now called 'selfspec' "
              "(the same name as the eval method); allowed autoregressive, selfspec")
        check(self.strategy in STRATEGIES, f"decode.strategy={self.strategy!r}: allowed {', '.join(STRATEGIES)}")
        check(is_int(self.draft_len) and self.draft_len >= 1, f"decode.draft_len={self.draft_len}: must be an integer >= 1")
        _at_most("draft_len", self.draft_len, MAX_DRAFT_LEN)
        check(
            self.draft_threshold is None or is_number(self.draft_threshold) and 0.0 <= self.draft_threshold < 1.0,
            f"decode.draft_threshold={self.draft_threshold}: must be in [0, 1) or null",
        )
        check(
            self.draft_continue is None or is_number(self.draft_continue) and 0.0 < self.draft_continue < 1.0,
            f"decode.draft_continue={self.draft_continue}: must be in (0, 1) or null",
        )
        # inf would divide every logit to 0: a uniform draw over the vocabulary, never what was meant
        check(is_number(self.temperature) and (is_int(self.temperature) or math.isfinite(self.temperature))
              and self.temperature >= 0, f"decode.temperature={self.temperature}: must be >= 0 and finite (0 = greedy)")
        check(
            self.temperature == 0 or self.temperature >= MIN_TEMPERATURE,
            f"decode.temperature={self.temperature}: must be 0 (greedy) or >= {MIN_TEMPERATURE} (smaller ones overflow the logits)",
        )
        check(is_int(self.top_k) and self.top_k >= 0, f"decode.top_k={self.top_k}: must be an integer >= 0 (0 = off)")
        check(is_number(self.top_p) and 0.0 < self.top_p <= 1.0, f"decode.top_p={self.top_p}: must be in (0, 1]")
        self._check_call_keys()
        check(is_int(self.tokens_per_pass) and self.tokens_per_pass >= 1,
              f"decode.tokens_per_pass={self.tokens_per_pass!r}: must be an integer >= 1")
        _at_most("tokens_per_pass", self.tokens_per_pass, MAX_TOKENS_PER_PASS)
        self.stop = self._stop_list(self.stop)
        self._check_tree()

    def _check_call_keys(self) -> None:
        """The keys that change from call to call of one evaluation (`for_call`); no other check reads them."""
        check(is_int(self.max_new_tokens) and self.max_new_tokens >= 1, f"decode.max_new_tokens={self.max_new_tokens}: must be an integer >= 1")
        check(self.seed is None or is_int(self.seed) and 0 <= self.seed <= MAX_SEED,
              f"decode.seed={self.seed!r}: must be an integer or null (an integer in [0, 2**64 - 1])")

    def for_call(self, max_new_tokens: int | None = None, seed: int | None = None) -> "DecodeConfig":
        """This config for one call with another max_new_tokens and/or seed (None: this config's). The rest was
        validated when this config was built, so only these two are checked (with `replace`'s messages)."""
        changes = {k: v for k, v in (("max_new_tokens", max_new_tokens), ("seed", seed)) if v is not None}
        if all(getattr(self, k) == v for k, v in changes.items()):
            return self
        out = copy.copy(self)
        for k, v in changes.items():
            setattr(out, k, v)
        out._check_call_keys()
        return out

    def _check_tree(self) -> None:
        check(self.tree in TREES, f"decode.tree={self.tree!r}: allowed {', '.join(TREES)}")
        limits = {"tree_nodes": MAX_TREE_NODES, "tree_topk": MAX_TREE_NODES, "lookup_len": MAX_DRAFT_LEN,
                  "lookup_branches": MAX_TREE_NODES, "lookup_min_ngram": MAX_NGRAM}
        for name, hi in limits.items():
            value = getattr(self, name)
            check(is_int(value) and value >= 1, f"decode.{name}={value!r}: must be an integer >= 1")
            _at_most(name, value, hi)
        check(is_int(self.lookup_max_ngram) and self.lookup_max_ngram >= self.lookup_min_ngram,
              f"decode.lookup_max_ngram={self.lookup_max_ngram!r}: must be an integer >= lookup_min_ngram ({self.lookup_min_ngram})")
        check(self.lookup_max_ngram <= MAX_NGRAM, f"decode.lookup_max_ngram={self.lookup_max_ngram}: must be in "
                                                  f"[lookup_min_ngram ({self.lookup_min_ngram}), {MAX_NGRAM}]")
        shape = self.tree_shape
        check(isinstance(shape, (list, tuple)) and len(shape) > 0 and all(is_int(b) and b >= 1 for b in shape),
              f"decode.tree_shape={shape!r}: must be a non-empty list of integers >= 1 (children per node at each depth)")
        check(len(shape) <= MAX_DRAFT_LEN and max(shape) <= MAX_TREE_NODES,
              f"decode.tree_shape=[{len(shape)} levels, up to {max(shape)} children]: must be 1 to {MAX_DRAFT_LEN} levels "
              f"of 1 to {MAX_TREE_NODES} children")
        self.tree_shape = list(shape)
        nodes, width = 0, 1
        for b in self.tree_shape:
            width *= b
            nodes += width
        check(nodes <= MAX_TREE_NODES, f"decode.tree_shape={self.tree_shape}: {nodes} draft nodes; at most {MAX_TREE_NODES}")
        if self.tree in ("dynamic", "auto"):  # a dynamic round drafts tree_topk children at each of draft_len depths
            check(self.tree_topk * self.draft_len <= MAX_TREE_NODES,
                  f"decode.tree_topk={self.tree_topk}: tree_topk x draft_len ({self.tree_topk} x {self.draft_len}) draft nodes "
                  f"per round; at most {MAX_TREE_NODES}")
        if self.lookup:  # lookup branches are tree nodes verified in the same pass
            check(self.lookup_len * self.lookup_branches <= MAX_TREE_NODES,
                  f"decode.lookup_branches={self.lookup_branches}: lookup_branches x lookup_len ({self.lookup_branches} x "
                  f"{self.lookup_len}) draft nodes per round; at most {MAX_TREE_NODES}")
        if self.proposer is not None:
            check(self.proposer in proposer_names(),
                  f"decode.proposer={self.proposer!r}: allowed {', '.join(proposer_names())} (or null: from the keys)")
        check(isinstance(self.lookup, bool), f"decode.lookup={self.lookup!r}: must be true or false")
        check(isinstance(self.fused_chain, bool), f"decode.fused_chain={self.fused_chain!r}: must be true or false")
        check(self.lookup_mode in LOOKUP_MODES, f"decode.lookup_mode={self.lookup_mode!r}: allowed {', '.join(LOOKUP_MODES)}")
        check(not (self.lookup and self.lookup_mode in CHAIN_LOOKUP_MODES and self.tree != "chain"),
              f"decode.lookup_mode={self.lookup_mode}: rounds are chains (lookup's or the head's); not with decode.tree={self.tree} "
              "(use decode.lookup_mode=branch for lookup branches in a tree)")
        check(self.tokens_per_pass == 1 or not (self.lookup and self.lookup_mode == "checked"),
              f"decode.tokens_per_pass={self.tokens_per_pass}: not with decode.lookup_mode=checked (use 1)")
        check(self.tokens_per_pass == 1 or not self.uses_tree,
              f"decode.tokens_per_pass={self.tokens_per_pass}: chain rounds only; not with decode.tree={self.tree} / "
              "decode.lookup=true with lookup_mode=branch")
        for name in ("draft_threshold", "draft_continue"):  # how far a chain drafts: no meaning for a tree
            value = getattr(self, name)
            check(value is None or not self.uses_tree,
                  f"decode.{name}={value}: not supported with decode.tree={self.tree} / "
                  "decode.lookup=true (branches); use null, or decode.lookup_mode=first")

    def check_fits(self, max_positions: int, where: str = "decode") -> None:
        """The sizes tied to a model with `max_positions` positions: a round drafts at most the context, and the
        slots a round writes past the committed tokens (tree_slots) fit in one more context's worth of cache.
        One line naming the key and the allowed range; call it before allocating a generation's buffers."""
        ctx = int(max_positions)
        for name in ("draft_len", "lookup_len", "tokens_per_pass"):
            value = getattr(self, name)
            check(value <= ctx - 1, f"{where}.{name}={value}: must be in [1, {ctx - 1}] for this model's context ({ctx} positions)")
        check(len(self.tree_shape) <= ctx - 1 or self.tree != "static",
              f"{where}.tree_shape={self.tree_shape}: at most {ctx - 1} levels for this model's context ({ctx} positions)")
        slots = self.tree_slots()
        check(slots <= ctx, f"{where}: a round writes {slots} cache slots past the committed tokens (draft_len={self.draft_len}, "
                            f"tree={self.tree}, tree_nodes={self.tree_nodes}, tree_topk={self.tree_topk}, lookup_len="
                            f"{self.lookup_len}, lookup_branches={self.lookup_branches}); at most the model's context ({ctx})")

    @staticmethod
    def _stop_list(stop) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):  # one stop string, never its characters
            stop = [stop]
        check(
            isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop),
            f"decode.stop={stop!r}: must be a string or a list of strings",
        )
        return [s for s in stop if s]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_tree(self) -> bool:
        """Rounds verify a draft tree (proposers/trees.py, verify.py) rather than a chain of draft_len drafts."""
        return rounds_are_trees(self)

    @property
    def lookup_branches_tree(self) -> bool:
        """Context lookup adds tree branches (decode.lookup with lookup_mode=branch)."""
        return self.lookup and self.lookup_mode == "branch"

    @property
    def lookup_first(self) -> bool:
        """Chain rounds that draft from context lookup when it matches, from the head otherwise."""
        return self.lookup and self.lookup_mode in CHAIN_LOOKUP_MODES

    def tree_depth(self, head: bool) -> int:
        """The deepest draft a round can verify (the stats' draft_len); for auto, the deepest of its candidates."""
        depth = {"chain": self.draft_len, "static": len(self.tree_shape), "dynamic": self.draft_len,
                 "auto": max(self.draft_len, len(self.tree_shape))}[self.tree] if head else 0
        return max(depth, self.lookup_len if self.lookup else 0)

    def round_slots(self) -> int:
        """Cache slots past the committed tokens that one round may write: none autoregressively, a chain's K
        drafts, a tree's slots (tree_slots) when rounds verify trees or context lookup proposes."""
        if self.strategy != "selfspec":
            return 0
        return self.tree_slots() if self.uses_tree or self.lookup else self.draft_len

    def tree_slots(self) -> int:
        """Cache slots past the root a round can write: the head's draft slots, then every verified node (for auto,
        the most any candidate tree writes)."""
        widths = [1]
        for b in self.tree_shape:
            widths.append(widths[-1] * b)
        head = {"static": sum(widths),  # drafted and verified nodes alike
                "dynamic": max(self.tree_nodes + 1, 1 + self.tree_topk * self.draft_len),
                "chain": self.draft_len + 1}
        head["auto"] = max(head.values())
        return 2 * head[self.tree] + (self.lookup_len * self.lookup_branches if self.lookup else 0)


def _keys(flag: str) -> tuple[str, ...]:
    return tuple(f.name for f in fields(DecodeConfig) if f.metadata.get(flag))


# The decode keys, in one place: DecodeConfig's fields (`setting` says what each one is to the rest of selfspec).
DECODE_KEYS = tuple(f.name for f in fields(DecodeConfig))  # api.generate's keyword arguments, Hydra's decode.*
TUNED_KEYS = _keys("tuned")  # a saved head's "decode" block (heads/saving.py; training writes them: tuned_settings)
VARIANT_KEYS = _keys("variant")  # evaluation method variants (evaluation/runner.py)
LOOKUP_KEYS = _keys("lookup")  # the `lookup` method's variants
CHAIN_ONLY_KEYS = _keys("chain")  # dynamic K, several drafts per pass: not with tree rounds


def _default(name: str):
    f = DecodeConfig.__dataclass_fields__[name]
    return f.default_factory() if f.default is MISSING else f.default


def rounds_are_trees(cfg: DecodeConfig, changes: dict | None = None) -> bool:
    """`cfg` with `changes` verifies draft trees (DecodeConfig.uses_tree), told without building that config."""
    tree, lookup, mode = ((changes or {}).get(k, getattr(cfg, k)) for k in ("tree", "lookup", "lookup_mode"))
    return tree != "chain" or bool(lookup) and mode == "branch"


def tuned_settings(cfg: DecodeConfig) -> dict:
    """The decode settings a head records as those its validation ran with (its "decode" block): the TUNED_KEYS
    keys whose `tuned` condition holds (K and dynamic K always; the tree keys with a tree, the lookup keys with
    lookup, tokens_per_pass when it is not 1)."""
    when = {f.name: f.metadata.get("tuned") for f in fields(DecodeConfig)}
    return {k: getattr(cfg, k) for k in TUNED_KEYS if when[k] is True or getattr(cfg, when[k]) != _default(when[k])}


def tuned_overrides(cfg: DecodeConfig, tuned: dict, user_set) -> dict:
    """The head's tuned decode settings (`tuned`) that apply over `cfg`: every TUNED_KEYS key the user did not set
    himself, less those that do not combine with the user's own (chain-only keys beside tree rounds, a chain lookup
    mode beside a tree). Only a self-speculative decode uses them."""
    if cfg.strategy != "selfspec" or not tuned:
        return {}
    user_set = set(user_set)
    take = {k: v for k, v in tuned.items() if k in TUNED_KEYS and k not in user_set}
    merged = {k: take.get(k, getattr(cfg, k)) for k in ("tree", "lookup", "lookup_mode")}
    if rounds_are_trees(cfg, take):  # DecodeConfig refuses dynamic K and parallel drafts with tree rounds
        take = {k: v for k, v in take.items() if k not in CHAIN_ONLY_KEYS}
    if merged["lookup"] and merged["lookup_mode"] in CHAIN_LOOKUP_MODES and merged["tree"] != "chain":
        take.pop("lookup_mode", None)  # the user's tree keeps lookup as branches
    return take


def with_tuned_settings(cfg: DecodeConfig, tuned: dict, user_set) -> tuple[DecodeConfig, list[str]]:
    """`cfg` with the head's tuned decode settings (tuned_overrides) -> (the config to decode with, the keys taken
    from the head)."""
    take = tuned_overrides(cfg, tuned, user_set)
    return (replace(cfg, **take), sorted(take)) if take else (cfg, [])


def user_set_keys(overrides, group: str = "decode") -> set[str]:
    """Keys of `group` given on a Hydra command line (`decode.draft_len=3`, `+decode.x=..`, `~decode.x`)."""
    keys = set()
    for o in overrides or ():
        name = str(o).lstrip("+~").split("=", 1)[0]
        if name.startswith(group + "."):
            keys.add(name[len(group) + 1:])
    return keys
