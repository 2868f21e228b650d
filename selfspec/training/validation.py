"""Validation is real self-speculative decoding: the trained head drafts, the full stack verifies, on
held-out prompts, against our own autoregressive path (the same engine with no drafts).

The autoregressive baseline does not change while the head trains, so it is decoded once per run and
reused: its outputs are the reference for `lossless` and its tokens/s the denominator of `speedup`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from selfspec.decoding.engine import DecodeConfig, Decoder


@dataclass
class Baseline:
    outputs: list[list[int]]
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def _warm_up(decoder: Decoder, prompt: list[int], cfg: DecodeConfig, eos_ids) -> None:
    # The first call pays for allocator growth and kernel selection; keep it out of the timings.
    decoder.generate(prompt, replace(cfg, max_new_tokens=min(4, cfg.max_new_tokens)), eos_ids)


def autoregressive_baseline(backbone, prompts: list[list[int]], cfg: DecodeConfig, eos_ids) -> Baseline:
    cfg = replace(cfg, strategy="autoregressive")
    decoder = Decoder(backbone, None)
    _warm_up(decoder, prompts[0], cfg, eos_ids)
    outputs, tokens, seconds = [], 0, 0.0
    for ids in prompts:
        new, stats = decoder.generate(ids, cfg, eos_ids)
        outputs.append(new)
        tokens += stats["new_tokens"]
        seconds += stats["seconds"]
    return Baseline(outputs, tokens, seconds)


def validate(backbone, head, prompts: list[list[int]], cfg: DecodeConfig, eos_ids, baseline: Baseline) -> dict:
    """Decode every prompt with the head; -> val/* metrics (tau and rates pooled over all verify steps)."""
    cfg = replace(cfg, strategy="self_speculative")
    was_training = head.training
    head.eval()
    try:
        decoder = Decoder(backbone, head)
        _warm_up(decoder, prompts[0], cfg, eos_ids)
        tokens = steps = drafted = accepted = 0
        seconds = 0.0
        same = 0
        drafted_pos = [0] * cfg.draft_len
        accepted_pos = [0] * cfg.draft_len
        for ids, ref in zip(prompts, baseline.outputs):
            new, s = decoder.generate(ids, cfg, eos_ids)
            tokens += s["new_tokens"]
            steps += s["verify_steps"]
            drafted += s["drafted"]
            accepted += s["accepted"]
            seconds += s["seconds"]
            same += int(new == ref)
            for i, (d, a) in enumerate(zip(s["drafted_per_position"], s["accepted_per_position"])):
                drafted_pos[i] += d
                accepted_pos[i] += a
    finally:
        head.train(was_training)
    tps = tokens / seconds if seconds > 0 else 0.0
    return {
        "val/tau": tokens / steps if steps else 0.0,
        "val/accept_rate": accepted / drafted if drafted else 0.0,
        "val/accept_rate_per_position": [a / d if d else None for a, d in zip(accepted_pos, drafted_pos)],
        "val/speedup": tps / baseline.tokens_per_s if baseline.tokens_per_s > 0 else 0.0,
        "val/tokens_per_s": tps,
        "val/ar_tokens_per_s": baseline.tokens_per_s,
        # Greedy decoding must reproduce the autoregressive output exactly; under sampling the two paths
        # draw different random streams, so only the distribution is equal and this is not measured.
        "val/lossless": same / len(prompts) if cfg.greedy else None,
        "val/new_tokens": tokens,
    }
