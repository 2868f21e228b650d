"""Draft and verify step costs for the analysed heads, timed with the engine's step timer
(selfspec.evaluation.costs.StepTimer), in autoregressive steps."""

from __future__ import annotations

from selfspec.evaluation.costs import StepTimer


def measure(backbone, heads: dict[str, object], draft_lens: list[int], context: int, repeats: int = 10,
            warmup: int = 3, verify: dict | None = None) -> tuple[dict, dict]:
    """-> ({label: c, (label, m): c_m for heads that propose m > 1 tokens per pass}, verify costs {"full" | E: {K: v}}). `verify` (from an earlier call) is extended, not
    re-measured: heads that reuse the early layers verify with reuse at their E, the others over the full stack."""
    ctx = max(1, min(context, backbone.max_positions - max(draft_lens) - 2))
    timer = StepTimer(backbone, ctx, max(draft_lens), repeats, warmup)
    verify = dict(verify or {})
    draft = {}
    for label, head in heads.items():
        draft[label] = timer.ratio(timer.draft_step(head, head.exit_layer))
        if head.max_ahead > 1:  # a pass that proposes max_ahead tokens (decode.tokens_per_pass)
            draft[(label, head.max_ahead)] = timer.ratio(timer.draft_step(head, head.exit_layer, head.max_ahead))
        key = verify_key(head)
        if key not in verify:
            E = head.verify_reuse
            verify[key] = {K: timer.ratio(timer.verify_step(K, E)) for K in draft_lens}
    return draft, verify


def ar_step_seconds(backbone, context: int, repeats: int = 10, warmup: int = 3) -> float:
    ctx = max(1, min(context, backbone.max_positions - 2))
    timer = StepTimer(backbone, ctx, 1, repeats, warmup)
    return timer.seconds(timer.ar_step())


def verify_key(head):
    return head.verify_reuse if head.verify_reuse is not None else "full"
