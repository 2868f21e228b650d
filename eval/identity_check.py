"""Same decodes under two checkouts of selfspec: are greedy tokens, tau and verify steps identical? (issue 11)

A restructure must not change behaviour. This decodes Spec-Bench prompts (N per task, 128 tokens, greedy) with
the autoregressive path and self-speculation (the lens at K=4; a trained head, when given, at K=4 and with
dynamic K), writing one JSON line per decode; `--compare` then diffs two such files.

    git worktree add /tmp/before <commit>                       # or git clone + checkout
    python eval/identity_check.py run --tree /tmp/before --out before.jsonl --per-task 10 --head HEAD_DIR
    python eval/identity_check.py run --out after.jsonl --per-task 10 --head HEAD_DIR
    python eval/identity_check.py compare before.jsonl after.jsonl

`--tree` imports selfspec from that checkout instead of the installed one (the editable install's import hook is
set aside). Token ids, tau and verify steps must match exactly; wall time is recorded but not compared.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared/data/spec_bench/question.jsonl"


def use_tree(tree: str) -> None:
    """Import selfspec from `tree`: drop the editable install's finder and put the checkout first."""
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")
                        and "editable" not in type(f).__module__]
    sys.path.insert(0, str(Path(tree).resolve()))


def spec_bench_prompts(path: Path, per_task: int) -> list[tuple[str, str, str]]:
    items, count = [], {}
    with open(path) as f:
        for line in f:
            d = json.loads(line)
            task = d["category"] if d["category"] in TASKS else "mt_bench"
            count[task] = count.get(task, 0) + 1
            if count[task] <= per_task:
                items.append((task, str(d["question_id"]), d["turns"][0]))
    return items


def run(args) -> None:
    if args.tree:
        use_tree(args.tree)
    import torch

    import selfspec
    from selfspec.api import SelfSpecModel

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    print(f"selfspec from {Path(selfspec.__file__).parent}", file=sys.stderr)
    models = {"lens": SelfSpecModel.from_pretrained("smollm2_135m", head="lens", exit_layer=6)}
    if args.head:
        models["head"] = SelfSpecModel.from_pretrained("smollm2_135m", head=args.head)
    ar = models["lens"]
    methods = [("ar", ar, dict(strategy="autoregressive"))]
    methods.append(("lens_k4", models["lens"], dict(draft_len=4, draft_threshold=0.0)))
    if "head" in models:
        methods += [("head_k4", models["head"], dict(draft_len=4, draft_threshold=0.0)),
                    ("head_k2_t0.3", models["head"], dict(draft_len=2, draft_threshold=0.3))]
    if args.methods:
        known = [name for name, _, _ in methods]
        wanted = args.methods.split(",")
        bad = [m for m in wanted if m not in known]
        if bad:
            sys.exit(f"--methods: unknown {bad}; allowed {','.join(known)}")
        methods = [m for m in methods if m[0] in wanted]
    done = set()
    if os.path.exists(args.out):  # resume: skip decodes already written
        done = {(d["id"], d["method"]) for d in map(json.loads, open(args.out))}
    with open(args.out, "a") as f:
        for task, qid, text in spec_bench_prompts(Path(args.data), args.per_task):
            ids = ar.encode([{"role": "user", "content": text}])
            for name, m, kw in methods:
                if (qid, name) in done:
                    continue
                r = m.generate(ids, max_new_tokens=args.max_new_tokens, **kw)
                f.write(json.dumps({"id": qid, "task": task, "method": name, "tokens": r.token_ids,
                                    "tau": r.stats["tau"], "verify_steps": r.stats["verify_steps"],
                                    "tokens_per_s": r.stats["tokens_per_s"]}) + "\n")
                f.flush()


def compare(args) -> int:
    def load(p):
        return {(d["id"], d["method"]): d for d in map(json.loads, open(p))}

    a, b = load(args.before), load(args.after)
    common = sorted(set(a) & set(b))
    same = [k for k in common if all(a[k][f] == b[k][f] for f in ("tokens", "tau", "verify_steps"))]
    prompts = {k[0] for k in common}
    print(f"{len(common)} decodes ({len(prompts)} prompts x {sorted({k[1] for k in common})}): "
          f"tokens, tau and verify steps identical in {len(same)}/{len(common)}")
    for k in common:
        if k not in same:
            print("DIFF", k, a[k]["tau"], b[k]["tau"])
    return 0 if len(same) == len(common) and common else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--tree", default=None, help="a selfspec checkout to import instead of the installed one")
    r.add_argument("--head", default=None, help="a saved head directory (besides the lens)")
    r.add_argument("--methods", default=None, help="comma-separated subset of ar,lens_k4,head_k4,head_k2_t0.3")
    r.add_argument("--per-task", type=int, default=10)
    r.add_argument("--max-new-tokens", type=int, default=128)
    r.add_argument("--data", default=str(DEFAULT_DATA))
    c = sub.add_parser("compare")
    c.add_argument("before")
    c.add_argument("after")
    args = p.parse_args()
    if args.cmd == "run":
        run(args)
        return 0
    return compare(args)


if __name__ == "__main__":
    sys.exit(main())
