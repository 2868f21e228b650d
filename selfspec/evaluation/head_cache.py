"""Heads for evaluation: a saved directory, the head cache, training on demand, or an untrained head.

A sweep over exit layers needs one trained head per E. They live in a cache keyed by what determines the
weights' shape and meaning:

    <cache>/heads/<model>-<type>-E<e>-<fingerprint>/      (head_config.json + head.safetensors, see heads/)

where <cache> is `selfspec.model.loading.cache_dir()` (SELFSPEC_CACHE) unless `head_cache.dir` says otherwise,
and the fingerprint hashes the base model's fingerprint and the head's size options. A missing head is trained
once (under a file lock, so parallel sweep jobs wait for the first instead of training the same E twice) when
`head_cache.train_missing` is on and `selfspec.training.train_head` exists; otherwise the untrained head is used
and the source is reported as "untrained".
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import asdict, replace
from pathlib import Path

from selfspec.errors import check
from selfspec.heads import ExitHead, HeadConfig, build_head, default_exit_layer, load_head
from selfspec.heads.base import check_exit_layer
from selfspec.model.loading import cache_dir

log = logging.getLogger(__name__)

# HeadConfig fields that change a head's weights (not where it is stored or which layer it exits at).
_SIZE_KEYS = ("draft_vocab", "num_blocks", "num_heads", "adapter_heads", "lora_rank", "lora_alpha", "lora_targets")


def heads_root(configured: str | None = None) -> Path:
    return Path(configured).expanduser() if configured else cache_dir() / "heads"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]+", "_", name)


def head_fingerprint(backbone, hcfg: HeadConfig) -> str:
    payload = {"model": backbone.fingerprint(), "head": {k: getattr(hcfg, k) for k in _SIZE_KEYS}, "type": hcfg.type}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:10]


def head_dir(root: Path, model_name: str, backbone, hcfg: HeadConfig, exit_layer: int) -> Path:
    return root / f"{_safe(model_name)}-{hcfg.type}-E{exit_layer}-{head_fingerprint(backbone, hcfg)}"


def cached_exit_layers(root: Path, model_name: str, backbone, hcfg: HeadConfig) -> dict[int, Path]:
    """E -> directory for every complete cached head of this model, type and sizes."""
    fp = head_fingerprint(backbone, hcfg)
    pattern = re.compile(rf"^{re.escape(_safe(model_name))}-{re.escape(hcfg.type)}-E(\d+)-{fp}$")
    found = {}
    if root.is_dir():
        for d in root.iterdir():
            m = pattern.match(d.name)
            if m and (d / "head_config.json").is_file() and (d / "head.safetensors").is_file():
                found[int(m.group(1))] = d
    return dict(sorted(found.items()))


@contextlib.contextmanager
def _lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes, also if the process dies
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _trainer():
    """`selfspec.training.train_head(cfg, run_dir) -> head dir`, or None without the training package."""
    try:
        from selfspec import training
    except ImportError:
        return None
    return getattr(training, "train_head", None)


def train_config(model_node, hcfg: HeadConfig, exit_layer: int, overrides: list[str]):
    """The training config (conf/train.yaml + overrides) with the evaluated model and this head put in."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from selfspec.paths import conf_dir

    if GlobalHydra.instance().is_initialized():  # inside `python -m selfspec.eval`: same config search path
        tcfg = compose(config_name="train", overrides=list(overrides))
    else:
        with initialize_config_dir(str(conf_dir()), version_base="1.3"):
            tcfg = compose(config_name="train", overrides=list(overrides))
    OmegaConf.set_struct(tcfg, False)
    tcfg.model = model_node
    tcfg.head = OmegaConf.create(asdict(replace(hcfg, exit_layer=exit_layer, path=None)))
    return tcfg


def _train(train_head, model_node, hcfg: HeadConfig, exit_layer: int, overrides: list[str],
           run_dir: Path | None) -> Path:
    out = train_head(train_config(model_node, hcfg, exit_layer, overrides), run_dir)
    check(out is not None and Path(out).is_dir(), f"selfspec.training.train_head returned {out!r}, not a head directory")
    return Path(out)


def resolve_head(
    model,
    hcfg: HeadConfig,
    exit_layer: int | None = None,
    model_name: str = "model",
    model_node=None,
    root: Path | None = None,
    train_missing: bool = True,
    train_overrides: list[str] | None = None,
    train_dir: Path | None = None,
) -> tuple[ExitHead, str]:
    """-> (head on model.backbone, source) with source one of "path", "cache", "trained", "untrained".

    hcfg.path wins (Hydra interpolation makes it a template: head.path='heads/E${head.exit_layer}'); a head
    loaded from a path must exit where head.exit_layer says, when that is set, so a sweep cannot silently run
    one head under several E labels. A head trained here keeps its training run (logs, checkpoints) in
    train_dir/<type>-E<e> (default: the trainer's own outputs/train/...)."""
    bb = model.backbone
    if hcfg.path:
        head = load_head(hcfg.path, bb)
        want = exit_layer if exit_layer is not None else hcfg.exit_layer
        check(want is None or head.exit_layer == want,
              f"head.path={hcfg.path!r}: the head exits at layer {head.exit_layer}, but head.exit_layer={want}")
        return head, "path"
    E = exit_layer if exit_layer is not None else hcfg.exit_layer
    E = E if E is not None else default_exit_layer(bb.num_layers)
    check_exit_layer(E, bb.num_layers)
    fresh = replace(hcfg, exit_layer=E, path=None)
    if fresh.type == "lens" and not fresh.draft_vocab:
        return build_head(fresh, bb, model.eos_ids), "untrained"  # nothing to train: the logit lens is exact
    root = root or heads_root()
    target = head_dir(root, model_name, bb, fresh, E)
    if (target / "head_config.json").is_file():
        return load_head(target, bb), "cache"
    train_head = _trainer() if train_missing else None
    if train_head is None:
        if train_missing:
            log.warning("no cached %s head for E=%d and selfspec.training.train_head is not available: "
                        "using an UNTRAINED head (acceptance will be low)", fresh.type, E)
        return build_head(fresh, bb, model.eos_ids), "untrained"
    # Lock files live apart from the heads: removing one while another job waits on it would break the lock.
    with _lock(root / ".locks" / f"{target.name}.lock"):
        if not (target / "head_config.json").is_file():  # another job may have trained it while we waited
            log.info("training a %s head at E=%d into %s (once; later jobs load it)", fresh.type, E, target)
            run_dir = Path(train_dir) / f"{fresh.type}-E{E}" if train_dir else None
            trained = _train(train_head, model_node, fresh, E, train_overrides or [], run_dir)
            tmp = target.with_name(target.name + f".tmp{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(trained, tmp)
            os.replace(tmp, target)
            source = "trained"
        else:
            source = "cache"
    return load_head(target, bb), source
