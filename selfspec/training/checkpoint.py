"""Training checkpoints: head (or LoRA) weights, optimizer, scheduler, RNG states and the step.

Files are `<run dir>/checkpoints/step-<N>.pt`, each written to a temp file and renamed into place, so a run
killed mid-write leaves the previous checkpoint intact (and only a stray temp file, removed on resume).
"""

from __future__ import annotations

import logging
import random
import re
from pathlib import Path

import numpy as np
import torch

from selfspec.errors import SelfSpecError
from selfspec.training.dataset import atomic_torch_save

log = logging.getLogger(__name__)

FORMAT = "selfspec-train-ckpt/1"
_NAME = re.compile(r"^step-(\d+)\.pt$")


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_files(directory: Path) -> list[Path]:
    """step-*.pt files in directory, oldest step first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def save_checkpoint(directory: Path, step: int, state: dict, keep: int) -> Path:
    path = directory / f"step-{step:07d}.pt"
    atomic_torch_save({"format": FORMAT, "step": step, **state}, path)
    for old in checkpoint_files(directory)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def load_checkpoint(path: Path) -> dict:
    try:
        # RNG states hold numpy arrays and Python tuples: not loadable with weights_only. These files are
        # our own, written by this run or the one it resumes.
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # torch raises several types for truncated / foreign files
        raise SelfSpecError(f"trainer.resume: cannot read checkpoint {path} ({str(exc).splitlines()[0]})")
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise SelfSpecError(f"trainer.resume: {path} is not a selfspec training checkpoint")
    return state


def find_resume_checkpoint(resume: bool | str, run_dir: Path) -> Path | None:
    """The checkpoint to resume from: resume=true -> the newest in run_dir/checkpoints (None when there is
    none yet: a first launch of a requeued job); a path -> that file, or the newest under that run dir."""
    if resume is False or resume in ("false", "False", ""):
        return None
    if resume is True or resume in ("true", "True"):
        directory = run_dir / "checkpoints"
        for tmp in directory.glob(".step-*.tmp*") if directory.is_dir() else []:
            tmp.unlink(missing_ok=True)  # a write that a kill interrupted
        files = checkpoint_files(directory)
        if not files:
            log.warning("trainer.resume=true: no checkpoint in %s yet; starting from step 0", directory)
            return None
        return files[-1]
    path = Path(str(resume)).expanduser()
    if path.is_file():
        return path
    for directory in (path / "checkpoints", path):
        files = checkpoint_files(directory)
        if files:
            return files[-1]
    raise SelfSpecError(f"trainer.resume={resume!r}: no checkpoint file there (expected step-N.pt or a run dir with checkpoints/)")
