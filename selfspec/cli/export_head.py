"""python -m selfspec.cli.export_head SRC DEST [--dtype float16] [--readme FILE] [--draft-vocab N [--keep-ids 0,2]]
[--average OTHER [--average-weight W]]: a saved head with its weights in a smaller dtype, its draft vocabulary cut, or
its weights averaged with another head's (selfspec/heads/export.py: export_head)."""

from __future__ import annotations

import argparse
import sys

from selfspec.errors import SelfSpecError
from selfspec.heads import export
from selfspec.heads.export import DTYPES, export_head


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m selfspec.cli.export_head", description=export.__doc__.splitlines()[0])
    p.add_argument("src", help="a saved head directory (head_config.json + head.safetensors) or a shipped head's name")
    p.add_argument("dest", help="the new head directory (replaced atomically if it exists)")
    p.add_argument("--dtype", default="float16", help=f"one of {', '.join(DTYPES)}")
    p.add_argument("--readme", default=None, help="a README.md to put beside the head")
    p.add_argument("--draft-vocab", type=int, default=None, help="keep the N lowest ids of the head's draft vocabulary")
    p.add_argument("--keep-ids", default="", help="comma-separated ids kept beside them (the model's EOS ids)")
    p.add_argument("--average", default=None, metavar="OTHER",
                   help="a saved head of the same shape to average with: W * SRC + (1 - W) * OTHER")
    p.add_argument("--average-weight", type=float, default=0.5, metavar="W", help="SRC's weight in (0, 1); 0.5 unless given")
    args = p.parse_args(argv)
    try:
        try:
            keep = tuple(int(x) for x in args.keep_ids.split(",") if x.strip())
        except ValueError:
            raise SelfSpecError(f"--keep-ids={args.keep_ids!r}: must be comma-separated integers") from None
        out = export_head(args.src, args.dest, args.dtype, args.readme, args.draft_vocab, keep, args.average,
                          args.average_weight)
    except SelfSpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
