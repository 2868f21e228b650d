"""python -m selfspec.eval model=smollm2_135m head=lens head.exit_layer=6 data=spec_bench data.path=FILE

Runs `methods` (hf_generate, hf_early_exit, hf_prompt_lookup, autoregressive, selfspec) in one process,
interleaved prompt by prompt, and writes into the run dir:

  results.jsonl   one line per prompt x method: method, prompt_id, category, token_ids, text, stats
  summary.json    report.summarize_methods(...) + "config" (resolved) + "run" (heads, calibration, costs, wall time)
  summary.md      the same as tables;  acceptance_by_position.png, speedup_by_category.png
  result.json     flat `eval/...` metrics of the selfspec method, for sweep aggregation (sweep.md, heatmaps)

Sweeps: `python -m selfspec.eval -m head.exit_layer=4,8,12 decode.draft_len=1,2,4,6,8`; the callback in
conf/eval.yaml writes sweep.md and heatmap_{speedup,tau}.png into the sweep dir.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import replace
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from selfspec.errors import SelfSpecError, check
from selfspec.hydra_utils import RESULT_FILE, print_user_error_and_exit, run_job_safely
from selfspec.paths import conf_dir

log = logging.getLogger("selfspec.eval")

# Spec-Bench's multi-turn task is MT-bench, whose questions carry MT-bench's own eight categories.
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


# ------------------------------------------------------------------------------------------------ data
def load_items(node) -> list:
    """Prompt items from the `data` group. Reads path / limit / categories and the optional eval-only keys
    per_category, format and spec_bench_tasks; other keys (the training's, in a shared data file) are ignored."""
    from selfspec.data import builtin_prompts, load_prompts

    if isinstance(node, DictConfig) and OmegaConf.is_missing(node, "path"):
        raise SelfSpecError("data.path: required for this data set (data.path=FILE)")
    d = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node or {})
    path, limit = d.get("path"), d.get("limit")
    per_category = bool(d.get("per_category", False))
    categories = d.get("categories")
    if isinstance(categories, str):
        categories = [categories]
    check(limit is None or (isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1),
          f"data.limit={limit!r}: must be an integer >= 1, or null for all prompts")
    items = builtin_prompts() if path is None else load_prompts(path, fmt=d.get("format") or "auto")
    if d.get("spec_bench_tasks"):
        # Spec-Bench reports six tasks; its MT-bench part spreads over eight categories of 10 questions each.
        items = [replace(it, category="mt_bench") if it.category in MT_BENCH_CATEGORIES else it for it in items]
    present = list(dict.fromkeys(it.category for it in items))
    if categories:
        unknown = [c for c in categories if c not in present]
        check(not unknown, f"data.categories: {unknown} not in the data; present: {', '.join(present)}")
        items = [it for it in items if it.category in set(categories)]
    if limit is not None:
        if per_category:
            seen: dict[str, int] = {}
            kept = []
            for it in items:
                seen[it.category] = seen.get(it.category, 0) + 1
                if seen[it.category] <= limit:
                    kept.append(it)
            items = kept
        else:
            items = items[:limit]
    check(len(items) > 0, "data: no prompts selected")
    return items


# ------------------------------------------------------------------------------------------------ heads
def _prepare_heads(cfg, model, hcfg, decode_dict: dict, items, renderer, out_dir: Path) -> tuple[object | None, dict]:
    """The head for selfspec / hf_early_exit, and K when decode.draft_len=auto. -> (head, run info)."""
    from selfspec.evaluation.head_cache import cached_exit_layers, heads_root, resolve_head
    from selfspec.evaluation.runner import calibrate
    from selfspec.heads import HeadConfig, build_head, default_exit_layer

    methods = list(cfg.methods)
    info: dict = {}
    if "selfspec" not in methods:
        if "hf_early_exit" not in methods:
            return None, info
        # HF's early exit only needs E; a lens head carries it at no cost.
        E = hcfg.exit_layer if hcfg.exit_layer is not None else default_exit_layer(model.backbone.num_layers)
        return build_head(HeadConfig(type="lens", exit_layer=E), model.backbone, model.eos_ids), info
    hc = cfg.head_cache
    root = heads_root(hc.dir)
    common = dict(model_name=model.model_config.name, model_node=cfg.model, root=root,
                  train_missing=bool(hc.train_missing), train_overrides=list(hc.train_overrides or []),
                  train_dir=out_dir / "train")
    head, source = resolve_head(model, hcfg, **common)
    info["head"] = {"type": head.kind, "exit_layer": head.exit_layer, "source": source, "params": head.num_params()}
    if decode_dict["draft_len"] != "auto":
        return head, info

    a = cfg.auto
    heads = {head.exit_layer: head}
    sources = {head.exit_layer: source}
    if not hcfg.path and head.kind != "lora":  # a model carries one LoRA: no E search for LoRA heads
        wanted = list(a.exit_layers) if a.exit_layers else list(cached_exit_layers(root, common["model_name"],
                                                                                   model.backbone, hcfg))
        for E in map(int, wanted):
            if E not in heads:
                heads[E], sources[E] = resolve_head(model, hcfg, exit_layer=E, **common)
    calib_ids = [renderer.render(it.turns, [])[0] for it in items[: int(a.prompts)]]
    cal = calibrate(model, heads, calib_ids, list(a.draft_lens), int(a.max_new_tokens))
    log.info("draft_len=auto: E=%d K=%d (predicted speedup %.2fx)", cal.exit_layer, cal.draft_len, cal.predicted_speedup)
    decode_dict["draft_len"] = cal.draft_len
    info["auto"] = {"exit_layer": cal.exit_layer, "draft_len": cal.draft_len,
                    "predicted_speedup": cal.predicted_speedup, "table": cal.table}
    head = heads[cal.exit_layer]
    info["head"].update(exit_layer=head.exit_layer, source=sources[head.exit_layer], params=head.num_params())
    return head, info


# ------------------------------------------------------------------------------------------------ outputs
def _write_json(path: Path, payload) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def flat_result(summary: dict, info: dict, method: str = "selfspec") -> dict:
    """result.json: `eval/...` metrics of one method plus the (E, K, head) the sweep report groups by."""
    m = summary["methods"].get(method) or {}
    head = info.get("head") or {}
    pred = info.get("predicted") or {}
    return {
        "status": "ok",
        "head": head.get("type"),
        "head_source": head.get("source"),
        "exit_layer": head.get("exit_layer"),
        "draft_len": info.get("draft_len"),
        "head_params": head.get("params"),
        "eval/speedup": m.get("speedup"),
        "eval/tau": m.get("tau"),
        "eval/accept_rate": m.get("accept_rate"),
        "eval/lossless": m.get("lossless"),
        "eval/tokens_per_s": m.get("tokens_per_s"),
        "eval/predicted_speedup": pred.get("speedup"),
        "eval/draft_cost": pred.get("draft_cost"),
        "eval/verify_cost": pred.get("verify_cost"),
        "eval/alpha": pred.get("alpha"),
    }


def _predicted(records: list[dict], summary: dict, draft_len: int | None) -> dict:
    """Predicted speedup of selfspec from its measured acceptance and cost ratios (report.predicted_speedup)."""
    from selfspec.evaluation.report import alpha_from_accept_rate_per_position, cost_ratios, predicted_speedup

    m = summary["methods"].get("selfspec")
    if not m or not draft_len:
        return {}
    baseline = "autoregressive" if "autoregressive" in summary["methods"] else "hf_generate"
    costs = cost_ratios(records, "selfspec", baseline)
    rates = m.get("accept_rate_per_position") or []
    if costs is None or not any(r is not None for r in rates):
        return {}
    alpha = alpha_from_accept_rate_per_position(rates)
    return {"alpha": alpha, "baseline": baseline, **costs,
            "speedup": predicted_speedup(alpha, draft_len, costs["draft_cost"], costs["verify_cost"])}


def _run_markdown(info: dict, wall_s: float) -> str:
    lines = ["", "## Run", ""]
    head = info.get("head")
    if head:
        lines.append(f"- head: `{head['type']}` at E={head['exit_layer']} ({head['source']}, {head['params']} params)")
    if info.get("draft_len") is not None:
        lines.append(f"- draft_len: {info['draft_len']}" + (" (auto)" if info.get("auto") else ""))
    if info.get("draft_threshold"):
        lines.append(f"- draft_threshold: {info['draft_threshold']} (dynamic K, at most draft_len)")
    p = info.get("predicted") or {}
    if p:
        lines.append(f"- predicted speedup over `{p['baseline']}`: {p['speedup']:.2f}x (alpha {p['alpha']:.3f}, "
                     f"draft cost c={p['draft_cost']:.3f} per exit-head pass, verify cost v={p['verify_cost']:.3f})"
                     + ("; the model assumes K drafts every round, which dynamic K does not do" if info.get("draft_threshold") else ""))
    lines.append(f"- prompts: {info['prompts']}, max_new_tokens: {info['max_new_tokens']}, device: {info['device']}, "
                 f"dtype: {info['dtype']}, wall time: {wall_s:.1f} s")
    return "\n".join(lines) + "\n"


def _log_to_logger(logger, summary: dict, plots: dict, result: dict) -> None:
    cols = ["method", "tokens_per_s", "speedup", "tau", "accept_rate", "lossless", "peak_memory_mb", "head_params"]
    logger.log_table("eval/methods", cols, [[n] + [m.get(c) for c in cols[1:]] for n, m in summary["methods"].items()])
    ccols = ["category", "method", "tokens_per_s", "speedup", "tau", "accept_rate", "lossless"]
    logger.log_table("eval/per_category", ccols, [[cat, n] + [v.get(c) for c in ccols[2:]]
                                                  for cat, per in summary["per_category"].items() for n, v in per.items()])
    for name, path in plots.items():
        logger.log_image(f"eval/{name}", path)
    flat = {f"eval/{n}/{k}": v for n, m in summary["methods"].items() for k, v in m.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}
    flat.update({k: v for k, v in result.items() if k.startswith("eval/") and v is not None})
    logger.summary(flat)


# ------------------------------------------------------------------------------------------------ the job
def run(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig

    from selfspec.api import SelfSpecModel
    from selfspec.config import decode_config, head_config, logger_config, model_config, to_dict
    from selfspec.evaluation.plots import plot_acceptance_by_position, plot_speedup_by_category
    from selfspec.evaluation.report import summarize_methods, summary_markdown
    from selfspec.evaluation.runner import Renderer, build_methods, check_methods, run_eval
    from selfspec.logger import logging_run

    t_start = time.perf_counter()
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    # Everything that can be checked without the model is checked first: a typo fails in a second, not after a load.
    items = load_items(cfg.data)
    decode_dict = to_dict(cfg.decode)
    auto = decode_dict.get("draft_len") == "auto"
    dcfg = decode_config({**decode_dict, "draft_len": max(cfg.auto.draft_lens) if auto else decode_dict["draft_len"]})
    hcfg = head_config(cfg.head)
    mcfg = model_config(cfg.model)
    lcfg = logger_config(cfg.logger)
    methods_names = list(cfg.methods)
    check_methods(methods_names, dcfg)
    check(cfg.reference is None or cfg.reference in methods_names,
          f"reference={cfg.reference!r}: not among methods={methods_names}")

    model = SelfSpecModel.from_pretrained(mcfg, head=None)
    chat = cfg.chat if cfg.chat is not None else bool(model.tokenizer.chat_template)
    check(not chat or bool(model.tokenizer.chat_template), "chat=true: this tokenizer has no chat template")
    renderer = Renderer(model.tokenizer, bool(chat))
    head, info = _prepare_heads(cfg, model, hcfg, decode_dict, items, renderer, out_dir)
    if auto and decode_dict["draft_len"] != "auto":  # calibrated (only when selfspec runs)
        dcfg = decode_config(decode_dict)
    methods = build_methods(methods_names, model, dcfg, head=head, hf_options=to_dict(cfg.hf))
    info.update(draft_len=dcfg.draft_len if "selfspec" in methods_names else None, draft_threshold=dcfg.draft_threshold,
                prompts=len(items), max_new_tokens=dcfg.max_new_tokens, device=str(model.backbone.device),
                dtype=str(model.backbone.dtype).removeprefix("torch."))
    if "selfspec" in methods_names:
        log.info("selfspec: %s head at E=%d (%s), K=%d%s", info["head"]["type"], info["head"]["exit_layer"],
                 info["head"]["source"], dcfg.draft_len, f", threshold {dcfg.draft_threshold}" if dcfg.draft_threshold else "")

    resolved = OmegaConf.to_container(cfg, resolve=True)
    reference = cfg.reference or ("hf_generate" if "hf_generate" in methods_names else "autoregressive")
    out_dir.mkdir(parents=True, exist_ok=True)
    results_path = out_dir / "results.jsonl"
    with logging_run(lcfg, out_dir, resolved) as logger, results_path.open("w") as results_file:

        def on_record(rec: dict, i: int, n: int) -> None:
            # Streamed, so an interrupted run keeps what it measured.
            results_file.write(json.dumps(rec) + "\n")
            results_file.flush()
            s = rec["stats"]
            log.info("[%d/%d] %-16s %s (%s): %d tokens, %.1f tok/s, tau %.2f", i + 1, n, rec["method"],
                     rec["prompt_id"], rec["category"], s["new_tokens"], s["tokens_per_s"], s["tau"])

        records = run_eval(methods, items, renderer, dcfg.max_new_tokens, model.backbone.device,
                           warmup=bool(cfg.warmup), save_prompts=bool(cfg.save_prompts), on_record=on_record)
        summary = summarize_methods(records, reference=reference)
        info["predicted"] = _predicted(records, summary, info.get("draft_len"))
        wall_s = time.perf_counter() - t_start
        info["wall_s"] = wall_s
        plots = {
            "acceptance_by_position": plot_acceptance_by_position(summary, out_dir / "acceptance_by_position.png"),
            "speedup_by_category": plot_speedup_by_category(summary, out_dir / "speedup_by_category.png"),
        }
        result = flat_result(summary, info)
        _write_json(out_dir / "summary.json", {**summary, "run": info, "config": resolved})
        (out_dir / "summary.md").write_text(summary_markdown(summary) + _run_markdown(info, wall_s))
        _write_json(out_dir / RESULT_FILE, result)
        _log_to_logger(logger, summary, plots, result)

    print(summary_markdown(summary) + _run_markdown(info, wall_s))
    print(f"written: {out_dir}")
    return result["eval/speedup"]


@hydra.main(config_path=str(conf_dir()), config_name="eval", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.get().mode == RunMode.MULTIRUN:
        return run_job_safely(run, cfg)  # a failed job is recorded in its result.json; the sweep goes on
    try:
        return run(cfg)
    except SelfSpecError as exc:
        print_user_error_and_exit(exc)  # one line and exit 2, no traceback for a user error


if __name__ == "__main__":
    main()
