"""Helpers for the Hydra entry points: keep one failing sweep job from stopping the others, and report user
errors as one line instead of a traceback."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

log = logging.getLogger(__name__)

RESULT_FILE = "result.json"


def _write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """Write via a temp file + os.replace, so a reader (the sweep summary) never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


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
            _write_json_atomic(Path(hydra_cfg.runtime.output_dir) / RESULT_FILE, {"status": "failed", "error": error})
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
