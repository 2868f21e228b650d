"""Draft and verify step costs for the analysed heads, timed with the engine's step timer
(selfspec.evaluation.costs.StepTimer), in autoregressive steps."""

from __future__ import annotations

import torch

from selfspec.decoding.config import DecodeConfig
from selfspec.decoding.engine import Decoder
from selfspec.evaluation.costs import StepTimer, median_seconds


def measure(backbone, heads: dict[str, object], draft_lens: list[int], context: int, repeats: int = 10,
            warmup: int = 3, verify: dict | None = None) -> tuple[dict, dict]:
    """-> ({label: c, (label, m): c_m for heads that propose m > 1 tokens per pass}, verify costs {"full" | E: {K: v}}). `verify` (from an earlier call) is extended, not
    re-measured: heads that reuse the early layers verify with reuse at their E, the others over the full stack."""
    ctx = max(1, min(context, backbone.max_positions - max(draft_lens) - 2))
    timer = StepTimer(backbone, ctx, max(draft_lens), repeats, warmup)
    verify = dict(verify or {})
    draft = {}
    for label, head in heads.items():
        draft[label] = timer.draft_cost(head, head.exit_layer)
        if head.max_ahead > 1:  # a pass that proposes max_ahead tokens (decode.tokens_per_pass)
            draft[(label, head.max_ahead)] = timer.ratio(timer.draft_step(head, head.exit_layer, head.max_ahead))
        key = verify_key(head)
        if key not in verify:
            E = head.verify_reuse
            verify[key] = {K: timer.ratio(timer.verify_step(K, E)) for K in draft_lens}
    return draft, verify


def prefill_fit(backbone, prompt_lens: list[int], repeats: int = 3, warmup: int = 1) -> tuple[float, float]:
    """A prompt's prefill in seconds as a*P + b*P^2 (matmuls grow with P, attention with P^2), least squares through
    timed prefills at the shortest, median and longest of `prompt_lens`: the engine's first autoregressive round
    (every prompt token through the stack, one new token), which both paths of a generation pay. -> (a, b)."""
    lens = sorted(prompt_lens)
    points = sorted({max(1, min(n, backbone.max_positions - 2)) for n in (lens[0], lens[len(lens) // 2], lens[-1])})
    decoder, cfg = Decoder(backbone, None), DecodeConfig(strategy="autoregressive", max_new_tokens=1)
    g = torch.Generator().manual_seed(0)
    rows, secs = [], []
    for n in points:
        ids = torch.randint(0, min(backbone.vocab_size, 256), (n,), generator=g).tolist()
        secs.append(median_seconds(lambda: decoder.decode(ids, cfg), backbone.device, repeats, warmup))
        rows.append([float(n), float(n) ** 2])
    A, y = torch.tensor(rows, dtype=torch.float64), torch.tensor(secs, dtype=torch.float64)[:, None]
    if len(points) < 2:  # one length: the linear term alone
        return secs[0] / points[0], 0.0
    a, b = torch.linalg.lstsq(A, y).solution[:, 0].tolist()
    return a, b


def ar_step_seconds(backbone, context: int, repeats: int = 10, warmup: int = 3) -> float:
    ctx = max(1, min(context, backbone.max_positions - 2))
    timer = StepTimer(backbone, ctx, 1, repeats, warmup)
    return timer.seconds(timer.ar_step())


def verify_key(head):
    return head.verify_reuse if head.verify_reuse is not None else "full"
