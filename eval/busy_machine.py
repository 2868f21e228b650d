"""How much of its quiet speed each method keeps when one CPU-bound process shares the machine (issue 58, item 1).

Three evals of the same prompts and methods, one after the other, each interleaved prompt by prompt:
  quiet        threads=auto, nothing else running
  busy, auto   threads=auto, one `while True: pass` process beside it (the thread count adapts per prompt)
  busy, fixed  threads=<the start count>, the same process beside it (what every run did before adapting)

    python eval/busy_machine.py                       # the 12 held-out code prompts, 128 new tokens
    python eval/busy_machine.py --limit 4 --out outputs/busy

Prints per method: tokens/s in each run, the share of the quiet speed kept, and each drafting method's ratio to our
AR path with its change from quiet. Writes busy_machine.json (and each eval's own output dir) under --out.
Run it on a machine with nothing else running: the quiet run is the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = '[autoregressive,"selfspec:lookup=false",selfspec]'
LABELS = {"autoregressive": "our AR path", "selfspec:lookup=false": "drafting alone (lookup off)",
          "selfspec": "the shipped setting"}


def run_eval(out: Path, threads: str, args) -> dict:
    cmd = [sys.executable, "-m", "selfspec.eval", f"model={args.model}", "prompts=jsonl", f"prompts.path={args.prompts}",
           f"prompts.limit={args.limit}", f"decode.max_new_tokens={args.tokens}", "logger=none",
           "reference=autoregressive", f"methods={METHODS}", f"threads={threads}", f"hydra.run.dir={out}"]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
                   stdout=subprocess.DEVNULL)
    summary = json.loads((out / "summary.json").read_text())
    return {"methods": summary["methods"], "thread_policy": summary["run"].get("thread_policy")}


def busy_run(out: Path, threads: str, args) -> dict:
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1.0)
        return run_eval(out, threads, args)
    finally:
        hog.kill()
        hog.wait()


def table(runs: dict[str, dict]) -> str:
    quiet = runs["quiet"]["methods"]
    names = list(quiet)
    lines = ["| method | quiet tok/s | busy, auto tok/s (kept) | busy, fixed threads tok/s (kept) | "
             "vs AR: quiet / busy auto / busy fixed |", "|---|---:|---:|---:|---:|"]
    for name in names:
        q = quiet[name]["tokens_per_s"]
        cells = [LABELS.get(name, name), f"{q:.1f}"]
        for key in ("busy_auto", "busy_fixed"):
            b = runs[key]["methods"][name]["tokens_per_s"]
            cells.append(f"{b:.1f} ({100 * b / q:.0f}%)")
        ratios = [runs[k]["methods"][name]["speedup"] for k in ("quiet", "busy_auto", "busy_fixed")]
        cells.append(" / ".join(f"{r:.2f}x" for r in ratios))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--prompts", default=str(ROOT / "eval" / "prompts" / "code.jsonl"))
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--fixed-threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "busy_machine" / time.strftime("%Y-%m-%d_%H-%M-%S"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = {"quiet": run_eval(args.out / "quiet", "auto", args),
            "busy_auto": busy_run(args.out / "busy_auto", "auto", args),
            "busy_fixed": busy_run(args.out / "busy_fixed", str(args.fixed_threads), args)}
    (args.out / "busy_machine.json").write_text(json.dumps(runs, indent=1))
    print(table(runs))
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
