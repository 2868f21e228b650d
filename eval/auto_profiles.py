"""Write head=auto's candidates, with their profiles measured by an eval run, into a shipped head's head_config.json.

    python eval/auto_profiles.py RUN_DIR eval/auto_candidates/smollm2_135m.json

RUN_DIR is a `python -m selfspec.eval` run that timed every candidate's method (the spec file names each one's
method; a candidate with "run": DIR reads its method from that run instead, relative to the repository root, for
candidates whose method another run of the same prompts timed). A candidate's profile is its pooled stats over the run's prompts, per verify step: tau (new tokens),
draft_passes (the head's draft passes, lookup rounds counting none) and verify_rows (drafts verified plus one).
selfspec/heads/auto.py combines them with this machine's step costs. The profile's source names the run's record.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from selfspec.decoding.stats import pool_stats
from selfspec.heads.auto import parse_candidates
from selfspec.utils.io import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]


def profiles(run_dir: Path) -> dict[str, dict]:
    by_method: dict[str, list[dict]] = {}
    for line in (run_dir / "results.jsonl").read_text().splitlines():
        rec = json.loads(line)
        by_method.setdefault(rec["method"], []).append(rec["stats"])
    out = {}
    for method, stats in by_method.items():
        steps = sum(s["verify_steps"] for s in stats)
        out[method] = {"tau": round(sum(s["new_tokens"] for s in stats) / steps, 4),
                       "draft_passes": round(sum(s.get("draft_steps", 0) for s in stats) / steps, 4),
                       "verify_rows": round(1 + sum(s["drafted"] for s in stats) / steps, 4)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("spec", type=Path)
    ap.add_argument("--source", default=None, help="what the profiles' source says (default: the run dir's name)")
    args = ap.parse_args()
    spec = json.loads(args.spec.read_text())
    runs: dict[Path, dict] = {}
    cands = []
    for c in spec["candidates"]:
        run = ROOT / c["run"] if c.get("run") else args.run_dir
        if run not in runs:
            runs[run] = profiles(run)
        measured = runs[run]
        source = args.source if args.source and not c.get("run") else f"eval run {run.name}"
        prof = dict(measured[c["method"]], source=f"{source}, method {c['method']}")
        cands.append({k: v for k, v in {"name": c["name"], "head": c["head"], "draft_precision": c.get("draft_precision"),
                                        "decode": c.get("decode", {}), "profile": prof}.items()})
    path = ROOT / spec["head_dir"] / "head_config.json"
    config = json.loads(path.read_text())
    config["auto"] = {"candidates": cands}
    parse_candidates(config["auto"], str(path))  # what head=auto will read back
    atomic_write_text(path, json.dumps(config, indent=2) + "\n")
    for c in cands:
        print(f"{c['name']}: {c['profile']}")
    print(f"written: {path}")


if __name__ == "__main__":
    main()
