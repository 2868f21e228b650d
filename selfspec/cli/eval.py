"""python -m selfspec.eval model=smollm2_135m head=lens head.exit_layer=6 prompts=spec_bench prompts.path=FILE

Runs `methods` (hf_generate, hf_early_exit, hf_prompt_lookup, autoregressive, selfspec, lookup, selfspec+lookup, and
variants of the drafting ones such as "selfspec:tree=dynamic:tree_nodes=8", see evaluation/runner.py) in one process,
interleaved prompt by prompt, greedy or sampled (decode=sample, our engine's methods only), and writes into the run dir:

  results.jsonl   one line per prompt x method: method, prompt_id, category, token_ids, text, stats
  model_answer/   <method>.jsonl: the same answers in Spec-Bench's answer format, which its evaluation/speed.py and
                  equal.py read (evaluation/spec_bench.py)
  summary.json    report.summarize_methods(...) + "config" (resolved) + "run" (heads, calibration, costs, wall time)
  summary.md      the same as tables;  acceptance_by_position.png, speedup_by_category.png
  result.json     flat `eval/...` metrics of the selfspec method, for sweep aggregation (sweep.md, heatmaps)

Sweeps: `python -m selfspec.eval -m head.exit_layer=4,8,12 decode.draft_len=1,2,4,6,8`; the callback in
conf/eval.yaml writes sweep.md and heatmap_{speedup,tau}.png into the sweep dir.

Configs: the model / head / decode / logger groups as everywhere, `prompts` (conf/prompts/, the prompt set) and
evaluation's own keys (selfspec/evaluation/config.py: EvalConfig). A missing head is trained through training's
public entry point, `selfspec.training.train_head`, with a typed recipe (`head_cache.trainer`, `head_cache.data`).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from selfspec.api import SelfSpecModel
from selfspec.cli.config import decode_config, head_config, logger_config, model_config
from selfspec.cli.hydra_utils import RESULT_FILE, decode_keys_set, print_user_error_and_exit, run_job_safely
from selfspec.data.exclude import register_eval_prompts
from selfspec.decoding.config import VARIANT_KEYS, tuned_overrides
from selfspec.errors import SelfSpecError, check
from selfspec.evaluation.calibration import calibrate, calibrate_tree
from selfspec.evaluation.config import EvalConfig
from selfspec.evaluation.head_cache import cached_exit_layers, heads_root, resolve_head
from selfspec.evaluation.prompt_set import load_prompt_set, prompt_set_config
from selfspec.evaluation.record import build_record, code_version, command_line, prompts_digest
from selfspec.evaluation.report import (alpha_from_accept_rate_per_position, cost_ratios, predicted_speedup,
                                        summarize_methods, summary_markdown)
from selfspec.evaluation.runner import (EngineMethod, HEAD_METHODS, Renderer, build_methods, check_methods,
                                        method_bases, method_head_refs, needs_run_head, parse_method, run_eval)
from selfspec.evaluation.spec_bench import write_answers
from selfspec.heads import HeadConfig, build_head
from selfspec.heads.auto import AUTO_HEAD, auto_head_config
from selfspec.model import cpu_kernels
from selfspec.training import TrainRunConfig
from selfspec.utils.config import build, to_dict
from selfspec.utils.io import atomic_write_json, atomic_write_text
from selfspec.utils.logger import head_artifact_name, logging_run, run_config
from selfspec.utils.machine import ThreadPolicy, cpu_identity, software
from selfspec.utils.paths import conf_dir

log = logging.getLogger("selfspec.eval")

# The config groups of conf/eval.yaml; every other top-level key is an EvalConfig field.
_GROUPS = ("model", "head", "decode", "prompts", "logger")


# ------------------------------------------------------------------------------------------------ config
def load_items(node) -> list:
    """Prompt items of a `prompts` node (conf/prompts/: path, format, limit, categories, per_category,
    spec_bench_tasks); unknown keys are refused."""
    return load_prompt_set(prompt_set_config(node))


def _record_eval_prompts(node) -> None:
    """A prompt file evaluated on is remembered (content hashes, $SELFSPEC_CACHE/excluded/) so that training data
    built afterwards leaves it out (data.mix.exclude: evaluated; data/exclude.py). Never fails the run."""
    path = prompt_set_config(node).path
    if path is not None:
        register_eval_prompts(path)


def eval_config(cfg: DictConfig):
    """conf/eval.yaml's own keys as an EvalConfig; a key that belongs to no group nor to EvalConfig is refused."""
    own = {k: v for k, v in to_dict(cfg).items() if k not in _GROUPS}
    if "data" in own:
        raise SelfSpecError("data: evaluation reads prompts=builtin|spec_bench|jsonl (prompts.path, prompts.limit, "
                            "prompts.per_category, ...); the data group is training's")
    return build(EvalConfig, own, "eval")


def decode_config_for_eval(node):
    d = to_dict(node)
    if d.get("draft_len") == "auto":
        raise SelfSpecError("decode.draft_len=auto: a calibrated K is auto.enabled=true now "
                            "(decode.draft_len is an integer >= 1)")
    return decode_config(d)


# ------------------------------------------------------------------------------------------------ heads
def train_recipe(mcfg, ecfg):
    """The typed training recipe (selfspec.training.TrainRunConfig) for heads the head cache trains on
    demand: the evaluated model, head_cache.trainer and head_cache.data; the head is set per exit layer."""
    return TrainRunConfig(model=mcfg, head=None, data=ecfg.head_cache.data, trainer=ecfg.head_cache.trainer)


def _auto_head(model, hcfg, info: dict):
    """head=auto: the chosen candidate's head config (None: context lookup alone); the choice, its reason and the
    decode settings it adds go into the run info (summary.md, the record)."""
    if hcfg.path != AUTO_HEAD:
        return hcfg
    hcfg, decode, choice = auto_head_config(model.backbone, hcfg)
    info["auto_head"] = (choice.as_dict() if choice is not None
                         else {"chosen": "default", "reason": "head=auto: no candidates ship for this model; head=default"})
    info["auto_head"]["decode"] = decode
    return hcfg


def _prepare_heads(ecfg, model, mcfg, hcfg, items, renderer, out_dir: Path) -> tuple[object | None, dict, int | None]:
    """The head for selfspec / hf_early_exit, and K when auto.enabled. -> (head, run info, calibrated K or None)."""
    methods = method_bases(ecfg.methods)  # variants (selfspec:draft_len=2) need what their base method needs
    info: dict = {}
    if not needs_run_head(ecfg.methods):  # no head method, or each names its own head (selfspec:head=DIR)
        if "hf_early_exit" not in methods:
            return None, info, None
        # HF's early exit only needs E (head.exit_layer, else the default); a lens head carries it at no cost.
        return build_head(HeadConfig(type="lens", exit_layer=hcfg.exit_layer), model.backbone, model.eos_ids), info, None
    hcfg = _auto_head(model, hcfg, info)
    if hcfg is None:  # head=auto chose context lookup alone: the head methods draft with no head
        info["head"] = {"type": None, "exit_layer": None, "source": "auto", "params": 0}
        return None, info, None
    hc = ecfg.head_cache
    root = heads_root(hc.dir)
    common = dict(model_name=model.model_config.cache_name, root=root, train_missing=hc.train_missing,
                  recipe=train_recipe(mcfg, ecfg), train_dir=out_dir / "train")
    head, source = resolve_head(model, hcfg, **common)
    info["head"] = {"type": head.config.type, "exit_layer": head.exit_layer, "source": source, "params": head.num_params(),
                    "draft_precision": head.draft_precision}
    if hasattr(head.config, "own_precision"):  # a context head: its own matrices in a draft step
        info["head"]["own_precision"] = head.config.own_precision
    if head.base_model_check is not None:  # a saved head: how its base model compares with this one (model/identity.py)
        info["head"]["base_model"] = head.base_model_check
    if not ecfg.auto.enabled:
        return head, info, None

    a = ecfg.auto
    heads = {head.exit_layer: head}
    sources = {head.exit_layer: source}
    if not hcfg.path and not head.one_per_model:  # a model carries one LoRA: no E search for LoRA heads
        wanted = a.exit_layers or list(cached_exit_layers(root, common["model_name"], model.backbone, hcfg, common["recipe"]))
        for E in map(int, wanted):
            if E not in heads:
                heads[E], sources[E] = resolve_head(model, hcfg, exit_layer=E, **common)
    calib_ids = [renderer.render(it.turns, [])[0] for it in items[: a.prompts]]
    cal = calibrate(model, heads, calib_ids, a.draft_lens, a.max_new_tokens, repeats=a.repeats)
    log.info("auto: E=%d K=%d (predicted speedup %.2fx)", cal.exit_layer, cal.draft_len, cal.predicted_speedup)
    info["auto"] = {"exit_layer": cal.exit_layer, "draft_len": cal.draft_len,
                    "predicted_speedup": cal.predicted_speedup, "table": cal.table}
    head = heads[cal.exit_layer]
    info["head"].update(exit_layer=head.exit_layer, source=sources[head.exit_layer], params=head.num_params())
    return head, info, cal.draft_len


def resolve_auto_tree(ecfg, model, head, dcfg, items, renderer):
    """decode.tree=auto: the chain or a draft tree, chosen by calibration.calibrate_tree on the calibration prompts
    (the first turns of the first auto.prompts prompts, auto.max_new_tokens each) among the chain and dynamic trees of
    auto.tree_nodes nodes (+ the static decode.tree_shape with auto.tree_static). -> (dcfg with the choice, the
    calibration as plain data for the run info)."""
    from dataclasses import replace

    a = ecfg.auto
    calib_ids = [renderer.render(it.turns, [])[0] for it in items[: a.prompts]]
    cal = calibrate_tree(model, head, calib_ids, dcfg, a.tree_nodes, static=a.tree_static,
                         max_new_tokens=a.max_new_tokens, repeats=a.repeats)
    log.info("decode.tree=auto: %s (predicted speedup %.2fx over our autoregressive path; %s)", cal.name,
             cal.predicted_speedup, ", ".join(f"{r['name']} {r['predicted']:.2f}x" for r in cal.table))
    return replace(dcfg, **cal.settings), cal.to_dict()


# ------------------------------------------------------------------------------------------------ outputs
def _write_json(path: Path, payload) -> None:
    atomic_write_json(path, payload, indent=2, default=str)


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
        "draft_precision": head.get("draft_precision", "full"),
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


def chain_model_applies(dcfg) -> bool:
    """`_predicted`'s cost model is a chain of K exit-head drafts, one pass each: it does not describe tree rounds,
    rounds drafted by context lookup (lookup_mode=first) or several drafts per pass."""
    return not (dcfg.uses_tree or dcfg.lookup_first or dcfg.tokens_per_pass > 1)


def _predicted(records: list[dict], summary: dict, draft_len: int | None) -> dict:
    """Predicted speedup of selfspec from its measured acceptance and cost ratios (report.predicted_speedup)."""
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
    head, threshold = info.get("head"), info.get("draft_threshold")
    if head:
        lines.append(f"- head: `{head['type']}` at E={head['exit_layer']} ({head['source']}, {head['params']} params)")
    for name, h in (info.get("method_heads") or {}).items():
        lines.append(f"- `{name}`: its own head `{h['type']}` at E={h['exit_layer']} ({h['path']}, {h['params']} params)")
    if info.get("draft_len") is not None:
        lines.append(f"- draft_len: {info['draft_len']}" + (" (auto)" if info.get("auto") else ""))
    if threshold:
        lines.append(f"- draft_threshold: {threshold} (dynamic K, at most draft_len)")
    if info.get("draft_continue"):
        lines.append(f"- draft_continue: {info['draft_continue']} (the first draft always, the next while the drafts' "
                     "joint confidence is at least this, at most draft_len)")
    if info.get("decode_from_head"):
        lines.append(f"- from the head's saved settings (not set by the user): {', '.join(info['decode_from_head'])}")
    t = info.get("tree_auto")
    if t:
        lines.append(f"- decode.tree=auto: `{t['name']}` (predicted {t['predicted_speedup']:.2f}x over our autoregressive "
                     "path; " + ", ".join(f"{r['name']} {r['predicted']:.2f}x" for r in t["table"]) + "; `run.tree_auto`)")
    for name, d in (info.get("method_settings") or {}).items():
        lines.append(f"- `{name}` decodes with " + ", ".join(f"{k}={json.dumps(v)}" for k, v in d.items()) + " beside decode.*")
    sampled = info.get("sampled")
    if sampled:
        lines.append(f"- sampled: temperature {sampled['temperature']}, top_k {sampled['top_k']}, top_p {sampled['top_p']}, "
                     f"seed {sampled['seed']} (each prompt's turn gets one seed derived from it, the same for every method)")
    p = info.get("predicted") or {}
    if p:
        lines.append(f"- predicted speedup over `{p['baseline']}`: {p['speedup']:.2f}x (alpha {p['alpha']:.3f}, "
                     f"draft cost c={p['draft_cost']:.3f} per exit-head pass, verify cost v={p['verify_cost']:.3f})"
                     + ("; the model assumes K drafts every round, which dynamic K does not do" if threshold else ""))
    lines.append(f"- prompts: {info['prompts']}, max_new_tokens: {info['max_new_tokens']}, device: {info['device']}, "
                 f"dtype: {info['dtype']}, " + (f"CPU threads: {info['threads']}, " if info.get("threads") else "")
                 + (f"matmul kernel: {info['cpu_isa']}, " if info.get("cpu_isa") else "") + f"wall time: {wall_s:.1f} s")
    if info.get("auto_head"):
        lines.append(f"- {info['auto_head']['reason']}")
    busy = _busy_line(info.get("thread_policy") or {})
    if busy:
        lines.append(busy)
    return "\n".join(lines) + "\n"


def _busy_line(policy: dict) -> str | None:
    """summary.md's warning when other processes shared the CPU during the run (utils/machine.py)."""
    if not policy.get("busy"):
        return None
    load = policy.get("busy_other_load_cores") or policy["mean_other_load_cores"]
    return (f"- **busy machine**: before {policy['busy']} of {policy['adaptations']} prompts other processes kept "
            f"{load} cores busy on average; those prompts ran on fewer threads than {policy['limit']} "
            f"({policy['threads_used']} used). Speeds are lower than on a quiet machine, and ratios less reliable")


PER_PROMPT_COLUMNS = ["method", "prompt_id", "category", "turns", "new_tokens", "verify_steps", "tau", "accept_rate",
                      "tokens_per_s", "seconds", "same_as_reference", "text"]


def per_prompt_rows(records: list[dict], reference: str | None) -> list[list]:
    """The W&B per-prompt table (PER_PROMPT_COLUMNS): one row per method and prompt, its turns pooled (token counts
    and seconds summed, texts joined); same_as_reference: its tokens equal the reference method's on that prompt
    (None for the reference itself, without it, or where either side sampled)."""
    pooled: dict[tuple[str, str], dict] = {}
    for rec in records:
        key = (rec["method"], str(rec["prompt_id"]))
        p = pooled.setdefault(key, {"category": rec.get("category"), "turns": 0, "ids": [], "text": [], "sampled": False,
                                    **{k: 0 for k in ("new_tokens", "verify_steps", "accepted", "drafted", "seconds")}})
        st = rec.get("stats") or {}
        p["turns"] += 1
        p["ids"] += list(rec.get("token_ids") or [])
        p["text"].append(rec.get("text") or "")
        p["sampled"] = p["sampled"] or bool(rec.get("sampled"))
        for k in ("new_tokens", "verify_steps", "accepted", "drafted", "seconds"):
            p[k] += st.get(k) or 0
    rows = []
    for (method, pid), p in pooled.items():
        ref = pooled.get((reference, pid)) if reference and method != reference else None
        same = None if ref is None or ref["sampled"] or p["sampled"] else p["ids"] == ref["ids"]
        rows.append([method, pid, p["category"], p["turns"], p["new_tokens"], p["verify_steps"],
                     p["new_tokens"] / p["verify_steps"] if p["verify_steps"] else None,
                     p["accepted"] / p["drafted"] if p["drafted"] else None,
                     p["new_tokens"] / p["seconds"] if p["seconds"] else None, p["seconds"], same, "\n\n".join(p["text"])])
    return rows


def _log_to_logger(logger, summary: dict, plots: dict, result: dict, records: list[dict] | None = None) -> None:
    if records is not None:
        logger.log_table("eval/per_prompt", PER_PROMPT_COLUMNS, per_prompt_rows(records, summary.get("reference")))
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

def _method_heads(ecfg, model, dcfg) -> tuple[dict, dict]:
    """The heads variants name (`selfspec:head=DIR`), each loaded once. -> ({ref: head}, run info per method). A
    method's own head decodes with the run's decode.* and its variant's settings; saved decode settings that differ
    are logged, not applied."""
    heads, sources = {}, {}
    for ref in method_head_refs(ecfg.methods):
        heads[ref], sources[ref] = resolve_head(model, HeadConfig(path=ref), train_missing=False)
        ignored = {k: v for k, v in heads[ref].decode_settings.items() if getattr(dcfg, k, v) != v}
        if ignored:
            log.info("head=%s: its saved decode settings %s are not applied (the run's decode.* is); set them in the "
                     "method's variant", ref, ignored)
    info = {}
    for name in ecfg.methods:
        ref = parse_method(name).settings.get("head")
        if ref is not None:
            h = heads[ref]
            info[name] = {"type": h.config.type, "exit_layer": h.exit_layer, "source": sources[ref], "path": ref,
                          "params": h.num_params()}
    return heads, info


# ------------------------------------------------------------------------------------------------ the job
def _checked_configs(cfg: DictConfig):
    """Everything that can be checked without the model, checked first: a typo fails in a second, not after a load.
    -> (EvalConfig, prompt items, DecodeConfig, HeadConfig, ModelConfig, LoggerConfig)."""
    ecfg = eval_config(cfg)
    items = load_items(cfg.prompts)
    _record_eval_prompts(cfg.prompts)
    dcfg = decode_config_for_eval(cfg.decode)
    hcfg = head_config(cfg.head)
    mcfg = model_config(cfg.model)
    lcfg = run_config(logger_config(cfg.logger), "eval")  # job_type eval; a multirun's group and job name
    check_methods(ecfg.methods, dcfg, duplicates=hcfg.path is None)  # a saved head's settings may still change decode.*
    return ecfg, items, dcfg, hcfg, mcfg, lcfg


def _renderer(ecfg, model):
    chat = ecfg.chat if ecfg.chat is not None else bool(model.tokenizer.chat_template)
    check(not chat or bool(model.tokenizer.chat_template), "chat=true: this tokenizer has no chat template")
    return Renderer(model.tokenizer, bool(chat))


def _run_decode_config(cfg: DictConfig, ecfg, model, head, dcfg, calibrated_k, items, renderer, info: dict):
    """decode.* as this run decodes it: a trained head's tuned settings (draft_len, draft_threshold, ...) where the
    user did not set them, on the command line, in a decode= file or an experiment yaml (hydra_utils.decode_keys_set),
    and auto.enabled's K, in one new config; then decode.tree=auto's calibrated choice. -> (config, keys taken from
    the head)."""
    from dataclasses import replace

    saved = {**(head.decode_settings if head is not None else {}), **(info.get("auto_head") or {}).get("decode", {})}
    changes = tuned_overrides(dcfg, saved, decode_keys_set(cfg.decode))
    tuned = sorted(changes)
    if calibrated_k is not None:
        changes["draft_len"] = calibrated_k
    dcfg = replace(dcfg, **changes) if changes else dcfg
    dcfg.check_fits(model.backbone.max_positions)
    if dcfg.tree == "auto" and any(n in HEAD_METHODS for n in method_bases(ecfg.methods)):
        dcfg, info["tree_auto"] = resolve_auto_tree(ecfg, model, head, dcfg, items, renderer)
    return dcfg, tuned


def _describe_run(info: dict, ecfg, model, dcfg, tuned: list[str], methods: list, items: list) -> bool:
    """The run info (summary.json's "run", summary.md's Run section) of what decodes how. -> whether a method drafts
    with the head."""
    import torch

    drafts = any(n in HEAD_METHODS for n in method_bases(ecfg.methods))
    info.update(draft_len=dcfg.draft_len if drafts else None, draft_threshold=dcfg.draft_threshold,
                draft_continue=dcfg.draft_continue, decode_from_head=tuned if drafts else [],
                prompts=len(items), max_new_tokens=dcfg.max_new_tokens, device=str(model.backbone.device),
                dtype=str(model.backbone.dtype).removeprefix("torch."), threads=torch.get_num_threads(),
                cpu_isa=cpu_kernels.gemm_isa() if model.backbone.device.type == "cpu" else None)
    # what each drafting method decodes with beside decode.* (its own settings, a variant's, a dropped threshold)
    differ = {m.name: {k: getattr(m.cfg, k) for k in VARIANT_KEYS if getattr(m.cfg, k) != getattr(dcfg, k)}
              for m in methods if isinstance(m, EngineMethod) and m.base != "autoregressive"}
    info["method_settings"] = {name: d for name, d in differ.items() if d}
    if not dcfg.greedy:
        info["sampled"] = {"temperature": dcfg.temperature, "top_k": dcfg.top_k, "top_p": dcfg.top_p,
                           "seed": next((m.seed for m in methods if m.sampled), dcfg.seed)}
    if drafts and (info.get("head") or {}).get("type"):
        log.info("selfspec: %s head at E=%d (%s), K=%d%s", info["head"]["type"], info["head"]["exit_layer"],
                 info["head"]["source"], dcfg.draft_len, f", threshold {dcfg.draft_threshold}" if dcfg.draft_threshold else "")
    return drafts


@dataclass
class _Prepared:
    """What a run evaluates, once the model is loaded and decode.* is final."""

    ecfg: Any
    mcfg: Any
    lcfg: Any
    items: list
    model: Any
    renderer: Any
    head: Any
    dcfg: Any
    methods: list
    info: dict  # summary.json's "run"
    drafts: bool  # a method drafts with the head


def _prepare(cfg: DictConfig, out_dir: Path) -> _Prepared:
    ecfg, items, dcfg, hcfg, mcfg, lcfg = _checked_configs(cfg)
    model = SelfSpecModel.from_pretrained(mcfg, head=None)
    renderer = _renderer(ecfg, model)
    head, info, calibrated_k = _prepare_heads(ecfg, model, mcfg, hcfg, items, renderer, out_dir)
    dcfg, tuned = _run_decode_config(cfg, ecfg, model, head, dcfg, calibrated_k, items, renderer, info)
    method_heads, info["method_heads"] = _method_heads(ecfg, model, dcfg)
    methods = build_methods(ecfg.methods, model, dcfg, head=head, hf_options=ecfg.hf, method_heads=method_heads)
    drafts = _describe_run(info, ecfg, model, dcfg, tuned, methods, items)
    return _Prepared(ecfg, mcfg, lcfg, items, model, renderer, head, dcfg, methods, info, drafts)


def _evaluate(cfg: DictConfig, p: _Prepared, out_dir: Path, t_start: float) -> tuple[dict, dict]:
    """Run the methods over the prompts inside the logger's run, streaming results.jsonl, and write the outputs.
    -> (summary, result)."""
    # matplotlib (evaluation/plots.py) is loaded only when a run has results to plot, never for --help or a bad config
    from selfspec.evaluation.plots import plot_acceptance_by_position, plot_speedup_by_category

    info, head = p.info, p.head
    resolved = OmegaConf.to_container(cfg, resolve=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    with logging_run(p.lcfg, out_dir, resolved) as logger, (out_dir / "results.jsonl").open("w") as results_file:
        if p.drafts and getattr(head, "source_dir", None) is not None:  # a saved head: this run's input artifact
            info["head"]["artifact"] = logger.use_artifact(
                head.source_dir, head_artifact_name(p.mcfg.cache_name, head.config.type, head.exit_layer), "head")

        def on_record(rec: dict, i: int, n: int) -> None:
            # Streamed, so an interrupted run keeps what it measured.
            results_file.write(json.dumps(rec) + "\n")
            results_file.flush()
            s = rec["stats"]
            log.info("[%d/%d] %-16s %s (%s): %d tokens, %.1f tok/s, tau %.2f", i + 1, n, rec["method"],
                     rec["prompt_id"], rec["category"], s["new_tokens"], s["tokens_per_s"], s["tau"])

        threads = ThreadPolicy(p.ecfg.threads)
        records = run_eval(p.methods, p.items, p.renderer, p.dcfg.max_new_tokens, p.model.backbone.device,
                           warmup=p.ecfg.warmup, save_prompts=p.ecfg.save_prompts, on_record=on_record,
                           threads=threads)
        info["thread_policy"] = threads.summary()
        write_answers(records, out_dir, p.mcfg.cache_name, info["dtype"], p.dcfg.temperature)  # Spec-Bench's format
        summary = summarize_methods(records, reference=p.ecfg.reference_method)
        info["predicted"] = _predicted(records, summary, info.get("draft_len")) if chain_model_applies(p.dcfg) else {}
        info["wall_s"] = time.perf_counter() - t_start
        plots = {
            "acceptance_by_position": plot_acceptance_by_position(summary, out_dir / "acceptance_by_position.png"),
            "speedup_by_category": plot_speedup_by_category(summary, out_dir / "speedup_by_category.png"),
        }
        result = flat_result(summary, info)
        _write_json(out_dir / "summary.json", {**summary, "run": info, "config": resolved})
        atomic_write_text(out_dir / "summary.md", summary_markdown(summary) + _run_markdown(info, info["wall_s"]))
        _write_json(out_dir / RESULT_FILE, result)
        _write_json(out_dir / RECORD_FILE, _record(cfg, summary, info, p, threads))
        _log_to_logger(logger, summary, plots, result, records)
    return summary, result


RECORD_FILE = "record.json"  # the result record (evaluation/record.py), beside summary.md


def _record(cfg: DictConfig, summary: dict, info: dict, p: _Prepared, threads: ThreadPolicy) -> dict:
    """The run's result record: the machine, the code, the command and the prompts beside the summary's numbers."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get() if HydraConfig.initialized() else None
    overrides = list(hc.overrides.task) if hc is not None else []
    bb = p.model.backbone
    source = {k: v for k, v in OmegaConf.to_container(cfg.prompts, resolve=True).items()
              if k in ("path", "format", "limit", "categories", "per_category")}
    source["set"] = hc.runtime.choices.get("prompts") if hc is not None else None
    prompts = {"source": source,
               "count": len(p.items), "sha256": prompts_digest(p.items), "max_new_tokens": p.dcfg.max_new_tokens}
    model = {"name": p.mcfg.cache_name, "dtype": info.get("dtype"), "device": info.get("device"),
             "layers": bb.num_layers}
    machine = {"cpu": cpu_identity(), "software": software(), "threads": threads.summary()}
    return build_record(summary, info, machine=machine, code=code_version(), command=command_line("selfspec.eval", overrides),
                        model=model, prompts=prompts)


def run(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig

    t_start = time.perf_counter()
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    prepared = _prepare(cfg, out_dir)
    summary, result = _evaluate(cfg, prepared, out_dir, t_start)
    print(summary_markdown(summary) + _run_markdown(prepared.info, prepared.info["wall_s"]))
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
