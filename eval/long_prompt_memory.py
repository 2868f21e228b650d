"""Peak memory and time of one greedy decode of a long prompt with a context head, decode.fused_chain on and off.

    python eval/long_prompt_memory.py --tokens 6000 --new 16        # the shipped context head on SmolLM2-135M
    python eval/long_prompt_memory.py --tokens 3000 --repeats 2 --out long_prompt.json

The prompt is TEXT repeated up to --tokens tokens (raw text, no chat template). Each decode runs in a fresh
subprocess (nothing cached or allocated by an earlier one): it loads the model and head, resets the process's peak
resident size (writing 5 to /proc/self/clear_refs), decodes, and reports the peak (VmHWM) minus the resident size
just before the decode, and the decode's wall time. Settings alternate (off, on, off, on, ...) so that drift on a
shared machine hits both; the tokens of every run must be the same (exactness). Why: with fused_chain the first
round's C call used to run the head over every prompt row, with an attention-score buffer of rows x keys floats
(issue 58).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TEXT = ("The history of the river valley begins with the first farmers, who cleared the forest along the banks and "
        "planted barley and wheat. Over the centuries the villages grew into towns, the towns traded along the river, "
        "and the river itself was dammed, straightened and bridged. ")


def _status_kb(field: str) -> int:
    """A field of /proc/self/status in kB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> bool:
    """Make VmHWM the current resident size (Linux >= 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def child(args) -> dict:
    """One decode in this process -> what main() reports."""
    import selfspec
    from selfspec.api import SelfSpecModel

    m = SelfSpecModel.from_pretrained(args.model, head=args.head)
    ids = m.encode(TEXT * (args.tokens // 40 + 1), chat=False)[: args.tokens]
    if len(ids) < args.tokens:
        raise SystemExit(f"error: the prompt has {len(ids)} tokens, fewer than --tokens={args.tokens}")
    reset = _reset_peak()
    rss = _status_kb("VmRSS")
    t0 = time.perf_counter()
    out = m.generate(ids, max_new_tokens=args.new, fused_chain=args.fused == "on", chat=False)
    wall = time.perf_counter() - t0
    return {"fused_chain": args.fused, "prompt_tokens": len(ids), "new_tokens": len(out.token_ids),
            "peak_increase_mb": round((_status_kb("VmHWM") - rss) / 1024, 1), "peak_reset": reset,
            "wall_s": round(wall, 2), "token_ids": out.token_ids, "draft_steps": out.stats["draft_steps"],
            "verify_steps": out.stats["verify_steps"], "selfspec": os.path.dirname(selfspec.__file__)}


def _run(args, fused: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--fused", fused, "--tokens", str(args.tokens),
           "--new", str(args.new), "--model", args.model, "--head", args.head]
    # the selfspec of the checkout this script lies in (not whichever one the environment has installed)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"error: the fused_chain={fused} run failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2_135m", help="a conf/model name, a directory or a hub id")
    ap.add_argument("--head", default="smollm2_135m+context", help="a context head: shipped name or directory")
    ap.add_argument("--tokens", type=int, default=6000, help="prompt tokens")
    ap.add_argument("--new", type=int, default=16, help="max_new_tokens")
    ap.add_argument("--repeats", type=int, default=1, help="decodes per setting (alternating)")
    ap.add_argument("--out", default=None, help="also write the runs as JSON here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--fused", choices=("on", "off"), default="on", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    runs = [_run(args, fused) for _ in range(args.repeats) for fused in ("off", "on")]
    print(f"{args.model} + {args.head}: a {args.tokens}-token prompt, max_new_tokens={args.new}, greedy "
          f"(selfspec from {runs[0]['selfspec']})\n")
    print("| decode.fused_chain | peak RSS increase (MB) | wall (s) | new tokens | draft / verify passes |")
    print("|---|---|---|---|---|")
    for r in runs:
        print(f"| {r['fused_chain']} | {r['peak_increase_mb']} | {r['wall_s']} | {r['new_tokens']} | "
              f"{r['draft_steps']} / {r['verify_steps']} |")
    same = all(r["token_ids"] == runs[0]["token_ids"] for r in runs)
    print(f"\nsame tokens in every run: {same}; peak reset before the decode: {all(r['peak_reset'] for r in runs)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(runs, f, indent=2)
            f.write("\n")
        print(f"written: {args.out}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
