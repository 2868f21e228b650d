"""Where the Hydra configs live: the top-level conf/ in a source checkout (editable install), or
selfspec/conf inside an installed wheel (pyproject maps conf/ there)."""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent


def conf_dir() -> Path:
    for candidate in (_HERE.parent / "conf", _HERE / "conf"):
        if (candidate / "model").is_dir():
            return candidate
    raise FileNotFoundError("selfspec: cannot find the conf/ directory (broken install?)")
