"""Verify cost vs rows on this machine: one full-stack pass over 1..64 tree rows, in autoregressive steps.

    python eval/verify_rows.py                                  # SmolLM2-135M, rows 1,2,4,8,16,32,64
    python eval/verify_rows.py --model qwen2.5_coder_0.5b --context 500 --repeats 30 --out verify_rows.json

Columns (selfspec/evaluation/tree_costs.py): `tree` as the backbone runs a tree verify by default (the C decoder
layer up to cpu_kernels.TREE_MAX_ROWS rows), `tree, torch` with the CPU kernels off, `chain` the same rows as a
causal chunk. On a shared machine set OMP_NUM_THREADS to the free cores; the ratios are paired, so slow drift
cancels, but contention does not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2_135m", help="a conf/model name, a directory or a hub id")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--branching", type=int, default=4, help="children per tree node")
    ap.add_argument("--out", default=None, help="also write the numbers as JSON here")
    args = ap.parse_args(argv)

    from selfspec.api import SelfSpecModel
    from selfspec.errors import SelfSpecError
    from selfspec.evaluation.tree_costs import verify_rows_costs, verify_rows_markdown

    try:
        rows = [int(r) for r in args.rows.split(",") if r.strip()]
    except ValueError:
        print(f"error: --rows={args.rows!r}: must be comma-separated integers", file=sys.stderr)
        return 2
    try:
        model = SelfSpecModel.from_pretrained(args.model, head=None)
        costs = verify_rows_costs(model.backbone, rows, context=args.context, repeats=args.repeats, branching=args.branching)
    except SelfSpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    costs["model"] = args.model
    print(verify_rows_markdown(costs, title=f"Verify cost vs rows: {args.model}"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(costs, f, indent=2)
            f.write("\n")
        print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
