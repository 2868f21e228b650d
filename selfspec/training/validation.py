"""Validation is real self-speculative decoding: each head drafts, the full stack verifies, on held-out
prompts, against our own autoregressive path (the same engine with no drafts).

The autoregressive path and every head decode prompt by prompt, interleaved, with the order rotating from
one prompt to the next: on a shared machine the load drifts, and a baseline timed minutes apart from the
heads would turn that drift into a fake speedup (measured here: 2.0x for a head whose interleaved speedup
is below 1). Its outputs are also the reference for `lossless`.

With `reference` (HF `generate`, what `make train`'s final table compares against), that method joins the
rotation too: each head and the autoregressive path also get a speedup over it (`val/speedup_hf`), and
`lossless` is then checked against its output.
"""

from __future__ import annotations

from dataclasses import replace

from selfspec.decoding.engine import DecodeConfig, Decoder

AR = "autoregressive"
REF = "reference"


def validate(backbone, heads: dict, prompts: list[list[int]], cfg: DecodeConfig, eos_ids, reference=None) -> dict[str, dict]:
    """heads: name -> exit head; reference: an object with `generate(ids, max_new_tokens) -> (ids, stats)`
    (evaluation's HF generate method) or None. -> name -> val/* metrics (tau and rates pooled over all verify
    steps); with a reference, also an `autoregressive` entry with its tokens/s and speedup over the reference."""
    decoders = {AR: (Decoder(backbone, None), replace(cfg, strategy="autoregressive"))}
    decoders.update({n: (Decoder(backbone, h), replace(cfg, strategy="self_speculative")) for n, h in heads.items()})
    runs = {n: (lambda ids, c, d=d: d.generate(ids, c, eos_ids)) for n, (d, _) in decoders.items()}
    configs = {n: c for n, (_, c) in decoders.items()}
    if reference is not None:
        runs[REF] = lambda ids, c: reference.generate(list(ids), c.max_new_tokens)
        configs[REF] = cfg
    modes = {n: h.training for n, h in heads.items()}
    for h in heads.values():
        h.eval()
    totals = {n: dict(tokens=0, steps=0, drafted=0, accepted=0, seconds=0.0, same=0,
                      drafted_pos=[0] * cfg.draft_len, accepted_pos=[0] * cfg.draft_len) for n in runs}
    truth = REF if reference is not None else AR
    try:
        for name, run in runs.items():  # the first call pays for allocator growth: keep it out of the timings
            run(prompts[0], replace(configs[name], max_new_tokens=min(4, cfg.max_new_tokens)))
        names = list(runs)
        for i, ids in enumerate(prompts):
            outputs = {}
            for name in names[i % len(names):] + names[: i % len(names)]:
                outputs[name], s = runs[name](ids, configs[name])
                t = totals[name]
                t["tokens"] += s["new_tokens"]
                t["seconds"] += s["seconds"]
                if name == REF:
                    continue
                t["steps"] += s["verify_steps"]
                t["drafted"] += s["drafted"]
                t["accepted"] += s["accepted"]
                for k, (d, a) in enumerate(zip(s["drafted_per_position"], s["accepted_per_position"])):
                    t["drafted_pos"][k] += d
                    t["accepted_pos"][k] += a
            for name in [*heads, AR]:
                totals[name]["same"] += int(list(outputs[name]) == list(outputs[truth]))
    finally:
        for n, h in heads.items():
            h.train(modes[n])

    def tps(t):
        return t["tokens"] / t["seconds"] if t["seconds"] > 0 else 0.0

    base = tps(totals[AR])
    ref = tps(totals[REF]) if reference is not None else None
    out = {}
    for name in heads:
        t = totals[name]
        out[name] = {
            "val/tau": t["tokens"] / t["steps"] if t["steps"] else 0.0,
            "val/accept_rate": t["accepted"] / t["drafted"] if t["drafted"] else 0.0,
            "val/accept_rate_per_position": [a / d if d else None for a, d in zip(t["accepted_pos"], t["drafted_pos"])],
            "val/speedup": tps(t) / base if base > 0 else 0.0,
            "val/tokens_per_s": tps(t),
            "val/ar_tokens_per_s": base,
            # Greedy decoding must reproduce the autoregressive output exactly; under sampling the two paths
            # draw different random streams, so only the distribution is equal and this is not measured.
            "val/lossless": t["same"] / len(prompts) if cfg.greedy else None,
            "val/new_tokens": t["tokens"],
        }
        if ref:
            out[name]["val/speedup_hf"] = tps(t) / ref
    if ref:
        out[AR] = {"val/tokens_per_s": base, "val/speedup_hf": base / ref,
                   "val/lossless": totals[AR]["same"] / len(prompts) if cfg.greedy else None}
    return out
