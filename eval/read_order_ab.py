"""A/B of how the float matmul reads the weights (gemm_tuning.py) on whole decodes, in ONE process.

    python eval/read_order_ab.py --prompts ../shared/data/spec_bench/question.jsonl --per-task 5 [--new-tokens 128]

Side A reads every matmul's weights in blocks of rows prefetched into L1 and never row by row (prefetch level 1,
stream_rows 0: the kernel before it had the choice), side B with this machine's setting (measured, or
SELFSPEC_GEMM_PREFETCH / SELFSPEC_GEMM_STREAM_ROWS). Each prompt runs every method under both
sides, the side that goes first alternating prompt by prompt, so drift hits both alike. Prints per method the
tokens/s of each side, B/A, each side's speedup over its own autoregressive path, and whether every prompt's tokens
are the same on both sides (they must be: the two read orders give the same sums). Writes nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

METHODS = {  # name -> (head, decode keys)
    "autoregressive": ("default", dict(strategy="autoregressive")),
    "context head alone (K=1)": ("smollm2_135m+context", dict(lookup=False, draft_len=1)),
    "int4_mlp self-draft alone": ("default", dict(lookup=False)),
    "shipped (lookup first)": ("default", {}),
}


def load_prompts(path: str, per_task: int) -> list[str]:
    taken: dict[str, int] = {}
    prompts = []
    with open(path) as f:
        for line in f:
            q = json.loads(line)
            cat = q.get("category", "")
            if taken.get(cat, 0) < per_task:
                taken[cat] = taken.get(cat, 0) + 1
                prompts.append(q["turns"][0])
    return prompts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", required=True, help="a Spec-Bench question.jsonl")
    ap.add_argument("--per-task", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--model", default="smollm2_135m")
    args = ap.parse_args(argv)

    from selfspec.api import SelfSpecModel
    from selfspec.model import cpu_kernels

    models = {h: SelfSpecModel.from_pretrained(args.model, head=h) for h in {h for h, _ in METHODS.values()}}
    if cpu_kernels.gemm_stream_rows() is None:
        print("error: the CPU kernels are not in use here; nothing to compare", file=sys.stderr)
        return 2
    sides = {"A": (0, 1), "B": (cpu_kernels.gemm_stream_rows(), cpu_kernels.gemm_prefetch_level())}
    prompts = load_prompts(args.prompts, args.per_task)
    secs = {(m, s): 0.0 for m in METHODS for s in sides}
    toks = {(m, s): 0 for m in METHODS for s in sides}
    same = {m: True for m in METHODS}
    for name, (head, keys) in METHODS.items():  # warm-up, not timed
        models[head].generate(prompts[0], max_new_tokens=8, **keys)
    for i, prompt in enumerate(prompts):
        order = list(sides) if i % 2 == 0 else list(sides)[::-1]
        for name, (head, keys) in METHODS.items():
            ids = {}
            for side in order:
                cpu_kernels.gemm_stream_rows(sides[side][0])
                cpu_kernels.gemm_prefetch_level(sides[side][1])
                t = time.perf_counter()
                r = models[head].generate(prompt, max_new_tokens=args.new_tokens, **keys)
                secs[name, side] += time.perf_counter() - t
                toks[name, side] += len(r.token_ids)
                ids[side] = r.token_ids
            same[name] &= ids["A"] == ids["B"]
    cpu_kernels.gemm_stream_rows(sides["B"][0])
    cpu_kernels.gemm_prefetch_level(sides["B"][1])
    print(f"(stream_rows, prefetch level): A = {sides['A']}, B = {sides['B']}; {len(prompts)} prompts, "
          f"{args.new_tokens} new tokens\n")
    print("| method | A tokens/s | B tokens/s | B / A | A over its AR | B over its AR | same tokens |")
    print("|---|---:|---:|---:|---:|---:|---|")
    rate = {k: toks[k] / secs[k] for k in secs}
    for name in METHODS:
        a, b = rate[name, "A"], rate[name, "B"]
        ar_a, ar_b = rate["autoregressive", "A"], rate["autoregressive", "B"]
        print(f"| {name} | {a:.1f} | {b:.1f} | {b / a:.3f} | {a / ar_a:.2f}x | {b / ar_b:.2f}x | {same[name]} |")
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
