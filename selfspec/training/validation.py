"""Validation is real self-speculative decoding: each head drafts, the full stack verifies, on held-out
prompts, against our own autoregressive path (the same engine with no drafts).

The autoregressive path and every head decode prompt by prompt, interleaved, with the order rotating from
one prompt to the next (selfspec/utils/timing.py, the harness evaluation uses too): on a shared machine the load
drifts, and a baseline timed minutes apart from the heads would turn that drift into a fake speedup. Its
outputs are also the reference for `lossless`.

With `reference` (HF `generate`, what `make train`'s final table compares against), that method joins the
rotation too: each head and the autoregressive path also get a speedup over it (`val/speedup_hf`), and
`lossless` is then checked against its output.
"""

from __future__ import annotations

from dataclasses import replace

from selfspec.decoding.engine import DecodeConfig, Decoder
from selfspec.decoding.stats import pool_stats
from selfspec.utils.timing import run_interleaved

AR = "autoregressive"
REF = "reference"


def validate(backbone, heads: dict, prompts: list[list[int]], cfg: DecodeConfig, eos_ids, reference=None) -> dict[str, dict]:
    """heads: name -> exit head (None: no head, e.g. context lookup alone when cfg.lookup), or (head, DecodeConfig) for a
    head that decodes with its own settings (the model's shipped setting); reference: an object with `generate(ids, max_new_tokens) -> (ids, stats)`
    (`selfspec.model.hf_baselines.HFGenerate`, HF's generate) or None. -> name -> val/* metrics (tau and
    rates pooled over all verify steps); with a reference, also an `autoregressive` entry with its tokens/s
    and speedup over the reference."""
    decoders = {AR: (Decoder(backbone, None), replace(cfg, strategy="autoregressive"))}
    own = {n: h for n, h in heads.items() if isinstance(h, tuple)}  # (head, its own decode settings): a shipped setting
    heads = {n: (h[0] if isinstance(h, tuple) else h) for n, h in heads.items()}
    decoders.update({n: (Decoder(backbone, h), replace(own[n][1] if n in own else cfg, strategy="selfspec",
                                                       max_new_tokens=cfg.max_new_tokens)) for n, h in heads.items()})
    runs = {n: (lambda ids, c, d=d: d.generate(ids, c, eos_ids)) for n, (d, _) in decoders.items()}
    configs = {n: c for n, (_, c) in decoders.items()}
    if reference is not None:
        runs[REF] = lambda ids, c: reference.generate(list(ids), c.max_new_tokens)
        configs[REF] = cfg
    modes = {n: h.training for n, h in heads.items() if h is not None}
    for n in modes:
        heads[n].eval()
    truth = REF if reference is not None else AR
    try:
        per_prompt = run_interleaved(
            {name: (lambda ids, run=run, c=configs[name]: run(ids, c)) for name, run in runs.items()}, prompts,
            # the first call pays for allocator growth: keep it out of the timings
            warmup=lambda name: runs[name](prompts[0], replace(configs[name], max_new_tokens=min(4, cfg.max_new_tokens))),
        )
    finally:
        for n, mode in modes.items():
            heads[n].train(mode)
    pooled = {name: pool_stats([results[name][1] for results in per_prompt]) for name in runs}
    same = {name: sum(int(list(r[name][0]) == list(r[truth][0])) for r in per_prompt) for name in [*heads, AR]}

    base = pooled[AR]["tokens_per_s"]
    ref = pooled[REF]["tokens_per_s"] if reference is not None else None
    out = {}
    for name in heads:
        p = pooled[name]
        out[name] = {
            "val/tau": p["tau"],
            "val/accept_rate": p["accept_rate"] or 0.0,
            "val/accept_rate_per_position": p["accept_rate_per_position"],
            "val/speedup": p["tokens_per_s"] / base if base > 0 else 0.0,
            "val/tokens_per_s": p["tokens_per_s"],
            "val/ar_tokens_per_s": base,
            # Greedy decoding must reproduce the autoregressive output exactly; under sampling the two paths
            # draw different random streams, so only the distribution is equal and this is not measured.
            "val/lossless": same[name] / len(prompts) if cfg.greedy else None,
            "val/new_tokens": p["new_tokens"],
        }
        if ref:
            out[name]["val/speedup_hf"] = p["tokens_per_s"] / ref
    if ref:
        out[AR] = {"val/tokens_per_s": base, "val/speedup_hf": base / ref,
                   "val/lossless": same[AR] / len(prompts) if cfg.greedy else None}
    return out
