"""Helpers for the Hydra entry points: keep one failing sweep job from stopping the others, report user
errors as one line instead of a traceback, and give every run a directory of its own (`${unique_dir:...}`)."""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf

from selfspec.decoding.config import DECODE_KEYS, user_set_keys
from selfspec.errors import SelfSpecError
from selfspec.utils.io import atomic_write_json, unique_dir
from selfspec.utils.paths import conf_dir
from selfspec.utils.sweeps import RESULT_FILE

log = logging.getLogger(__name__)

_RUN_DIRS: dict[str, str] = {}


def unique_run_dir(base: str) -> str:
    """The resolver `${unique_dir:outputs/train/${now:...}}`: a directory no other run has. Runs started in
    the same second get base, base_1, base_2, ... (created here, atomically). The ranks of one torchrun job
    share one directory, named after the job (rank 0's is the one that counts). Resolved once per process."""
    if base not in _RUN_DIRS:
        if "TORCHELASTIC_RUN_ID" in os.environ and os.environ.get("WORLD_SIZE", "1") != "1":
            job = "|".join(os.environ.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"))
            path = Path(f"{base}_{hashlib.sha256(job.encode()).hexdigest()[:8]}")
            path.mkdir(parents=True, exist_ok=True)
            _RUN_DIRS[base] = str(path)
        else:
            _RUN_DIRS[base] = str(unique_dir(base))
    return _RUN_DIRS[base]


if not OmegaConf.has_resolver("unique_dir"):
    # use_cache: Hydra copies resolver caches into each sweep job's config (as for ${now:}), so a job that
    # re-resolves its sweep dir in another process (submitit) gets the same directory, not a new one.
    OmegaConf.register_new_resolver("unique_dir", unique_run_dir, use_cache=True)


def run_job_safely(fn: Callable[[Any], float | None], cfg: Any) -> float | None:
    """Call fn(cfg); on failure record it in <run dir>/result.json for the sweep summary.

    In a multirun the error is logged and None returned, so that Hydra's launcher goes on with the other jobs
    (the sweep summary then lists this one as failed). In a single run the exception is re-raised, so the
    caller still sees it and exits non-zero.
    """
    try:
        return fn(cfg)
    except Exception as exc:
        hydra_cfg = HydraConfig.get()
        error = f"{type(exc).__name__}: {exc}"
        try:
            # Atomically (selfspec.utils.io): the sweep summary never reads half a file.
            atomic_write_json(Path(hydra_cfg.runtime.output_dir) / RESULT_FILE, {"status": "failed", "error": error},
                              sort_keys=True)
        except OSError as write_exc:
            # Never let the bookkeeping hide the real error.
            log.error("could not write %s: %s", RESULT_FILE, write_exc)
        log.error("job failed: %s", error, exc_info=True)
        if hydra_cfg.mode == RunMode.MULTIRUN:
            return None
        raise


def print_user_error_and_exit(exc: BaseException) -> NoReturn:
    """Report a user error (bad config, unusable file) as `error: <message>` and exit with status 2."""
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(2)


def run_or_exit(fn: Callable[[Any], Any], cfg: Any) -> Any:
    """An entry point's body: `fn(cfg)`, with a user error (SelfSpecError) reported in one line and exit 2."""
    try:
        return fn(cfg)
    except SelfSpecError as exc:
        print_user_error_and_exit(exc)


# ------------------------------------------------------------------------------------------------ user-set keys
DEFAULT_DECODE = "greedy"  # conf/decode/greedy.yaml: the decode group's default, DecodeConfig's own values


def _option_file(group: str, option: str) -> Path | None:
    """The yaml file of `group=option` on this run's config search path (file:// and pkg:// sources)."""
    import importlib.resources

    for source in HydraConfig.get().runtime.config_sources:
        try:
            if source.schema == "file":
                path = Path(source.path) / group / f"{option}.yaml"
            elif source.schema == "pkg":
                path = Path(str(importlib.resources.files(source.path.replace("/", ".")))) / group / f"{option}.yaml"
            else:
                continue
        except (ModuleNotFoundError, TypeError, ValueError):
            continue
        if path.is_file():
            return path
    return None


def _is_global(path: Path) -> bool:
    """A config file whose keys sit at the root (`# @package _global_`), as experiment files do."""
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line.startswith("# @package"):
            return line.split()[-1] == "_global_"
        if line and not line.startswith("#"):
            return False
    return False


def _decode_keys_in(group: str, option: str, seen: set) -> set[str]:
    """The decode keys that the file of `group=option` (and decode files it pulls in) writes itself."""
    if (group, option) in seen or option in (None, "null") or (group == "decode" and option == DEFAULT_DECODE):
        return set()
    seen.add((group, option))
    path = _option_file(group, str(option))
    if path is None:
        return set()
    node = OmegaConf.to_container(OmegaConf.load(path)) or {}
    if not isinstance(node, dict):
        return set()
    keys: set[str] = set()
    defaults = node.pop("defaults", None) or []
    if group == "decode":
        keys |= set(node)
        for entry in defaults:  # another decode option it builds on (`- sample`), not `_self_`
            if isinstance(entry, str) and entry != "_self_":
                keys |= _decode_keys_in("decode", entry, seen)
    elif _is_global(path) and isinstance(node.get("decode"), dict):
        keys |= set(node["decode"])
    return keys


def decode_keys_set(decode_node) -> set[str]:
    """The decode keys the user set in this Hydra run, by any route: on the command line (`decode.k=v`), in the
    chosen `decode=` file (conf/decode/ or a hydra.searchpath directory), in an experiment (or any other
    `@package _global_`) file, and any key whose composed value differs from the decode group's default
    (conf/decode/greedy.yaml). A head's tuned settings fill only the other keys (decoding/config.py:
    with_tuned_settings). Outside a Hydra run: every key (nothing is taken from a head)."""
    every = set(DECODE_KEYS)
    if not HydraConfig.initialized():
        return every
    hc = HydraConfig.get()
    keys = set(user_set_keys(hc.overrides.task))
    base = OmegaConf.to_container(OmegaConf.load(conf_dir() / "decode" / f"{DEFAULT_DECODE}.yaml")) or {}
    base.pop("defaults", None)
    composed = OmegaConf.to_container(decode_node, resolve=True) if decode_node is not None else {}
    keys |= {k for k, v in composed.items() if k not in base or base[k] != v}
    seen: set = set()
    for group, option in hc.runtime.choices.items():
        if not str(group).startswith("hydra"):
            keys |= _decode_keys_in(str(group), option, seen)
    return keys
