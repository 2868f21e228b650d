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

Lookup first (decode.lookup_mode=first, `lookup_first=true`): the engine's rounds replayed with context lookup's
chain where the history matches and the head's K drafts elsewhere (`replay_lookup_first`); its predicted speedup
counts the head's draft passes at c and every round's verify at v(k) for the k tokens it proposed.

Several tokens per pass (decode.tokens_per_pass=m, a medusa head's extra heads): draft j of a round that starts
at answer token t comes from head j mod m of the pass at t + j - (j mod m), so the events are per start,
`draft_events`; every number above is then taken over them (`per_pass=m`), and a round of K drafts costs
ceil(K/m) passes of c_m (one pass plus m heads).

A head whose later drafts read its own predicted features (head=context) also has per-start events: draft j of the
round at t is its (j+1)-th-in-a-round prediction of token t + j (`PositionScores.chained_correct`), so its numbers
are taken over `draft_events` as well.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from selfspec.analysis.scoring import PositionScores
from selfspec.decoding.lookup import NgramIndex


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def run_lengths(correct: torch.Tensor, cap: int) -> torch.Tensor:
    """r[t] = number of consecutive right drafts from t on (within `correct`), capped at `cap`."""
    r = torch.zeros(correct.numel() + 1, dtype=torch.long)
    c = correct.to(torch.long)
    for t in range(correct.numel() - 1, -1, -1):
        r[t] = (r[t + 1] + 1) * c[t]
    return r[:-1].clamp_max(cap)


def _per_draft(first: torch.Tensor, extra: torch.Tensor | None, per_pass: int, positions: int, fill) -> torch.Tensor:
    """(n, positions): for a round starting at position t, draft j's value; head 0's `first[t + j]`, or with
    per_pass = m > 1 extra head j mod m's `extra[t + j - (j mod m), j mod m - 1]` (its pass is at t + j - (j mod m));
    `fill` past the end."""
    n = first.numel()
    t = torch.arange(n)[:, None]
    j = torch.arange(positions)[None]
    head = (j % per_pass).expand(n, positions)
    inside = t + j < n
    out = torch.full((n, positions), fill, dtype=first.dtype)
    use = inside & (head == 0)
    out[use] = first[(t + j).clamp(max=n - 1)][use]
    if per_pass > 1:
        if extra is None or extra.shape[1] < per_pass - 1:
            raise ValueError(f"per_pass={per_pass}: the head proposes fewer tokens per pass")
        use = inside & (head > 0)
        out[use] = extra[(t + j - head).clamp(max=n - 1), (head - 1).clamp(min=0)][use]
    return out


def _chained(values: torch.Tensor, positions: int, fill) -> torch.Tensor:
    """(n, positions) from values (n, S): draft j of a round starting at t is values[t + j, min(j, S - 1)] (a
    round longer than the scored steps repeats the last one); `fill` past the end."""
    n, S = values.shape
    t = torch.arange(n)[:, None]
    j = torch.arange(positions)[None]
    inside = (t + j < n).expand(n, positions)
    out = torch.full((n, positions), fill, dtype=values.dtype)
    out[inside] = values[(t + j).clamp(max=n - 1), j.clamp(max=S - 1).expand(n, positions)][inside]
    return out


def per_start(s: PositionScores, per_pass: int) -> bool:
    """Whether the head's events depend on where its round started (extra heads, or chained predicted features)."""
    return per_pass > 1 or s.chained_correct is not None


def draft_events(s: PositionScores, per_pass: int, positions: int) -> torch.Tensor:
    """(n, positions) bool: draft j of a round starting at position t is right (False past the scores)."""
    if s.chained_correct is not None:
        return _chained(s.chained_correct, positions, False)
    return _per_draft(s.correct, s.ahead_correct, per_pass, positions, False)


def _event_conf(s: PositionScores, per_pass: int, positions: int) -> torch.Tensor:
    """(n, positions) the top-1 probability of the head that makes each draft of `draft_events`."""
    if s.chained_conf is not None:
        return _chained(s.chained_conf, positions, 1.0)
    return _per_draft(s.conf, s.ahead_conf, per_pass, positions, 1.0)


def conditional_agreement(scores: Sequence[PositionScores], positions: int = 8, per_pass: int = 1) -> list[float | None]:
    """a_j, j = 0..positions-1, over answer positions only, pooled over sequences."""
    num = [0] * positions
    den = [0] * positions
    for s in scores:
        n = s.n_answer
        if not per_start(s, per_pass):
            r = run_lengths(s.correct[:n], positions)
        else:  # runs over each start's own events
            r = draft_events(s, per_pass, positions)[:n].long().cumprod(-1).sum(-1)
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
           conf: Sequence[float] | None = None, threshold: float | None = None, per_pass: int = 1,
           events: torch.Tensor | None = None, event_conf: torch.Tensor | None = None,
           draft_continue: float | None = None) -> dict:
    """The engine's greedy loop (decoding/engine.py) on teacher-forced events for one answer.

    Each round drafts k = min(K, max_new_tokens - n - 1) tokens from position n and accepts the longest right
    prefix, then the target's token: n += a + 1, until the answer is complete. With `threshold` (dynamic K)
    drafting also stops at the first draft whose top-1 probability is below it; with `draft_continue` (joint-confidence
    K) it stops after the draft that takes the product of the round's top-1 probabilities below it. Accepted counts and
    tau stay exact; `drafted` then counts only drafts made while all earlier ones were right (a lower bound).
    per_pass = m > 1: draft a of the round at n is right when events[n, a] (draft_events), its probability
    event_conf[n, a]; `passes` counts ceil(drafts / m) per round."""
    K = draft_len
    n = rounds = passes = 0
    drafted = [0] * K
    accepted = [0] * K
    m = len(correct)

    def right(p: int, a: int) -> bool:
        if events is not None:
            return p < m and bool(events[n, a])
        return p < m and bool(correct[p])

    def confidence(p: int, a: int) -> float | None:
        if event_conf is not None:
            return float(event_conf[n, a]) if p < m else None
        return conf[p] if conf is not None and p < m else None

    gated = bool(threshold or draft_continue)
    while n < n_answer:
        k = max(0, min(K, max_new_tokens - n - 1))
        a = made = 0
        joint = 1.0
        while a < k:
            p = n + a
            c = confidence(p, a) if gated else None
            if threshold and c is not None and c < threshold:
                break
            made += 1
            if not right(p, a):
                break
            a += 1
            if draft_continue and c is not None:
                joint *= c
                if joint < draft_continue:
                    break
        if not gated:
            made = k
        for i in range(made):
            drafted[i] += 1
        for i in range(a):
            accepted[i] += 1
        passes += -(-made // per_pass)
        n += a + 1
        rounds += 1
    return {"new_tokens": n_answer, "verify_steps": rounds, "drafted_per_position": drafted,
            "accepted_per_position": accepted, "drafted": sum(drafted), "accepted": sum(accepted), "passes": passes}


def replay_all(scores: Sequence[PositionScores], max_new_tokens: int, draft_len: int,
               threshold: float | None = None, per_pass: int = 1, draft_continue: float | None = None) -> dict:
    """`replay` summed over sequences, with tau and accept rates."""
    tot = {"new_tokens": 0, "verify_steps": 0, "drafted": 0, "accepted": 0, "passes": 0,
           "drafted_per_position": [0] * draft_len, "accepted_per_position": [0] * draft_len}
    for s in scores:
        events = event_conf = None
        if per_start(s, per_pass):
            events = draft_events(s, per_pass, draft_len)
            event_conf = _event_conf(s, per_pass, draft_len) if threshold or draft_continue else None
        r = replay(s.correct.tolist(), s.n_answer, max_new_tokens, draft_len, s.conf.tolist(), threshold, per_pass,
                   events, event_conf, draft_continue)
        for key in ("new_tokens", "verify_steps", "drafted", "accepted", "passes"):
            tot[key] += r[key]
        for key in ("drafted_per_position", "accepted_per_position"):
            tot[key] = [a + b for a, b in zip(tot[key], r[key])]
    tot["tau"] = _ratio(tot["new_tokens"], tot["verify_steps"])
    tot["accept_rate"] = _ratio(tot["accepted"], tot["drafted"])
    return tot


def summarize(scores: Sequence[PositionScores], topk: Sequence[int], draft_lens: Sequence[int], max_new_tokens: int,
              threshold: float | None = None, per_pass: int = 1, draft_continue: float | None = None) -> dict:
    """Every number above for one head over `scores` (a set of sequences: all, or one category); per_pass = m > 1:
    the rounds of decode.tokens_per_pass=m, plus each extra head's own agreement (`ahead_agreement`, offsets 2..m)."""
    k_max = max(draft_lens)
    n = sum(s.n_answer for s in scores)
    if n == 0:
        return {"tokens": 0}

    def mean(field: str) -> float:
        return float(sum(getattr(s, field)[: s.n_answer].double().sum() for s in scores)) / n

    covered = sum(s.covered[: s.n_answer].double().sum(0) for s in scores) / n
    cond = conditional_agreement(scores, k_max, per_pass)
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
    if per_pass > 1:
        out["tokens_per_pass"] = per_pass
        out["ahead_agreement"] = [
            float(sum(s.ahead_correct[: max(0, s.n_answer - i), i - 1].double().sum() for s in scores))
            / max(1, sum(max(0, s.n_answer - i) for s in scores)) for i in range(1, per_pass)]
    for K in draft_lens:
        r = replay_all(scores, max_new_tokens, K, per_pass=per_pass)
        out["replay"][int(K)] = {k: r[k] for k in ("tau", "accept_rate", "verify_steps", "drafted", "accepted",
                                                   "passes", "accepted_per_position")}
    if threshold:
        r = replay_all(scores, max_new_tokens, k_max, threshold, per_pass)
        out["replay_threshold"] = {"threshold": threshold, "draft_len": k_max, "tau": r["tau"],
                                   "accepted_per_position": r["accepted_per_position"]}
    if draft_continue:
        by_k = {}
        for K in draft_lens:
            r = replay_all(scores, max_new_tokens, K, per_pass=per_pass, draft_continue=draft_continue)
            by_k[int(K)] = {"tau": r["tau"], "drafted": r["drafted"], "verify_steps": r["verify_steps"]}
        out["replay_continue"] = {"threshold": draft_continue, "by_k": by_k}
    return out


def replay_lookup_first(correct: Sequence[bool], prompt_ids: list[int], target_ids: list[int], n_answer: int,
                        max_new_tokens: int, draft_len: int, lookup: dict) -> dict:
    """The engine's greedy rounds under decode.lookup_mode=first (proposers/lookups.py: LookupFirst) on one answer.

    A round at n asks context lookup (decoding/lookup.py over the prompt and the answer so far, `lookup`'s len,
    min_ngram, max_ngram) for a chain of up to min(len, room) tokens; with one, it accepts the longest prefix equal to
    the target's tokens (no draft pass); without one, it drafts k = min(K, room) head tokens, right where `correct`
    says (teacher-forced, as `replay`). Then the target's token: n += a + 1. -> rounds and accepted tokens of each
    kind, head draft passes, and verify_rows {k: rounds that verified k proposed tokens}."""
    index = NgramIndex(prompt_ids, lookup["min_ngram"], lookup["max_ngram"])
    n = passes = 0
    rounds, accepted, drafted = Counter(), Counter(), Counter()
    verify_rows: Counter = Counter()
    m = len(correct)
    while n < n_answer:
        room = max(0, max_new_tokens - n - 1)
        chain = next(iter(index.propose_many(min(lookup["len"], room), 1)), []) if room > 0 else []
        kind, k, a = ("lookup", len(chain), 0) if chain else ("head", min(draft_len, room), 0)
        if chain:
            while a < k and n + a < len(target_ids) and chain[a] == target_ids[n + a]:
                a += 1
        else:
            while a < k and n + a < m and correct[n + a]:
                a += 1
            passes += k
        rounds[kind] += 1
        drafted[kind] += k
        accepted[kind] += a
        verify_rows[k] += 1
        index.extend(target_ids[n : n + a + 1])
        n += a + 1
    return {"new_tokens": n_answer, "rounds": dict(rounds), "drafted": dict(drafted), "accepted": dict(accepted),
            "passes": passes, "verify_rows": dict(verify_rows)}


def lookup_first_summary(scores: Sequence[PositionScores], seqs, max_new_tokens: int, draft_lens: Sequence[int],
                         lookup: dict) -> dict:
    """`replay_lookup_first` summed over sequences (seqs[i]: the prompt and target ids of scores[i]), per K."""
    out = {}
    for K in draft_lens:
        tot = {"new_tokens": 0, "passes": 0, "rounds": Counter(), "drafted": Counter(), "accepted": Counter(),
               "verify_rows": Counter()}
        for s, seq in zip(scores, seqs):
            r = replay_lookup_first(s.correct.tolist(), seq.prompt_ids, seq.answer_ids + seq.overhang_ids, s.n_answer,
                                    max_new_tokens, K, lookup)
            tot["new_tokens"] += r["new_tokens"]
            tot["passes"] += r["passes"]
            for key in ("rounds", "drafted", "accepted", "verify_rows"):
                tot[key].update(r[key])
        rounds = sum(tot["rounds"].values())
        out[int(K)] = {"tokens": tot["new_tokens"], "passes": tot["passes"], "verify_steps": rounds,
                       "tau": _ratio(tot["new_tokens"], rounds), "lookup_rounds": _ratio(tot["rounds"]["lookup"], rounds),
                       "lookup_accept_rate": _ratio(tot["accepted"]["lookup"], tot["drafted"]["lookup"]),
                       "head_accept_rate": _ratio(tot["accepted"]["head"], tot["drafted"]["head"]),
                       "verify_rows": {int(k): c for k, c in sorted(tot["verify_rows"].items())}}
    return out


def lookup_first_speedups(summary: dict, draft_cost: float, verify_cost: dict[int, float]) -> dict[int, float | None]:
    """Predicted speedup of lookup-first rounds per K: new tokens / (head draft passes * c + sum over rounds of
    v(k)), v(k) the verify of k proposed tokens (v(0) = 1, an autoregressive step)."""
    out = {}
    for K, r in summary.items():
        cost = r["passes"] * draft_cost + sum(c * (verify_cost[k] if k else 1.0) for k, c in r["verify_rows"].items())
        out[K] = r["tokens"] / cost if cost else None
    return out


def end_to_end(predicted: dict, tokens: int, prefill_s: float, ar_step_s: float) -> dict[int, float | None]:
    """Predicted speedup of whole generations, what `selfspec.eval` measures: both paths pay the prompts' prefill
    (`prefill_s`, summed over the sequences) beside decoding `tokens` new tokens. Per K, from the replayed speedup:
    (prefill + tokens t) / (prefill + tokens t / S_replay(K)), t one autoregressive step."""
    out = {}
    for K, s in predicted["speedup_replay"].items():
        out[K] = (prefill_s + tokens * ar_step_s) / (prefill_s + tokens * ar_step_s / s) if s else None
    return out


def speedups(summary: dict, draft_cost: float, verify_cost: dict[int, float]) -> dict:
    """Predicted speedup over our autoregressive path per K: from the expected tau (`speedup`) and from the
    replay, whose rounds near max_new_tokens draft fewer than K (`speedup_replay`:
    new tokens / (draft passes * c + verify steps * v(K))). With summary["tokens_per_pass"] = m, a round of K drafts
    makes ceil(K/m) passes and `draft_cost` is one such pass."""
    m = summary.get("tokens_per_pass", 1)
    out: dict = {"speedup": {}, "speedup_replay": {}}
    for K, tau in summary["tau"].items():
        v = verify_cost[K]
        out["speedup"][K] = tau / (-(-K // m) * draft_cost + v)
        r = summary["replay"][K]
        cost = r["passes"] * draft_cost + r["verify_steps"] * v
        out["speedup_replay"][K] = summary["tokens"] / cost if cost else None
    best = max(out["speedup"], key=lambda k: out["speedup"][k])
    out["best"] = {"draft_len": best, "speedup": out["speedup"][best]}
    return out
