"""One training job end to end: configs -> model -> data -> features -> training -> validation -> files.

`run_recipe` is the job from a typed recipe (TrainRunConfig): what `python -m selfspec.train` runs inside its Hydra
run dir (selfspec/cli/train.py builds the recipe from conf/train.yaml); `train_head` is the same job for another
tool (the evaluation's head cache), returning the head's dir.

Files in the run dir: head/, result.json, checkpoints/step-N.pt, wandb/ (with logger=wandb).

What can be checked without the slow stages is checked first: a bad prompt file and a bad `trainer.resume`
before the model loads; a checkpoint trained with other settings, and validation prompts longer than the
model's context allows, before data synthesis.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from selfspec.api import SelfSpecModel
from selfspec.data import load_prompts
from selfspec.decoding.config import tuned_settings
from selfspec.errors import SelfSpecError, check
from selfspec.heads import HeadConfig, build_head, draft_vocab_from_counts, load_head, save_head
from selfspec.heads.saving import shipped_head_for
from selfspec.model.hf_baselines import HFGenerate
from selfspec.model.identity import weights_digest
from selfspec.training import dataset, validation
from selfspec.training.checkpoint import (checkpoint_recipe, load_checkpoint, load_resume_checkpoint,
                                          recipe_differences, resume_candidates, save_checkpoint)
from selfspec.training.config import TrainRunConfig
from selfspec.training.distributed import broadcast_object, init_distributed, rank_device, shutdown
from selfspec.training.features import hidden_path, load_or_compute_hidden, side_by_side
from selfspec.training.loop import Hooks, TrainResult, Trainer, seed_everything, trainable_parameters
from selfspec.utils.io import atomic_write_text, safe_name, unique_dir
from selfspec.utils.logger import LoggerConfig, head_artifact_name, logging_run
from selfspec.utils.paths import cache_dir
from selfspec.utils.sweeps import RESULT_FILE, write_json

log = logging.getLogger("selfspec.train")


Configs = TrainRunConfig  # every group as a validated dataclass (training/config.py)


# Trainer keys that do not change the trained weights: a resumed run may change them freely.
_NOT_RECIPE = ("resume", "resume_override", "stop_after", "log_every", "val_every", "ckpt_every", "keep_checkpoints",
               "compare_lens", "num_threads", "checkpoint_dir")


def training_recipe(c: Configs, model_key: str | None = None) -> dict:
    """What decides the trained weights, flat (`trainer.lr`, `data.path`, `head.num_blocks`, `model`): a
    checkpoint stores it, and resuming under another recipe is refused (trainer.resume_override=true); the
    evaluation's head cache keys its heads on it. Without a head (c.head None) or model key, those are left out."""
    flat = {f"trainer.{k}": v for k, v in asdict(c.trainer).items() if k not in _NOT_RECIPE}
    flat.update({f"data.{k}": v for k, v in {**dataset.data_settings(c.data), "feature_dtype": c.data.feature_dtype}.items()})
    if c.data.also:  # the datasets trained on beside it, by what decides each
        flat["data.also"] = [dataset.data_settings(x) for x in c.data.extra_datasets()]
    if c.head is not None:
        # not recipe: where a head comes from, whether it may load on another model, the precision it drafts in
        flat.update({f"head.{k}": v for k, v in asdict(c.head).items() if k not in ("path", "allow_other_model", "draft_precision")})
    if model_key is not None:
        flat["model"] = model_key
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in flat.items()}


def checkpoint_dir(c: Configs, run_dir: Path, mkey: str, exit_layer: int | None = None) -> Path:
    """Where this run writes its checkpoints, and where trainer.resume=auto|true looks for one to continue from:
    trainer.checkpoint_dir when set; in a SLURM job (SLURM_JOB_ID set) with trainer.resume=auto|true, a directory
    named by the job's config alone, $SELFSPEC_CACHE/checkpoints/<model>-<head>-E<e>-<hash>, where the hash covers
    the training recipe and the validation's decode settings: a requeued job and a relaunch of the same config
    (each in a fresh timestamped run dir) find the checkpoints and continue; elsewhere <run dir>/checkpoints."""
    if c.trainer.checkpoint_dir:
        return Path(c.trainer.checkpoint_dir).expanduser()
    if os.environ.get("SLURM_JOB_ID") and c.trainer.resume in (True, "true", "True", "auto"):
        key = json.dumps({"recipe": training_recipe(c, mkey), "decode": asdict(c.decode)}, sort_keys=True, default=str)
        E = exit_layer if exit_layer is not None else c.head.exit_layer
        name = f"{c.model.cache_name}-{c.head.type}-E{E}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
        return cache_dir() / "checkpoints" / safe_name(name)
    return run_dir / "checkpoints"


WANDB_ID_FILE = "wandb-run-id"  # beside the checkpoints: the W&B run a resumed training continues


def read_wandb_run_id(directory: Path) -> str | None:
    try:
        text = (Path(directory) / WANDB_ID_FILE).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return text if text and all(ch.isalnum() or ch in "-_" for ch in text) else None


def write_wandb_run_id(directory: Path, run_id: str) -> None:
    atomic_write_text(Path(directory) / WANDB_ID_FILE, run_id + "\n")


def check_resume_recipe(path, state: dict, current: dict, override: bool) -> None:
    """Refuse (one line naming the keys) to resume a checkpoint trained under another recipe; compares
    only the keys `current` has (the model's, once it is loaded)."""
    saved = checkpoint_recipe(state)
    if saved is None:
        log.warning("trainer.resume: %s records no settings (an older checkpoint); cannot check they match", path)
        return
    diff = recipe_differences({k: v for k, v in saved.items() if k in current}, current)
    if not diff:
        return

    def short(v) -> str:
        text = repr(v)
        return text if len(text) <= 40 else text[:37] + "..."

    detail = ", ".join(f"{k} {short(saved.get(k))} -> {short(current.get(k))}" for k in diff)
    if override:
        log.warning("trainer.resume_override=true: resuming %s despite other settings: %s", path, detail)
        return
    raise SelfSpecError(f"trainer.resume: {path} was trained with other settings: {detail}; "
                        "use the same settings, or trainer.resume_override=true to resume anyway")


def check_val_prompt_lengths(model, c: Configs, items=None) -> None:
    """Validation decodes each held-out prompt for decode.max_new_tokens tokens: refuse a prompt that would
    not fit the model's context now, not after data synthesis and training. jsonl: the file's last
    data.val_prompts records (items, from load_prompts); selfgen: the longest prompt sampling can produce."""
    ctx, n = model.backbone.max_positions, c.decode.max_new_tokens
    if items is not None:
        for it in items[-c.data.val_prompts:]:
            length = len(model.encode(it.turns[0], chat=True))
            if length + n > ctx:
                raise SelfSpecError(
                    f"data.path={c.data.path}: validation prompt {it.id!r} is {length} tokens; with decode.max_new_tokens={n} "
                    f"it exceeds the model's context ({ctx}); lower decode.max_new_tokens or shorten the prompt")
    elif c.data.source == "selfgen":
        longest = c.data.prompt_max_tokens + len(model.encode("x", chat=True)) - 1  # + the chat template's tokens
        if longest + n > ctx:
            raise SelfSpecError(
                f"data.prompt_max_tokens={c.data.prompt_max_tokens}: sampled validation prompts reach {longest} tokens "
                f"with the chat template; with decode.max_new_tokens={n} that exceeds the model's context ({ctx})")


def _shipped_setting(model, decode_cfg):
    """(the head that ships for this model, the decode settings it carries over `decode_cfg`), or None when none
    ships: make train's final table shows the shipped setting beside the head it trained."""
    from dataclasses import replace as _replace

    path = shipped_head_for(model.backbone)
    if path is None:
        return None
    head = load_head(path, model.backbone)
    return head, _replace(decode_cfg, **head.decode_settings)


class RunHooks:
    """What logging, validating and checkpointing mean for this run (rank 0 only).

    With `lens` given, the validation at `final_step` also decodes the untrained logit lens, interleaved with
    the trained head and the autoregressive path, and keeps both rows in `compare`."""

    def __init__(self, logger, model, head, val_prompts, decode_cfg, run_dir: Path, keep: int,
                 lens=None, final_step: int | None = None, ckpt_dir: Path | None = None):
        self.logger, self.model, self.head, self.val_prompts = logger, model, head, val_prompts
        self.decode_cfg, self.run_dir, self.keep = decode_cfg, run_dir, keep
        self.ckpt_dir = ckpt_dir if ckpt_dir is not None else run_dir / "checkpoints"
        self.lens, self.final_step = lens, final_step
        self.compare: list[dict] = []
        self.val_time = 0.0
        self.recipe: dict | None = None  # stored in each checkpoint (training_recipe)

    def log(self, step: int, metrics: dict) -> None:
        self.logger.log(metrics, step=step)
        log.debug("step %d %s", step, metrics)

    def validate(self, step: int) -> dict:
        heads = {"trained": self.head}
        reference = None
        if self.lens is not None and step == self.final_step:
            heads["lens"] = self.lens
            if self.decode_cfg.lookup:  # what context lookup gives without any head, beside the heads that use it
                heads["lookup"] = None
            shipped = _shipped_setting(self.model, self.decode_cfg)
            if shipped is not None:  # the model's default (head=default) with its own settings, beside the new head
                heads["shipped"] = shipped
            # the table's speedup over HF generate
            reference = HFGenerate(self.model.hf_model, self.model.tokenizer, self.model.eos_ids)
        t = time.perf_counter()
        results = validation.validate(self.model.backbone, heads, self.val_prompts, self.decode_cfg, self.model.eos_ids, reference)
        self.val_time += time.perf_counter() - t
        metrics = results["trained"]
        self.logger.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)
        rows = [[i + 1, r] for i, r in enumerate(metrics["val/accept_rate_per_position"])]
        self.logger.log_table("val/accept_rate_by_position", ["position", "accept_rate"], rows)
        log.info("step %d: val/tau=%.3f val/accept_rate=%.3f val/speedup=%.3f", step, metrics["val/tau"],
                 metrics["val/accept_rate"], metrics["val/speedup"])
        if "lens" in results:
            E, K = self.head.exit_layer, self.decode_cfg.draft_len
            ar = results.get("autoregressive", {})
            self.compare = [{"name": "autoregressive (ours)", "exit_layer": None, "draft_len": None, "val/accept_rate": None,
                             "val/tau": 1.0, "val/speedup": 1.0, **ar},
                            {"name": "lens (untrained" + (f", {self.lens.draft_precision})" if self.lens.draft_precision != "full" else ")"),
                             "exit_layer": E, "draft_len": K, **results["lens"]},
                            {"name": f"{self.head.config.type} (trained)", "exit_layer": E, "draft_len": K, **metrics}]
            if "lookup" in results:
                with_lookup = f" + lookup ({self.decode_cfg.lookup_mode})"
                self.compare[1]["name"] += with_lookup
                self.compare[2]["name"] += with_lookup
                self.compare.insert(1, {"name": "context lookup alone (no head)", "exit_layer": None,
                                        "draft_len": self.decode_cfg.lookup_len, **results["lookup"]})
            if "shipped" in results:
                sh, scfg = heads["shipped"]
                self.compare.append({"name": f"shipped default ({sh.config.type}, {sh.draft_precision}"
                                             + (f", lookup {scfg.lookup_mode}" if scfg.lookup else "") + ")",
                                     "exit_layer": sh.exit_layer, "draft_len": scfg.draft_len, **results["shipped"]})
            self.logger.log_table("val/compare", ["method", "accept_rate", "tau", "speedup", "speedup_hf", "lossless"],
                                  [[r["name"], r["val/accept_rate"], r["val/tau"], r["val/speedup"], r.get("val/speedup_hf"),
                                    r["val/lossless"]] for r in self.compare])
            if metrics["val/tau"] < results["lens"]["val/tau"]:  # e.g. a low-bit draft trained on its own exact grid
                log.warning("the trained %s head drafts worse than the untrained lens of the same exit layer and precision "
                            "on the held-out prompts (tau %.2f < %.2f): keep the untrained draft, or train with a lower "
                            "trainer.lr", self.head.config.type, metrics["val/tau"], results["lens"]["val/tau"])
        return metrics

    def checkpoint(self, step: int, state: dict) -> None:
        save_checkpoint(self.ckpt_dir, step, state, self.keep, self.recipe)


def run_recipe(c: Configs, run_dir: Path, wandb_group: str | None = None, wandb_name: str | None = None,
               config: dict | None = None) -> dict:
    """The job from a typed recipe; `config` is what the W&B run records (default: the recipe itself)."""
    items = None
    if c.data.source == "jsonl":  # a bad prompt file fails here, naming file and line, before the model loads
        items = load_prompts(c.data.path, fmt=c.data.format, limit=c.data.limit)
        check(len(items) > c.data.val_prompts,
              f"data.path={c.data.path}: {len(items)} prompts; need more than data.val_prompts={c.data.val_prompts}")
    if c.trainer.resume not in (True, False, "true", "True", "false", "False", "", "auto"):
        files, named = resume_candidates(c.trainer.resume, Path(run_dir))  # a bad path fails now
        if named:
            check_resume_recipe(files[0], load_checkpoint(files[0]), training_recipe(c), c.trainer.resume_override)
    dist = init_distributed(c.model.device)
    c = replace(c, model=replace(c.model, device=rank_device(c.model.device, dist)))  # cuda:LOCAL_RANK per rank
    try:
        return _run(config if config is not None else asdict(c), c, dist, Path(run_dir), wandb_group, wandb_name, items)
    finally:
        shutdown(dist)


def _run(config: dict, c: Configs, dist, run_dir: Path, wandb_group, wandb_name, items=None) -> dict:
    """The job on this rank: model and head -> resume point -> data and features -> training (and validation) ->
    head/ and result.json (rank 0). -> the result ({} on ranks > 0)."""
    main = dist.is_main
    # Under torchrun every rank has its own Hydra run dir; rank 0's is the one that counts.
    run_dir = Path(broadcast_object(dist, str(run_dir.resolve())))
    run_dir.mkdir(parents=True, exist_ok=True)
    if c.trainer.num_threads:
        torch.set_num_threads(c.trainer.num_threads)
    seed_everything(c.trainer.seed)
    timings: dict[str, float] = {}

    t = time.perf_counter()
    model, head = _model_and_head(c)  # a bad exit layer fails before data synthesis
    timings["load_s"] = time.perf_counter() - t
    trainable = len(trainable_parameters(head)) > 0
    # before anything slow: the checkpoint to resume from, and the validation prompts' lengths
    mkey, ckpt_dir, resume = _resume_point(c, model, head, run_dir, main and trainable)
    check_val_prompt_lengths(model, c, items)
    data, data_dirs, hidden, final, cache_bytes = _data_and_features(model, head, c, dist, trainable, timings)
    val_prompts = _val_prompt_ids(model, data, c.decode.max_new_tokens)
    digest_before = weights_digest(model.hf_model)
    lcfg = replace(c.logger, group=wandb_group or c.logger.group, name=wandb_name or c.logger.name,
                   job_type=c.logger.job_type or "train") if main else LoggerConfig(kind="none")
    # a resumed training continues its W&B run: the id is kept beside the checkpoints it resumes from
    wandb_id = read_wandb_run_id(resume[0].parent) if resume is not None else None
    lens = _untrained_lens(head, model.backbone) if trainable and c.trainer.compare_lens else None
    head_dir = artifact = None
    with logging_run(lcfg, run_dir, config, wandb_id) as logger:
        if main and trainable and logger.run_id:
            write_wandb_run_id(ckpt_dir, logger.run_id)
        hooks = RunHooks(logger, model, head, val_prompts, c.decode, run_dir, c.trainer.keep_checkpoints, lens,
                         c.trainer.max_steps, ckpt_dir)
        hooks.recipe = training_recipe(c, mkey)
        result = _train(model.backbone, head, data, (hidden, final), c, dist, hooks, trainable, resume, timings)
        if main:
            logger.summary({k: v for k, v in result.metrics.items() if isinstance(v, (int, float))})
        # Only the head (or its LoRA) may have changed; the target itself must be untouched.
        if weights_digest(model.hf_model) != digest_before:
            raise RuntimeError("training changed the base model's weights (a bug: only the head may train)")
        if main and not result.stopped:
            head_dir, artifact = _save(head, result, c, run_dir, model.backbone, logger, mkey)
    if not main:
        return {}
    payload = _payload(head, result, c, timings, data, data_dirs, cache_bytes)
    if hooks.compare:
        payload["compare"] = hooks.compare
    if not result.stopped:
        payload["head_dir"] = str(head_dir)
        if artifact is not None:
            payload["head_artifact"] = artifact
    write_json(run_dir / RESULT_FILE, payload)
    return payload


def _model_and_head(c: Configs):
    """The model and the head to train: the saved one of head.path, or a fresh (untrained) one. -> (model, head)."""
    model = SelfSpecModel.from_pretrained(c.model, head=None)
    bb = model.backbone
    head = (load_head(c.head.path, bb, allow_other_model=c.head.allow_other_model).set_draft_precision(c.head.draft_precision)
            if c.head.path else build_head(replace(c.head, draft_vocab=None), bb, model.eos_ids))
    if c.trainer.init_from:
        check(not c.head.path, f"trainer.init_from={c.trainer.init_from!r}: give it or head.path (continue a saved head "
                               "as it is), not both")
        donor = load_head(c.trainer.init_from, bb, allow_other_model=c.head.allow_other_model)
        check(donor.config.type == head.config.type, f"trainer.init_from={c.trainer.init_from!r}: a {donor.config.type} "
                                                     f"head; head.type is {head.config.type}")
        copied, kept = head.load_matching(donor.trainable_state_dict())
        head.set_draft_vocab(donor.vocab_ids if donor.has_draft_vocab else None)
        log.info("trainer.init_from=%s: %d tensors copied; at their initialisation: %s", c.trainer.init_from,
                 len(copied), ", ".join(kept) or "none")
    return model, head


def _resume_point(c: Configs, model, head, run_dir: Path, look: bool):
    """-> (the model's cache key, the checkpoint dir, (path, state) of the checkpoint to resume from or None). With
    `look` (rank 0, a head with parameters) the checkpoint is read and its recipe checked (check_resume_recipe)."""
    bb = model.backbone
    mkey = dataset.model_key(c.model.cache_name, bb.fingerprint(), str(bb.dtype).removeprefix("torch."))
    ckpt_dir = checkpoint_dir(c, run_dir, mkey, head.exit_layer)
    resume = None
    if look:
        resume = load_resume_checkpoint(c.trainer.resume, run_dir, ckpt_dir)
        if resume is not None:
            check_resume_recipe(resume[0], resume[1], training_recipe(c, mkey), c.trainer.resume_override)
    return mkey, ckpt_dir, resume


def _data_and_features(model, head, c: Configs, dist, trainable: bool, timings: dict):
    """The training data, built by every rank (each answering its share of the prompts; rank 0 saves the cache)
    when it is not cached, and the head's draft vocabulary from it; then the layer-E hidden states, for heads that
    leave layers < E untouched, and the full-depth states for heads that read the verified context (the same cache
    at E = L): under torchrun each rank computes (or loads) only its part, the states of the sequences it trains on.
    With data.also, the union of several datasets (dataset.union), each with its own cache.
    -> (data, its cache dirs (data.also's after the first), the layer-E states or None, the final-layer states or
    None, bytes this run's data takes on disk)."""
    main, bb = dist.is_main, model.backbone
    t = time.perf_counter()
    data, data_dir, data_cached = dataset.load_or_build(model, c.data, cache_dir(), c.model.cache_name, progress=main, dist=dist)
    parts, dirs = [data], [data_dir]
    if c.data.also:  # more datasets beside it: one union, each read (or built) from its own cache
        check(not dist.enabled, "data.also: trains in one process only; under torchrun train on one dataset")
        for i, extra in enumerate(c.data.extra_datasets()):
            more, more_dir, _ = dataset.load_or_build(model, extra, cache_dir(), c.model.cache_name, progress=main, dist=dist)
            check(more_dir not in dirs, f"data.also[{i}]: names a dataset already in the union ({more_dir})")
            parts.append(more)
            dirs.append(more_dir)
        # encode: a part whose cache records no training prompts is checked by its tokens, encoded as it was built
        data, positions = dataset.union(parts, encode=lambda text: model.encode(text, chat=True))
        log.info("data.also: %s", ", ".join(f"{d.name} ({a['sequences']} sequences; {a['left_out']} left out, "
                                            f"their prompts held out)" for d, a in zip(dirs[1:], data.meta["also"])))
    timings["data_s"] = time.perf_counter() - t
    if not data_cached:  # the split of a fresh build: sampling prompts vs answering them
        timings.update({f"data_{k}": data.meta[k] for k in ("prompts_s", "answers_s") if k in data.meta})
    if c.head.draft_vocab and not c.head.path and not c.trainer.init_from:  # init_from: the donor's vocabulary
        # The N tokens the target actually writes most, measured on its own answers.
        head.set_draft_vocab(draft_vocab_from_counts(data.token_counts(bb.vocab_size), c.head.draft_vocab, model.eos_ids))
    log.info("data: %d sequences, %d response tokens, %d validation prompts (%s %s)", data.num_sequences,
             data.num_targets, len(data.val_prompts), "cached" if data_cached else "built", data_dir)

    t = time.perf_counter()
    hidden = final = None
    part = (dist.rank, dist.world_size)

    def states(depth: int):  # the cached states at `depth` of every token of `data` (of a union: each part's kept)
        if len(parts) == 1:
            return load_or_compute_hidden(bb, data, data_dir, depth, c.data.feature_dtype, main, part=part)[0]
        return torch.cat([load_or_compute_hidden(bb, p, d, depth, c.data.feature_dtype, main)[0][k]
                          for p, d, k in zip(parts, dirs, positions)])

    if trainable and head.training_input != "ids":  # "ids": the head runs layers < E itself (LoRA, lowbit)
        hidden = states(head.exit_layer)
    if trainable and head.training_input == "context":  # the states it reads: the same cache at each context depth
        final = side_by_side([hidden if d == head.exit_layer and hidden is not None else states(d)
                              for d in head.context_depths])
    timings["features_s"] = time.perf_counter() - t
    cache_bytes = sum((d / dataset.DATASET_FILE).stat().st_size for d in dirs)  # what this run's data costs on disk
    depths = ({head.exit_layer} if hidden is not None else set()) | (set(head.context_depths) if final is not None else set())
    cache_bytes += sum(hidden_path(d, e, c.data.feature_dtype, part).stat().st_size for d in dirs for e in depths)
    return data, dirs, hidden, final, cache_bytes


def _val_prompt_ids(model, data, max_new_tokens: int) -> list[list[int]]:
    """The held-out prompts, chat-encoded; one that leaves no room for max_new_tokens is refused."""
    bb = model.backbone
    val_prompts = [model.encode(p, chat=True) for p in data.val_prompts]
    too_long = [len(p) for p in val_prompts if len(p) + max_new_tokens > bb.max_positions]
    check(not too_long, f"decode.max_new_tokens={max_new_tokens}: a validation prompt of {max(too_long or [0])} tokens "
                        f"plus max_new_tokens exceeds the model's context ({bb.max_positions})")
    return val_prompts


def _untrained_lens(head, backbone):
    """trainer.compare_lens: the logit lens at the head's exit, with its draft vocabulary and draft precision: only
    training differs."""
    lens = build_head(HeadConfig(type="lens", exit_layer=head.exit_layer, draft_precision=head.draft_precision), backbone)
    lens.set_draft_vocab(head.vocab_ids if head.has_draft_vocab else None)
    return lens


def _train(backbone, head, data, features, c: Configs, dist, hooks: RunHooks, trainable: bool, resume, timings: dict):
    """Train the head on `features` ((layer-E states, final-layer states), either None) (from `resume`, (path, state), when rank 0 found a checkpoint), or validate a head without
    parameters as it is. -> TrainResult; its train_s and val_s into timings."""
    main = dist.is_main
    t = time.perf_counter()
    if trainable:
        trainer = Trainer(backbone, head, data, features[0], c.trainer, dist, progress=main, final=features[1])
        resume_from = broadcast_object(dist, str(resume[0]) if resume else None)
        if resume_from:
            trainer.load_state_dict(resume[1] if main else load_checkpoint(Path(resume_from)))
            log.info("resumed from %s at step %d", resume_from, trainer.step)
        result = trainer.fit(hooks if main else Hooks())
    else:  # the logit lens has nothing to train: validate it as it is
        log.info("head.type=%s has no trainable parameters: validation only", head.config.type)
        result = TrainResult(0, False, 0.0, hooks.validate(0) if main else {})
    timings["train_s"] = time.perf_counter() - t - hooks.val_time
    timings["val_s"] = hooks.val_time
    return result


def _save(head, result, c: Configs, run_dir: Path, backbone, logger, mkey: str):
    """Rank 0, a finished run: head/ (with the decode settings validation ran with: API, CLI and eval use them by
    default) and its W&B artifact. -> (the head's dir, the artifact or None)."""
    summary = {k: result.metrics[k] for k in ("val/tau", "val/accept_rate", "val/speedup") if k in result.metrics}
    head_dir = save_head(head, run_dir / "head", backbone, extra={"train": {"steps": result.step, **summary},
                                                                  "decode": tuned_settings(c.decode)}).resolve()
    artifact = logger.log_artifact(head_dir, head_artifact_name(c.model.cache_name, head.config.type, head.exit_layer),
                                   "head", metadata={"steps": result.step, **summary, "model": mkey})
    return head_dir, artifact


def _payload(head, result, c: Configs, timings: dict, data, data_dirs: list[Path], cache_bytes: int) -> dict:
    """result.json's numbers: the head, the steps, the timings, the data and the final metrics."""
    return {
        "status": "stopped" if result.stopped else "ok",
        "head": head.config.type, "exit_layer": head.exit_layer, "draft_len": c.decode.draft_len,
        "draft_vocab": int(head.vocab_ids.numel()) or None, "head_params": head.num_params(),
        "steps": result.step, "train_time_s": result.train_time_s, "timings": timings,
        "data": {"sequences": data.num_sequences, "response_tokens": data.num_targets, "tokens": int(data.tokens.numel()),
                 "cache_dir": str(data_dirs[0]), "cache_mb": cache_bytes / 2**20,
                 **({"also": [str(d) for d in data_dirs[1:]]} if len(data_dirs) > 1 else {}),
                 "cache_mb_per_1k_response_tokens": cache_bytes / 2**20 / max(1, data.num_targets) * 1000},
        **result.metrics,
    }


def train_head(recipe: Configs, run_dir: str | os.PathLike | None = None) -> Path:
    """Train a head from a typed recipe (TrainRunConfig; the evaluation's head cache builds one) -> its directory.

    Runs outside any Hydra job of its own, so it logs nothing to W&B (the caller owns that run) and writes
    into run_dir (default: a new outputs/train/<time>[_N])."""
    recipe = replace(recipe, logger=LoggerConfig(kind="none"))
    run_dir = Path(run_dir) if run_dir else unique_dir(Path("outputs/train") / time.strftime("%Y-%m-%d_%H-%M-%S"))
    payload = run_recipe(recipe, run_dir)
    return Path(payload["head_dir"])
