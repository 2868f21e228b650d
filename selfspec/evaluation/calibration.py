"""Calibration before an evaluation run: settings chosen by predicted speedup on this hardware.

  calibrate        auto.enabled=true: the exit layer E (among the given heads) and the chain's draft length K
  calibrate_tree   decode.tree=auto: the chain at decode.draft_len, or a dynamic tree of one of `tree_nodes` nodes
                   (or the static decode.tree_shape)

Both measure acceptance with short decodes of a few prompts, time the engine's own steps at the prompts' context
length (costs.StepTimer: each step as the median of its ratio to an autoregressive step timed right before it), and
return plain JSON-able tables beside the choice. They do no I/O; the caller logs and records them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from selfspec.decoding.config import DecodeConfig
from selfspec.decoding.engine import Decoder
from selfspec.decoding.stats import DecodeStats, pool_stats
from selfspec.errors import check
from selfspec.evaluation.costs import StepTimer
from selfspec.evaluation.report import alpha_from_accept_rate_per_position, predicted_speedup

# Predictions within this share of the best count as a tie, and the tie goes to the smaller tree: timing noise on a
# shared CPU is larger than 1%, and a smaller tree needs fewer cache slots.
TIE = 0.01


def _context(model, prompt_ids: list[list[int]], context: int | None, room: int) -> int:
    """The timings' context: the calibration prompts' mean length, clipped so that `room` more positions fit."""
    ctx = context or max(1, int(sum(len(p) for p in prompt_ids) / len(prompt_ids)))
    return max(1, min(ctx, model.backbone.max_positions - room - 2))


# ------------------------------------------------------------------------------------ auto.enabled: E and K
@dataclass
class Calibration:
    exit_layer: int
    draft_len: int
    predicted_speedup: float
    table: dict = field(default_factory=dict)  # E -> {"alpha", "draft_cost", "verify_cost": {K}, "predicted": {K}}


def calibrate(model, heads: dict[int, object], prompt_ids: list[list[int]], draft_lens: Sequence[int],
              max_new_tokens: int, context: int | None = None, repeats: int = 5) -> Calibration:
    """Pick (E, K) by predicted speedup: alpha from a short run at the largest K on a few prompts, costs c and
    v(K) from step timings at the prompts' context length (costs.StepTimer), then argmax over E x K of
    `report.predicted_speedup(alpha, K, c, v(K))`."""
    check(len(prompt_ids) > 0, "auto.enabled=true: no calibration prompts")
    ks = sorted({int(k) for k in draft_lens})
    check(ks and ks[0] >= 1, f"auto.draft_lens={list(draft_lens)}: integers >= 1")
    k_max = ks[-1]
    bb = model.backbone
    timer = StepTimer(bb, _context(model, prompt_ids, context, k_max), k_max, repeats)
    table: dict = {}
    best: tuple[float, int, int] = (-math.inf, 0, 0)
    for E, head in heads.items():
        decoder = Decoder(bb, head)
        cfg = DecodeConfig(draft_len=k_max, max_new_tokens=max_new_tokens)
        pooled = pool_stats([decoder.generate(ids, cfg, model.eos_ids)[1] for ids in prompt_ids])
        rates = pooled["accept_rate_per_position"]
        alpha = alpha_from_accept_rate_per_position(rates) if any(r is not None for r in rates) else 0.0
        c = timer.draft_cost(head, E)
        v = {k: timer.ratio(timer.verify_step(k, head.verify_reuse)) for k in ks}
        pred = {k: predicted_speedup(alpha, k, c, v[k]) for k in ks}
        table[E] = {"alpha": alpha, "accept_rate_per_position": rates, "draft_cost": c, "verify_cost": v,
                    "predicted": pred}
        for k, s in pred.items():
            if s > best[0]:
                best = (s, E, k)
    return Calibration(exit_layer=best[1], draft_len=best[2], predicted_speedup=best[0], table=table)


# ------------------------------------------------------------------------------------ decode.tree=auto
@dataclass
class TreeCalibration:
    """decode.tree=auto resolved: the chosen candidate's decode settings, its prediction, and every candidate's row
    of measurements (`table`: name, tree, tree_nodes, rows, tau, draft_passes, draft_cost, verify_cost, predicted)."""

    name: str  # "chain", "dynamic/8", "static/[2, 2, 1, 1]"
    settings: dict  # the decode keys to set: {"tree": ...} (+ "tree_nodes" for a dynamic tree)
    predicted_speedup: float
    context: int | None  # the timings' context length (None: costs were given, not timed)
    table: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"name": self.name, **self.settings, "predicted_speedup": self.predicted_speedup,
                "context": self.context, "table": [dict(r) for r in self.table]}


def tree_candidates(decode: DecodeConfig, tree_nodes: Sequence[int], static: bool = False) -> list[tuple[str, DecodeConfig]]:
    """(name, decode config) of each candidate: the chain at decode.draft_len, a dynamic tree (decode.draft_len deep,
    decode.tree_topk wide) of each node budget in `tree_nodes`, and with `static` the static decode.tree_shape. Dynamic K
    (draft_threshold, draft_continue) is off in all of them: trees do not take it."""
    check(len(tree_nodes) > 0 and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in tree_nodes),
          f"auto.tree_nodes={list(tree_nodes)}: must be a non-empty list of integers >= 1")
    base = replace(decode, strategy="selfspec", draft_threshold=None, draft_continue=None, tree="chain")
    out = [("chain", base)]
    out += [(f"dynamic/{n}", replace(base, tree="dynamic", tree_nodes=int(n))) for n in sorted(set(tree_nodes))]
    if static:
        out.append((f"static/{decode.tree_shape}", replace(base, tree="static")))
    return out


def head_rows(cfg: DecodeConfig) -> int:
    """Verify rows of a full round of the head's drafts: the root plus every draft node (context-lookup branches,
    which vary by round, not counted)."""
    if cfg.tree == "dynamic":
        return cfg.tree_nodes + 1
    if cfg.tree == "static":
        rows, width = 1, 1
        for b in cfg.tree_shape:
            width *= b
            rows += width
        return rows
    return cfg.draft_len + 1


def tree_speedup(tau: float, draft_passes: float, draft_cost: float, verify_cost: float) -> float:
    """Predicted speedup over our autoregressive path: tau / (draft_passes * draft_cost + verify_cost), costs in
    autoregressive steps per round."""
    cost = draft_passes * draft_cost + verify_cost
    return tau / cost if cost > 0 else 0.0


def choose(table: Sequence[dict], tie: float = TIE) -> int:
    """The index of the row with the best `predicted`; rows within `tie` (a share) of the best count as tied, and the
    one with the fewest `rows` (then the earlier) wins."""
    check(len(table) > 0, "choose: no candidates")
    best = max(r["predicted"] for r in table)
    tied = [i for i, r in enumerate(table) if r["predicted"] >= best * (1 - tie)]
    return min(tied, key=lambda i: (table[i]["rows"], i))


CostFn = Callable[[DecodeConfig, int], "tuple[float, float]"]


def calibrate_tree(model, head, prompt_ids: list[list[int]], decode: DecodeConfig, tree_nodes: Sequence[int] = (4, 8, 16),
                   static: bool = False, max_new_tokens: int = 32, context: int | None = None, repeats: int = 5,
                   costs: CostFn | None = None, tie: float = TIE) -> TreeCalibration:
    """decode.tree=auto: choose between the chain and draft trees (tree_candidates) by predicted speedup over our
    autoregressive path, in autoregressive steps per round:

        speedup = tau / (draft_passes * c + v)

      tau           new tokens per verify step, from decoding `prompt_ids` (max_new_tokens each) with the candidate
      draft_passes  early-layer draft passes per round in those decodes (stats draft_steps / verify_steps)
      c             one draft pass on this hardware: the chain's StepTimer.draft_step (one token); a tree's timed draft
                    phase (StepTimer.tree_steps: the pass after the root and one per depth's frontier of up to
                    decode.tree_topk rows) divided by its passes
      v             the round's verify pass on this hardware: the chain's StepTimer.verify_step over K+1 rows, a
                    tree's verify.TreeDraft.verify over its rows with the tree mask (layer < E reuse included for heads
                    that allow it)

    Timings at the prompts' mean length (or `context`), each the median of `repeats` paired ratios. `costs(cfg, rows)
    -> (c, v)` replaces the timings (tests, or costs measured elsewhere). The best prediction wins; predictions within
    `tie` of it count as tied and the smallest tree among them wins (`choose`)."""
    check(head is not None, "decode.tree=auto: needs an exit head (head=... or head.path=DIR)")
    check(len(prompt_ids) > 0, "decode.tree=auto: no calibration prompts")
    check(isinstance(max_new_tokens, int) and max_new_tokens >= 1, f"auto.max_new_tokens={max_new_tokens!r}: must be an integer >= 1")
    candidates = tree_candidates(decode, tree_nodes, static)
    bb, decoder = model.backbone, Decoder(model.backbone, head)
    timer = ctx = None
    if costs is None:
        depth = max(cfg.tree_depth(head=True) for _, cfg in candidates)
        room = max(max(cfg.tree_slots() for _, cfg in candidates), depth)
        ctx = _context(model, prompt_ids, context, room)
        timer = StepTimer(bb, ctx, depth, repeats)
        E = head.exit_layer
        chain_c = timer.draft_cost(head, E)

    table = []
    for name, cfg in candidates:
        run = cfg.for_call(max_new_tokens)
        stats = DecodeStats.merge(decoder.decode(ids, run, model.eos_ids).stats for ids in prompt_ids)
        passes = stats.draft_steps / stats.verify_steps if stats.verify_steps else 0.0
        rows = head_rows(cfg)
        if costs is not None:
            c, v = costs(cfg, rows)
        elif cfg.uses_tree:
            draft, verify, timed_passes, rows = timer.tree_steps(head, cfg)
            c = timer.ratio(draft) / max(timed_passes, 1)
            v = timer.ratio(verify)
        else:
            c, v = chain_c, timer.ratio(timer.verify_step(cfg.draft_len, head.verify_reuse))
        table.append({"name": name, "tree": cfg.tree, "tree_nodes": cfg.tree_nodes if cfg.tree == "dynamic" else None,
                      "rows": rows, "tau": stats.tau, "draft_passes": passes, "draft_cost": c, "verify_cost": v,
                      "predicted": tree_speedup(stats.tau, passes, c, v)})
    best = table[choose(table, tie)]
    settings = {"tree": best["tree"]} | ({"tree_nodes": best["tree_nodes"]} if best["tree"] == "dynamic" else {})
    return TreeCalibration(name=best["name"], settings=settings, predicted_speedup=best["predicted"], context=ctx,
                           table=table)
