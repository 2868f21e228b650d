"""From teacher-forced events to the numbers a head is chosen by. Pure functions, no model, no I/O.

Definitions (greedy; pooled over all answer positions of all sequences given):

  agreement       P(draft top-1 == the target's token), over every answer position.
  coverage[k]     P(the target's token is among the draft's top k).
  kl              mean KL(target || draft) in nats (a reduced draft vocabulary: see scoring.py).
  outside         mean target mass outside the draft vocabulary (0 without a reduced one).
  conf            mean top-1 probability of the draft (what decode.draft_threshold tests).
  conditional[j]  a_j = P(draft at t+j right | drafts at t .. t+j-1 right), j = 0..7 (draft positions 1..8),
                  over every start t with t+j inside the answer; a_0 = agreement. These are exactly the
                  engine's conditional acceptance rates at draft position j+1, if rounds started anywhere.
  tau[K]          1 + sum_{i=1..K} prod_{j<i} a_j: the expected new tokens per verify step of a round that
                  drafts K tokens (the target's own token counted), from the conditional rates. Nondecreasing
                  in K and <= K + 1.
  replay[K]       the engine's own greedy schedule with a fixed K (`replay`) run on the events: rounds start
                  only where the decode starts them (after a rejection or a bonus token) and drafts stop at
                  max_new_tokens. Its tau is what `python -m selfspec.eval` measures for the same head, K,
                  prompts and max_new_tokens; its per-position counts are the engine's, event for event.
  speedup[K]      tau[K] / (K c + v(K)), c = one draft pass, v(K) = one verify pass over K+1 rows, both in
                  autoregressive steps (Leviathan et al. 2023 with measured costs): the predicted speedup over
                  our autoregressive path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from selfspec.analysis.scoring import PositionScores


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def run_lengths(correct: torch.Tensor, cap: int) -> torch.Tensor:
    """r[t] = number of consecutive right drafts from t on (within `correct`), capped at `cap`."""
    r = torch.zeros(correct.numel() + 1, dtype=torch.long)
    c = correct.to(torch.long)
    for t in range(correct.numel() - 1, -1, -1):
        r[t] = (r[t + 1] + 1) * c[t]
    return r[:-1].clamp_max(cap)


def conditional_agreement(scores: Sequence[PositionScores], positions: int = 8) -> list[float | None]:
    """a_j, j = 0..positions-1, over answer positions only, pooled over sequences."""
    num = [0] * positions
    den = [0] * positions
    for s in scores:
        n = s.n_answer
        r = run_lengths(s.correct[:n], positions)
        for j in range(positions):
            valid = r[: max(0, n - j)]  # starts t with t + j inside the answer
            den[j] += int((valid >= j).sum())
            num[j] += int((valid >= j + 1).sum())
    return [_ratio(a, b) for a, b in zip(num, den)]


def expected_tau(conditional: Sequence[float | None], draft_len: int) -> float:
    """1 + sum_{i=1..K} prod_{j<i} a_j; a position never reached (None) counts as 0."""
    tau, prod = 1.0, 1.0
    for j in range(draft_len):
        a = conditional[j] if j < len(conditional) else None
        prod *= a or 0.0
        tau += prod
    return tau


def replay(correct: Sequence[bool], n_answer: int, max_new_tokens: int, draft_len: int,
           conf: Sequence[float] | None = None, threshold: float | None = None) -> dict:
    """The engine's greedy loop (decoding/engine.py) on teacher-forced events for one answer.

    Each round drafts k = min(K, max_new_tokens - n - 1) tokens from position n and accepts the longest right
    prefix, then the target's token: n += a + 1, until the answer is complete. With `threshold` (dynamic K)
    drafting also stops at the first draft whose top-1 probability is below it; accepted counts and tau stay
    exact, `drafted` then counts only drafts made while all earlier ones were right (a lower bound)."""
    K = draft_len
    n = rounds = 0
    drafted = [0] * K
    accepted = [0] * K
    m = len(correct)
    while n < n_answer:
        k = max(0, min(K, max_new_tokens - n - 1))
        a = made = 0
        while a < k:
            p = n + a
            if threshold and conf is not None and p < m and conf[p] < threshold:
                break
            made += 1
            if p >= m or not correct[p]:
                break
            a += 1
        if not threshold:
            made = k
        for i in range(made):
            drafted[i] += 1
        for i in range(a):
            accepted[i] += 1
        n += a + 1
        rounds += 1
    return {"new_tokens": n_answer, "verify_steps": rounds, "drafted_per_position": drafted,
            "accepted_per_position": accepted, "drafted": sum(drafted), "accepted": sum(accepted)}


def replay_all(scores: Sequence[PositionScores], max_new_tokens: int, draft_len: int,
               threshold: float | None = None) -> dict:
    """`replay` summed over sequences, with tau and accept rates."""
    tot = {"new_tokens": 0, "verify_steps": 0, "drafted": 0, "accepted": 0,
           "drafted_per_position": [0] * draft_len, "accepted_per_position": [0] * draft_len}
    for s in scores:
        r = replay(s.correct.tolist(), s.n_answer, max_new_tokens, draft_len, s.conf.tolist(), threshold)
        for key in ("new_tokens", "verify_steps", "drafted", "accepted"):
            tot[key] += r[key]
        for key in ("drafted_per_position", "accepted_per_position"):
            tot[key] = [a + b for a, b in zip(tot[key], r[key])]
    tot["tau"] = _ratio(tot["new_tokens"], tot["verify_steps"])
    tot["accept_rate"] = _ratio(tot["accepted"], tot["drafted"])
    return tot


def summarize(scores: Sequence[PositionScores], topk: Sequence[int], draft_lens: Sequence[int], max_new_tokens: int,
              threshold: float | None = None) -> dict:
    """Every number above for one head over `scores` (a set of sequences: all, or one category)."""
    k_max = max(draft_lens)
    n = sum(s.n_answer for s in scores)
    if n == 0:
        return {"tokens": 0}

    def mean(field: str) -> float:
        return float(sum(getattr(s, field)[: s.n_answer].double().sum() for s in scores)) / n

    covered = sum(s.covered[: s.n_answer].double().sum(0) for s in scores) / n
    cond = conditional_agreement(scores, k_max)
    out = {
        "tokens": n,
        "agreement": mean("correct"),
        "coverage": {int(k): float(c) for k, c in zip(topk, covered)},
        "kl": mean("kl"),
        "outside": mean("outside"),
        "conf": mean("conf"),
        "conditional": cond,
        "tau": {int(K): expected_tau(cond, K) for K in draft_lens},
        "replay": {},
    }
    for K in draft_lens:
        r = replay_all(scores, max_new_tokens, K)
        out["replay"][int(K)] = {k: r[k] for k in ("tau", "accept_rate", "verify_steps", "drafted", "accepted",
                                                   "accepted_per_position")}
    if threshold:
        r = replay_all(scores, max_new_tokens, k_max, threshold)
        out["replay_threshold"] = {"threshold": threshold, "draft_len": k_max, "tau": r["tau"],
                                   "accepted_per_position": r["accepted_per_position"]}
    return out


def speedups(summary: dict, draft_cost: float, verify_cost: dict[int, float]) -> dict:
    """Predicted speedup over our autoregressive path per K: from the expected tau (`speedup`) and from the
    replay, whose rounds near max_new_tokens draft fewer than K (`speedup_replay`:
    new tokens / (draft passes * c + verify steps * v(K)))."""
    out: dict = {"speedup": {}, "speedup_replay": {}}
    for K, tau in summary["tau"].items():
        v = verify_cost[K]
        out["speedup"][K] = tau / (K * draft_cost + v)
        r = summary["replay"][K]
        cost = r["drafted"] * draft_cost + r["verify_steps"] * v
        out["speedup_replay"][K] = summary["tokens"] / cost if cost else None
    best = max(out["speedup"], key=lambda k: out["speedup"][k])
    out["best"] = {"draft_len": best, "speedup": out["speedup"][best]}
    return out
