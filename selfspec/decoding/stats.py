"""`DecodeStats`: what one decode call (or several, pooled) did. Counts are kept; rates are derived from them.

`to_dict()` is the stats dict of `GenerationResult.stats` and of the evaluation's records (the keys and their
order are part of the results format). `pool_stats` pools several calls' stats dicts (the turns of a conversation,
the prompts of a validation or of an evaluation summary): counts and seconds add up, per-position counts add up
elementwise, and tau, the accept rates and tokens/s are recomputed from the sums, never averaged. It is the one
pooling: `DecodeStats.merge` (typed), timing's harness and evaluation/report.py's summaries all call it.

Rounds that verify a draft tree (decode.tree / decode.lookup) count every draft node in `drafted`, the accepted
path's depth in `accepted`, and per depth in the per-position lists ([i]: rounds whose tree / accepted path
reached depth i+1); their dict carries TREE_KEYS after the chain's keys (a chain decode's dict is unchanged).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields


def _ratio(num: float, den: float, empty):
    return num / den if den else empty


# Counts only tree rounds record (summed when stats are pooled), and the keys a tree decode's dict appends.
TREE_COUNTS = ("drafted_lookup", "accepted_lookup")
TREE_KEYS = ("tree", "lookup", "nodes_per_step", "accepted_depth", "drafted_head", "accepted_head", "accept_rate_head",
             "drafted_lookup", "accepted_lookup", "accept_rate_lookup")


def tree_rates(d: dict) -> dict:
    """The derived TREE_KEYS of a stats dict from its counts (drafted, accepted, verify_steps, TREE_COUNTS)."""
    steps, drafted, accepted = d.get("verify_steps", 0), d.get("drafted", 0), d.get("accepted", 0)
    dl, al = d.get("drafted_lookup", 0), d.get("accepted_lookup", 0)
    return {
        "nodes_per_step": _ratio(drafted, steps, 0.0),  # draft nodes verified per round
        "accepted_depth": _ratio(accepted, steps, 0.0),  # mean depth of the accepted path
        "drafted_head": drafted - dl,
        "accepted_head": accepted - al,
        "accept_rate_head": _ratio(accepted - al, drafted - dl, None),
        "drafted_lookup": dl,
        "accepted_lookup": al,
        "accept_rate_lookup": _ratio(al, dl, None),
    }


# Counts that add up over calls; the rates are recomputed from the sums, never averaged.
SUM_KEYS = ("new_tokens", "verify_steps", "drafted", "draft_steps", "accepted", "seconds", "draft_s", "verify_s",
            "engine_seconds", "prompt_tokens", *TREE_COUNTS)
LIST_KEYS = ("drafted_per_position", "accepted_per_position")  # summed elementwise (rounds of different K: padded)


def _sum_elementwise(lists: Iterable[list | None]) -> list:
    acc: list = []
    for values in lists:
        for i, v in enumerate(values or []):
            if i == len(acc):
                acc.append(0)
            acc[i] += v
    return acc


def pool_stats(stats: Sequence[Mapping], empty: float | None = 0.0) -> dict:
    """Stats dicts of several decode calls as one: SUM_KEYS summed (those some call has), LIST_KEYS summed
    elementwise, tau / accept rates / tokens per second recomputed from the sums. Keys that are not counts are taken
    from the first call. empty: tau and tokens_per_s where nothing was verified / timed (0.0, as DecodeStats; the
    evaluation summary's None)."""
    out: dict = {k: v for k, v in stats[0].items() if k not in SUM_KEYS and k not in LIST_KEYS}
    for k in SUM_KEYS:
        vals = [s[k] for s in stats if s.get(k) is not None]
        if vals:
            out[k] = sum(vals)
    for k in LIST_KEYS:
        out[k] = _sum_elementwise(s.get(k) for s in stats)
    out["accepted_per_position"] += [0] * (len(out["drafted_per_position"]) - len(out["accepted_per_position"]))
    n, steps, drafted = out["new_tokens"], out.get("verify_steps", 0), out.get("drafted", 0)
    out["tau"] = _ratio(n, steps, empty)
    out["accept_rate"] = _ratio(out["accepted"], drafted, None)
    out["accept_rate_per_position"] = [_ratio(a, d, None) for a, d in
                                       zip(out["accepted_per_position"], out["drafted_per_position"])]
    out["tokens_per_s"] = n / out["seconds"] if out["seconds"] > 0 else empty
    if "tree" in out:  # draft-tree rounds: their rates from the pooled counts too
        out.update(tree_rates(out))
    return out


@dataclass
class DecodeStats:
    strategy: str = ""
    exit_layer: int | None = None  # the draft's exit layer; None without drafts
    draft_len: int = 0  # K (0: autoregressive)
    new_tokens: int = 0
    verify_steps: int = 0  # full-depth passes (one per round)
    drafted: int = 0  # drafts sent to verification
    draft_steps: int = 0  # exit-head passes, including drafts declined under draft_threshold
    accepted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)  # [i]: rounds that drafted an i+1-th token
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: rounds that accepted it
    draft_s: float = 0.0
    verify_s: float = 0.0  # verification, acceptance and bookkeeping (all of a round without drafts)
    seconds: float = 0.0  # the whole call
    prompt_tokens: int = 0
    tree: str | None = None  # None: chain rounds (today's loop); else decode.tree of a tree decode
    lookup: bool = False  # context-lookup drafts were proposed
    drafted_lookup: int = 0  # of `drafted`: nodes only context lookup proposed
    accepted_lookup: int = 0  # of `accepted`: such nodes on the accepted path
    draft_precision: str = "full"  # head.draft_precision of the draft pass
    draft_bytes: int = 0  # the low-precision weight copies the draft pass reads (0 at full precision)

    # ---------------------------------------------------------------- derived
    @property
    def tau(self) -> float:
        """New tokens per verify step (the target's own token counted)."""
        return _ratio(self.new_tokens, self.verify_steps, 0.0)

    @property
    def accept_rate(self) -> float | None:
        return _ratio(self.accepted, self.drafted, None)

    @property
    def accept_rate_per_position(self) -> list[float | None]:
        return [_ratio(a, d, None) for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    # ---------------------------------------------------------------- recording
    def record_round(self, drafted: int, accepted: int) -> None:
        """One verify step that checked `drafted` drafts and accepted the first `accepted` of them."""
        self.verify_steps += 1
        self.drafted += drafted
        self.accepted += accepted
        grow = drafted - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i in range(drafted):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += int(i < accepted)

    def record_tree_round(self, depth: int, nodes: int, lookup_nodes: int, accepted: int, accepted_lookup: int) -> None:
        """One verify step over a tree `depth` deep with `nodes` draft nodes (`lookup_nodes` of them from context
        lookup only) whose accepted path holds `accepted` drafts (`accepted_lookup` of them lookup nodes)."""
        self.record_round(depth, accepted)  # per depth, as a chain's per position
        self.drafted += nodes - depth
        self.drafted_lookup += lookup_nodes
        self.accepted_lookup += accepted_lookup

    # ---------------------------------------------------------------- dicts
    def to_dict(self) -> dict:
        d = {
            "strategy": self.strategy,
            "exit_layer": self.exit_layer,
            "draft_len": self.draft_len,
            "new_tokens": self.new_tokens,
            "verify_steps": self.verify_steps,
            "tau": self.tau,
            "drafted": self.drafted,
            "draft_steps": self.draft_steps,
            "accepted": self.accepted,
            "accept_rate": self.accept_rate,
            "drafted_per_position": list(self.drafted_per_position),
            "accepted_per_position": list(self.accepted_per_position),
            "accept_rate_per_position": self.accept_rate_per_position,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "seconds": self.seconds,
            "tokens_per_s": self.tokens_per_s,
            "prompt_tokens": self.prompt_tokens,
            "draft_precision": self.draft_precision,
            "draft_bytes": self.draft_bytes,
        }
        if self.tree is not None:
            d = {**d, "tree": self.tree, "lookup": self.lookup, **tree_rates(d | {"drafted_lookup": self.drafted_lookup,
                                                                                  "accepted_lookup": self.accepted_lookup})}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DecodeStats":
        """From a stats dict (ours, or another method's with fewer keys: missing counts are 0); derived keys and
        keys DecodeStats does not know are ignored."""
        names = {f.name for f in fields(cls)}
        kept = {k: v for k, v in d.items() if k in names and v is not None}
        for k in ("drafted_per_position", "accepted_per_position"):
            kept[k] = list(kept.get(k) or [])
        return cls(**kept)

    @classmethod
    def merge(cls, items: Iterable["DecodeStats | dict"]) -> "DecodeStats":
        """Several calls as one (pool_stats): counts, seconds and per-position counts summed; labels (strategy,
        exit_layer, draft_precision) from the first, tree from the first that has one, draft_len and draft_bytes the
        largest, lookup from any."""
        items = [s if isinstance(s, DecodeStats) else cls.from_dict(s) for s in items]
        if not items:
            return cls()
        out = cls.from_dict(pool_stats([vars(s) for s in items]))
        out.draft_len = max(s.draft_len for s in items)
        out.tree = next((s.tree for s in items if s.tree is not None), None)
        out.lookup = any(s.lookup for s in items)
        out.draft_bytes = max(s.draft_bytes for s in items)
        out.drafted_per_position += [0] * (len(out.accepted_per_position) - len(out.drafted_per_position))
        return out
