"""Where things live: the Hydra configs (the top-level conf/ in a source checkout or editable install,
selfspec/conf inside an installed wheel, where pyproject maps conf/), and the cache directory."""

from __future__ import annotations

import os
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def conf_dir() -> Path:
    for candidate in (_HERE.parent / "conf", _HERE / "conf"):
        if (candidate / "model").is_dir():
            return candidate
    raise FileNotFoundError("selfspec: cannot find the conf/ directory (broken install?)")


def cache_dir() -> Path:
    """Converted models, training data, heads, compiled kernels: $SELFSPEC_CACHE, default ~/.cache/selfspec."""
    return Path(os.environ.get("SELFSPEC_CACHE", Path.home() / ".cache" / "selfspec")).expanduser()
