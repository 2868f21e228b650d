"""Training checkpoints: head (or LoRA) weights, optimizer, scheduler, RNG states, the step and the recipe.

Files are `<run dir>/checkpoints/step-<N>.pt`, written atomically and fsync'ed (selfspec.utils.io), so a run
killed mid-write leaves the previous checkpoint intact (and only a stray temp file, removed on resume).

Everything in a checkpoint is a tensor, a number, a string or a list/dict of them, so it loads with
`torch.load(weights_only=True)`: a crafted file given as `trainer.resume` cannot run code. The run's
training recipe (the settings that decide the weights) is stored too; resuming with other settings is
refused, naming the keys (`trainer.resume_override=true` resumes anyway).
"""

from __future__ import annotations

import json
import logging
import random
import re
from pathlib import Path

import numpy as np
import torch

from selfspec.errors import SelfSpecError
from selfspec.utils.io import atomic_write
from selfspec.utils.tensors import safe_torch_load

log = logging.getLogger(__name__)

FORMAT = "selfspec-train-ckpt/2"
_NAME = re.compile(r"^step-(\d+)\.pt$")


def rng_state() -> dict:
    """Every RNG the training touches, as tensors and plain numbers (loadable with weights_only=True)."""
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_files(directory: Path) -> list[Path]:
    """step-*.pt files in directory, oldest step first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def save_checkpoint(directory: Path, step: int, state: dict, keep: int, recipe: dict | None = None) -> Path:
    path = directory / f"step-{step:07d}.pt"
    payload = {"format": FORMAT, "step": step, **state}
    if recipe is not None:
        payload["recipe"] = json.dumps(recipe, sort_keys=True, default=str)
    atomic_write(path, lambda f: torch.save(payload, f))
    prune_checkpoints(directory, step, keep)
    return path


def prune_checkpoints(directory: Path, step: int, keep: int) -> None:
    """After writing step `step`: keep it and the newest `keep - 1` before it. A checkpoint of a higher step is
    stale (left by a run this one does not continue: it resumed from an earlier step, or started over in the
    same directory); it goes, since keeping it would discard fresh checkpoints and `trainer.resume=true` would
    jump back onto it."""
    files = checkpoint_files(directory)
    stale = [p for p in files if _step_of(p) > step]
    current = [p for p in files if _step_of(p) <= step]
    for old in stale:
        log.warning("removing stale checkpoint %s (step %d is ahead of this run's step %d)", old, _step_of(old), step)
        old.unlink(missing_ok=True)
    for old in current[:-keep] if keep > 0 else current:
        old.unlink(missing_ok=True)


def _step_of(path: Path) -> int:
    return int(_NAME.match(path.name).group(1))


def load_checkpoint(path: Path) -> dict:
    """The checkpoint's state dict; SelfSpecError (one line) for anything that is not a readable selfspec
    checkpoint. Never unpickles arbitrary objects (weights_only=True)."""
    try:
        if path.stat().st_size == 0:
            raise SelfSpecError(f"trainer.resume: cannot read checkpoint {path} (the file is empty)")
        state = safe_torch_load(path)
    except SelfSpecError:
        raise
    except Exception as exc:  # torch raises several types for truncated / foreign / malicious files
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "weights_only" in str(exc) or "Unsupported global" in str(exc):
            first = "it holds objects other than tensors and plain values; refusing to unpickle it"
        raise SelfSpecError(f"trainer.resume: cannot read checkpoint {path} ({first})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise SelfSpecError(f"trainer.resume: {path} is not a selfspec training checkpoint (format {FORMAT})")
    return state


def checkpoint_recipe(state: dict) -> dict | None:
    raw = state.get("recipe")
    try:
        return json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        return None


def recipe_differences(saved: dict, current: dict) -> list[str]:
    """The keys (e.g. `trainer.lr`) whose values differ between two flat recipes, sorted."""
    return sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))


def resume_candidates(resume: bool | str, run_dir: Path, directory: Path | None = None) -> tuple[list[Path], bool]:
    """The checkpoints to try, newest first, and whether the user named one file (no fallback then).

    resume=auto|true -> the run's checkpoint dir (`directory`, default run_dir/checkpoints; none yet: an empty list,
    a first launch of a requeued job); a path -> that file, or the checkpoints under that run dir (or directory of
    checkpoints)."""
    if resume is False or resume in ("false", "False", ""):
        return [], False
    if resume is True or resume in ("true", "True", "auto"):
        directory = directory if directory is not None else run_dir / "checkpoints"
        for tmp in directory.glob(".step-*.tmp*") if directory.is_dir() else []:
            tmp.unlink(missing_ok=True)  # a write that a kill interrupted
        return checkpoint_files(directory)[::-1], False
    path = Path(str(resume)).expanduser()
    if path.is_file():
        return [path], True
    for directory in (path / "checkpoints", path):
        files = checkpoint_files(directory)
        if files:
            return files[::-1], False
    raise SelfSpecError(f"trainer.resume={resume!r}: no checkpoint file there (expected step-N.pt or a run dir with checkpoints/)")


def load_resume_checkpoint(resume: bool | str, run_dir: Path, directory: Path | None = None) -> tuple[Path, dict] | None:
    """(path, state) of the checkpoint to resume from, or None when there is nothing to resume.

    A newest checkpoint that cannot be read (zero-length after a crash, damaged) falls back to the one
    before it, with one warning line; a file named explicitly must be readable."""
    files, named = resume_candidates(resume, run_dir, directory)
    if not files:
        if resume not in (False, "false", "False", "", "auto"):
            log.warning("trainer.resume=true: no checkpoint in %s yet; starting from step 0", directory or run_dir / "checkpoints")
        return None
    errors = []
    for path in files:
        try:
            return path, load_checkpoint(path)
        except SelfSpecError as exc:
            if named:
                raise
            errors.append(str(exc))
            log.warning("skipping unreadable checkpoint %s (%s)", path, str(exc).split("(", 1)[-1].rstrip(")"))
    raise SelfSpecError(f"trainer.resume: no readable checkpoint among {len(files)} in {files[0].parent} (newest: {errors[0]})")
