"""Score a list of heads on cached answers: build or load each head, score it teacher-forced, time it, summarise.
Returns a plain dict (what analysis.json holds); no files are written here."""

from __future__ import annotations

import logging
from collections import defaultdict

from selfspec.analysis import costs as step_costs
from selfspec.analysis.config import AnalysisConfig
from selfspec.analysis.heads import HeadEntry, build, split_lora
from selfspec.analysis.metrics import end_to_end, lookup_first_speedups, lookup_first_summary, speedups, summarize
from selfspec.analysis.scoring import PositionScores, score_sequence

log = logging.getLogger(__name__)


def score_heads(backbone, heads: dict[str, object], seqs, topk: list[int], chunk: int = 128, steps: int = 8
                ) -> tuple[dict[str, list[PositionScores]], int]:
    """-> ({label: scores per sequence, in the order of seqs}, target argmax mismatches). `steps`: the draft
    positions a context-reading head's rounds are scored at."""
    out: dict[str, list[PositionScores]] = {label: [] for label in heads}
    mismatch = 0
    for seq in seqs:
        per, m = score_sequence(backbone, heads, seq.prompt_ids, seq.answer_ids + seq.overhang_ids,
                                len(seq.answer_ids), topk, chunk, steps)
        mismatch += m
        for label, s in per.items():
            out[label].append(s)
    return out, mismatch


def _head_info(spec: HeadEntry, head) -> dict:
    return {"type": head.config.type, "exit_layer": head.exit_layer, "source": spec.path or "untrained",
            "precision": head.draft_precision, "params": head.num_params(), "draft_vocab": int(head.vocab_ids.numel()) if head.has_draft_vocab else None}


def _add_end_to_end(info: dict, seqs, cats: dict, prefill: tuple[float, float], ar_s: float) -> None:
    """info["predicted"]["end_to_end"] (and per category): the predicted speedup with the prompts' prefill counted,
    as `selfspec.eval` times whole generations (metrics.end_to_end; prefill a*P + b*P^2, costs.prefill_fit)."""
    def prefill_s(idx):
        return sum(prefill[0] * len(seqs[i].prompt_ids) + prefill[1] * len(seqs[i].prompt_ids) ** 2 for i in idx)

    info["predicted"]["end_to_end"] = end_to_end(info["predicted"], info["overall"]["tokens"],
                                                 prefill_s(range(len(seqs))), ar_s)
    for c, idx in cats.items():
        p = info["predicted_per_category"][c]
        p["end_to_end"] = end_to_end(p, info["per_category"][c]["tokens"], prefill_s(idx), ar_s)


def _add_lookup_first(info: dict, sc, seqs, cats: dict, cfg: AnalysisConfig, prefill: tuple | None, ar_s) -> None:
    """info["lookup_first"]: the head's rounds under decode.lookup_mode=first, replayed (overall and per category),
    with predicted decode and end-to-end speedups when the steps were timed."""
    def part(idx) -> dict:
        out = {"replay": lookup_first_summary([sc[i] for i in idx], [seqs[i] for i in idx], cfg.max_new_tokens,
                                              cfg.draft_lens, cfg.lookup)}
        if cfg.costs:
            out["speedup"] = lookup_first_speedups(out["replay"], info["draft_cost"], info["verify_cost"])
            pre = sum(prefill[0] * len(seqs[i].prompt_ids) + prefill[1] * len(seqs[i].prompt_ids) ** 2 for i in idx)
            tokens = sum(sc[i].n_answer for i in idx)
            out["end_to_end"] = end_to_end({"speedup_replay": out["speedup"]}, tokens, pre, ar_s)
        return out

    info["lookup_first"] = {"settings": cfg.lookup, **part(range(len(seqs))),
                            "per_category": {c: part(idx) for c, idx in cats.items()}}


def analyze_heads(model, seqs, specs: list[HeadEntry], cfg: AnalysisConfig) -> dict:
    """Every head in `specs` on the answers `seqs` (answers.AnswerSeq). LoRA heads last (see heads.split_lora)."""
    bb = model.backbone
    plain, lora = split_lora(specs)
    cats = defaultdict(list)
    for i, s in enumerate(seqs):
        cats[s.category].append(i)
    context = cfg.timing.context or max(1, round(sum(len(s.prompt_ids) + len(s.answer_ids) / 2 for s in seqs) / len(seqs)))
    heads_out: dict[str, dict] = {}
    verify: dict = {}
    draft: dict = {}
    mismatch = None
    ar_s = prefill = None
    for group in (plain, lora):
        if not group:
            continue
        heads = {s.entry: build(s, model) for s in group}
        for s in group:
            log.info("head %s: %s at E=%d, %d params", s.entry, heads[s.entry].config.type, heads[s.entry].exit_layer,
                     heads[s.entry].num_params())
        scores, m = score_heads(bb, heads, seqs, cfg.topk, cfg.chunk, max(cfg.draft_lens))
        mismatch = m if mismatch is None else mismatch  # the first pass is the target's reference forward
        if cfg.costs:
            if ar_s is None:  # before a LoRA is injected (it slows the early layers for every path)
                ar_s = step_costs.ar_step_seconds(bb, context, cfg.timing.repeats, cfg.timing.warmup)
                prefill = step_costs.prefill_fit(bb, [len(s.prompt_ids) for s in seqs])
            d, verify = step_costs.measure(bb, heads, cfg.draft_lens, context, cfg.timing.repeats, cfg.timing.warmup,
                                           verify)
            draft.update(d)
        for s in group:
            heads_out[s.entry] = _head_result(s, heads[s.entry], scores[s.entry], seqs, cats, cfg,
                                              (draft, verify, prefill, ar_s))
    run = {
        "model": model.model_config.name if model.model_config else "model",
        "prompts": len({s.prompt_id for s in seqs}), "sequences": len(seqs),
        "answer_tokens": sum(len(s.answer_ids) for s in seqs), "max_new_tokens": cfg.max_new_tokens,
        "topk": cfg.topk, "draft_lens": cfg.draft_lens, "target_mismatch": mismatch or 0,
        "device": str(bb.device), "dtype": str(bb.dtype).removeprefix("torch."),
        "costs": None,
    }
    if cfg.costs:
        run["costs"] = {"context": context, "repeats": cfg.timing.repeats, "verify": verify,
                        "ar_step_s": ar_s, "prefill_fit": {"a": prefill[0], "b": prefill[1]}}
    # keep the user's order in the output
    order = [s.entry for s in specs]
    return {"run": run, "heads": {k: heads_out[k] for k in order}}


def _head_result(s: HeadEntry, head, sc: list, seqs, cats: dict[str, list[int]], cfg: AnalysisConfig,
                 costs: tuple) -> dict:
    """One head's entry of analysis.json from its scores `sc` (one per sequence): agreement overall and per
    category, and with cfg.costs its step costs and predicted speedups. costs: (draft costs by entry, verify costs,
    the prefill fit, the AR step's seconds), as measured so far (the latter two None without cfg.costs)."""
    draft, verify, prefill, ar_s = costs
    info = _head_info(s, head)
    info["overall"] = summarize(sc, cfg.topk, cfg.draft_lens, cfg.max_new_tokens, cfg.draft_threshold,
                                draft_continue=cfg.draft_continue)
    info["per_category"] = {c: summarize([sc[i] for i in idx], cfg.topk, cfg.draft_lens, cfg.max_new_tokens,
                                         cfg.draft_threshold, draft_continue=cfg.draft_continue)
                            for c, idx in cats.items()}
    if cfg.costs:
        info["draft_cost"] = draft[s.entry]
        info["verify_cost"] = verify[step_costs.verify_key(head)]
        info["predicted"] = speedups(info["overall"], info["draft_cost"], info["verify_cost"])
        info["predicted_per_category"] = {
            c: speedups(v, info["draft_cost"], info["verify_cost"]) for c, v in info["per_category"].items()}
        _add_end_to_end(info, seqs, cats, prefill, ar_s)
    if cfg.lookup_first:
        _add_lookup_first(info, sc, seqs, cats, cfg, prefill, ar_s)
    M = head.max_ahead
    if M > 1:  # its extra heads: M drafts per pass (decode.tokens_per_pass=M)
        par = {"tokens_per_pass": M,
               "overall": summarize(sc, cfg.topk, cfg.draft_lens, cfg.max_new_tokens, cfg.draft_threshold, M)}
        if cfg.costs:
            par["draft_cost"] = draft[(s.entry, M)]
            par["predicted"] = speedups(par["overall"], par["draft_cost"], info["verify_cost"])
        info["parallel"] = par
    return info
