"""Pure tensor functions: logits processing and the speculative accept/reject rules.

Exactness (Leviathan et al. 2023, Chen et al. 2023): with p the target's processed distribution and q the
draft's, accepting draft x with probability min(1, p(x)/q(x)) and otherwise sampling from
norm(max(0, p - q)) yields samples from p exactly, whatever q is. Temperature, top-k and top-p are applied
to both p and q the same way *before* the test.
"""

from __future__ import annotations

import torch


def process_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """(..., V) logits -> (..., V) probabilities after temperature, top-k, then top-p (HF's order)."""
    logits = logits.float() / temperature
    V = logits.shape[-1]
    if top_k and top_k < V:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        # Keep the smallest set of tokens whose mass reaches top_p (the top token always stays).
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p  # mass before this token already >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def greedy_accept(drafts: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """drafts (k,), target_logits (k+1, V) -> (accepted count a, next token: target's argmax at row a), both 0-d
    tensors on the logits' device: nothing is read back to the host (the engine reads a round's result once).

    Accept the longest prefix where draft == target argmax, then append the target's own token at the
    first mismatch (or the bonus token after all k)."""
    targets = target_logits.argmax(-1)  # (k+1,)
    k = drafts.shape[0]
    match = (drafts.to(targets.device) == targets[:k]).long()
    a = match.cumprod(0).sum()  # 0-d; 0 when k == 0
    return a, targets.gather(0, a.reshape(1))[0]  # gather, not targets[a]: a 0-d tensor index is read back


def speculative_accept(
    drafts: torch.Tensor,  # (k,) draft tokens
    q: torch.Tensor,  # (k, V) draft probabilities the drafts were sampled from
    p: torch.Tensor,  # (k+1, V) target probabilities at the same positions (+ the bonus position)
    generator: torch.Generator | None = None,
) -> tuple[int, torch.Tensor]:
    """Speculative sampling: -> (accepted count a, next token sampled from the residual or the bonus row)."""
    k = drafts.shape[0]
    if k:
        idx = torch.arange(k, device=p.device)
        p_x = p[idx, drafts]
        q_x = q[idx, drafts]
        u = torch.rand(k, device=p.device, generator=generator)
        # accept iff u < p/q  <=>  u * q < p   (q_x > 0: the draft sampled x from q)
        accept = (u * q_x < p_x).int()
        a = int(accept.cumprod(0).sum())
    else:
        a = 0
    if a < k:
        residual = (p[a] - q[a]).clamp_min(0)
        total = residual.sum()
        # total == 0 only when p == q at that row, where a rejection has probability 0; guard for rounding.
        dist = residual / total if total > 0 else p[a]
    else:
        dist = p[k]
    token = torch.multinomial(dist, 1, generator=generator)[0]
    return a, token


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """(V,) probabilities -> () token."""
    return torch.multinomial(probs, 1, generator=generator)[0]
