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

from selfspec.utils.io import atomic_write_json, unique_dir

log = logging.getLogger(__name__)

RESULT_FILE = "result.json"

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
    from selfspec.errors import SelfSpecError

    try:
        return fn(cfg)
    except SelfSpecError as exc:
        print_user_error_and_exit(exc)
