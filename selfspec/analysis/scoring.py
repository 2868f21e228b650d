"""Teacher-forced scoring: every head's draft at every answer position, in one pass over each sequence.

For a sequence prompt + answer (+ overhang, see answers.py) of T tokens with a P-token prompt, the draft for
answer token t (at position P + t) is made from the layer-E hidden state at position P + t - 1, exactly as the
engine drafts it once the tokens before it are committed. One forward of the full stack gives the layer-E
states of every exit layer on the way (heads that reuse the early layers) and the target's logits; a head that
changes the early layers (LoRA) runs its own pass of layers [0, E) inside its `drafting()` context. A head with
per-generation state (the adapter attends over all earlier positions) gets a fresh state and is fed the
sequence in position order, as in decoding.

A head that reads the verified context (head=context) drafts a round's first token from the verified full-depth
state of the position before, and its later drafts from its own predicted features. Its events are per draft
position within a round (`chained_correct`): training-time test's step j at row t (heads/context.py: train_steps)
is exactly the j-th draft of a round that starts at row t-j+1 when the drafts before it were right, and the
teacher-forced text is what the drafts were when right.

Greedy drafting chains drafts: the draft at t + j is made from the head's own drafts t .. t + j - 1, which are
the answer's tokens exactly when they were right. So the teacher-forced event "draft at t is right" is the
engine's acceptance event at t whenever the drafts before it in the round were accepted: the events below are
what a greedy decode would see, position for position (metrics.replay).

KL(target || draft) with a reduced draft vocabulary: the draft puts no mass outside it, so KL would be infinite
wherever the target does. The draft is smoothed instead: mass OFF_VOCAB_MASS spread evenly over the tokens
outside its vocabulary (its own distribution scaled by 1 - OFF_VOCAB_MASS), and the target's mass outside the
draft vocabulary is reported on its own (`outside`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from selfspec.decoding.drafters import PrecisionView

OFF_VOCAB_MASS = 1e-6


@dataclass
class PositionScores:
    """One head on one sequence; arrays over the answer's positions followed by the overhang's."""

    n_answer: int               # positions 0..n_answer-1 are the answer, the rest overhang
    correct: torch.Tensor       # (n,) bool: draft top-1 == the answer token (the greedy acceptance event)
    covered: torch.Tensor       # (n, len(topk)) bool: the answer token among the draft's top-k
    kl: torch.Tensor            # (n,) float: KL(target || draft) in nats
    conf: torch.Tensor          # (n,) float: the draft's top-1 probability (what decode.draft_threshold tests)
    outside: torch.Tensor       # (n,) float: the target's mass outside the draft vocabulary (0 without one)
    # Heads that propose several tokens per pass (medusa's extra heads, decode.tokens_per_pass): column i-1 is
    # extra head i from the row that drafts answer token t, against token t+i (False past the sequence's end).
    ahead_correct: torch.Tensor | None = None  # (n, M-1) bool
    ahead_conf: torch.Tensor | None = None     # (n, M-1) float: those heads' top-1 probabilities
    # Heads whose later drafts in a round read their own predicted features (head=context): column j is the draft
    # of answer token t made as the (j+1)-th of its round (j predicted features on the way); column 0 == correct.
    chained_correct: torch.Tensor | None = None  # (n, S) bool
    chained_conf: torch.Tensor | None = None     # (n, S) float


def _head_rows(head, bb, h: torch.Tensor, first: int, chunk: int):
    """Yield (start, draft logits (1, R, V')) for rows first..T-1 of h (1, T, H), in chunks of `chunk` rows.
    A head with per-generation state is first fed rows 0..first-1 (their logits are not needed)."""
    T = h.shape[1]
    state = head.new_state(bb, T)
    if state is not None:
        for s in range(0, first, chunk):
            e = min(first, s + chunk)
            head(h[:, s:e], bb, state, pos0=s, last_only=True)
    for s in range(first, T, chunk):
        e = min(T, s + chunk)
        yield s, head(h[:, s:e], bb, state, pos0=s)


def _chunk_scores(logits_p: torch.Tensor, logits_q: torch.Tensor, y: torch.Tensor, vocab_ids: torch.Tensor | None,
                  topk: list[int]) -> tuple:
    """logits_p (R, V) target, logits_q (R, V') draft, y (R,) answer tokens -> per-row scores."""
    V = logits_p.shape[-1]
    logp = logits_p.float().log_softmax(-1)
    logq = logits_q.float().log_softmax(-1)
    to_ids = (lambda i: vocab_ids[i]) if vocab_ids is not None else (lambda i: i)
    correct = to_ids(logits_q.argmax(-1)) == y  # argmax on the raw logits, as the engine drafts
    top = to_ids(logq.topk(min(max(topk), logq.shape[-1]), dim=-1).indices)  # (R, kmax)
    hits = top == y[:, None]
    covered = torch.stack([correct | hits[:, :k].any(-1) for k in topk], -1)
    conf = logq.max(-1).values.exp()
    p = logp.exp()
    if vocab_ids is None:
        logq_full = logq
        outside = torch.zeros_like(conf)
    else:
        off = V - vocab_ids.numel()
        eps = OFF_VOCAB_MASS if off > 0 else 0.0
        logq_full = torch.full_like(logp, math.log(eps / off) if off > 0 else 0.0)
        logq_full[:, vocab_ids] = logq + math.log1p(-eps)
        outside = (1.0 - p[:, vocab_ids].sum(-1)).clamp_min(0.0)
    kl = (p * (logp - logq_full)).sum(-1).clamp_min(0.0)
    return correct, covered, kl, conf, outside


@torch.inference_mode()
def score_sequence(bb, heads: dict[str, object], prompt_ids: list[int], target_ids: list[int], n_answer: int,
                   topk: list[int], chunk: int = 128, steps: int = 8) -> tuple[dict[str, PositionScores], int]:
    """Score every head on one sequence. target_ids = answer + overhang; `steps`: the draft positions a round of
    a context-reading head is scored at (the longest K of interest). -> ({label: scores}, number of answer
    positions where the teacher-forced target's argmax differs from the answer token: float rounding between
    the one-pass forward and the engine's step-by-step decode, normally 0)."""
    P, n = len(prompt_ids), len(target_ids)
    T = P + n - 1  # the last target token is never an input
    x = torch.tensor((prompt_ids + target_ids)[:T], dtype=torch.long, device=bb.device)[None]
    y = torch.tensor(target_ids, dtype=torch.long, device=bb.device)
    L = bb.num_layers

    # One pass of the full stack, keeping the layer-E states of every exit layer the reusing heads need and the
    # states at every depth a context head reads (head.context_depths; the last is L).
    need = {hd.exit_layer for hd in heads.values() if hd.reuses_early_layers and hd.draft_precision == "full"}
    need |= {d for hd in heads.values() for d in hd.context_depths if d < L}
    f_all, captured = bb.run_capturing(bb.embed(x), 0, L, sorted(need))  # (1, T, H) full-depth states, final norm not applied
    states = {**dict(zip(sorted(need), captured)), L: f_all}
    h_final = bb.norm(f_all[:, P - 1:])  # (1, n, H): the rows that predict target_ids
    logits_p = [bb.logits(h_final[:, s:s + chunk])[0] for s in range(0, n, chunk)]
    mismatch = int(sum(int((lp.argmax(-1) != y[s:s + chunk])[: max(0, n_answer - s)].sum())
                       for s, lp in zip(range(0, n, chunk), logits_p)))

    out: dict[str, PositionScores] = {}
    quant_states: dict[tuple[str, int], torch.Tensor] = {}
    for label, head in heads.items():
        E = head.exit_layer
        quant = head.draft_copies(bb)
        dbb = bb if quant is None else PrecisionView(bb, quant)  # the LM head in the draft's precision
        if quant is not None and head.reuses_early_layers:
            # the low-precision layers over the whole sequence in one pass: their own K/V for every position,
            # where a decode's draft attends over the target's full-precision K/V of verified positions (so this
            # slightly understates decode agreement)
            key = (id(quant), E)  # a trained low-bit draft has copies of its own (heads/lowbit.py)
            if key not in quant_states:
                quant_states[key] = bb.run_layers(bb.embed(x), 0, E, quant=quant)
            hE = quant_states[key]
        elif head.reuses_early_layers:
            hE = states[E]
        else:  # its own early layers (LoRA on), as it drafts
            with head.drafting():
                hE = bb.run_layers(bb.embed(x), 0, E, quant=quant)
        vocab_ids = head.vocab_ids.to(bb.device) if head.has_draft_vocab else None
        if head.reads_context:
            f_ctx = torch.cat([states[d] for d in head.context_depths], dim=-1)
            out[label] = _context_scores(head, dbb, hE, f_ctx, P, n_answer, logits_p, y, vocab_ids, topk, chunk, steps)
            continue
        parts = []
        for s, logits_q in _head_rows(head, dbb, hE, P - 1, chunk):
            r = s - (P - 1)
            parts.append(_chunk_scores(logits_p[r // chunk], logits_q[0], y[r:r + logits_q.shape[1]], vocab_ids, topk))
        correct, covered, kl, conf, outside = (torch.cat(t).cpu() for t in zip(*parts))
        out[label] = PositionScores(n_answer, correct, covered, kl, conf, outside,
                                    *_ahead_scores(head, dbb, hE[:, P - 1:], y, vocab_ids, chunk))
    return out, mismatch


def _context_scores(head, bb, hE, f_all, P: int, n_answer: int, logits_p: list, y, vocab_ids, topk, chunk: int,
                    steps: int) -> PositionScores:
    """A context-reading head on one sequence: training-time test's steps 1..steps over the whole sequence (hE the
    layer-E states (1, T, H), f_all the states at the head's context depths side by side (1, T, k*H)); step j's rows
    P-1.. are the answer tokens' j-th drafts of a round. The first-draft scores (correct, covered, kl, ...) are step
    1's."""
    n = y.numel()
    correct, conf, first = [], [], None
    for j, x in enumerate(head.train_steps(hE, f_all, bb, steps=steps)):
        parts = []
        for s in range(0, n, chunk):
            logits_q = bb.logits(bb.norm(x[:, P - 1 + s: P - 1 + s + chunk]), head.lm_weight(bb))
            parts.append(_chunk_scores(logits_p[s // chunk], logits_q[0], y[s:s + chunk], vocab_ids, topk))
        fields = [torch.cat(t).cpu() for t in zip(*parts)]
        first = first or fields
        correct.append(fields[0])
        conf.append(fields[3])
    return PositionScores(n_answer, *first, chained_correct=torch.stack(correct, -1), chained_conf=torch.stack(conf, -1))


def _ahead_scores(head, bb, h: torch.Tensor, y: torch.Tensor, vocab_ids, chunk: int):
    """Extra heads (max_ahead > 1): h (1, n, H) the rows that draft y[0..n) -> ((n, M-1) right, (n, M-1) top-1 prob),
    extra head i from row t scored against y[t+i]; (None, None) for a head without extra heads."""
    M, n = head.max_ahead, y.numel()
    if M == 1:
        return None, None
    right = torch.zeros(n, M - 1, dtype=torch.bool)
    conf = torch.zeros(n, M - 1)
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        for i, logits in enumerate(head.extra_logits(h[:, s:e], bb), start=1):
            logq = logits[0].float().log_softmax(-1)
            top = logq.argmax(-1)
            ids = vocab_ids[top] if vocab_ids is not None else top
            rows = torch.arange(s, e, device=ids.device)
            ok = rows + i < n
            right[s:e, i - 1] = (ok & (ids == y[(rows + i).clamp(max=n - 1)])).cpu()
            conf[s:e, i - 1] = logq.max(-1).values.exp().cpu()
    return right, conf
