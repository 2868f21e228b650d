"""python -m selfspec.cli.exclude FILE -o OUT.json [--name NAME]: the content hashes of a prompt file's prompts, the
format of selfspec/data/excluded/ (selfspec/data/exclude.py; this is how the shipped spec_bench.json was made)."""

from __future__ import annotations

import argparse

from selfspec.data import exclude
from selfspec.data.exclude import PromptHashes
from selfspec.utils.io import atomic_write_json


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m selfspec.cli.exclude", description=exclude.__doc__.split("\n\n")[0])
    ap.add_argument("file", help="a prompt file (Spec-Bench question.jsonl, ShareGPT, prompt records)")
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--name", default=None)
    args = ap.parse_args(argv)
    hashes = PromptHashes.from_prompt_file(args.file, args.name)
    atomic_write_json(args.output, hashes.to_json())
    print(f"{args.output}: {len(hashes.texts)} turns, {len(hashes.grams)} sampled {hashes.ngram}-grams, digest {hashes.digest()}")


if __name__ == "__main__":
    main()
