"""python -m selfspec.analyze model=smollm2_135m 'heads=[lens@4,lens@6,medusa@6,DIR]' prompts=spec_bench prompts.path=FILE

How well can layer E draft for this model, with which head, without a decode loop: the target's greedy answers
are generated once (our engine, cached on disk), then every head is scored teacher-forced on them (see
selfspec/analysis/). Writes into the run dir:

  analysis.json   run info + per head: overall and per-category agreement, top-k coverage, KL, conditional
                  agreement by position, expected and replayed tau by K, step costs, predicted speedup
  analysis.md     the same as tables
  agreement_vs_exit_layer.png, tau_vs_k.png, speedup_vs_k.png (with costs=true)
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from selfspec.analysis import AnalysisConfig, analyze_heads, load_or_generate, parse_heads
from selfspec.analysis.heads import check_exit_layers
from selfspec.analysis.report import analysis_markdown, plot_agreement_vs_exit_layer, plot_by_draft_len
from selfspec.api import SelfSpecModel
from selfspec.cli.config import logger_config, model_config
from selfspec.cli.hydra_utils import run_or_exit
from selfspec.errors import SelfSpecError
from selfspec.evaluation.prompt_set import load_prompt_set, prompt_set_config
from selfspec.evaluation.runner import Renderer
from selfspec.heads.saving import read_head_config
from selfspec.utils.config import build
from selfspec.utils.io import atomic_write_json, atomic_write_text
from selfspec.utils.logger import head_artifact_name, logging_run, run_config
from selfspec.utils.paths import conf_dir

log = logging.getLogger("selfspec.analyze")

_GROUPS = ("model", "prompts", "logger")  # conf/analyze.yaml's config groups; every other key is AnalysisConfig's


def _log_to_logger(logger, result: dict, plots: dict) -> None:
    heads = result["heads"]
    topk = result["run"]["topk"]
    cols = ["head", "type", "exit_layer", "params", *[f"top{k}" for k in topk], "kl", "draft_cost", "best_k",
            "predicted_speedup"]
    logger.log_table("analysis/heads", cols, [
        [label, h["type"], h["exit_layer"], h["params"], *[h["overall"]["coverage"][k] for k in topk], h["overall"]["kl"],
         h.get("draft_cost"), (h.get("predicted") or {}).get("best", {}).get("draft_len"),
         (h.get("predicted") or {}).get("best", {}).get("speedup")] for label, h in heads.items()])
    logger.log_table("analysis/per_category", ["category", "head", "tokens", "agreement", "kl"], [
        [c, label, v["tokens"], v.get("agreement"), v.get("kl")] for label, h in heads.items()
        for c, v in h["per_category"].items()])
    for name, path in plots.items():
        logger.log_image(f"analysis/{name}", path)
    flat = {}
    for label, h in heads.items():
        o = h["overall"]
        flat[f"analysis/{label}/agreement"] = o["agreement"]
        flat[f"analysis/{label}/kl"] = o["kl"]
        flat.update({f"analysis/{label}/tau_k{k}": v for k, v in o["tau"].items()})
        if h.get("predicted"):
            flat[f"analysis/{label}/draft_cost"] = h["draft_cost"]
            flat[f"analysis/{label}/best_speedup"] = h["predicted"]["best"]["speedup"]
    logger.summary(flat)


def _use_saved_heads(logger, specs, model_name: str) -> None:
    """Declare every trained head given as a DIR as an input artifact of this run (as eval does)."""
    for spec in specs:
        if spec.path is not None and spec.path != "default":
            saved = read_head_config(spec.path)
            logger.use_artifact(spec.path, head_artifact_name(model_name, saved["type"], saved.get("exit_layer")), "head")


def run(cfg: DictConfig) -> dict:
    from hydra.core.hydra_config import HydraConfig

    t0 = time.perf_counter()
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    # Everything that can be checked without the model first: a typo fails in a second, not after a load.
    acfg = build(AnalysisConfig, {k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
                                  for k, v in cfg.items() if k not in _GROUPS}, "analyze")
    specs = parse_heads(acfg.heads)
    items = load_prompt_set(prompt_set_config(cfg.prompts))  # the same prompts as eval for the same overrides
    mcfg = model_config(cfg.model)
    lcfg = run_config(logger_config(cfg.logger), "analyze")  # job_type analyze; a multirun's group and job name

    model = SelfSpecModel.from_pretrained(mcfg, head=None)
    check_exit_layers(specs, model.backbone.num_layers)
    chat = acfg.chat if acfg.chat is not None else bool(model.tokenizer.chat_template)
    if chat and not model.tokenizer.chat_template:
        raise SelfSpecError("chat=true: this tokenizer has no chat template")
    renderer = Renderer(model.tokenizer, bool(chat))

    def progress(i: int, n: int) -> None:
        log.info("answers: %d/%d prompts", i, n)

    seqs, answers_file, cached = load_or_generate(model, renderer, items, acfg.max_new_tokens, acfg.answers_dir,
                                                  progress=progress)
    log.info("answers: %d turns, %d tokens (%s %s)", len(seqs), sum(len(s.answer_ids) for s in seqs),
             "cached in" if cached else "written to", answers_file)
    result = analyze_heads(model, seqs, specs, acfg)
    result["run"].update(answers_file=str(answers_file), answers_cached=cached, wall_s=time.perf_counter() - t0)
    resolved = OmegaConf.to_container(cfg, resolve=True)

    out_dir.mkdir(parents=True, exist_ok=True)
    with logging_run(lcfg, out_dir, resolved) as logger:
        _use_saved_heads(logger, specs, mcfg.cache_name)
        plots = {"agreement_vs_exit_layer": plot_agreement_vs_exit_layer(result, out_dir / "agreement_vs_exit_layer.png"),
                 "tau_vs_k": plot_by_draft_len(result, "tau", out_dir / "tau_vs_k.png")}
        if acfg.costs:
            plots["speedup_vs_k"] = plot_by_draft_len(result, "speedup", out_dir / "speedup_vs_k.png")
        md = analysis_markdown(result)
        atomic_write_json(out_dir / "analysis.json", {**result, "config": resolved})
        atomic_write_text(out_dir / "analysis.md", md)
        _log_to_logger(logger, result, plots)
    print(md)
    print(f"written: {out_dir}")
    return result


@hydra.main(config_path=str(conf_dir()), config_name="analyze", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_or_exit(run, cfg)


if __name__ == "__main__":
    main()
