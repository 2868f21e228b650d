"""python -m selfspec.cli.compare ANALYSIS_DIR EVAL_DIR [--head LABEL]: predicted against measured tau, an analysis
run next to an evaluation run of the same head and prompts (selfspec/analysis/compare.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from selfspec.analysis import compare as cmp
from selfspec.errors import SelfSpecError, check


def _load(path: Path, name: str) -> dict:
    f = path / name if path.is_dir() else path
    check(f.is_file(), f"{path}: no {name}")
    try:
        return json.loads(f.read_text())
    except ValueError as exc:
        raise SelfSpecError(f"{f}: not JSON ({exc})")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m selfspec.cli.compare", description=cmp.__doc__.splitlines()[0])
    p.add_argument("analysis", type=Path, help="analysis run dir (or its analysis.json)")
    p.add_argument("evaluation", type=Path, help="evaluation run dir (or its summary.json)")
    p.add_argument("--head", default=None, help="the analysis's head label (needed when it has several)")
    args = p.parse_args(argv)
    try:
        print(cmp.compare(_load(args.analysis, "analysis.json"), _load(args.evaluation, "summary.json"), args.head), end="")
    except SelfSpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
