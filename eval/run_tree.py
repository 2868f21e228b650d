"""Run a selfspec entry point from another checkout: before/after measurements of a change (issue 11).

    git worktree add /tmp/before 522881f
    python eval/run_tree.py /tmp/before selfspec.evaluation.costs model=smollm2_135m costs.repeats=10  # that tree's path
    python eval/run_tree.py . selfspec.cli.costs model=smollm2_135m costs.repeats=10

The editable install's import hook is set aside and the checkout goes first on sys.path, so `selfspec` (and its
conf/) come from TREE; the remaining arguments are the module's own (Hydra overrides here).
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit("usage: python eval/run_tree.py TREE MODULE [ARGS...]")
    tree, module = Path(sys.argv[1]).resolve(), sys.argv[2]
    if not (tree / "selfspec" / "__init__.py").is_file():
        sys.exit(f"TREE={str(tree)!r}: not a selfspec checkout (no selfspec/__init__.py)")
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")
                        and "editable" not in type(f).__module__]
    sys.path.insert(0, str(tree))
    sys.argv = [module] + sys.argv[3:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
