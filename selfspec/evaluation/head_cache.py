"""Heads for evaluation: a saved directory, the head cache, training on demand, or an untrained head.

A sweep over exit layers needs one trained head per E. They live in a cache keyed by what determines the
weights' shape and meaning:

    <cache>/heads/<model>-<type>-E<e>-<fingerprint>/      (head_config.json + head.safetensors, see heads/)

where <cache> is `selfspec.utils.paths.cache_dir()` (SELFSPEC_CACHE) unless `head_cache.dir` says otherwise,
and the fingerprint hashes the base model's fingerprint, the head's size options and the whole training recipe
(every trainer and data setting that changes the weights: a head trained for 2 steps is not reused for a
recipe of 50). <model> is the model's cache name (model=hf: its path), made path-safe. A missing head is trained
once (under a file lock, so parallel sweep jobs wait for the first instead of training the same E twice) when
`head_cache.train_missing` is on, by calling training's public entry point `selfspec.training.train_head` with a
typed recipe (TrainRunConfig: the model, this head, `head_cache.trainer` and `head_cache.data`); otherwise the
untrained head is used and the source is reported as "untrained".
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path

from selfspec.errors import check
from selfspec.heads import ExitHead, HeadConfig, as_head_config, build_head, head_spec, load_head
from selfspec.heads.saving import DEFAULT_HEAD, resolve_default_head
from selfspec import training
from selfspec.training import TrainRunConfig
from selfspec.utils.io import atomic_dir, file_lock, safe_name
from selfspec.utils.paths import cache_dir

log = logging.getLogger(__name__)

# Head config fields that do not change a head's weights (where it is stored, which layer it exits at); every
# other field of the head type's config (heads/config.py) does.
_NOT_SIZE_KEYS = ("type", "exit_layer", "path", "allow_other_model", "draft_precision")


def heads_root(configured: str | None = None) -> Path:
    return Path(configured).expanduser() if configured else cache_dir() / "heads"


def recipe_key(recipe=None) -> dict:
    """The training settings that decide a trained head's weights (selfspec.training.run.training_recipe of
    the TrainRunConfig, its model and head left out: they are keyed apart); None = training's defaults."""
    # the training machinery (training/run.py and its data stack) loads when a head is keyed, not for eval --help
    from selfspec.training.run import training_recipe

    return training_recipe(replace(recipe if recipe is not None else TrainRunConfig(model=None, head=None), head=None))


def head_fingerprint(backbone, hcfg: HeadConfig, recipe=None) -> str:
    payload = {"model": backbone.fingerprint(), "head": {k: v for k, v in asdict(as_head_config(hcfg)).items() if k not in _NOT_SIZE_KEYS},
               "type": hcfg.type, "recipe": recipe_key(recipe)}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:10]


def head_dir(root: Path, model_name: str, backbone, hcfg: HeadConfig, exit_layer: int, recipe=None) -> Path:
    return root / f"{safe_name(model_name)}-{hcfg.type}-E{exit_layer}-{head_fingerprint(backbone, hcfg, recipe)}"


def cached_exit_layers(root: Path, model_name: str, backbone, hcfg: HeadConfig, recipe=None) -> dict[int, Path]:
    """E -> directory for every complete cached head of this model, type, sizes and training recipe."""
    fp = head_fingerprint(backbone, hcfg, recipe)
    pattern = re.compile(rf"^{re.escape(safe_name(model_name))}-{re.escape(hcfg.type)}-E(\d+)-{fp}$")
    found = {}
    if root.is_dir():
        for d in root.iterdir():
            m = pattern.match(d.name)
            if m and (d / "head_config.json").is_file() and (d / "head.safetensors").is_file():
                found[int(m.group(1))] = d
    return dict(sorted(found.items()))


def _trainer():
    """`selfspec.training.train_head(recipe, run_dir) -> head dir` (tests put a fake, or None for no trainer, in its place)."""
    return training.train_head


def head_recipe(recipe, hcfg: HeadConfig, exit_layer: int):
    """The typed training recipe (selfspec.training.TrainRunConfig) with this head at this exit layer."""
    return replace(recipe, head=replace(hcfg, exit_layer=exit_layer, path=None))


def _train(train_head, recipe, run_dir: Path | None) -> Path:
    out = train_head(recipe, run_dir)
    check(out is not None and Path(out).is_dir(), f"selfspec.training.train_head returned {out!r}, not a head directory")
    return Path(out)


def resolve_head(
    model,
    hcfg: HeadConfig,
    exit_layer: int | None = None,
    model_name: str = "model",
    root: Path | None = None,
    train_missing: bool = True,
    recipe=None,
    train_dir: Path | None = None,
) -> tuple[ExitHead, str]:
    """-> (head on model.backbone, source) with source one of "shipped" (head=default), "path", "cache", "trained",
    "untrained".

    recipe: the selfspec.training.TrainRunConfig a missing head is trained with (its head is replaced by this
    one); None = training's defaults for model.model_config.

    hcfg.path wins (Hydra interpolation makes it a template: head.path='heads/E${head.exit_layer}'); a head
    loaded from a path must exit where head.exit_layer says, when that is set, so a sweep cannot silently run
    one head under several E labels. A head trained here keeps its training run (logs, checkpoints) in
    train_dir/<type>-E<e> (default: the trainer's own outputs/train/...)."""
    bb = model.backbone
    shipped = hcfg.path == DEFAULT_HEAD
    hcfg = resolve_default_head(hcfg, bb)  # head=default: the shipped head for this model, else the lens
    if hcfg.path:
        head = load_head(hcfg.path, bb, allow_other_model=hcfg.allow_other_model).set_draft_precision(hcfg.draft_precision)
        want = exit_layer if exit_layer is not None else hcfg.exit_layer
        check(want is None or head.exit_layer == want,
              f"head.path={hcfg.path!r}: the head exits at layer {head.exit_layer}, but head.exit_layer={want}")
        return _from_dir(head, hcfg.path), "shipped" if shipped else "path"
    E = head_spec(hcfg.type).head_class.exit_layer_for(exit_layer if exit_layer is not None else hcfg.exit_layer, bb.num_layers)
    fresh = replace(hcfg, exit_layer=E, path=None)
    if fresh.type == "lens" and not fresh.draft_vocab:
        return build_head(fresh, bb, model.eos_ids), "untrained"  # nothing to train: the logit lens is exact
    root = root or heads_root()
    target = head_dir(root, model_name, bb, fresh, E, recipe)
    if (target / "head_config.json").is_file():
        return _from_dir(load_head(target, bb).set_draft_precision(hcfg.draft_precision), target), "cache"
    train_head = _trainer() if train_missing else None
    if train_head is None:
        if train_missing:
            log.warning("no cached %s head for E=%d and selfspec.training.train_head is not available: "
                        "using an UNTRAINED head (acceptance will be low)", fresh.type, E)
        return build_head(fresh, bb, model.eos_ids), "untrained"
    source = _train_into(target, root, train_head, model, fresh, model_name, recipe, train_dir)
    return _from_dir(load_head(target, bb).set_draft_precision(hcfg.draft_precision), target), source


def _train_into(target: Path, root: Path, train_head, model, fresh: HeadConfig, model_name: str, recipe,
                train_dir: Path | None) -> str:
    """Train the missing head `fresh` (at its exit layer) with `train_head` and store it at `target`, under a lock, so
    that parallel jobs train it once -> "trained", or "cache" when another job stored it while this one waited."""
    E = fresh.exit_layer
    # Lock files live apart from the heads: removing one while another job waits on it would break the lock.
    with file_lock(root / ".locks" / f"{target.name}.lock"):
        if (target / "head_config.json").is_file():  # another job may have trained it while we waited
            return "cache"
        run_dir = Path(train_dir) / f"{fresh.type}-E{E}" if train_dir else None
        if recipe is None:
            recipe = TrainRunConfig(model=model.model_config, head=fresh)
        log.warning("head cache: no trained %s head at E=%d for %s: training one now (%s), run dir %s, then "
                    "stored in %s for later jobs", fresh.type, E, model_name, _recipe_summary(recipe),
                    run_dir or "outputs/train/<time>", target)
        t = time.perf_counter()
        trained = _train(train_head, head_recipe(recipe, fresh, E), run_dir)
        with atomic_dir(target, replace=False) as tmp:
            shutil.copytree(trained, tmp, dirs_exist_ok=True)
        log.warning("head cache: trained the %s head at E=%d in %.0f s: %s", fresh.type, E, time.perf_counter() - t,
                    target)
        return "trained"


def _from_dir(head: ExitHead, path) -> ExitHead:
    """The head, marked with the directory it was loaded from (`source_dir`: eval declares it as its W&B input)."""
    head.source_dir = Path(path)
    return head


def _recipe_summary(recipe) -> str:
    """What a head cache training run does, in a few words: its steps, batch, lr and data."""
    t, d = recipe.trainer, recipe.data
    data = f"data.source={d.source}" + (f" data.path={d.path}" if d.path else f" data.num_prompts={d.num_prompts}")
    return f"trainer.max_steps={t.max_steps} trainer.batch_size={t.batch_size} trainer.lr={t.lr} {data}"
