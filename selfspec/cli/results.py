"""python -m selfspec.cli.results [--write | --check] [--dir results] [--add RUN_DIR NAME]: the published results
(selfspec/evaluation/results.py).

  (no flag)   print the README's results table, rendered from results/*.json
  --write     put it into README.md (the headline methods, each from its model's newest record) and BENCHMARKS.md
              (every row), between the results markers, with BENCHMARKS.md's list of where each record came from
  --check     exit 1 when either document differs from the rendering (the test suite runs this)
  --add RUN_DIR NAME   copy an eval run's record.json into results/NAME.json (then --write)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from selfspec.errors import SelfSpecError, check
from selfspec.evaluation import results as res
from selfspec.evaluation.record import check_record
from selfspec.utils.io import atomic_write_text

ROOT = Path(__file__).resolve().parents[2]


def documents(root: Path, records) -> dict[Path, str]:
    """Each document's expected text: its current text with the rendered region."""
    out = {}
    table = res.render_table(records)
    readme = root / "README.md"
    loaded = [(n, r) for n, r in records if not res.is_testbed(r)]  # the README: models as users load them
    out[readme] = res.replace_region(readme.read_text(encoding="utf-8"),
                                     res.render_table(loaded, newest_of=res.README_METHODS), "README.md")
    bench = root / "BENCHMARKS.md"
    rendered = table + "\nWhere each record came from (the file, when, the code, the command):\n\n" + res.render_sources(records)
    out[bench] = res.replace_region(bench.read_text(encoding="utf-8"), rendered, "BENCHMARKS.md")
    return out


def add(run_dir: Path, name: str, directory: Path) -> Path:
    src = run_dir / "record.json" if run_dir.is_dir() else run_dir
    check(src.is_file(), f"--add: {run_dir} has no record.json")
    check(name.replace("-", "").replace("_", "").replace(".", "").isalnum() and not name.startswith("."),
          f"--add NAME={name!r}: letters, digits, '-', '_' and '.' only")
    try:
        rec = json.loads(src.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SelfSpecError(f"--add: {src} is not valid JSON ({exc})") from None
    check_record(rec, f"--add: {src}")
    dest = directory / f"{name.removesuffix('.json')}.json"
    atomic_write_text(dest, json.dumps(rec, indent=1) + "\n")
    return dest


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m selfspec.cli.results", description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=ROOT / "results", help="the records (default: the repo's results/)")
    p.add_argument("--root", type=Path, default=ROOT, help="where README.md and BENCHMARKS.md are")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true")
    mode.add_argument("--check", action="store_true")
    mode.add_argument("--add", nargs=2, metavar=("RUN_DIR", "NAME"))
    args = p.parse_args(argv)
    try:
        if args.add:
            print(f"written: {add(Path(args.add[0]), args.add[1], args.dir)}")
            return
        records = res.load_records(args.dir)
        if not (args.write or args.check):
            print(res.render_table(records), end="")
            return
        stale = []
        for path, text in documents(args.root, records).items():
            if path.read_text(encoding="utf-8") != text:
                stale.append(path.name)
                if args.write:
                    atomic_write_text(path, text)
        if args.check and stale:
            print(f"error: {', '.join(stale)} differ from results/ (run python -m selfspec.cli.results --write)",
                  file=sys.stderr)
            sys.exit(1)
        if args.write:
            print(f"updated: {', '.join(stale) or 'nothing (already current)'}")
    except SelfSpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
