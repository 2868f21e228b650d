"""python -m selfspec.cli.export_head SRC DEST [--dtype float16] [--readme FILE]: a saved head with its weights in a
smaller dtype (selfspec/heads/export.py: export_head)."""

from __future__ import annotations

import argparse
import sys

from selfspec.errors import SelfSpecError
from selfspec.heads import export
from selfspec.heads.export import DTYPES, export_head


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m selfspec.cli.export_head", description=export.__doc__.splitlines()[0])
    p.add_argument("src", help="a saved head directory (head_config.json + head.safetensors)")
    p.add_argument("dest", help="the new head directory (replaced atomically if it exists)")
    p.add_argument("--dtype", default="float16", help=f"one of {', '.join(DTYPES)}")
    p.add_argument("--readme", default=None, help="a README.md to put beside the head")
    args = p.parse_args(argv)
    try:
        out = export_head(args.src, args.dest, args.dtype, args.readme)
    except SelfSpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
