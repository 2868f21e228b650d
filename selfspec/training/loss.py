"""Self-distillation losses: pure tensor functions, no state.

The head learns the full model's next-token distribution p (its top-k, renormalised) at every response
position: soft cross-entropy H(p, q) = KL(p || q) + H(p), whose gradient is the KL's. An optional hard term
adds cross-entropy on the token that actually followed (the target's own greedy choice for greedy data).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch


def vocab_index(vocab_ids: torch.Tensor | None, vocab_size: int, device=None) -> torch.Tensor | None:
    """(V,) token id -> its index in the draft vocabulary, -1 outside it; None for the full vocabulary."""
    if vocab_ids is None or vocab_ids.numel() == 0:
        return None
    index = torch.full((vocab_size,), -1, dtype=torch.long, device=device)
    index[vocab_ids.to(device)] = torch.arange(vocab_ids.numel(), device=device)
    return index


def to_draft_vocab(ids: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """Token ids (any shape) -> draft-vocabulary indices, -1 where a token is outside it (dropped)."""
    return ids if index is None else index[ids]


def loss_counts(topk_ids: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    """(rows with target mass in the vocabulary, rows with a label in it): what distill_loss averages over; topk_ids
    and labels as distill_loss takes them (-1 = outside the head's vocabulary)."""
    return int((topk_ids >= 0).any(-1).sum()), int((labels >= 0).sum())


def distill_loss(
    logits: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    hard_weight: float = 0.0,
    counts: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """logits (N, V') of the head; topk_ids (N, k) target indices into V' (-1 = outside the head's vocabulary:
    that mass is dropped and the rest renormalised); topk_logprobs (N, k); labels (N,) indices into V' or -1.

    -> (loss, {"soft", "hard", "acc"}); loss = T^2 * H(p_T, q_T) + hard_weight * CE(q, label), where p_T and q_T
    are both distributions softened by T (Hinton et al.: the T^2 keeps gradient sizes comparable across T).

    counts: (soft rows, labelled rows) of a larger batch this call is part of (loss_counts of it): the means are
    taken over those counts instead of this call's own rows, so the parts' losses add up to the whole batch's
    (a data-parallel rank's share of a micro-batch).
    """
    logits = logits.float()
    keep = topk_ids >= 0  # (N, k)
    rows = keep.any(-1)  # (N,) positions with some target mass inside the vocabulary
    # One log-softmax over every row (no copies of the (N, V') logits: rows are picked from the small results).
    logq = (logits / temperature if temperature != 1 else logits).log_softmax(-1)  # (N, V')
    logq_t = logq.gather(-1, topk_ids.clamp(min=0))  # (N, k)
    p = (topk_logprobs.float() / temperature).masked_fill(~keep, float("-inf"))
    p = p.masked_fill(~rows[:, None], 0.0).softmax(-1)  # rows without mass: a placeholder, dropped below
    ce = -(p * logq_t).masked_fill(~keep, 0.0).sum(-1)[rows]  # (M,)
    valid = labels >= 0
    with torch.no_grad() if not hard_weight else nullcontext():  # at weight 0 the hard term is a statistic only
        logp = logq if temperature == 1 else logits.log_softmax(-1)
        nll = -logp.gather(-1, labels.clamp(min=0)[:, None])[:, 0][valid]  # (n_hard,)
    hits = (logits.detach().argmax(-1)[valid] == labels[valid]).float()
    if counts is None:  # this call's own means
        soft = ce.mean() * temperature**2 if ce.numel() else logits.sum() * 0.0
        hard, acc = (nll.mean(), hits.mean()) if valid.any() else (logits.sum() * 0.0,) * 2
    else:  # sums over this call's rows / the whole batch's counts
        n_soft, n_hard = max(counts[0], 1), max(counts[1], 1)
        soft = ce.sum() / n_soft * temperature**2 if ce.numel() else logits.sum() * 0.0
        hard = nll.sum() / n_hard if valid.any() else logits.sum() * 0.0
        acc = hits.sum() / n_hard
    loss = soft + hard_weight * hard if hard_weight else soft
    return loss, {"soft": soft.detach(), "hard": hard.detach(), "acc": acc.detach()}
