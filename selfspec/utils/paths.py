"""Where things live: the Hydra configs (the top-level conf/ in a source checkout or editable install,
selfspec/conf inside an installed wheel, where pyproject maps conf/), and the cache directory."""

from __future__ import annotations

import os
from pathlib import Path

_HERE = Path(__file__).resolve().parents[1]  # selfspec/


def conf_dir() -> Path:
    for candidate in (_HERE.parent / "conf", _HERE / "conf"):
        if (candidate / "model").is_dir():
            return candidate
    raise FileNotFoundError("selfspec: cannot find the conf/ directory (broken install?)")


def cache_dir() -> Path:
    """The one place the cache root is decided (converted models, training data, heads, excluded-prompt hashes,
    compiled kernels): $SELFSPEC_CACHE, or ~/.cache/selfspec when it is unset, empty or blank (an empty value
    never means the working directory)."""
    value = os.environ.get("SELFSPEC_CACHE")
    if value is None or not value.strip():
        return Path.home() / ".cache" / "selfspec"
    return Path(value).expanduser()
