"""A Hydra sweep dir as the jobs left it: each job writes `result.json` into its own run dir (a failed job one with
"status": "failed"), and the sweep reports (cli/sweep_summary.py, evaluation/sweep.py) read them back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from selfspec.utils.io import atomic_write_json

RESULT_FILE = "result.json"

# Directories that a sweep dir holds besides job dirs (Hydra's own, submitit's, W&B's); never job dirs.
_SKIP_DIRS = {".hydra", ".submitit", "wandb", "__pycache__"}


def write_json(path: Path, payload: dict) -> None:
    """Atomically (selfspec.utils.io): the sweep summary never reads half a result."""
    atomic_write_json(path, payload, sort_keys=True)


def _is_job_dir(path: Path) -> bool:
    # A job that crashed before writing result.json still has the .hydra/ that Hydra writes at job start.
    return (path / RESULT_FILE).is_file() or (path / ".hydra").is_dir()


def _job_sort_key(rel: str) -> tuple[Any, ...]:
    # Hydra's default subdir is the job number: "10" must come after "9", not after "1".
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in Path(rel).parts)


def find_job_dirs(sweep_dir: Path) -> list[Path]:
    """Job dirs under sweep_dir, in job order; nested ones too, for a custom `hydra.sweep.subdir` with slashes."""
    found: list[Path] = []

    def walk(directory: Path) -> None:
        for child in directory.iterdir():
            if not child.is_dir() or child.name in _SKIP_DIRS or child.name.startswith("."):
                continue
            if _is_job_dir(child):
                found.append(child)  # a job dir's own subdirs (checkpoints, wandb) are not jobs
            else:
                walk(child)

    walk(sweep_dir)
    return sorted(found, key=lambda p: _job_sort_key(p.relative_to(sweep_dir).as_posix()))
